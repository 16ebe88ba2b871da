"""CUDA low-latency mode: LogFMT combine rows and the wait-cost stats, on the CPU kernel
emulator (tests/test_cuda_gpu.py runs the same checks on a GPU).

LogFMT (``combine_send/combine_recv(use_logfmt=True)``, csrc/kernels/logfmt.cuh): the
combined output equals the reference (plain float32 sums of the expert outputs) within the
bounds the host backend's LogFMT test uses, with -1 slots and a rank without tokens; the
bytes the send kernel wrote into each owner's combine rows decode with moe_comm/logfmt.decode
within half a level and agree with moe_comm/logfmt.encode within one level (both backends
speak one format); a rank passing another use_logfmt makes every rank raise
CallMismatchError naming it, and the next combine is exact again. 2 and 3 ranks by pointer,
and 2 ranks on two emulated hosts (network ranks: the encoded rows travel through the IBGDA
build's puts from the mirror).

Wait stats (``wait_stats`` of dispatch_recv / combine_recv, the Buffer's
``*_wait_recv_cost_stats``): added to, never below what was there, and a rank that sleeps
before it sends shows at least its sleep, more than the others.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

import moe_comm
from moe_comm import logfmt
from moe_comm.cuda import ll as cll
from moe_comm.cuda import memory
from moe_comm.jit import emulator
from moe_comm.reference import reference_ll_combine, reference_ll_dispatch
from moe_comm.wire import LL_MAX_TOPK, LL_NUM_BUFFERS, LLLayout, ll_stride

import cuda_cases as C
from checks import expert_ll, ll_inputs

CPU = torch.device("cpu")
ODD = 1                 # the rank that passes use_logfmt=False in the mismatch call
SLOW = 1                # the rank that sleeps before it sends (wait stats)
STATS_START = 10 ** 6   # what the stats tensors hold before the call: the kernels add to it


def _emulator_or_skip():
    if not emulator.available():
        pytest.skip("the kernel emulator needs a C++ compiler (g++)")


# ---- inputs ------------------------------------------------------------------------------------
def logfmt_cases(n):
    """bf16 dispatch (the returned rows are known exactly: x * (owner + 1)) with -1 slots and
    rank 1 without tokens, one block and several (the generic hidden variant), and an fp8
    dispatch of a specialised hidden size."""
    def tokens(m):
        return [m if r == 0 else (0 if r == 1 else min(m, 1 + 2 * r)) for r in range(n)]
    return [
        dict(seed=11, hidden=256, fp8=False, round_scale=False, ue8m0=False, routing="holes",
             max_tokens=12, tokens=tokens(12), experts=4 * n, topk=min(4, 4 * n)),
        dict(seed=12, hidden=128, fp8=False, round_scale=False, ue8m0=False,
             routing="skewed", max_tokens=8, tokens=tokens(8), experts=2 * n, topk=2),
        dict(seed=13, hidden=7168, fp8=True, round_scale=False, ue8m0=False,
             routing="random", max_tokens=4, tokens=tokens(4), experts=2 * n, topk=3),
    ]


def logfmt_inputs(case, rank):
    """ll_inputs with what LogFMT treats specially: a zero block (token 0), rows at another
    scale (odd tokens), and a channel far below its block's largest value (sent as zero)."""
    x, idx, w = ll_inputs(case, rank)
    x = x.float()
    if x.shape[0]:
        x[0, :128] = 0
        x[1::2] *= 2.0 ** -12
        x[:, 5] *= 2.0 ** -40
    return x.bfloat16(), idx, w


# ---- rank bodies -------------------------------------------------------------------------------
def _dispatch(comm, case, lay, x, idx):
    recv_x, recv_scales, recv_count = C.ll_outputs(case, comm.num_ranks, comm.device)
    handle = cll.dispatch_send(comm, x=x, topk_idx=idx, lay=lay, use_fp8=case["fp8"],
                               round_scale=case["round_scale"], buffer_key=C.KEY)
    cll.dispatch_recv(comm, handle, lay, recv_x=recv_x, recv_scales=recv_scales,
                      recv_count=recv_count, use_fp8=case["fp8"], use_ue8m0=case["ue8m0"],
                      stats=None)
    return handle, (recv_x, recv_scales) if case["fp8"] else recv_x


