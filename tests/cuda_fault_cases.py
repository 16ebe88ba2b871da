"""The CUDA backend's error paths and caller-tensor edge cases, shared by the emulator tests
(tests/test_cuda_emulator.py) and the GPU tests (tests/test_cuda_gpu.py), like
tests/cuda_cases.py for the reference checks:

* an overflow every rank detects: every rank raises it, no block is left at a barrier, the
  block counters are back at 0;
* a rank that failed (an error of its own) makes its peers fail at once, naming it, instead of
  at their deadline - or, elastic, be masked at once while the call completes over the rest;
* LL dispatch from an ``x`` and LL combine into an ``out`` that are views at a 2-byte offset
  (a GPU faults on a misaligned 16-byte access): results equal to aligned tensors'.
* ranks that disagree about a call (another hidden size): both raise CallMismatchError, and
  the next dispatch on which they agree is exact.

"At once" is measured against the deadline: the group's deadline is TIMEOUT_S (30 s, capped
by MOE_COMM_TEST_TIMEOUT_S like tests/cuda_cases.py) and a peer must see the failure in under
half of it. A small call takes well under a second on the emulator and milliseconds on a GPU,
so the bound holds on a loaded machine; the code before the fix waited the whole deadline.
"""
from __future__ import annotations

import time

import torch

from cuda_cases import deadline, outer_timeout, preload
from moe_comm.cuda import groups
from moe_comm.cuda.comm import CudaCommError
from moe_comm.testing.local_cuda import run_local
from moe_comm.wire import LLLayout

TIMEOUT_S = deadline(30.0)
FAST_S = TIMEOUT_S / 2
KEY = ("faults",)
HEAP = 8 << 20


def _group(n, device, ll_bytes=0, elastic=False):
    """Two ranks with every kernel the checks use loaded (before any rank waits on another)."""
    preload(device, n, {256}, ll=True)
    return groups.local_group(n, HEAP, ll_bytes, TIMEOUT_S, device=device, elastic=elastic)


def _run(fn, comms, *args):
    """fn on every rank; errors are the rank bodies' to return, so none is re-raised."""
    try:
        return run_local(fn, comms, *args, timeout=outer_timeout(4 * TIMEOUT_S), check=False)
    finally:
        for c in comms:
            c.destroy(barrier=False)


def _outcome(call):
    """(error text or None, seconds) of ``call()``."""
    t0 = time.monotonic()
    try:
        call()
        return None, time.monotonic() - t0
    except CudaCommError as e:
        return str(e), time.monotonic() - t0


def _normal_dispatch(comm, x, idx, worst, experts):
    from moe_comm.cuda import normal as cn
    return cn.dispatch(comm, x_bytes=x.view(torch.uint8), dtype=x.dtype, hidden=x.shape[1],
                       scales=None, topk_idx=idx, topk_weights=None, layout=None, handle=None, num_experts=experts,
                       num_worst_tokens=worst, buffer_key=KEY)


def _ll_round(comm, x, idx, lay):
    """One bf16 LL dispatch + combine (weights 1) of ``x``/``idx``; returns the combined rows."""
    from moe_comm.cuda import ll as cll
    dev, tokens = comm.device, x.shape[0]
    h = cll.dispatch_send(comm, x=x, topk_idx=idx, lay=lay, use_fp8=False, round_scale=False,
                          buffer_key=KEY)
    rx = torch.empty(lay.num_local, comm.num_ranks * lay.max_tokens, x.shape[1],
                     dtype=torch.bfloat16, device=dev)
    cll.dispatch_recv(comm, h, lay, recv_x=rx, recv_scales=None,
                      recv_count=torch.zeros(lay.num_local, dtype=torch.int32, device=dev),
                      use_fp8=False, use_ue8m0=False, stats=None)
    seq, buf = cll.combine_send(comm, x=rx, handle=h, lay=lay)
    out = torch.empty(tokens, x.shape[1], dtype=torch.bfloat16, device=dev)
    cll.combine_recv(comm, seq, buf, lay, handle=h, topk_idx=idx,
                     topk_weights=torch.ones(idx.shape, device=dev), out=out)
    return out


