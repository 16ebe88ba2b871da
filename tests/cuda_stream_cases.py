"""Batches larger than the buffer stream through it on the CUDA backend (moe_comm/cuda/normal.py
``Rounds``): checks shared by the emulator tests (tests/test_cuda_streaming.py) and the GPU
tests (tests/test_cuda_gpu.py), like tests/cuda_cases.py for the single copy.

* Every receive region of the streamed cases is at least 4x the data region: results equal
  the reference and, bit for bit, what a buffer large enough for one copy returns - dispatch
  (bf16, fp8 with scales, fp32, fp16 with num_worst_tokens), the cached dispatch that reuses a
  streamed handle, combine (with bias; its rows come back in rounds too) - on ragged and
  skewed routing with -1 slots and a rank with no tokens. The data region is poisoned before
  every call (cuda_cases.normal_rank) and so is every tensor the calls allocate (outputs, the
  combine's staging rows): a row no round wrote shows up as NaN / -1.
* A row larger than half the data region is refused on every rank, and the buffer works after.
* A rank that fails in the middle of a streamed call (its error word set before round 0 or 1)
  makes its peer fail at once, naming it, not at the deadline, and leaves no block counter
  behind - also when the peer reaches that round after the failed rank ran through the rest.
* A signature mismatch found in the first round of a streamed combine leaves the buffer
  usable: the failure marks its later rounds left in the signature slots do not fail the
  next call of a peer that reads them before they are rewritten.
* Elastic: a rank silent from the start is masked at the first notify's deadline and the
  survivors stream the rest without it; their outputs equal the reference over them.
"""
from __future__ import annotations

import contextlib
import threading
import time

import torch

import cuda_cases as C
import moe_comm
from checks import assert_same_bits, check_normal, flat
from inputs import expert_fn, make_inputs
from moe_comm.cuda import groups
from moe_comm.cuda import normal as cn
from moe_comm.cuda.comm import CudaCommError
from moe_comm.testing.local_cuda import run_local
from moe_comm.wire import SlabLayout

SMALL_HEAP = 64 << 10          # the streamed cases' regions are 4x this and more
LARGE_HEAP = C.HEAP            # one copy of every case
FAULT_TIMEOUT_S = C.deadline(30.0)
FAST_S = FAULT_TIMEOUT_S / 2   # "at once": a small streamed call takes ~1 s emulated
# Blocks of the data kernels: DeepEP's default (20) on a GPU; on the emulator, where a launch
# costs its threads and a streamed call launches per round, 2 (which also runs the kernels'
# grid-stride loops many times over)
NUM_SMS = 2


def stream_cases(n):
    """The first four stream (``streams``, checked by check_streams_exactly); the last fits
    one copy."""
    base = dict(experts=4 * n, topk=4, bias=False, alignment=1, worst=0, streams=True)
    return [
        dict(base, seed=11, tokens=[260 + 13 * r for r in range(n)], hidden=256,
             routing="random", dtype="bfloat16", bias=True),
        dict(base, seed=12, tokens=[300] * n, hidden=512, routing="skewed", dtype="fp8",
             alignment=4),
        dict(base, seed=13, tokens=[0] + [600] * (n - 1), hidden=128, routing="holes",
             dtype="float32", bias=True),
        dict(base, seed=14, tokens=[300 + r for r in range(n)], hidden=256, routing="one_rank",
             dtype="float16", worst=(300 + n) * n),
        dict(base, seed=15, tokens=[6] * n, hidden=128, routing="random", dtype="bfloat16",
             streams=False),
    ]


def _elem_bytes(case):
    return 1 if case["dtype"] == "fp8" else getattr(torch, case["dtype"]).itemsize


