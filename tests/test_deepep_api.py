"""DeepEP's V1 calls beyond the core four, with DeepEP's meaning, on real rank processes:
constructor keywords (enable_shrink is elastic masking), the shrink mask calls, the local
buffer view, dispatch without topk_idx, DeepEP's returns of a cached dispatch and of
num_worst_tokens, handles indexed like DeepEP's tuples, the low-latency wait-cost stats, and
low_latency_combine's positional order (use_logfmt before zero_copy; use_logfmt=True encodes
the rows, LogFMT, on both backends).
"""
from __future__ import annotations

import inspect
import os
import time

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm.backend import pick_device
from moe_comm.buffer import nvrtc_targets
from moe_comm.jit import emulator
from ranks import run_ranks

E, K, H, T = 6, 2, 128, 10          # experts, top-k, hidden, tokens per rank
M = 16                               # low-latency num_max_dispatch_tokens_per_rank


@pytest.fixture(params=["host", "cuda_emulated"])
def backend(request, monkeypatch):
    """The host backend, and the CUDA backend on the CPU kernel emulator (ranks as
    processes), for the calls whose CUDA side differs."""
    if request.param == "cuda_emulated":
        if not emulator.available():
            pytest.skip("the kernel emulator needs a C++ compiler (g++)")
        import cuda_cases
        cuda_cases.preload("cpu", 3, {H}, ll=True)       # built before any deadline
        monkeypatch.setenv("MOE_COMM_CPU_BACKEND", "emulator")
    return request.param


def _inputs(rank):
    """Rows that name their source: x[t] = 1000 * rank + t in every channel."""
    g = torch.Generator().manual_seed(100 + rank)
    x = (1000.0 * rank + torch.arange(T, dtype=torch.float32))[:, None].expand(T, H)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    w = torch.rand(T, K, generator=g)
    return x.contiguous(), idx, w


def _ll_buffer(n, **kwargs):
    return moe_comm.Buffer(None, 4 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        M, H, n, E), low_latency_mode=True, **kwargs)


# -- 1. constructor keywords ------------------------------------------------------------------
def _constructor_worker(rank, n):
    # DeepEP's positional order: ..., allow_mnnvl, use_fabric, explicitly_destroy, enable_shrink
    buf = moe_comm.Buffer(None, 4 << 20, 0, False, 8, False, True, True, True, True, None,
                          timeout_s=20)
    facts = dict(elastic=buf.elastic, shrink=buf.enable_shrink,
                 explicitly_destroy=buf.explicitly_destroy)
    plain = moe_comm.Buffer(dist.group.WORLD, 4 << 20, comm=object(), use_fabric=False,
                            timeout_s=20)                # a communicator beside a group: unused
    facts["plain_elastic"] = plain.elastic
    plain.destroy()
    buf.destroy()
    return facts


def test_constructor_takes_deepeps_keywords():
    for got in run_ranks(_constructor_worker, 2, timeout=60):
        assert got == dict(elastic=True, shrink=True, explicitly_destroy=True,
                           plain_elastic=False)


def test_default_device_follows_deepep(monkeypatch):
    """Without ``device=``: the current CUDA device wherever CUDA is available, whatever the
    group's backend (vLLM builds its Buffer from a gloo group; tests/test_cuda_gpu.py runs
    that on a GPU), else the CPU; ``MOE_COMM_DEVICE`` and ``device=`` choose otherwise."""
    monkeypatch.delenv("MOE_COMM_DEVICE", raising=False)
    want = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    assert pick_device(None) == want
    monkeypatch.setenv("MOE_COMM_DEVICE", "cpu")
    assert pick_device(None) == torch.device("cpu")
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("MOE_COMM_DEVICE", "cuda:0")
    assert pick_device(torch.device("cpu")) == torch.device("cpu")   # the argument wins


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(use_fabric="yes"), TypeError, "use_fabric"),
    (dict(enable_shrink=2), TypeError, "enable_shrink"),
    (dict(allow_mnnvl=None), TypeError, "allow_mnnvl"),
    (dict(num_qps_per_rank=0), ValueError, "num_qps_per_rank"),
    (dict(comm=object()), TypeError, "torch.distributed group"),
])
def test_constructor_checks_deepeps_keywords(kwargs, error, words):
    with pytest.raises(error, match=words):          # checked before any group is needed
        moe_comm.Buffer(None, 4 << 20, **kwargs)


