"""Run a function on N local processes joined by a gloo process group (tests, benchmark).

``run_ranks(fn, n, *args)`` forks n processes (fork: 0.1 s for 4 ranks vs 5 s with spawn),
each calls ``fn(rank, n, *args)`` after ``init_process_group``; returns the list of results by
rank, re-raising the first rank's exception with its traceback. Every run has a deadline:
ranks still alive after ``timeout`` are killed and the test fails, never hangs.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, n, port, queue, args):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n)
        result = fn(rank, n, *args)
        blob = io.BytesIO()
        torch.save(result, blob)          # plain bytes: no fd passing racing os._exit
        queue.put((rank, True, blob.getvalue()))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        os._exit(0)


class RankFailure(AssertionError):
    pass


def run_ranks(fn, n, *args, timeout=120.0, expect_exit=()):
    """``expect_exit``: ranks that may die without reporting (killed on purpose)."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, n, port, queue, args)) for r in range(n)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    expected = set(range(n)) - set(expect_exit)
    while expected - set(results) - set(errors):
        if not queue.empty():
            rank, ok, val = queue.get()
            (results if ok else errors)[rank] = val
            continue
        if time.monotonic() > deadline:
            break
        if all(not p.is_alive() for p in procs) and queue.empty():
            break
        # asleep until a result comes or a rank ends (not a poll every few ms: the ranks of
        # a benchmark share the cores with this process)
        mp.connection.wait([queue._reader, *(p.sentinel for p in procs)],
                           timeout=min(1.0, max(0.0, deadline - time.monotonic())))
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    while not queue.empty():
        rank, ok, val = queue.get()
        (results if ok else errors)[rank] = val
    if errors:
        rank = min(errors)
        raise RankFailure(f"rank {rank} failed:\n{errors[rank]}")
    missing = expected - set(results)
    if missing:
        raise RankFailure(f"ranks {sorted(missing)} did not finish within {timeout} s "
                          "(hang or crash)")
    return [None if results.get(r) is None else
            torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(n)]
