"""The CUDA backend on a GPU, checked against moe_comm.reference (skipped without CUDA).

The cases and rank bodies are tests/cuda_cases.py, which tests/test_cuda_emulator.py also runs
on the CPU kernel emulator. Here ranks are threads of this process, each with its own CUDA
stream (their kernels run concurrently; processes on one GPU would time-slice without MPS), and
one test runs two real processes (spawn) that map each other's buffers through CUDA IPC, the
deployment path.

Ranks sharing one GPU as threads need CUDA_MODULE_LOADING=EAGER,
CUDA_DEVICE_MAX_CONNECTIONS=32 and torch's stream-ordered allocator
(PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync) set before torch is imported: tests/conftest.py
does it, bench/gpu_check.py sets them for its steps; moe_comm/testing/local_cuda.py says why.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import cuda_cases as C
import cuda_fault_cases as F
import cuda_stream_cases as S
import test_cuda_ll_extras as X
from checks import check_ll, check_normal
from moe_comm.reference import (reference_combine, reference_dispatch,
                                reference_ll_combine, reference_ll_dispatch)
from moe_comm.testing import netns

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu():
    return torch.device("cuda", torch.cuda.current_device())


# 16: a group above one node's 8 GPUs (the rank count is a kernel argument), 16 rank streams
# on the one GPU; bench/gpu_check.py runs this file, so the first lent GPU checks it too
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_normal_dispatch_combine_match_reference(n):
    C.check_normal_group(n, _gpu())


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_low_latency_matches_reference(n):
    C.check_ll_group(n, _gpu())


@pytest.mark.parametrize("n", [2, 4])
def test_low_latency_two_in_flight_and_long_runs(n):
    C.check_ll_in_flight(n, _gpu())


@pytest.mark.parametrize("mode", ["normal", "ll"])
def test_silent_rank_is_named_not_hung(mode):
    C.check_silent_rank(mode, _gpu())


@pytest.mark.parametrize("silent", ["start", "mid_notify", "after_agree"])
def test_elastic_normal_mode_masks_a_silent_rank(silent):
    C.check_elastic_normal(_gpu(), silent=silent)


def test_elastic_low_latency_masks_a_silent_rank():
    C.check_elastic_ll(_gpu())


# ---- LL extras (tests/test_cuda_ll_extras.py): LogFMT combine rows, wait-cost stats ----------
@pytest.mark.parametrize("n", [2, 3])
def test_low_latency_logfmt_combine_matches_reference_and_a_mismatch_raises(n):
    X.check_logfmt_group(n, _gpu())


def test_low_latency_wait_stats_name_the_rank_that_sent_late():
    X.check_wait_stats(_gpu())


# ---- error paths and caller tensors (tests/cuda_fault_cases.py) ------------------------------
def test_overflow_fails_every_rank_and_resets_the_block_counters():
    F.check_overflow_fails_every_rank(_gpu())


@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
@pytest.mark.parametrize("mode", ["normal", "ll"])
def test_failed_rank_fails_its_peers_at_once(mode, elastic):
    F.check_failed_rank_fails_peers_at_once(_gpu(), mode, elastic)


def test_low_latency_overflow_on_one_rank_fails_its_peer_at_once():
    F.check_ll_overflow_fails_the_peer_at_once(_gpu())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_low_latency_x_and_out_at_any_offset(fp8):
    F.check_ll_views_at_any_offset(_gpu(), fp8)


def test_ranks_that_disagree_about_a_call_all_raise_and_go_on():
    F.check_mismatch_raises_everywhere_and_the_next_call_works(_gpu())


# ---- batches larger than the buffer (tests/cuda_stream_cases.py) --------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_a_batch_larger_than_the_buffer_streams_exactly(n):
    S.check_streams_exactly(n, _gpu())


def test_a_row_larger_than_half_the_buffer_is_refused_on_every_rank():
    S.check_row_too_big_refused_everywhere(2, _gpu())


@pytest.mark.parametrize("failing_round", [0, 1])
def test_a_rank_failing_mid_stream_fails_its_peer_at_once(failing_round):
    S.check_failure_mid_stream_fails_peers_at_once(_gpu(), failing_round)


def test_elastic_survivors_stream_without_a_silent_rank():
    S.check_elastic_survivors_stream(_gpu())


# ---- real processes through CUDA IPC -----------------------------------------------------------
def _spawned_rank(rank, n, port, queue, body, *args):
    """A spawned rank: a gloo group of ``n`` ranks, ``body(rank, n, *args)``, and its result
    (torch-saved) or its traceback on ``queue``."""
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n)
        res = body(rank, n, *args)
        blob = io.BytesIO()
        torch.save(res, blob)
        queue.put((rank, True, blob.getvalue()))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _ipc_rank(rank, n, normal_cases, ll_cases, transport="auto"):
    from moe_comm.cuda import groups
    from moe_comm.ibgda.runtime import rdma_devices
    if transport == "ibgda" and not rdma_devices():    # NVSHMEM by P2P only, no NIC
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    torch.cuda.set_device(0)
    comm = groups.from_group(dist.group.WORLD, C.HEAP, C.ll_bytes(ll_cases, n),
                             C.deadline(120.0), transport=transport)
    res = (C.normal_rank(comm, normal_cases, dist.barrier),
           C.ll_rank(comm, ll_cases, dist.barrier))
    comm.destroy()                      # collective: unmap, barrier, free
    return res


def test_two_processes_through_cuda_ipc():
    _two_processes("auto")


def test_two_processes_through_nvshmem():
    """The IBGDA build (nvcc + libnvshmem_device, library_init) and the symmetric heap of
    groups.from_group(transport="ibgda"). On one GPU without a NIC NVSHMEM maps the peer
    (P2P), so this checks the build, the host side and the kernels' pointer path under
    NVSHMEM; the network puts run on the emulator (tests/test_cuda_emulator.py) and on a
    machine with a NIC."""
    from test_ibgda_gpu import _missing_gpu_stack
    why = _missing_gpu_stack()
    if why:
        pytest.skip(why)
    _two_processes("ibgda")


# ---- Buffers on the GPU: from a gloo group (vLLM's construction), and across two hosts ---------
# one normal and one LL round through the Buffer API, checked against the reference
BUF_CASE = dict(tokens=(40, 0, 17, 33), hidden=256, experts=12, topk=3, max_tokens=48)


def _buffer_inputs(rank):
    g = torch.Generator().manual_seed(123 + rank)
    t, c = BUF_CASE["tokens"][rank], BUF_CASE
    x = torch.randn(t, c["hidden"], generator=g).bfloat16()
    idx = torch.randint(-1, c["experts"], (t, c["topk"]), generator=g)
    w = torch.rand(t, c["topk"], generator=g)
    return x, idx, w


def _buffer_round(rank, n, device=None, want="cuda", heap=C.HEAP):
    """Rank body: a Buffer (``device=None``: its own choice, which must be ``want``), one
    normal dispatch/combine and one LL dispatch/combine; CPU copies of what came back.
    (tests/test_buffer_emulated.py runs it on the CPU kernel emulator, ``want="cpu"``.)
    ``heap``: the normal-mode buffer (a small one sends a call across hosts in token
    rounds)."""
    import moe_comm
    if want == "cuda":
        torch.cuda.set_device(0)
    c = BUF_CASE
    rdma = moe_comm.Buffer.get_low_latency_rdma_size_hint(c["max_tokens"], c["hidden"], n,
                                                          c["experts"])
    buf = moe_comm.Buffer(None, heap, rdma, low_latency_mode=True,
                          timeout_s=C.deadline(60.0), device=device)
    assert buf.device.type == want, buf.device
    x, idx, w = (t.to(buf.device) for t in _buffer_inputs(rank))
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, c["experts"])
    rx, ri, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                           num_tokens_per_expert=nte, topk_idx=idx)
    out, _, _ = buf.combine(rx * (rank + 1), handle)
    recv, count, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, c["max_tokens"],
                                                            c["experts"], use_fp8=False)
    ll_out, _, _ = buf.low_latency_combine(recv * (rank + 1), idx, w, ll_handle)
    res = dict(rx=rx.cpu(), ri=ri.cpu(), out=out.cpu(), recv=recv.cpu(), count=count.cpu(),
               ll_out=ll_out.cpu(), relayed=handle.relay is not None,
               rounds=len(getattr(handle.rounds, "rounds", handle.rounds) or ()))
    buf.destroy()
    return res


def _check_buffer_rounds(results):
    n, c = len(results), BUF_CASE
    xs, idxs, ws = (list(t) for t in zip(*(_buffer_inputs(r) for r in range(n))))
    ref = reference_dispatch(xs, idxs, c["experts"])
    want = reference_combine([ref[d]["recv_x"] * (d + 1) for d in range(n)], ref,
                             [x.shape[0] for x in xs])
    ll_ref = reference_ll_dispatch(xs, idxs, c["experts"], c["max_tokens"])
    ll_want = reference_ll_combine([ll_ref[d]["recv_x"] * (d + 1) for d in range(n)], ll_ref,
                                   idxs, ws)
    for r, got in enumerate(results):
        assert torch.equal(got["rx"], ref[r]["recv_x"]), r
        assert torch.equal(got["ri"], ref[r]["recv_topk_idx"]), r
        torch.testing.assert_close(got["out"], want[r], rtol=1e-2, atol=1e-2)
        assert got["count"].tolist() == ll_ref[r]["recv_count"].tolist(), r
        for le, k in enumerate(got["count"].tolist()):
            assert torch.equal(got["recv"][le, :k], ll_ref[r]["recv_x"][le, :k]), (r, le)
        torch.testing.assert_close(got["ll_out"], ll_want[r], rtol=1e-2, atol=1e-2)


def _gloo_buffer_rank(rank, n):
    """No ``device=``, a gloo group, CUDA tensors: the Buffer must pick the GPU (DeepEP's
    rule), not the CPU because the group is gloo."""
    os.environ.pop("MOE_COMM_DEVICE", None)   # tests/conftest.py's CPU default
    return _buffer_round(rank, n)


def test_gloo_group_buffer_serves_cuda_tensors():
    results = _spawn_ranks(_gloo_buffer_rank, len(BUF_CASE["tokens"]), "gloo-group Buffer")
    _check_buffer_rounds([results[r] for r in sorted(results)])




def test_two_hosts_through_the_kernel_proxy():
    """Two network-namespace hosts x two ranks on the one GPU: peers on the other host are
    reached through the kernels' command ring and the kernel proxy over TCP (the emulated
    twin is tests/test_multihost.py's cuda_emulated case); normal mode goes by relays
    (moe_comm/cuda/relay.py: a token crosses once, to the rank of the other host with its
    sender's local index, which forwards it by peer stores). Needs root for the namespaces."""
    why = netns.available()
    if why:
        pytest.skip(f"no network namespaces: {why}")
    results = netns.run_on_hosts(_buffer_round, 2, 2, "cuda", mode="exec",
                                 timeout=C.outer_timeout(300), env={"MOE_COMM_TRANSPORT": "tcp"})
    assert all(r["relayed"] for r in results)
    _check_buffer_rounds(results)


ROUNDS_HEAP = 16 << 10       # BUF_CASE's largest receive region is several times this


def test_two_hosts_in_token_rounds_through_the_kernel_proxy():
    """The same with a buffer too small for one copy: normal mode goes across the hosts in
    token rounds of relayed calls (moe_comm/cuda/rounds.py), exact all the same."""
    why = netns.available()
    if why:
        pytest.skip(f"no network namespaces: {why}")
    results = netns.run_on_hosts(_buffer_round, 2, 2, "cuda", "cuda", ROUNDS_HEAP,
                                 mode="exec", timeout=C.outer_timeout(300),
                                 env={"MOE_COMM_TRANSPORT": "tcp"})
    assert all(r["rounds"] >= 2 for r in results), [r["rounds"] for r in results]
    _check_buffer_rounds(results)


def _spawn_ranks(body, n, what, *args):
    """Run ``body(rank, n, *args)`` in ``n`` spawned processes of one gloo group (CUDA
    cannot start in a forked child of this one); {rank: what it returned}. One rank per
    process: CUDA's lazy loading waits only for that process's kernels, so the children load
    lazily (EAGER, which ranks sharing a process need, costs each child seconds and memory;
    the driver reads it when it starts, which unpickling this module already does)."""
    from moe_comm.testing.processes import free_port
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawned_rank, args=(r, n, port, answers, body, *args))
             for r in range(n)]
    limit = C.outer_timeout(300)          # start, import, build and the cases
    end = time.monotonic() + limit
    replies = []
    loading = os.environ.get("CUDA_MODULE_LOADING")
    try:
        os.environ["CUDA_MODULE_LOADING"] = "LAZY"       # what the children inherit
        for p in procs:
            p.start()
        _restore_env("CUDA_MODULE_LOADING", loading)
        # read before joining: a child exits only once the pipe has taken its results (a
        # few hundred KB, more than the pipe holds)
        while len(replies) < n and time.monotonic() < end:
            try:
                replies.append(answers.get(timeout=max(0.1, min(5.0, end - time.monotonic()))))
            except queue.Empty:           # look again until the deadline, while a child lives
                if not any(p.is_alive() for p in procs) and answers.empty():
                    break                     # all ended, and all they wrote is read
        for p in procs:
            p.join(max(0.0, min(10.0, end - time.monotonic())))
    finally:        # also when pytest-timeout interrupts: no rank outlives the test
        _restore_env("CUDA_MODULE_LOADING", loading)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
    assert len(replies) == n, f"{what} ranks did not all answer within {limit:.0f} s " \
        f"(answered: {sorted(r[0] for r in replies)})"
    results = {}
    for rank, ok, val in replies:
        assert ok, f"rank {rank} failed:\n{val}"
        results[rank] = torch.load(io.BytesIO(val), weights_only=False)
    assert sorted(results) == list(range(n))
    return results


def _restore_env(name, value):
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _two_processes(transport):
    n = 2
    normal_cases = [c for c in C.normal_cases(n) if c["routing"] == "random"][:2]
    ll_cases = C.ll_cases(n)[:2]
    results = _spawn_ranks(_ipc_rank, n, transport, normal_cases, ll_cases, transport)
    check_normal(n, normal_cases, [results[r][0] for r in range(n)])
    check_ll(n, ll_cases, [results[r][1] for r in range(n)], C.kernel_quantize)
