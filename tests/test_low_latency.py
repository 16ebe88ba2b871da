"""Low-latency mode on real processes against the reference: ragged counts (0 and exactly
max_tokens), -1 slots, skew, hidden 128-7168, bf16 and fp8 (round_scale, UE8M0 checked bit by
bit), zero-copy and out= combine, receive hooks, stats, long runs, interleaving with normal
mode. The LL region is poisoned (0xFF) between calls so stale rows cannot pass for new ones."""
from __future__ import annotations

import resource

import numpy as np
import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm.host.late_rows import LateRows
from moe_comm.quant import quantize_fp8
from moe_comm.wire import tag
from checks import check_ll, expert_ll, ll_combine, ll_inputs
from moe_comm.reference import reference_ll_combine, reference_ll_dispatch
from ranks import run_ranks


def _buffer(case, n):
    return moe_comm.Buffer(None, 1 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        case["max_tokens"], case["hidden"], n, case["experts"]), low_latency_mode=True,
        timeout_s=30)


def _poison(buf):
    dist.barrier()
    comm = buf._comm
    if hasattr(comm, "poison_ll"):                  # the CUDA backend (tests on the emulator)
        comm.poison_ll()
    else:
        comm.peer_ll(buf.rank).fill_(0xFF)
    dist.barrier()


def _run(rank, n, cases):
    out = []
    for i, case in enumerate(cases):
        buf = _buffer(case, n)
        x, idx, w = ll_inputs(case, rank)
        stats = torch.full((case["experts"] // n,), 5, dtype=torch.int32)
        _poison(buf)
        rx, cnt, handle, ev, hook = buf.low_latency_dispatch(
            x, idx, case["max_tokens"], case["experts"],
            cumulative_local_expert_recv_stats=stats, use_fp8=case["fp8"],
            round_scale=case["round_scale"], use_ue8m0=case["ue8m0"],
            return_recv_hook=case["hook"])
        if case["hook"]:
            torch.randn(64, 64) @ torch.randn(64, 64)     # overlap: work before the hook
            hook()
        y = expert_ll(rx, rank)
        _poison(buf)
        combined, hook = ll_combine(buf, case, y, idx, w, handle, x.shape[0])
        hook()
        out.append(dict(rx=tuple(t.clone() for t in rx) if isinstance(rx, tuple)
                        else rx.clone(), cnt=cnt, stats=stats, y=y, combined=combined,
                        meta=handle.recv_meta.clone()))
        buf.destroy()
    return out


def _cases(n):
    M = 24
    cases = []
    specs = [  # (hidden, fp8, round_scale, ue8m0, hook, zero_copy, routing)
        (128, False, False, False, False, False, "random"),
        (256, True, False, False, True, False, "holes"),
        (512, True, True, False, False, True, "skewed"),
        (512, True, True, True, True, True, "random"),
        (7168, True, True, True, True, False, "skewed"),
        (7168, False, False, False, False, True, "holes"),
    ]
    for s, (h, fp8, rs, ue, hook, zc, rt) in enumerate(specs):
        tokens = [M if r == 0 else (0 if r == 1 else (3 + 5 * r) % M) for r in range(n)]
        cases.append(dict(seed=s, hidden=h, fp8=fp8, round_scale=rs, ue8m0=ue, hook=hook,
                          zero_copy=zc, routing=rt, max_tokens=M, tokens=tokens,
                          experts=4 * n if h < 7168 else 8 * n, topk=min(4, 4 * n)))
    return cases


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_low_latency_matches_reference(n):
    cases = _cases(n)
    if n == 8:
        cases = cases[:4]
    results = run_ranks(_run, n, cases, timeout=300)
    check_ll(n, cases, results, quantize_fp8)


CASE = dict(seed=99, hidden=256, max_tokens=8, experts=8, topk=2, routing="random",
            tokens=[8, 5])


def _hooks(rank, n):
    buf = _buffer(CASE, n)
    x, idx, w = ll_inputs(CASE, rank)
    errors = []
    a = buf.low_latency_dispatch(x, idx, 8, 8, use_fp8=False, return_recv_hook=True)
    b = buf.low_latency_dispatch(x * 2, idx, 8, 8, use_fp8=False, return_recv_hook=True)
    try:
        buf.low_latency_dispatch(x, idx, 8, 8, use_fp8=False, return_recv_hook=True)
    except RuntimeError as e:
        errors.append(str(e))
    try:
        buf.low_latency_combine(a[0], idx, w, a[2])
    except RuntimeError as e:
        errors.append(str(e))
    a[4]()
    try:
        a[4]()
    except RuntimeError as e:
        errors.append(str(e))
    b[4]()
    # both results intact: b is exactly twice a
    ok = all(torch.equal(b[0][le, :c].float(), 2 * a[0][le, :c].float())
             for le, c in enumerate(a[1].tolist()))
    buf.destroy()
    return errors, ok, a[1]


def test_hooks_two_in_flight_and_misuse_errors():
    results = run_ranks(_hooks, 2, timeout=60)
    for errors, ok, _ in results:
        assert ok
        assert "two low-latency dispatch calls are already in flight" in errors[0]
        assert "has not received yet" in errors[1]
        assert "already ran" in errors[2]


def _long_run(rank, n, iters):
    buf = _buffer(CASE, n)
    x, idx, w = ll_inputs(CASE, rank)
    first = None
    rss0 = None
    for i in range(iters):
        hook_mode = i % 2 == 0
        rx, cnt, h, _, hook = buf.low_latency_dispatch(x, idx, 8, 8, use_fp8=i % 3 == 0,
                                                       return_recv_hook=hook_mode)
        hook()
        y = expert_ll(rx, rank) if not isinstance(rx, tuple) else expert_ll(
            (rx[0], rx[1]), rank)
        out, _, hook = buf.low_latency_combine(y, idx, w, h, return_recv_hook=not hook_mode)
        hook()
        if i % 3 == 1:
            if first is None:
                first = out.clone()
            assert torch.equal(out, first), f"drift at call {i}"
        if i == 50:
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    growth_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    buf.destroy()
    return growth_kb


def test_thousand_alternating_calls_without_drift_or_leak():
    growth = run_ranks(_long_run, 2, 1000, timeout=300)
    assert max(growth) < 20_000, growth       # KiB


def _interleave(rank, n):
    M, H, E = 8, 256, 8
    buf = moe_comm.Buffer(None, 4 << 20,
                          moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, n, E),
                          low_latency_mode=True, timeout_s=30)
    x, idx, w = ll_inputs(CASE, rank)
    outs = []
    for step in range(3):
        ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
        rx, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                         num_tokens_per_expert=nte, topk_idx=idx)
        normal, _, _ = buf.combine(rx, h)
        lrx, cnt, lh, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        ll, _, _ = buf.low_latency_combine(lrx, idx, w, lh)
        outs.append((normal, ll))
        if step == 1:
            buf.clean_low_latency_buffer(M, H, E)
    buf.destroy()
    return outs