def _combine(comm, lay, handle, y, idx, w, use_logfmt):
    """One combine (send + receive) into a NaN-poisoned output; returns (out, buffer)."""
    seq, buf = cll.combine_send(comm, x=y, handle=handle, lay=lay, use_logfmt=use_logfmt)
    out = torch.full((idx.shape[0], y.shape[-1]), float("nan"), dtype=torch.bfloat16,
                     device=comm.device)
    cll.combine_recv(comm, seq, buf, lay, handle=handle, topk_idx=idx, topk_weights=w,
                     out=out, use_logfmt=use_logfmt)
    comm.synchronize()
    return out, buf


def _combine_rows_at(comm, lay, buf):
    return comm.pointers[comm.rank] + comm.ll_offset + lay.offset(buf, "combine",
                                                                  ll_stride(comm.ll_bytes))


def _poison_combine_rows(comm, lay):
    """0xFF over both buffers' combine rows (between barriers): a row slot the send kernel
    did not write decodes as NaN."""
    nbytes = lay.max_tokens * LL_MAX_TOPK * lay.hidden * 2
    for buf in range(LL_NUM_BUFFERS):
        memory.memset(comm.device, _combine_rows_at(comm, lay, buf), 0xFF, nbytes,
                      on_stream=False)


def _encoded_rows(comm, lay, buf, rows):
    """uint8 [rows, logfmt.row_bytes(H)]: the start of each of this rank's first `rows`
    combine row slots of buffer `buf` (where the peers' send kernels put the encoded rows)."""
    hidden = lay.hidden
    if rows == 0:            # a rank without tokens gets nothing back
        return torch.empty(0, logfmt.row_bytes(hidden), dtype=torch.uint8)
    words = memory.read_words(comm.device, _combine_rows_at(comm, lay, buf), rows * hidden // 4)
    slots = torch.from_numpy(words).view(torch.uint8).view(rows, hidden * 2)
    return slots[:, :logfmt.row_bytes(hidden)].clone()


def _mismatch_then_plain(comm, lay, handle, y, idx, w):
    """A combine where rank ODD passes use_logfmt=False (the rest True), then plain ones until
    one works (the first may still report the mismatch: kernels are asynchronous). Returns
    ([the CallMismatchErrors], the plain output)."""
    errors = []

    def attempt(use_logfmt):
        try:
            return _combine(comm, lay, handle, y, idx, w, use_logfmt)[0]
        except moe_comm.CallMismatchError as e:
            errors.append(e)
            return None

    attempt(comm.rank != ODD)
    for _ in range(2):
        again = attempt(False)
        if again is not None:
            return errors, again.cpu()
    return errors, None


def logfmt_rank(comm, cases, barrier):
    dev, n, out = comm.device, comm.num_ranks, []
    for ci, case in enumerate(cases):
        barrier()
        comm.reset_ll()
        lay = LLLayout(case["max_tokens"], case["hidden"], n, case["experts"])
        _poison_combine_rows(comm, lay)
        barrier()
        x, idx, w = (t.to(dev) for t in logfmt_inputs(case, comm.rank))
        handle, rx = _dispatch(comm, case, lay, x, idx)
        y = expert_ll(rx, comm.rank)
        combined, buf = _combine(comm, lay, handle, y, idx, w, True)
        barrier()          # every owner's rows of this combine are in: read them back
        got = dict(y=y.cpu(), combined=combined.cpu(), send_index=handle.send_index.cpu(),
                   encoded=_encoded_rows(comm, lay, buf, int((idx >= 0).sum())))
        if ci == 0:
            got["errors"], got["again"] = _mismatch_then_plain(comm, lay, handle, y, idx, w)
        out.append(got)
    return out


# ---- checks ------------------------------------------------------------------------------------
def _levels(encoded, hidden):
    """int64 [n, hidden] signed levels (-level for negative codes) of encoded rows."""
    codes = logfmt._unpack(encoded[:, hidden // logfmt.BLOCK * logfmt.HEADER_BYTES:], hidden)
    level = codes & logfmt.LEVELS
    return torch.where(codes >> 9 == 1, -level, level)


def check_encoded_rows(case, rank, got, x, idx):
    """The rows rank `rank` got back (bf16 dispatch: owner d returned x[t] * (d + 1)): they
    decode within half a level (plus float slack) and agree with the Python encoder."""
    hidden, num_local = case["hidden"], case["experts"] // len(case["tokens"])
    tok, slot = (idx >= 0).nonzero(as_tuple=True)
    if tok.numel() == 0:     # nothing sent (a rank without tokens, or only -1 slots)
        assert got["encoded"].shape[0] == 0, rank
        return
    rows = got["send_index"][tok, slot].long()
    assert sorted(rows.tolist()) == list(range(tok.numel())), rank   # every slot once
    owner = idx[tok, slot] // num_local
    want = (x[tok].float() * (owner + 1).unsqueeze(1).float()).bfloat16()
    enc = got["encoded"][rows]
    dec = logfmt.decode(enc, hidden)
    ref = logfmt.encode(want)
    # the block ranges: log2 of the same floats (a last-bit difference of log2f at most)
    torch.testing.assert_close(enc[:, :hidden // 128 * 8].view(torch.float32),
                               ref[:, :hidden // 128 * 8].view(torch.float32),
                               rtol=1e-6, atol=1e-6)
    diff = (_levels(enc, hidden) - _levels(ref, hidden)).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (rank, diff.max())
    exact = want.float()
    mag = exact.abs().view(-1, hidden // 128, 128)
    top = mag.amax(-1, keepdim=True)
    # sent as zero: zeros, and values more than 2^-LOG_RANGE below their block's largest
    kept = (mag > 0) & (mag >= top * 2.0 ** -logfmt.LOG_RANGE)
    assert torch.equal(dec.view_as(mag) != 0, kept), rank
    logs = mag.clamp(min=1e-38).log2()
    low = torch.where(kept, logs, torch.full_like(logs, float("inf"))).amin(-1, keepdim=True)
    width = torch.where(kept.any(-1, keepdim=True), top.clamp(min=1e-38).log2() - low,
                        torch.zeros_like(low))
    bound = torch.exp2(width / (logfmt.LEVELS - 1) * 0.5) - 1 + 1e-5       # half a level
    rel = (dec.view_as(mag) - exact.view_as(mag)).abs() / mag.clamp(min=1e-38)
    assert (rel[kept] <= bound.expand_as(rel)[kept]).all(), (rank, (rel - bound)[kept].max())


def check_logfmt_group(n, device, cases=None, network=0):
    cases = logfmt_cases(n) if cases is None else cases
    C.preload(device, n, {c["hidden"] for c in cases}, ll=True, network=network)
    barrier = threading.Barrier(n)
    results = C.run(logfmt_rank, C.group(n, device, C.ll_bytes(cases, n), network=network),
                    cases, barrier.wait)
    for ci, case in enumerate(cases):
        ins = [logfmt_inputs(case, r) for r in range(n)]
        sent = reference_ll_dispatch([i[0] for i in ins], [i[1] for i in ins],
                                     case["experts"], case["max_tokens"])
        ys = [results[d][ci]["y"] for d in range(n)]
        want = reference_ll_combine(ys, sent, [i[1] for i in ins], [i[2] for i in ins])
        for r in range(n):
            got = results[r][ci]
            # LogFMT: about 1% per value, summed over at most top-k rows (the host's bounds)
            torch.testing.assert_close(got["combined"].float(), want[r].float(), rtol=3e-2,
                                       atol=3e-2)
            if not case["fp8"]:
                check_encoded_rows(case, r, got, ins[r][0], ins[r][1])
            if ci == 0:
                errors = got["errors"]
                assert len(errors) == 1, (r, [str(e) for e in errors])
                assert errors[0].fields == {"use_logfmt": {q: q != ODD for q in range(n)}}, \
                    (r, errors[0].fields)
                assert f"rank {ODD} has False" in str(errors[0]), str(errors[0])
                torch.testing.assert_close(got["again"].float(), want[r].float(), rtol=2e-2,
                                           atol=2e-2)


# ---- wait stats --------------------------------------------------------------------------------
def _stats(comm):
    return torch.full((comm.num_ranks,), STATS_START, dtype=torch.int64, device=comm.device)


def wait_stats_rank(comm, case, delay_s, barrier):
    """One LL round; rank SLOW sleeps `delay_s` before its dispatch send and again before its
    combine send. Returns the (dispatch, combine) stats, each started at STATS_START, and a
    tensor that was never passed (None given: nothing else is touched)."""
    dev, n = comm.device, comm.num_ranks
    lay = LLLayout(case["max_tokens"], case["hidden"], n, case["experts"])
    x, idx, w = (t.to(dev) for t in ll_inputs(case, comm.rank))
    dispatch_cost, combine_cost = _stats(comm), _stats(comm)
    barrier()
    if comm.rank == SLOW:
        time.sleep(delay_s)
    recv_x, _, recv_count = C.ll_outputs(case, n, dev)
    handle = cll.dispatch_send(comm, x=x, topk_idx=idx, lay=lay, use_fp8=False,
                               round_scale=False, buffer_key=C.KEY)
    cll.dispatch_recv(comm, handle, lay, recv_x=recv_x, recv_scales=None,
                      recv_count=recv_count, use_fp8=False, use_ue8m0=False, stats=None,
                      wait_stats=dispatch_cost)
    comm.synchronize()
    barrier()
    if comm.rank == SLOW:
        time.sleep(delay_s)
    seq, buf = cll.combine_send(comm, x=recv_x, handle=handle, lay=lay)
    out = torch.empty(tuple(x.shape), dtype=torch.bfloat16, device=dev)
    cll.combine_recv(comm, seq, buf, lay, handle=handle, topk_idx=idx, topk_weights=w,
                     out=out, wait_stats=combine_cost)
    # a round without stats: the kernels get null and write nowhere
    untouched = _stats(comm)
    handle = cll.dispatch_send(comm, x=x, topk_idx=idx, lay=lay, use_fp8=False,
                               round_scale=False, buffer_key=C.KEY)
    cll.dispatch_recv(comm, handle, lay, recv_x=recv_x, recv_scales=None,
                      recv_count=recv_count, use_fp8=False, use_ue8m0=False, stats=None)
    comm.synchronize()
    return dispatch_cost.cpu(), combine_cost.cpu(), untouched.cpu()


def check_wait_stats(device, n=3):
    case = dict(seed=21, hidden=128, fp8=False, round_scale=False, ue8m0=False,
                routing="random", max_tokens=4, tokens=[4] * n, experts=2 * n, topk=2)
    timeout_s = C.deadline(60.0)
    delay_s = min(1.5, timeout_s / 4)       # well inside every wait's deadline
    C.preload(device, n, {128}, ll=True)
    barrier = threading.Barrier(n)
    lay = LLLayout(case["max_tokens"], case["hidden"], n, case["experts"])
    results = C.run(wait_stats_rank, C.group(n, device, lay.nbytes, timeout_s), case, delay_s,
                    barrier.wait)
    for r, (dispatch_cost, combine_cost, untouched) in enumerate(results):
        assert (untouched == STATS_START).all(), r
        for name, cost in (("dispatch", dispatch_cost), ("combine", combine_cost)):
            waited = cost - STATS_START
            assert (waited >= 0).all(), (r, name, waited)
            if r == SLOW:
                continue
            others = [q for q in range(n) if q != SLOW]
            # the receive started about when the others sent; SLOW sent delay_s later
            assert waited[SLOW] >= 0.5 * delay_s * 1e9, (r, name, waited)
            assert waited[SLOW] > waited[others].max(), (r, name, waited)


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_logfmt_combine_matches_reference_and_a_mismatch_raises_everywhere(n):
    _emulator_or_skip()
    check_logfmt_group(n, CPU)


def test_logfmt_combine_through_network_ranks():
    """Two emulated hosts: every peer is a network rank, its encoded rows built in the mirror
    and put by the IBGDA build (transport.cuh)."""
    _emulator_or_skip()
    check_logfmt_group(2, CPU, logfmt_cases(2)[:1], network=2)


def test_wait_stats_name_the_rank_that_sent_late():
    _emulator_or_skip()
    check_wait_stats(CPU)


def test_logfmt_hidden_not_a_multiple_of_128_is_refused_before_anything_moves():
    """The CUDA combine checks use_logfmt's hidden size itself (Buffer validates it too):
    ValueError naming use_logfmt, and the call number is not spent."""
    _emulator_or_skip()
    comm = C.group(1, CPU, LLLayout(4, 192, 1, 2).nbytes)[0]
    try:
        x = torch.zeros(2, 4, 192, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="use_logfmt"):
            cll.combine_send(comm, x=x, handle=None, lay=LLLayout(4, 192, 1, 2),
                             use_logfmt=True)
        assert comm.ll_seq["combine"] == 0
    finally:
        comm.destroy()
