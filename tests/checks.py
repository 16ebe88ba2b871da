"""Checks of backend results against moe_comm.reference, shared by the host (CPU) tests and the
CUDA tests: one definition of "correct" for every backend."""
from __future__ import annotations

import torch

import moe_comm
from moe_comm.layout import dispatch_layout
from moe_comm.quant import dequantize_fp8, unpack_ue8m0
from moe_comm.reference import reference_ll_combine, reference_ll_dispatch
from inputs import make_inputs, routing


def flat(rx):
    """A received x as a list of tensors: (fp8 payload, scales) or the one tensor."""
    return list(rx) if isinstance(rx, tuple) else [rx]


def assert_same_bits(n, cases, got, want):
    """Every rank's normal-mode results (``_run_cases`` dicts) in ``got`` equal ``want``'s bit
    for bit: a streamed call against the single copy of the same call."""
    for r in range(n):
        for ci in range(len(cases)):
            a, b = got[r][ci], want[r][ci]
            for key in ("rx", "rx2"):
                for g, e in zip(flat(a[key]), flat(b[key])):
                    assert torch.equal(g.view(torch.uint8), e.view(torch.uint8)), (r, ci, key)
            for key in ("ri", "rw", "comb", "comb_w"):
                assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), \
                    (r, ci, key)
            assert a["counts"] == b["counts"], (r, ci)