# ---- an overflow every rank sees ---------------------------------------------------------------
def _overflow_rank(comm):
    dev = comm.device
    x = torch.randn(16, 256, device=dev).bfloat16()
    idx = torch.tensor([[0, 4]] * 16, device=dev)         # every token to both ranks: 32 rows

    def call():
        _normal_dispatch(comm, x, idx, worst=4, experts=8)  # room for 4
        comm.synchronize()
    error, seconds = _outcome(call)
    return error, seconds, comm.counters.cpu().tolist()


def check_overflow_fails_every_rank(device):
    for r, (error, seconds, counters) in enumerate(_run(_overflow_rank, _group(2, device))):
        assert error and "more rows than the receive region" in error, (r, error)
        assert seconds < FAST_S, (r, seconds)
        assert counters == [0] * len(counters), (r, counters)


# ---- a rank whose earlier kernel failed ----------------------------------------------------------
def _failed_rank(comm, mode, elastic):
    """Rank 1 enters the call with its device error word set - the state a rank is in when a
    kernel failed after its host last checked (the host check passes, the queued kernels find
    the failure) - and runs it; rank 0 runs it normally."""
    from moe_comm.cuda import normal as cn
    dev = comm.device
    x = torch.randn(8, 256, device=dev).bfloat16()
    idx = torch.tensor([[0, 4]] * 8, device=dev)
    lay = LLLayout(8, 256, 2, 8)
    if comm.rank == 1:
        comm.err_dev[0] = 2                        # an earlier kernel's overflow

    def call():
        if mode == "normal":
            _, _, _, _, handle = _normal_dispatch(comm, x, idx, worst=16, experts=8)
            y = torch.randn(16, 256, device=dev).bfloat16()
            cn.combine(comm, x=y, handle=handle, topk_weights=None, bias=())
        else:
            _ll_round(comm, x, idx, lay)
        comm.synchronize()
    error, seconds = _outcome(call)
    return error, seconds, comm.active_ranks().cpu().tolist(), comm.counters.cpu().tolist()


def check_failed_rank_fails_peers_at_once(device, mode, elastic=False):
    ll_bytes = LLLayout(8, 256, 2, 8).nbytes if mode == "ll" else 0
    results = _run(_failed_rank, _group(2, device, ll_bytes, elastic), mode, elastic)
    error, seconds, active, counters = results[0]
    assert seconds < FAST_S, seconds
    assert counters == [0] * len(counters), counters
    if elastic:                      # the survivor masks the failed rank and finishes the call
        assert error is None, error
        assert active == [1, 0], active
    else:
        assert error and "rank(s) [1] failed this call" in error, error
    assert results[1][3] == [0] * len(results[1][3]), results[1][3]


# ---- LL overflow on one rank ------------------------------------------------------------------
def _ll_overflow_rank(comm, tokens):
    """Rank 0 lists expert 4 (rank 1's) twice for every token: 2M messages for one expert, M
    fit - an overflow only rank 0, the sender, sees, and whose count word rank 1 awaits; rank 1
    routes normally. (A failure whose rank then stops calling is a silent rank for the calls it
    misses: its peers meet their deadline there, and the timeout names it.)"""
    dev = comm.device
    lay = LLLayout(tokens, 256, 2, 8)
    x = torch.randn(tokens, 256, device=dev).bfloat16()
    idx = torch.tensor([[4, 4]] * tokens if comm.rank == 0 else [[1, 5]] * tokens, device=dev)

    def call():
        _ll_round(comm, x, idx, lay)
        comm.synchronize()
    return _outcome(call)