class _PoisonedTorch:
    """``torch`` for moe_comm/cuda/normal.py whose ``empty`` fills what it returns with 0xFF
    bytes (NaN, -1): an output row or staging row that no round writes cannot pass for a
    right one."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        if t.numel():
            t.view(-1).view(torch.uint8).fill_(0xFF)
        return t


@contextlib.contextmanager
def poisoned_outputs():
    saved = cn.torch
    cn.torch = _PoisonedTorch()
    try:
        yield
    finally:
        cn.torch = saved


def stream_rank(comm, cases, barrier, num_sms=NUM_SMS):
    """cuda_cases.normal_rank with ``num_sms`` blocks per data kernel."""
    return C.normal_rank(comm, cases, barrier, num_sms)


def _group(n, device, heap, timeout_s=None):
    C.preload(device, n)
    timeout_s = C.deadline(60.0) if timeout_s is None else timeout_s
    return groups.local_group(n, heap, 0, timeout_s, device=device)


def _num_sms(device):
    return NUM_SMS if torch.device(device).type == "cpu" else cn.DEFAULT_NUM_SMS


def _run_cases(n, device, heap, cases):
    barrier = threading.Barrier(n)
    with poisoned_outputs():
        return C.run(stream_rank, _group(n, device, heap), cases, barrier.wait,
                     _num_sms(device))


def _assert_it_streamed(n, cases, results, heap):
    """Dispatch: the largest receive region (or num_worst_tokens) is >= 4x the data region;
    combine: some owner's returned rows do not fit it either."""
    for ci, case in enumerate(cases):
        assert all(results[r][ci]["streamed"] == case["streams"] for r in range(n)), ci
        if not case["streams"]:
            continue
        row = case["hidden"] * _elem_bytes(case)
        scale_cols = row // 128 if case["dtype"] == "fp8" else 0
        most = max(flat(results[r][ci]["rx"])[0].shape[0] for r in range(n))
        assert SlabLayout(most, row, scale_cols, case["topk"]).nbytes >= 4 * heap, (ci, most)
        back = max(int(results[r][ci]["layout"][0].sum()) for r in range(n))
        out_row = case["hidden"] * (2 if case["dtype"] == "fp8" else _elem_bytes(case))
        assert SlabLayout(back, out_row, 0, case["topk"]).nbytes > heap, (ci, back)


def check_streams_exactly(n, device, cases=None):
    cases = stream_cases(n) if cases is None else cases
    small = _run_cases(n, device, SMALL_HEAP, cases)
    check_normal(n, cases, small)
    _assert_it_streamed(n, cases, small, SMALL_HEAP)
    assert_same_bits(n, cases, small, _run_cases(n, device, LARGE_HEAP, cases))


