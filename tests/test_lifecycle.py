"""Deadlines and resources: a silent peer is reported by rank within the deadline, never a
hang; segments never outlive their job; destroy() unmaps everything."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import moe_comm
from moe_comm.shm.segment import PREFIX, SHM_DIR, Segment, reclaim_stale_segments
from ranks import run_ranks


def _our_segments():
    return [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]


def _mapped_segments():
    with open("/proc/self/maps") as f:
        return [line for line in f if PREFIX in line]


def _silent_peer(rank, n):
    buf = moe_comm.Buffer(None, 4 << 20, timeout_s=1.5)
    idx = torch.randint(0, 4 * n, (16, 2))
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, 4 * n)
    if rank == n - 1:          # the last rank never calls dispatch
        time.sleep(3.0)
        return None
    t0 = time.monotonic()
    try:
        buf.dispatch(torch.randn(16, 128), topk_idx=idx, num_tokens_per_rank=ntr,
                     is_token_in_rank=itr, num_tokens_per_expert=nte)
    except moe_comm.CommTimeoutError as e:
        return e.silent_ranks, e.op, time.monotonic() - t0
    return "no error"


def test_silent_peer_raises_comm_timeout_naming_it():
    n = 3
    results = run_ranks(_silent_peer, n, timeout=60)
    for r in range(n - 1):
        silent, op, elapsed = results[r]
        assert silent == [n - 1], results[r]
        assert op == "dispatch/notify"
        assert 1.4 < elapsed < 3.0, elapsed


def _silent_after_counts(rank, n, where):
    """The last rank takes part in the count exchange, then goes silent: before it grants
    (``where`` "grant"), or after (``where`` "payload": it never writes nor says DONE). Its
    peers wait for it in granted.py's C call, which hands over to the Python waits at the
    deadline. Rows of 16 KB, ~300 a pair: beyond an eager slot (8 MiB / 3), so every pair is
    granted."""
    from moe_comm.host import exchange, granted, normal
    buf = moe_comm.Buffer(None, 64 << 20, timeout_s=1.5)
    torch.manual_seed(rank)
    idx = torch.stack([torch.randperm(4 * n)[:2] for _ in range(512)])
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, 4 * n)
    taken = []
    for name in ("dispatch", "fresh_dispatch"):   # the C payload phase of either path
        real = getattr(granted, name)
        setattr(granted, name, lambda *a, _real=real, **k: (taken.append(1), _real(*a, **k))[1])
    if rank == n - 1:                    # counts sent, then silent until its peers gave up
        def silent(*args, **kwargs):
            time.sleep(3.0)
            raise SystemExit(0)

        def grant_then_silent(comm, epoch, parity, handle, region, *args, **kwargs):
            exchange.grant(comm, epoch, region.nbytes, "dispatch",
                           handle.count_matrix[:, comm.rank].nonzero()[0].tolist())
            silent()
        # (direct.py's one-round path grants in granted.fresh_dispatch, normal.dispatch's
        # other calls in normal.grant, then granted.dispatch)
        if where == "grant":
            normal.grant = granted.fresh_dispatch = silent
        else:
            granted.dispatch, granted.fresh_dispatch = silent, grant_then_silent
    t0 = time.monotonic()
    try:
        buf.dispatch(torch.randn(512, 4096), topk_idx=idx, num_tokens_per_rank=ntr,
                     is_token_in_rank=itr, num_tokens_per_expert=nte)
    except moe_comm.CommTimeoutError as e:
        return (e.silent_ranks, e.op, time.monotonic() - t0, len(taken),
                len(buf._comm.heap.quarantined))
    except SystemExit:
        return None
    return "no error"


@pytest.mark.parametrize("where", ["grant", "payload"])
def test_peer_silent_after_the_counts_raises_comm_timeout_naming_it(where):
    n = 3
    results = run_ranks(_silent_after_counts, n, where, timeout=60)
    for r in range(n - 1):
        silent, op, elapsed, taken, quarantined = results[r]
        assert taken == 1, results[r]                  # the C payload phase waited
        assert silent == [n - 1], results[r]
        assert op == "dispatch/" + where
        assert 1.4 < elapsed < 3.0, elapsed
        # the region this rank granted the silent rank: it may still write there, so it is
        # never handed out again
        assert quarantined == 1, results[r]


def _destroy(rank, n):
    os.environ["MOE_COMM_SMALL"] = "0"      # rx in the heap (small calls' are not)
    buf = moe_comm.Buffer(None, 4 << 20, timeout_s=20)
    assert _our_segments() == [] or all(str(os.getpid()) not in s for s in _our_segments())
    idx = torch.randint(0, 2 * n, (8, 1))
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, 2 * n)
    rx, ri, rw, *_ = buf.dispatch(torch.randn(8, 128), topk_idx=idx, num_tokens_per_rank=ntr,
                          is_token_in_rank=itr, num_tokens_per_expert=nte)
    mapped_before = len(_mapped_segments())
    kept = rx.clone()
    buf.destroy()
    still_mapped = len(_mapped_segments())       # rx is alive: its pages stay mapped
    del rx, ri, rw
    import gc
    gc.collect()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.get_dispatch_layout(idx, 2 * n)
    return mapped_before, still_mapped, len(_mapped_segments()), kept.shape[0]


def test_destroy_unmaps_everything_and_names_are_gone():
    n = 2
    results = run_ranks(_destroy, n, timeout=60)
    for before, during, after, _ in results:
        assert before == n and during >= 1 and after == 0, results
    assert _our_segments() == []


def _killed_mid_run(rank, n):
    buf = moe_comm.Buffer(None, 4 << 20, timeout_s=20)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    return True


def test_killed_rank_leaves_no_segment():
    run_ranks(_killed_mid_run, 2, timeout=60, expect_exit=(1,))
    assert _our_segments() == []


def test_segment_of_a_dead_creator_is_reclaimed_on_next_start():
    pid = os.fork()
    if pid == 0:              # a "rank" killed between creating and unlinking its segment
        Segment.create(f"{PREFIX}testjob.0.{os.getpid()}", 1 << 16)
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    name = f"{PREFIX}testjob.0.{pid}"
    assert name in _our_segments()
    mode = os.stat(os.path.join(SHM_DIR, name)).st_mode & 0o777
    assert mode == 0o600
    assert name in reclaim_stale_segments()
    assert name not in _our_segments()


def test_reclaim_spares_live_segments():
    seg = Segment.create(f"{PREFIX}livejob.0.{os.getpid()}", 1 << 16)
    try:
        assert seg.name not in reclaim_stale_segments()
        assert seg.name in _our_segments()
    finally:
        seg.close()
    assert seg.name not in _our_segments()


def _refuse_then_go_on(rank, n, eager, small="0"):
    """Rank 1 keeps every result alive until its heap cannot take the next call's rows: it
    raises BufferTooSmallError, and the very next call (a combine on an earlier handle) works,
    even with rank 1 racing ahead while a slow sender is still busy. Its senders raise
    ReceiverFailed when they had to wait for its grant (MOE_COMM_EAGER=0, or rows beyond a
    slot: with small calls on, granted.py's C call then writes to the other ranks); with
    eager slots their rows needed none and their call went through. Ranks decide together
    (over the group) when to stop."""
    import os
    import time
    import torch
    import torch.distributed as dist
    os.environ["MOE_COMM_EAGER"] = eager
    os.environ["MOE_COMM_SMALL"] = small    # "0": results held in the heap (small calls'
    import moe_comm                         # are not); "1": rows beyond a slot, granted
    from moe_comm.host import granted
    from moe_comm.host.normal import ReceiverFailed
    taken = []
    for name in ("dispatch", "fresh_dispatch"):   # the C payload phase of either path
        real = getattr(granted, name)
        setattr(granted, name, lambda *a, _real=real, **k: (taken.append(1), _real(*a, **k))[1])
    buf = moe_comm.Buffer(None, (48 << 20) if small == "1" else (1 << 20), timeout_s=20)
    torch.manual_seed(rank)
    x = torch.randn(512, 4096) if small == "1" else torch.randn(64, 256)
    idx = torch.stack([torch.randperm(4 * n)[:2] for _ in range(x.shape[0])])
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4 * n)
    args = dict(topk_idx=idx, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert)
    rx, _, _, _, handle, _ = buf.dispatch(x, **args)
    kept, first = [], "no error"
    for _ in range(64):
        if rank == 2:
            time.sleep(0.05)                  # a slow sender
        try:
            out = buf.dispatch(x, **args)
            if rank == 1:
                kept.append(out)
        except (moe_comm.BufferTooSmallError, ReceiverFailed) as e:
            first = type(e).__name__
        seen = [None] * n
        dist.all_gather_object(seen, first)
        if any(s != "no error" for s in seen):
            break
    kept.clear()                              # rank 1 lets its results go
    out = None                                # (this one too, before the combine allocates)
    out, _, _ = buf.combine(rx, handle)
    return first, out, x, idx, len(taken)


@pytest.mark.parametrize("eager, small", [("1", "0"), ("0", "0"), ("1", "1")])
def test_a_refusing_receiver_leaves_the_buffer_usable(eager, small):
    results = run_ranks(_refuse_then_go_on, 3, eager, small, timeout=60)
    assert results[1][0] == "BufferTooSmallError"
    senders = "no error" if (eager, small) == ("1", "0") else "ReceiverFailed"
    assert results[0][0] == results[2][0] == senders
    # with small calls on, every dispatch's payload phase ran in C (granted.py)
    assert all((r[4] > 1) == (small == "1") for r in results), [r[4] for r in results]
    for first, out, x, idx, _ in results:
        # identity experts: each token comes back once per destination rank it went to
        ranks = (idx // 4).sort(1).values
        copies = 1 + (ranks[:, 1] != ranks[:, 0]).float()
        torch.testing.assert_close(out, x * copies.unsqueeze(1))


def _two_threads(rank, n):
    """Rank 0 calls dispatch from two threads at once. The first is held inside the call by
    rank 1, which starts only when rank 0 says so; the second is refused at once with a clear
    error; the first then completes with the right rows, a receive hook called from a second
    thread while the first is in a call is refused without being used up, the Buffer serves
    the calls after, and a hook called after destroy() gets a clear error."""
    import threading
    import torch.distributed as dist
    buf = moe_comm.Buffer(None, 4 << 20, num_rdma_bytes=1 << 20, low_latency_mode=True,
                          timeout_s=20)
    torch.manual_seed(rank)
    x = torch.randn(8, 128)
    idx = torch.tensor([[0, 2]] * 8)                  # E=4 on 2 ranks: every token to both
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    args = dict(topk_idx=idx, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert)
    refused = None
    if rank == 0:
        first = {}
        t = threading.Thread(target=lambda: first.update(out=buf.dispatch(x, **args)))
        t.start()
        deadline = time.monotonic() + 10
        while buf._owner is None and time.monotonic() < deadline:
            time.sleep(0.01)                          # the first thread is inside dispatch
        try:
            buf.dispatch(x, **args)
        except RuntimeError as e:
            refused = str(e)
        dist.barrier()                                # now rank 1 may call
        t.join(30)
        rx, _, _, _, handle, _ = first["out"]
    else:
        dist.barrier()
        rx, _, _, _, handle, _ = buf.dispatch(x, **args)
    out, _, _ = buf.combine(rx, handle)
    # a pending receive hook called by another thread while this one is inside a call
    _, _, ll_handle, _, hook = buf.low_latency_dispatch(
        x.bfloat16(), idx, 8, 4, use_fp8=False, return_recv_hook=True)
    hook_refused = None
    if rank == 0:
        inside, go = threading.Event(), threading.Event()

        def hold():
            with buf._exclusive("a test call"):
                inside.set()
                go.wait(10)
        t = threading.Thread(target=hold)
        t.start()
        inside.wait(10)
        try:
            hook()
        except RuntimeError as e:
            hook_refused = str(e)
        go.set()
        t.join(10)
    hook()                                            # not used up by the refusal
    *_, late_hook = buf.low_latency_dispatch(x.bfloat16(), idx, 8, 4, use_fp8=False,
                                             return_recv_hook=True)
    buf.destroy()
    try:
        late_hook()
        after_destroy = "no error"
    except RuntimeError as e:
        after_destroy = str(e)
    return refused, hook_refused, after_destroy, out, x


def test_calls_from_two_threads_are_refused_not_interleaved():
    results = run_ranks(_two_threads, 2, timeout=90)
    refused, hook_refused, _, _, _ = results[0]
    assert refused and "another thread is inside dispatch" in refused, refused
    assert hook_refused and "low_latency_dispatch receive hook: another thread is inside " \
        "a test call" in hook_refused, hook_refused
    for _, _, after_destroy, out, x in results:
        torch.testing.assert_close(out, 2 * x)        # both copies came back: a clean call
        assert "receive hook called after this Buffer was destroyed" in after_destroy
