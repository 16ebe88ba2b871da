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
    slowest = slowest_rank([block_seconds(fn, iters, device) for _ in range(repeats)])
    return min(slowest), statistics.median(slowest), max(slowest)


def block_seconds(fn, calls, device):
    """This rank's seconds per call of ``calls`` calls of ``fn()`` back to back, after a
    barrier of the default group (every rank times its block at once)."""
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / calls


def slowest_rank(values):
    """Per position of this rank's list ``values`` (each a number, as every rank's list is),
    the largest over the ranks of the default group; every rank gets the same list."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(values))
    return [max(col) for col in zip(*everyone)]


def calls_to_time(fn, iters, device, min_seconds, probe=3):
    """How many back-to-back calls of ``fn()`` a timed repeat makes: ``iters``, or more where
    that many would take less than ``min_seconds`` (``probe`` calls timed on every rank after
    a barrier, the slowest rank's time deciding, so every rank makes the same number of
    collective calls). A repeat of a few 100-us calls is as long as one late wake-up of one
    rank, and its median swings with it. Several calls probed, not one: the first call after a
    barrier can take several times a call's time where ranks share cores (3-4 ms calls of 4
    ranks on 2 cores probed at over 10 ms), and a repeat sized by it was 10 calls, which it
    then weighed on."""
    took = slowest_rank([block_seconds(fn, probe, device)])[0]
    return max(iters, min(int(min_seconds / max(took, 1e-9)) + 1, 100 * iters))


def timed_across_ranks(fn, iters, device, repeats=3):
    """The median of timed_spread: seconds per call of ``fn()`` across the ranks."""
    return timed_spread(fn, iters, device, repeats)[1]


def copy_gbps(nbytes, device, time_call):
    """GB/s (1e9 B/s) of copying ``nbytes`` from one buffer on ``device`` to another;
    ``time_call(fn)`` says how many seconds one call of fn takes (seconds_per_call for one
    process, timed_across_ranks for all ranks copying at once). The faster of copy_ways."""
    return nbytes / min(time_call(way) for way in copy_ways(nbytes, device)) / 1e9


def copy_ways(nbytes, device):
    """Copies of ``nbytes`` from one new buffer on ``device`` to another, as functions: torch's,
    and on the CPU one with non-temporal stores (native.copy_stream). The host backend writes
    a large dispatch's payload that way, which beat torch's copy by up to a fifth with two
    ranks copying at once (13 against 10.5-11 GB/s), so torch's alone is no upper bound. In a
    process group every rank gets the same ways (the callers time them as collectives)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)                          # first touch of dst: not what a copy costs
    ways = [lambda: dst.copy_(src)]
    if device.type != "cpu":
        return ways
    streamed = torch.tensor([int(native.library() is not None)])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(streamed, op=dist.ReduceOp.MIN)
    if streamed.item():
        ways.append(lambda: native.copy_stream(dst, src))
    return ways


class CopyBar:
    """copy_gbps's bar, sampled block by block between a call's own timed blocks, so that
    each of the call's repeats has copy samples taken just before and after it
    (timed_with_copy_bar): the machine's copy bandwidth swings several-fold within seconds,
    and a call and a bar timed a few seconds apart can land in different minutes. Copies of
    ``nbytes`` bytes, every rank at once (copy_ways), each a block of at least
    ``min_seconds``; a sample is the faster way. Every rank copies the same bytes, the ranks'
    mean of ``nbytes``."""

    def __init__(self, nbytes, device, iters, min_seconds):
        # every rank copies the ranks' mean: a sample's GB/s is then those bytes over the
        # slowest rank's time, on every rank alike
        mean = torch.tensor([float(nbytes)], dtype=torch.float64)
        dist.all_reduce(mean)
        nbytes = max(1, round(float(mean) / dist.get_world_size()))
        self.nbytes, self.device = nbytes, device
        self.ways = copy_ways(nbytes, device)
        self.calls = [calls_to_time(way, iters, device, min_seconds) for way in self.ways]
        self.local_sample()                 # untimed: see timed_spread (idle memory is slow)

    def local_sample(self):
        """This rank's seconds per copy, one block of each way (a collective: every rank
        calls it at the same point); gbps() turns every rank's into a sample."""
        return [block_seconds(way, calls, self.device)
                for way, calls in zip(self.ways, self.calls)]

    def gbps(self, everyone):
        """GB/s of one sample from every rank's local_sample (slowest rank per way, the
        faster way)."""
        return self.nbytes / min(max(col) for col in zip(*everyone)) / 1e9


def timed_with_copy_bar(fn, calls, bar, repeats):
    """``repeats`` blocks of ``calls`` calls of ``fn()`` (block_seconds) with a copy bar
    sample (``bar``, a CopyBar) before the first and after each, every rank at once. Returns
    per block (seconds per call of the slowest rank, copy GB/s: the mean of the samples just
    before and after it), the same on every rank. One untimed block first (timed_spread)."""
    block_seconds(fn, calls, bar.device)
    samples, blocks = [bar.local_sample()], []
    for _ in range(repeats):
        blocks.append(block_seconds(fn, calls, bar.device))
        samples.append(bar.local_sample())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (samples, blocks))
    gbps = [bar.gbps([rank[0][i] for rank in everyone]) for i in range(repeats + 1)]
    return [(max(rank[1][i] for rank in everyone), (gbps[i] + gbps[i + 1]) / 2)
            for i in range(repeats)]