# ---- a row larger than half the data region ----------------------------------------------------
def _too_big_then_fine(comm, barrier, after, num_sms):
    dev = comm.device
    x = torch.randn(4, SMALL_HEAP // 2, device=dev).bfloat16()     # one row = the whole region
    idx = torch.zeros(4, 1, dtype=torch.int64, device=dev)         # all to rank 0
    try:
        cn.dispatch(comm, x_bytes=x.view(torch.uint8), dtype=x.dtype, hidden=x.shape[1],
                    scales=None, topk_idx=idx, topk_weights=None, layout=None, handle=None,
                    num_experts=2 * comm.num_ranks, num_worst_tokens=0, buffer_key=C.KEY)
        got = "no error"
    except moe_comm.BufferTooSmallError as e:
        got = str(e)
    barrier()
    return got, stream_rank(comm, after, barrier, num_sms)


def check_row_too_big_refused_everywhere(n, device):
    after = [stream_cases(n)[0]]            # then a streamed batch works on the same buffer
    barrier = threading.Barrier(n)
    with poisoned_outputs():
        results = C.run(_too_big_then_fine, _group(n, device, SMALL_HEAP), barrier.wait, after,
                        _num_sms(device))
    for got, _ in results:
        assert "num_nvl_bytes too small" in got and "one row, streamed" in got, got
    check_normal(n, after, [res for _, res in results])


# ---- a rank failing in the middle of a streamed call -------------------------------------------
def _failing_round(original, failing_round, lag_s):
    """cn._dispatch_round, except that rank 1 sets its device error word before round
    ``failing_round`` - the state of a rank one of whose kernels failed in the round before
    (an overflow code: its kernels from there on skip their work and mark their signals) -
    and rank 0 starts that round ``lag_s`` late: the failed rank, which waits for nobody,
    runs through the rounds after and overwrites its failure marks of that round with later
    ones before rank 0 reads them."""
    def round_hook(comm, k, plan, epoch, first, rows, *rest):
        if plan.chunk and first == failing_round * plan.chunk:
            if comm.rank == 1:
                comm.err_dev[0] = 2
            else:
                time.sleep(lag_s)
        original(comm, k, plan, epoch, first, rows, *rest)
    return round_hook


def _streamed_call(comm):
    """A dispatch of 600 rows to each rank (about 9 rounds at SMALL_HEAP) and its combine."""
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(300, 256, generator=gen).bfloat16().to(comm.device)
    idx = torch.tensor([[0, 4]] * 300, device=comm.device)
    t0 = time.monotonic()
    error = None
    try:
        _, _, _, _, handle = cn.dispatch(
            comm, x_bytes=x.view(torch.uint8), dtype=x.dtype, hidden=256, scales=None,
            topk_idx=idx, topk_weights=None, layout=None, handle=None, num_experts=8,
            num_worst_tokens=0, buffer_key=C.KEY)
        y = torch.zeros(handle.num_recv_tokens, 256, device=comm.device).bfloat16()
        cn.combine(comm, x=y, handle=handle, topk_weights=None, bias=())
        comm.synchronize()
    except CudaCommError as e:
        error = str(e)
    return error, time.monotonic() - t0, comm.counters.cpu().tolist()


def check_failure_mid_stream_fails_peers_at_once(device, failing_round=1, lag_s=0.0):
    comms = _group(2, device, SMALL_HEAP, timeout_s=FAULT_TIMEOUT_S)
    saved = cn._dispatch_round
    cn._dispatch_round = _failing_round(saved, failing_round, lag_s)
    try:
        results = run_local(_streamed_call, comms, timeout=C.outer_timeout(4 * FAULT_TIMEOUT_S),
                            check=False)
    finally:
        cn._dispatch_round = saved
        for c in comms:
            c.destroy(barrier=False)
    (error, seconds, counters), (_, seconds1, counters1) = results
    assert error and "rank(s) [1] failed this call" in error, error
    assert seconds < FAST_S and seconds1 < FAST_S, (seconds, seconds1)
    assert counters == [0] * len(counters) and counters1 == [0] * len(counters1)


# ---- a signature mismatch in a streamed combine ------------------------------------------------
def _mismatch_then_fine(comm, lag_s):
    """A streamed combine of bf16 rows on rank 0 and the same bytes as fp16 on rank 1 (the
    same rounds): the first round's notify reports the mismatch, every round still runs, and
    the notifies of the rounds after mark the signature and count slots failed. The next
    meeting with the host raises the mismatch and clears it; then a dispatch and a combine
    must work, rank 1 starting them ``lag_s`` late, while rank 0 reads slots that still hold
    those marks of an earlier epoch."""
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(comm.rank)).bfloat16()
    x = x.to(comm.device)
    idx = torch.tensor([[0, 4]] * 300, device=comm.device)   # every token to both ranks

    def dispatch():
        return cn.dispatch(comm, x_bytes=x.view(torch.uint8), dtype=x.dtype, hidden=256,
                           scales=None, topk_idx=idx, topk_weights=None, layout=None,
                           handle=None, num_experts=8, num_worst_tokens=0, buffer_key=C.KEY)

    rx, _, _, _, handle = dispatch()
    y = rx if comm.rank == 0 else rx.view(torch.float16)
    cn.combine(comm, x=y, handle=handle, topk_weights=None, bias=())
    errors = []
    try:
        comm.synchronize()
    except (moe_comm.CallMismatchError, CudaCommError) as e:
        # (CudaCommError where the later rounds' marks overwrote the rows that differed)
        errors.append(str(e))
    if comm.rank == 1:
        time.sleep(lag_s)
    rx, _, _, _, handle = dispatch()
    out, _ = cn.combine(comm, x=rx, handle=handle, topk_weights=None, bias=())
    comm.synchronize()
    return errors, handle.streamed, C._cpu(out), C._cpu(x)