def test_module_level_names():
    assert moe_comm.topk_idx_t is torch.int64
    got = moe_comm.Buffer.is_sm90_compiled()
    assert isinstance(got, bool) and got == nvrtc_targets(90)


# -- 2. the shrink calls ------------------------------------------------------------------
def _mask_worker(rank, n):
    buf = _ll_buffer(n, timeout_s=20)
    status = torch.full((n,), 7, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    out = {"before": status.clone()}
    buf.low_latency_clean_mask_buffer()                  # nothing masked: nothing to do
    buf.low_latency_update_mask_buffer(0, False)         # active: nothing to do
    buf.low_latency_update_mask_buffer(n - 1, True)      # every rank masks the last one
    buf.low_latency_query_mask_buffer(status)
    out["after"] = status.clone()
    out["active"] = buf.active_ranks
    errors = []
    for call in (lambda: buf.low_latency_update_mask_buffer(n - 1, False),
                 buf.low_latency_clean_mask_buffer,
                 lambda: buf.low_latency_update_mask_buffer(n, True)):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    if rank != n - 1:                                    # the survivors go on without it
        x, idx, w = _inputs(rank)
        rx, count, handle, _, _ = buf.low_latency_dispatch(x.bfloat16(), idx, M, E,
                                                           use_fp8=False)
        out["count"] = count.clone()
        y, _, _ = buf.low_latency_combine(rx, idx, w, handle)
        out["combined"] = y.float()
    buf.destroy()
    return out


def test_shrink_calls_mask_and_query_ranks():
    n = 3
    results = run_ranks(_mask_worker, n, timeout=90)
    ins = [_inputs(r) for r in range(n)]
    local = E // n
    for rank, got in enumerate(results):
        assert got["before"].tolist() == [0] * n
        assert got["after"].tolist() == [0, 0, 1]
        assert got["active"].tolist() == [1, 1, 0]
        assert "cannot take a masked rank back" in got["errors"][0]
        assert "cannot take a masked rank back" in got["errors"][1]
        assert "rank_to_mask" in got["errors"][2]
        if rank == n - 1:
            continue
        # received: what the other survivor and this rank routed to this rank's experts
        want = sum(torch.bincount(ins[s][1][ins[s][1] >= 0], minlength=E)
                   for s in range(n - 1))[rank * local:(rank + 1) * local]
        assert got["count"].tolist() == want.tolist()
        # combined: each token's weights over the experts of the survivors only
        x, idx, w = ins[rank]
        alive = (idx >= 0) & (idx // local < n - 1)
        want_y = x * torch.where(alive, w, 0).sum(1, keepdim=True)
        torch.testing.assert_close(got["combined"], want_y.bfloat16().float(), rtol=2e-2,
                                   atol=1e-2)


def _shrink_worker(rank, n, victim):
    buf = _ll_buffer(n, timeout_s=2, enable_shrink=True)
    if rank == victim:
        os._exit(0)                                      # fails before its first call
    x, idx, _ = _inputs(rank)
    _, count, _, _, _ = buf.low_latency_dispatch(x.bfloat16(), idx, M, E, use_fp8=False)
    status = torch.zeros(n, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    out = dict(status=status.clone(), count=count.clone())
    buf.destroy()
    return out


def test_shrink_mode_masks_a_failed_rank():
    """DeepEP's shrink test: a rank dies; the survivors' call masks it, and the query says so."""
    n, victim = 3, 1
    results = run_ranks(_shrink_worker, n, victim, timeout=90, expect_exit=(victim,))
    ins = [_inputs(r) for r in range(n)]
    local = E // n
    for rank in (0, 2):
        assert results[rank]["status"].tolist() == [0, 1, 0]
        want = sum(torch.bincount(ins[s][1][ins[s][1] >= 0], minlength=E)
                   for s in (0, 2))[rank * local:(rank + 1) * local]
        assert results[rank]["count"].tolist() == want.tolist()


# -- 3. buffer access -----------------------------------------------------------------------
def _local_buffer_worker(rank, n):
    buf = _ll_buffer(n, timeout_s=20)
    comm = buf._comm
    out = dict(stream=buf.get_comm_stream(),
               nvl_bytes=buf.get_local_buffer_tensor(torch.uint8).numel(),
               heap_bytes=comm.heap_bytes,
               rdma_floats=buf.get_local_buffer_tensor(torch.float32,
                                                       use_rdma_buffer=True).numel(),
               ll_bytes=comm.peer_ll(rank).numel())
    view = buf.get_local_buffer_tensor(torch.int32, torch.Size([2, 3]), offset=64,
                                       use_rdma_buffer=True)
    view.copy_(torch.arange(6, dtype=torch.int32).view(2, 3) + 10 * rank)
    dist.barrier()
    # the peer's copy of this memory (its segment mapped here) shows what it wrote
    peer = (rank + 1) % n
    out["peer_words"] = comm.peer_ll(peer)[64:88].view(torch.int32).clone()
    out["own_words"] = comm.peer_ll(rank)[64:88].view(torch.int32).clone()
    try:
        buf.get_local_buffer_tensor(torch.float32, torch.Size([out["ll_bytes"]]),
                                    use_rdma_buffer=True)
    except ValueError as e:
        out["too_big"] = str(e)
    dist.barrier()
    buf.destroy()
    return out


def test_local_buffer_tensor_views_the_buffer_memory():
    n = 2         # (host backend: the peers' segments are mapped here to compare with)
    for rank, got in enumerate(run_ranks(_local_buffer_worker, n, timeout=60)):
        assert got["stream"] is None                     # host backend: no streams
        assert got["nvl_bytes"] == got["heap_bytes"] > 0
        assert got["rdma_floats"] == got["ll_bytes"] // 4
        assert got["own_words"].tolist() == [10 * rank + i for i in range(6)]
        assert got["peer_words"].tolist() == [10 * ((rank + 1) % n) + i for i in range(6)]
        assert "needs" in got["too_big"]


def _region_worker(rank, n):
    buf = _ll_buffer(n, timeout_s=20)
    comm = buf._comm
    ll = buf.get_local_buffer_tensor(torch.int64, use_rdma_buffer=True)
    ll.fill_(-1)
    dist.barrier()
    buf.clean_low_latency_buffer(M, H, E)                # the backend zeroes its LL region
    out = dict(ll_zero=bool((ll == 0).all()), ll_words=ll.numel(), ll_bytes=comm.ll_bytes)
    # the backend fills its normal-mode region (nothing received yet: all of it is free)
    if hasattr(comm, "poison_data"):
        comm.poison_data(0x5A)
    else:
        comm.poison_free_heap(0x5A)
    nvl = buf.get_local_buffer_tensor(torch.uint8)
    out["nvl_filled"] = bool((nvl == 0x5A).all())
    out["stream"] = buf.get_comm_stream()
    dist.barrier()
    buf.destroy()
    return out


def test_local_buffer_tensor_is_the_backends_memory(backend):
    for got in run_ranks(_region_worker, 2, timeout=120):
        assert got["ll_zero"] and got["nvl_filled"], got
        assert got["ll_words"] == got["ll_bytes"] // 8 and got["stream"] is None


# -- 4, 5. dispatch without topk_idx, DeepEP's returns, handles as tuples ------------------
def _normal_worker(rank, n):
    buf = moe_comm.Buffer(None, 16 << 20, timeout_s=20)
    x, idx, w = _inputs(rank)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)
    rx, ri, rw, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                 expert_alignment=4, **layout)
    out = dict(per_rank=per_rank, in_rank=in_rank, rx=rx.clone(), counts=counts)
    out["tuple"] = [None if t is None else t.clone() for t in handle]
    out["len"] = len(handle)
    out["h0"], out["h4"] = handle[0], handle[4]
    cached = buf.dispatch(x * 2, handle=handle)
    out["cached"] = [cached[0].clone()] + list(cached[1:5])
    # without topk_idx: where tokens go comes from is_token_in_rank
    rx2, ri2, rw2, counts2, handle2, _ = buf.dispatch(x, expert_alignment=4, **layout)
    out.update(rx2=rx2.clone(), ri2=ri2, rw2=rw2, counts2=counts2)
    combined, cw, _ = buf.combine(rx2, handle2)
    out.update(combined=combined, cw=cw)
    # num_worst_tokens: DeepEP's per-expert list is empty then
    _, _, _, counts3, _, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                          num_worst_tokens=n * T, **layout)
    out["counts3"] = counts3
    buf.destroy()
    return out