def check_ll_overflow_fails_the_peer_at_once(device, tokens=8):
    comms = _group(2, device, LLLayout(tokens, 256, 2, 8).nbytes)
    (err0, _), (err1, seconds1) = _run(_ll_overflow_rank, comms, tokens)
    assert err0 and "more rows than the receive region" in err0, err0
    assert err1 and "rank(s) [0] failed this call" in err1, err1
    assert seconds1 < FAST_S, seconds1


# ---- misaligned caller tensors (LL) --------------------------------------------------------------
def _offset_copy(t):
    """``t``'s values in a view that starts 2 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 == 2
    return view


def _ll_views_rank(comm, fp8):
    from moe_comm.cuda import ll as cll
    dev, T, H = comm.device, 8, 256
    lay = LLLayout(T, H, 2, 8)
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(T, H, generator=gen).bfloat16().to(dev)
    idx = torch.randint(0, 8, (T, 2), generator=gen).to(dev)
    w = torch.rand(T, 2, generator=gen).to(dev)
    results = []
    for offset in (False, True):
        comm.synchronize()
        h = cll.dispatch_send(comm, x=_offset_copy(x) if offset else x, topk_idx=idx, lay=lay,
                              use_fp8=fp8, round_scale=False, buffer_key=KEY)
        rx = torch.zeros(4, 2 * T, H, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                         device=dev)
        rs = torch.zeros(4, 2 * T, H // 128, device=dev) if fp8 else None
        cnt = torch.zeros(4, dtype=torch.int32, device=dev)
        cll.dispatch_recv(comm, h, lay, recv_x=rx, recv_scales=rs, recv_count=cnt,
                          use_fp8=fp8, use_ue8m0=False, stats=None)
        y = (rx.float() * (rs.repeat_interleave(128, -1) if fp8 else 1)).bfloat16()
        seq, buf = cll.combine_send(comm, x=y, handle=h, lay=lay)
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
        out = _offset_copy(out) if offset else out
        cll.combine_recv(comm, seq, buf, lay, handle=h, topk_idx=idx, topk_weights=w, out=out)
        comm.synchronize()
        results.append((rx.view(torch.uint8).cpu(), None if rs is None else rs.cpu(),
                        cnt.cpu(), out.cpu()))
    return results


def check_ll_views_at_any_offset(device, fp8):
    comms = _group(2, device, LLLayout(8, 256, 2, 8).nbytes)
    for r, (aligned, offset) in enumerate(_run(_ll_views_rank, comms, fp8)):
        assert int(aligned[2].sum()) > 0, r
        assert not aligned[3].isnan().any(), r
        for a, b in zip(aligned, offset):
            assert (a is None and b is None) or torch.equal(a, b), r


# ---- ranks that disagree about a call -----------------------------------------------------------
def _mismatch_rank(comm):
    """Rank 1 dispatches rows of 128 channels, rank 0 of 256: both raise CallMismatchError at
    the notify (the dispatch reads its counts), then agree on the next dispatch."""
    import moe_comm
    dev = comm.device
    idx = torch.tensor([[0, 4]] * 8, device=dev)
    x = torch.randn(8, 256, device=dev).bfloat16()
    try:
        _normal_dispatch(comm, x[:, :128].contiguous() if comm.rank == 1 else x, idx, worst=0,
                         experts=8)
        error = None
    except moe_comm.CallMismatchError as e:
        error = str(e)
    rx = _normal_dispatch(comm, x, idx, worst=0, experts=8)[0]
    comm.synchronize()
    return error, rx.cpu(), x.cpu()


def check_mismatch_raises_everywhere_and_the_next_call_works(device):
    results = _run(_mismatch_rank, _group(2, device))
    for r, (error, rx, x) in enumerate(results):
        assert error and "hidden: rank 0 has 256, rank 1 has 128" in error, (r, error)
    # every token went to both ranks: each receives both ranks' rows, by source then token
    want = torch.cat([results[0][2], results[1][2]])
    for r, (_, rx, _) in enumerate(results):
        assert torch.equal(rx, want), r
