"""How long a call takes: in one process (seconds_per_call), or across the ranks of a
torch.distributed group (timed_across_ranks); and the copy bandwidth both bench scripts set
beside their GB/s as the bar a copy-based exchange cannot beat."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from moe_comm.host import native


def sync(device):
    """Wait for the device's queued work (nothing to wait for on the CPU: there, and on the
    kernel emulator, a call's work is done when it returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(device, fn, iters=1):
    """Seconds per call of ``fn`` run ``iters`` times back to back in this process: CUDA
    events on a GPU (fn only queues its work), perf_counter on the CPU (no events there)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def timed_spread(fn, iters, device, repeats=3):
    """(min, median, max) over ``repeats`` of the seconds per call of ``fn()`` run ``iters``
    times back to back on every rank of the default group between barriers, each repeat
    counted at its slowest rank, after one warm-up call. Back-to-back calls measure what ranks
    sharing the cores sustain together (per-call timing would let them take turns). Every
    rank returns the same numbers. One untimed repeat first: on this project's virtual
    machines memory first touched, or idle for a second or two, is slow for its next ~10 uses
    (a 14.7 MB row copy into the receive heap took 10, 3.5, 2, ... 1.4 ms on its first
    calls; docs/PERF.md, session 16), and every column and copy sample is then timed warm."""
    for _ in range(iters):
        fn()
    per_call = []
    for _ in range(repeats):
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        per_call.append((time.perf_counter() - t0) / iters)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, per_call)
    slowest = [max(col) for col in zip(*everyone)]
    return min(slowest), statistics.median(slowest), max(slowest)


def calls_to_time(fn, iters, device, min_seconds, probe=3):
    """How many back-to-back calls of ``fn()`` a timed repeat makes: ``iters``, or more where
    that many would take less than ``min_seconds`` (``probe`` calls timed on every rank after
    a barrier, the slowest rank's time deciding, so every rank makes the same number of
    collective calls). A repeat of a few 100-us calls is as long as one late wake-up of one
    rank, and its median swings with it. Several calls probed, not one: the first call after a
    barrier can take several times a call's time where ranks share cores (3-4 ms calls of 4
    ranks on 2 cores probed at over 10 ms), and a repeat sized by it was 10 calls, which it
    then weighed on."""
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(probe):
        fn()
    sync(device)
    took = torch.tensor([(time.perf_counter() - t0) / probe], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return max(iters, min(int(min_seconds / max(float(took), 1e-9)) + 1, 100 * iters))


def timed_across_ranks(fn, iters, device, repeats=3):
    """The median of timed_spread: seconds per call of ``fn()`` across the ranks."""
    return timed_spread(fn, iters, device, repeats)[1]


def copy_gbps(nbytes, device, time_call):
    """GB/s (1e9 B/s) of copying ``nbytes`` from one buffer on ``device`` to another;
    ``time_call(fn)`` says how many seconds one call of fn takes (seconds_per_call for one
    process, timed_across_ranks for all ranks copying at once). On the CPU the faster of
    torch's copy and a copy with non-temporal stores (native.copy_stream): the host backend
    writes a large dispatch's payload that way, which beat torch's copy by up to a fifth with
    two ranks copying at once (13 against 10.5-11 GB/s), so torch's alone is no upper bound."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)                          # first touch of dst: not what a copy costs
    plain = nbytes / time_call(lambda: dst.copy_(src)) / 1e9
    if device.type != "cpu":
        return plain
    streamed = torch.tensor([int(native.library() is not None)])
    if dist.is_available() and dist.is_initialized():
        # time_call may be a collective: every rank times the streamed copy, or none does
        dist.all_reduce(streamed, op=dist.ReduceOp.MIN)
    if not streamed.item():
        return plain
    return max(plain, nbytes / time_call(lambda: native.copy_stream(dst, src)) / 1e9)