def test_dispatch_without_topk_and_deepep_handles(backend):
    n = 3
    results = run_ranks(_normal_worker, n, timeout=90)
    ins = [_inputs(r) for r in range(n)]
    ref = moe_comm.reference_dispatch([i[0] for i in ins], [i[1] for i in ins], E,
                                      [i[2] for i in ins])
    counts = torch.stack([r["per_rank"] for r in results])       # [src, dst]
    for d, got in enumerate(results):
        # handle[0]: the count matrix summed over source ranks, int32 [R, R]
        prefix = got["h0"]
        assert prefix.dtype == torch.int32 and torch.equal(prefix, counts.cumsum(0).int())
        assert got["len"] == 6 and len(got["tuple"]) == 6
        assert torch.equal(got["tuple"][0], prefix)
        assert got["tuple"][1:4] == [None, None, None] and got["tuple"][5] is None
        assert torch.equal(got["h4"], got["in_rank"])
        # rows from source s sit at [prefix[s-1, d], prefix[s, d]), in token order
        for s in range(n):
            lo = int(prefix[s - 1, d]) if s else 0
            want = ins[s][0][results[s]["in_rank"][:, d]]
            assert torch.equal(got["rx"][lo:int(prefix[s, d])], want)
        # cached dispatch: DeepEP's (recv_x, None, None, None, None, event)
        assert torch.equal(got["cached"][0], 2 * got["rx"])
        assert got["cached"][1:] == [None, None, None, None]
        # without topk_idx: the same rows, no top-k, the per-expert list from the counts
        assert torch.equal(got["rx2"], ref[d]["recv_x"]) and torch.equal(got["rx2"], got["rx"])
        assert got["ri2"] is None and got["rw2"] is None
        want_counts = [(c + 3) // 4 * 4 for c in ref[d]["num_recv_tokens_per_expert"]]
        assert got["counts2"] == got["counts"] == want_counts
        assert got["counts3"] == []
        # combine of the unchanged rows: each token once per rank it went to
        x, idx, _ = ins[d]
        torch.testing.assert_close(got["combined"], x * got["in_rank"].sum(1, keepdim=True))
        assert got["cw"] is None


def _ll_handle_worker(rank, n):
    buf = _ll_buffer(n, timeout_s=20)
    x, idx, _ = _inputs(rank)
    _, count, handle, _, hook = buf.low_latency_dispatch(x.bfloat16(), idx, M, E,
                                                         use_fp8=False, return_recv_hook=True)
    out = dict(numbers=handle[2:], len=len(handle))
    try:
        handle[0]
    except RuntimeError as e:
        out["early"] = str(e)
    hook()
    src_info, layout_range, *numbers = handle
    out.update(src_info=src_info, layout_range=layout_range, unpacked=numbers,
               count=count.clone())
    buf.destroy()
    return out


def test_low_latency_handle_reads_like_deepeps(backend):
    n = 3
    results = run_ranks(_ll_handle_worker, n, timeout=60)
    ins = [_inputs(r) for r in range(n)]
    local = E // n
    for d, got in enumerate(results):
        assert got["numbers"] == (M, H, E) and got["unpacked"] == [M, H, E]
        assert got["len"] == 5 and "receive hook" in got["early"]
        src_info, ranges = got["src_info"], got["layout_range"]
        assert src_info.dtype == torch.int32 and ranges.dtype == torch.int64
        assert src_info.shape == (local, n * M) and ranges.shape == (local, n)
        for le in range(local):
            expert = d * local + le
            for s in range(n):
                begin, rows = int(ranges[le, s]) >> 32, int(ranges[le, s]) & 0xFFFFFFFF
                tokens = (ins[s][1] == expert).any(1).nonzero().flatten()
                assert rows == tokens.numel(), (d, le, s)
                assert src_info[le, begin:begin + rows].tolist() == tokens.tolist()
            assert (src_info[le, int(got["count"][le]):] == -1).all()


# -- 6. wait-cost stats ----------------------------------------------------------------------
SLOW = 0.3           # seconds the slow rank sleeps before each of its sends


def _cost_worker(rank, n, slow):
    buf = _ll_buffer(n, timeout_s=20)
    x, idx, w = _inputs(rank)
    dispatch_cost = torch.full((n,), 7, dtype=torch.int64)
    combine_cost = torch.zeros(n, dtype=torch.int64)
    if rank == slow:
        time.sleep(SLOW)
    rx, _, handle, _, hook = buf.low_latency_dispatch(
        x.bfloat16(), idx, M, E, dispatch_wait_recv_cost_stats=dispatch_cost, use_fp8=False,
        return_recv_hook=True)
    hook()
    if rank == slow:
        time.sleep(SLOW)
    buf.low_latency_combine(rx, idx, w, handle, combine_wait_recv_cost_stats=combine_cost)
    buf.destroy()
    return dict(dispatch=dispatch_cost, combine=combine_cost)


def test_wait_cost_stats_name_the_slow_rank():
    n, slow = 3, 2
    results = run_ranks(_cost_worker, n, slow, timeout=60)
    for rank, got in enumerate(results):
        for kind in ("dispatch", "combine"):
            cost = got[kind] - (7 if kind == "dispatch" else 0)    # added to what was there
            assert (cost >= 0).all(), (rank, kind, cost)
            if rank != slow:
                assert cost[slow] >= 0.8 * SLOW * 1e9, (rank, kind, cost)
                assert cost[slow] > cost[rank], (rank, kind, cost)
            else:                       # it arrived last: nobody kept it waiting long
                assert cost.max() < 0.8 * SLOW * 1e9, (rank, kind, cost)


def _bad_extras_worker(rank, n):
    buf = _ll_buffer(n, timeout_s=20)
    x, idx, w = _inputs(rank)
    calls = [
        (lambda: buf.get_local_buffer_tensor(torch.int32, offset=2), "not a multiple"),
        (lambda: buf.get_local_buffer_tensor("int32"), "dtype must be a torch.dtype"),
        (lambda: buf.low_latency_query_mask_buffer(torch.zeros(n + 1, dtype=torch.int32)),
         "mask_status must have shape"),
        (lambda: buf.low_latency_query_mask_buffer(torch.zeros(n)), "mask_status must have"),
        (lambda: buf.low_latency_update_mask_buffer(0, "yes"), "mask must be a bool"),
        (lambda: buf.low_latency_dispatch(x.bfloat16(), idx, M, E, use_fp8=False,
                                          dispatch_wait_recv_cost_stats=torch.zeros(n)),
         "dispatch_wait_recv_cost_stats must have dtype"),
    ]
    seen = []
    for call, words in calls:
        try:
            call()
        except (TypeError, ValueError) as e:
            seen.append(words in str(e))
    # the Buffer still works: every rank's next call goes through
    _, count, _, _, _ = buf.low_latency_dispatch(x.bfloat16(), idx, M, E, use_fp8=False)
    buf.destroy()
    return seen, int(count.sum())


def test_bad_extras_are_named_and_buffer_survives():
    n = 2
    results = run_ranks(_bad_extras_worker, n, timeout=60)
    assert sum(int(r[1]) for r in results) == sum(
        int((_inputs(s)[1] >= 0).sum()) for s in range(n))
    for seen, _ in results:
        assert seen == [True] * 6, seen


# -- 7. low_latency_combine's argument order --------------------------------------------------
DEEPEP_LL_COMBINE = ("x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy",
                     "async_finish", "return_recv_hook", "out", "combine_wait_recv_cost_stats")


def test_low_latency_combine_takes_deepeps_argument_order():
    names = list(inspect.signature(moe_comm.Buffer.low_latency_combine).parameters)[1:]
    assert tuple(names[:len(DEEPEP_LL_COMBINE)]) == DEEPEP_LL_COMBINE


def _positional_combine_worker(rank, n):
    """DeepEP's positional order: (x, idx, w, handle, use_logfmt, zero_copy, async_finish,
    return_recv_hook); use_logfmt=True encodes the rows (LogFMT, both backends)."""
    buf = _ll_buffer(n, timeout_s=20)
    x, idx, w = _inputs(rank)
    rx, _, handle, _, _ = buf.low_latency_dispatch(x.bfloat16(), idx, M, E, use_fp8=False)
    encoded = buf.low_latency_combine(rx, idx, w, handle, True)[0].float()
    buf.get_next_low_latency_combine_buffer(handle).copy_(rx)
    zero_copy, _, _ = buf.low_latency_combine(torch.empty(0), idx, w, handle, False, True)
    zero_copy = zero_copy.float()
    hooked, _, hook = buf.low_latency_combine(rx, idx, w, handle, False, False, False, True)
    hook()
    buf.destroy()
    return encoded, zero_copy, hooked.float()


def test_low_latency_combine_positional_calls_land_as_in_deepep(backend):
    n = 3
    for rank, (encoded, zero_copy, hooked) in enumerate(
            run_ranks(_positional_combine_worker, n, timeout=60)):
        x, idx, w = _inputs(rank)
        # identity experts: each token's rows weighted by its slots' weights (-1: nothing)
        want = x.bfloat16().float() * torch.where(idx >= 0, w, 0.0).sum(1, keepdim=True)
        # LogFMT: about 1% per value
        torch.testing.assert_close(encoded, want, rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(zero_copy, want, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(hooked, want, rtol=1e-2, atol=1e-2)