def check_mismatch_mid_stream_leaves_the_buffer_usable(device, lag_s=2.0):
    comms = _group(2, device, SMALL_HEAP, timeout_s=FAULT_TIMEOUT_S)
    try:
        results = run_local(_mismatch_then_fine, comms, lag_s,
                            timeout=C.outer_timeout(4 * FAULT_TIMEOUT_S))
    finally:
        for c in comms:
            c.destroy(barrier=False)
    for errors, streamed, out, x in results:
        assert len(errors) == 1 and ("dtype" in errors[0] or "differ" in errors[0]), errors
        assert streamed
        assert torch.equal(out, x * 2)        # back from both ranks, unchanged


# ---- elastic: a rank silent from the start, the survivors stream ---------------------------------
ELASTIC_SILENT = 2


def _elastic_stream_rank(comm, case, num_sms):
    """Rank ELASTIC_SILENT never calls; the others dispatch and combine a batch 4x the data
    region: the first notify masks it at its deadline, and every round after goes without it."""
    if comm.rank == ELASTIC_SILENT:
        return None
    dev = comm.device
    x, idx, w, _ = make_inputs(case, comm.rank)
    comm.poison_data()
    rx, _, ri, rw, handle = cn.dispatch(
        comm, x_bytes=x.to(dev).view(torch.uint8), dtype=x.dtype, hidden=x.shape[1],
        scales=None, topk_idx=idx.to(dev), topk_weights=w.to(dev), layout=None, handle=None,
        num_experts=case["experts"], num_worst_tokens=0, buffer_key=C.KEY, num_sms=num_sms)
    y = expert_fn(rx, comm.rank)
    comm.poison_data()
    comb, comb_w = cn.combine(comm, x=y, handle=handle, topk_weights=rw, bias=(),
                              num_sms=num_sms)
    comm.synchronize()
    return dict(rx=C._cpu(rx), ri=C._cpu(ri), rw=C._cpu(rw), comb=C._cpu(comb),
                comb_w=C._cpu(comb_w), active=comm.active.tolist(), streamed=handle.streamed)


def check_elastic_survivors_stream(device):
    """The survivors' outputs equal the reference over them (the silent rank's tokens gone, its
    experts' slots -1), and the mask names the silent rank."""
    n = 3
    case = dict(seed=21, tokens=[300, 280, 250], hidden=256, experts=4 * n, topk=4,
                routing="random", dtype="bfloat16", bias=False, alignment=1, worst=0)
    C.preload(device, n)
    comms = groups.local_group(n, SMALL_HEAP, 0, C.deadline(4.0), device=device, elastic=True)
    with poisoned_outputs():
        results = C.run(_elastic_stream_rank, comms, case, _num_sms(device))
    lo, hi = ELASTIC_SILENT * 4, ELASTIC_SILENT * 4 + 4          # the silent rank's experts
    xs, ids, ws = [], [], []
    for r in range(n):
        x, idx, w, _ = make_inputs(case, r)
        if r == ELASTIC_SILENT:
            x, idx, w = x[:0], idx[:0], w[:0]
        xs.append(x)
        ids.append(torch.where((idx >= lo) & (idx < hi), -1, idx))
        ws.append(w)
    ref = moe_comm.reference_dispatch(xs, ids, case["experts"], ws)
    ys = [expert_fn(ref[r]["recv_x"], r) for r in range(n)]
    comb = moe_comm.reference_combine(ys, ref, [x.shape[0] for x in xs])
    for r in range(n):
        if r == ELASTIC_SILENT:
            continue
        got = results[r]
        assert got["active"] == [1, 1, 0] and got["streamed"], (r, got["active"])
        row = case["hidden"] * 2
        assert SlabLayout(got["rx"].shape[0], row, 0, 4).nbytes >= 4 * SMALL_HEAP, r
        assert torch.equal(got["rx"], ref[r]["recv_x"]), r
        assert torch.equal(got["ri"], ref[r]["recv_topk_idx"]), r
        assert torch.equal(got["rw"], ref[r]["recv_topk_weights"]), r
        torch.testing.assert_close(got["comb"].float(), comb[r].float(), rtol=1e-2, atol=1e-2)
        sent = ids[r] >= 0
        torch.testing.assert_close(got["comb_w"], torch.where(sent, ws[r], 0.0))