def test_normal_and_low_latency_interleave_with_clean():
    results = run_ranks(_interleave, 2, timeout=60)
    for r, outs in enumerate(results):
        x, idx, w = ll_inputs(CASE, r)
        hits = torch.tensor([len({int(e) // 4 for e in row if e >= 0}) for row in idx])
        wsum = torch.where(idx >= 0, w, 0.0).sum(1)
        for normal, ll in outs:
            torch.testing.assert_close(normal.float(), x.float() * hits[:, None], rtol=1e-2,
                                       atol=1e-2)
            torch.testing.assert_close(ll.float(), x.float() * wsum[:, None], rtol=2e-2,
                                       atol=2e-2)


def _ll_bad(rank, n):
    buf = _buffer(CASE, n)
    plain = moe_comm.Buffer(None, 1 << 20, timeout_s=10)
    x, idx, w = ll_inputs(CASE, rank)
    bad = [
        (lambda: plain.low_latency_dispatch(x, idx, 8, 8), ValueError, "low_latency_mode=True"),
        (lambda: buf.low_latency_dispatch(torch.cat([x, x]), torch.cat([idx, idx]), 8, 8),
         ValueError, "more than num_max_dispatch_tokens_per_rank=8"),
        (lambda: buf.low_latency_dispatch(x, idx, 8, 8, use_ue8m0=True), ValueError,
         "use_ue8m0 needs"),
        (lambda: buf.low_latency_dispatch(x, idx, 64, 8), moe_comm.BufferTooSmallError,
         "num_rdma_bytes too small"),
        (lambda: buf.low_latency_dispatch(x.float(), idx, 8, 8), TypeError, "torch.bfloat16"),
        (lambda: buf.low_latency_dispatch(x, torch.randint(0, 8, (x.shape[0], 17)), 8, 8),
         ValueError, "top-k <= 16"),
        (lambda: buf.low_latency_dispatch(x, idx + 100, 8, 8), ValueError, "expert id"),
        # every slot of every token to expert 3: its block of 8 rows at the receiver overflows
        (lambda: buf.low_latency_dispatch(x, torch.full((x.shape[0], 2), 3), 8, 8), ValueError,
         "a token names that expert more than once"),
    ]
    msgs = []
    for call, exc, text in bad:
        try:
            call()
            msgs.append("no error")
        except exc as e:
            msgs.append(text if text in str(e) else str(e))
    rx, cnt, h, _, _ = buf.low_latency_dispatch(x, idx, 8, 8, use_fp8=False)
    out, _, _ = buf.low_latency_combine(rx, idx, w, h)
    buf.destroy()
    plain.destroy()
    return msgs, [t for _, _, t in bad], out


def test_low_latency_bad_input_is_named_and_buffer_survives():
    results = run_ranks(_ll_bad, 2, timeout=60)
    for r, (msgs, want, out) in enumerate(results):
        assert msgs == want
        x, idx, w = ll_inputs(CASE, r)
        wsum = torch.where(idx >= 0, w, 0.0).sum(1)
        torch.testing.assert_close(out.float(), x.float() * wsum[:, None], rtol=2e-2,
                                   atol=2e-2)


def test_late_rows_are_placed_around_and_released():
    """host/late_rows.py: return rows avoid what a masked rank may still write, in both
    buffers; a hold ends when that rank's DONE of the call arrives or its process is gone;
    no room is None."""
    gone = set()
    held = LateRows(gone.__contains__)
    done = np.zeros(1, dtype=np.int64)                  # rank 2's DONE word, nothing yet
    offsets, row = [1000, 5000], 10                      # two buffers' combine rows, bytes
    assert held.place(30, row, offsets, 100) == 0        # nothing held
    held.hold(1000 + 5 * row, 1000 + 25 * row, 2, done, seq=7)      # rows [5, 25) of buffer 0
    assert held.place(30, row, offsets, 100) == 25       # past it, in both buffers
    assert held.place(5, row, offsets, 100) == 0         # a run that ends before it
    assert held.place(80, row, offsets, 100) is None     # nothing fits beside it
    done[0] = tag(6, 3)                                   # an older call's DONE: still held
    assert held.held == [(1050, 1250, 2)]
    done[0] = tag(7, 3)                                   # its late rows came
    assert held.held == [] and held.place(80, row, offsets, 100) == 0
    held.hold(5000, 5100, 3, np.zeros(1, dtype=np.int64), seq=9)     # never signals ...
    assert held.place(95, row, offsets, 100) is None
    gone.add(3)                                           # ... but its process is gone
    assert held.place(95, row, offsets, 100) == 0


def _logfmt_worker(rank, n, cases, odd_rank):
    """Each case's combine with use_logfmt=True (rows LogFMT-encoded, moe_comm/logfmt.py);
    then one combine where ``odd_rank`` passes use_logfmt=False: every rank raises
    CallMismatchError, and the next combine works."""
    out, mismatch = [], None
    for case in cases:
        buf = _buffer(case, n)
        x, idx, w = ll_inputs(case, rank)
        rx, cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, case["max_tokens"],
                                                         case["experts"], use_fp8=False)
        y = expert_ll(rx, rank)
        combined, _, _ = buf.low_latency_combine(y, idx, w, handle, use_logfmt=True)
        out.append(dict(rx=rx.clone(), cnt=cnt, y=y, combined=combined.clone()))
        if mismatch is None:
            try:
                buf.low_latency_combine(y, idx, w, handle, use_logfmt=rank != odd_rank)
                mismatch = "no error"
            except moe_comm.CallMismatchError as e:
                mismatch = str(e)
            again, _, _ = buf.low_latency_combine(y, idx, w, handle)
            out[-1]["again"] = again.clone()
        buf.destroy()
    return out, mismatch


def _reference_combine(ys, ins, case):
    """Per rank the reference LL combine of expert outputs ``ys`` (one per rank) for inputs
    ``ins`` ((x, idx, w) per rank)."""
    sent = reference_ll_dispatch([i[0] for i in ins], [i[1] for i in ins], case["experts"],
                                 case["max_tokens"])
    return reference_ll_combine(ys, sent, [i[1] for i in ins], [i[2] for i in ins])


def test_logfmt_combine_matches_reference_and_disagreement_raises_everywhere():
    n = 4
    cases = [dict(c, fp8=False, round_scale=False, ue8m0=False, hook=False, zero_copy=False)
             for c in _cases(n) if c["hidden"] % 128 == 0][:3]
    results = run_ranks(_logfmt_worker, n, cases, 1, timeout=180)
    for ci, case in enumerate(cases):
        ins = [ll_inputs(case, r) for r in range(n)]
        ys = [results[d][0][ci]["y"] for d in range(n)]
        comb = _reference_combine(ys, ins, case)
        for r in range(n):
            # LogFMT: about 1% per value, summed over at most top-k rows
            torch.testing.assert_close(results[r][0][ci]["combined"].float(), comb[r].float(),
                                       rtol=3e-2, atol=3e-2)
            if ci == 0:               # the mismatch, then a plain combine that works
                mismatch = results[r][1]
                assert "use_logfmt" in mismatch and "rank 1 has False" in mismatch, (r, mismatch)
                torch.testing.assert_close(results[r][0][0]["again"].float(), comb[r].float(),
                                           rtol=2e-2, atol=2e-2)