def check_normal(n, cases, results, tol=1e-2):
    """``results[rank][case]``: dict with rx, ri, rw, counts, y, comb, comb_w, rx2 (cached
    handle dispatch), ri2, and same_handle (a backend's dispatch) or handle2 and counts2 (a
    Buffer's); optionally layout. ``tol``: combine's tolerance against the float32 sums."""
    for ci, case in enumerate(cases):
        ins = [make_inputs(case, r) for r in range(n)]
        fp8 = case["dtype"] == "fp8"
        for r in range(n):
            if "layout" in results[r][ci]:
                want = dispatch_layout(ins[r][1], case["experts"], n)
                got = results[r][ci]["layout"]
                assert all(torch.equal(g, w) for g, w in zip(got, want)), (case, r, "layout")
        ref = moe_comm.reference_dispatch(
            [i[0][0] if fp8 else i[0] for i in ins], [i[1] for i in ins], case["experts"],
            [i[2] for i in ins], scales=[i[0][1] for i in ins] if fp8 else None)
        for d in range(n):
            got, exp = results[d][ci], ref[d]
            rows = exp["recv_x"].shape[0]
            want = [exp["recv_x"]] + ([exp["recv_scales"]] if fp8 else [])
            for g, e in zip(flat(got["rx"]), want):
                assert g.shape[0] == max(rows, case["worst"]), (case, d)
                assert torch.equal(g[:rows].view(torch.uint8), e.view(torch.uint8)), (case, d)
                if case["worst"]:
                    assert (g[rows:].view(torch.uint8) == 0).all(), (case, d, "padding")
            for g, e in zip(flat(got["rx2"]), want):
                assert torch.equal(g[:rows].view(torch.uint8), e.view(torch.uint8)), (case, d)
            assert torch.equal(got["ri"][:rows], exp["recv_topk_idx"]), (case, d)
            assert torch.equal(got["rw"][:rows], exp["recv_topk_weights"]), (case, d)
            if case["worst"]:
                assert (got["ri"][rows:] == -1).all() and (got["rw"][rows:] == 0).all()
            a = case["alignment"]
            want = [(c + a - 1) // a * a for c in exp["num_recv_tokens_per_expert"]]
            if case["worst"] and "same_handle" not in got:
                want = []      # Buffer.dispatch, as DeepEP: no list with num_worst_tokens
            assert got["counts"] == want, (case, d)
            assert got["ri2"] is None
            if "same_handle" in got:         # the backends' dispatch returns the handle
                assert got["same_handle"] and got.get("counts2", []) == []
            else:                            # Buffer.dispatch: DeepEP's (.., None, None, None)
                assert got["counts2"] is None and got["handle2"] is None
        ys = [results[d][ci]["y"][:ref[d]["recv_x"].shape[0]] for d in range(n)]
        bias = [i[3] for i in ins] if case["bias"] else None
        comb = moe_comm.reference_combine(ys, ref, case["tokens"], bias=bias)
        for r in range(n):
            got = results[r][ci]
            assert got["comb"].dtype == comb[r].dtype
            torch.testing.assert_close(got["comb"].float(), comb[r].float(), rtol=tol,
                                       atol=tol)
            # every token's weights come back whole: sum over ranks of zero-padded weights
            sent = ins[r][1] >= 0
            torch.testing.assert_close(got["comb_w"], torch.where(sent, ins[r][2], 0.0))


def ll_inputs(case, rank):
    """bf16 x [T, H], topk_idx [T, K], topk_weights [T, K] of ``rank`` for an LL case."""
    gen = torch.Generator().manual_seed(case["seed"] * 7919 + rank)
    t = case["tokens"][rank]
    x = torch.randn(t, case["hidden"], generator=gen).bfloat16()
    idx = routing(case["routing"], t, case["experts"], case["topk"], gen)
    w = torch.rand(t, case["topk"], generator=gen)
    return x, idx, w


def expert_ll(rx, rank):
    """bf16 expert output from what LL dispatch delivered (dequantised for fp8)."""
    if isinstance(rx, tuple):
        data, s = rx
        if s.dtype == torch.int32:
            s = unpack_ue8m0(s)
        return (dequantize_fp8(data, s) * (rank + 1)).bfloat16()
    return (rx.float() * (rank + 1)).bfloat16()


def ll_combine(buf, case, y, idx, w, handle, out_rows):
    """An LL case's combine of the expert output ``y``: through the Buffer's combine buffer
    (case["zero_copy"]), or from y into a NaN-filled out= of ``out_rows`` rows (None: no
    out=). Returns (combined, hook)."""
    if case["zero_copy"]:
        buf.get_next_low_latency_combine_buffer(handle).copy_(y)
        combined, _, hook = buf.low_latency_combine(torch.empty(0), idx, w, handle,
                                                    zero_copy=True,
                                                    return_recv_hook=case["hook"])
        return combined, hook
    dest = None if out_rows is None else \
        torch.full((out_rows, handle.hidden), float("nan")).bfloat16()
    combined, _, hook = buf.low_latency_combine(y, idx, w, handle, out=dest,
                                                return_recv_hook=case["hook"])
    assert dest is None or combined is dest
    return combined, hook


def check_ll(n, cases, results, quantize):
    """``results[rank][case]``: dict with rx, cnt, stats (started at 5), y, combined.
    ``quantize(x, round_scale) -> (fp8, scales)`` is the backend's cast, checked bit by bit."""
    for ci, case in enumerate(cases):
        ins = [ll_inputs(case, r) for r in range(n)]
        ref = reference_ll_dispatch([i[0] for i in ins], [i[1] for i in ins], case["experts"],
                                    case["max_tokens"])
        for d in range(n):
            got, exp = results[d][ci], ref[d]
            cnt = exp["recv_count"]
            assert torch.equal(got["cnt"], cnt), (case, d)
            assert torch.equal(got["stats"], cnt + 5), (case, d)
            for le in range(cnt.shape[0]):
                c = int(cnt[le])
                if "meta" in got:             # the handle's (token << 8 | slot) of each row
                    src = exp["recv_src"][le, :c]
                    assert torch.equal(got["meta"][le, :c].cpu(), src[:, 1] << 8 | src[:, 2]), \
                        (case, d, le)
                want = exp["recv_x"][le, :c]
                if not case["fp8"]:
                    assert torch.equal(got["rx"][le, :c], want), (case, d, le)
                    continue
                data, scales = got["rx"]
                q, s = quantize(want, case["round_scale"])
                assert torch.equal(data[le, :c].view(torch.uint8), q.view(torch.uint8)), \
                    (case, d, le)
                if case["ue8m0"]:
                    # UE8M0 byte = the float32 exponent field of the power-of-two scale
                    expo = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
                    assert torch.equal(scales[le, :c].contiguous().view(torch.uint8).view(
                        c, expo.shape[1]), expo), (case, d, le)
                else:
                    assert torch.equal(scales[le, :c], s), (case, d, le)
                if case["round_scale"]:
                    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
                # e4m3: 3 mantissa bits -> relative error <= 2^-4, plus the subnormal step
                deq = dequantize_fp8(q, s)
                bound = want.float().abs() * 2.0 ** -4 + s.repeat_interleave(128, 1) * 2 ** -9
                assert ((deq - want.float()).abs() <= bound).all(), (case, d, le)
        comb = reference_ll_combine([results[d][ci]["y"] for d in range(n)], ref,
                                    [i[1] for i in ins], [i[2] for i in ins])
        for r in range(n):
            torch.testing.assert_close(results[r][ci]["combined"].float(), comb[r].float(),
                                       rtol=2e-2, atol=2e-2)


def combine_biases(case, bias):
    """A case's biases as Buffer.combine takes them: None, one tensor, or two."""
    if bias is None:
        return None
    return bias if case["biases"] == 1 else (bias, (bias.float() * 0.5).to(bias.dtype))


def check_combine_bits(n, cases, results):
    """Every rank's combine (``results[rank][case]``: dict with y, comb, comb_w) equals
    moe_comm.reference_combine's bit for bit (a token's rows added in rank order, then the
    biases of combine_biases), and its weights come back once each (0 from other ranks;
    None where the case has ``weights`` False)."""
    for ci, case in enumerate(cases):
        ins = [make_inputs(case, r) for r in range(n)]
        ref = moe_comm.reference_dispatch([i[0] for i in ins], [i[1] for i in ins],
                                          case["experts"], [i[2] for i in ins])
        biases = None if not case["bias"] else [
            tuple(b.float() for b in ((combine_biases(case, i[3]),) if case["biases"] == 1
                                      else combine_biases(case, i[3]))) for i in ins]
        want = moe_comm.reference_combine([results[d][ci]["y"] for d in range(n)], ref,
                                          case["tokens"], bias=biases)
        for r in range(n):
            got = results[r][ci]
            assert got["comb"].dtype == want[r].dtype, (case, r)
            assert torch.equal(got["comb"].view(torch.uint8), want[r].view(torch.uint8)), \
                (case, r)
            if not case.get("weights", True):
                assert got["comb_w"] is None, (case, r)
                continue
            sent = ins[r][1] >= 0      # each weight comes back once, 0 from the other ranks
            assert torch.equal(got["comb_w"], torch.where(sent, ins[r][2], 0.0)), (case, r)
