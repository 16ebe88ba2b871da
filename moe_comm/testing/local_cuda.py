"""Ranks as threads of one process on one GPU: the GPU tests' and the single-GPU benchmark's
way to run a group (``moe_comm.cuda.groups.local_group``).

Each rank runs in its own thread with its own CUDA stream, so its kernels can run
concurrently with its peers' (a spinning notify of rank 0 does not block rank 1's kernels, as
it would with processes time-slicing one GPU without MPS). Host waits (``.cpu()``,
``synchronize``) release the GIL, so a rank blocked on its count matrix does not stop its
peers from queueing theirs.

Set ``CUDA_MODULE_LOADING=EAGER`` before CUDA initialises in such a process. With lazy loading
(torch's default) the first launch of any kernel - a torch fill as much as ours - may
synchronise the context; while a peer's kernel spins waiting for this rank that deadlocks until
the deadline. moe_comm's own kernels are loaded eagerly anyway (compiler.load_kernels).
Set ``CUDA_DEVICE_MAX_CONNECTIONS=32`` too: a process has 8 hardware queues by default, and two
ranks' streams that share one queue serialise, so a kernel queued behind a spinning notify could
keep a peer's notify from starting.

With comms on device ``cpu`` (the kernel emulator) each call simply runs in its thread: an
emulated launch returns when the kernel has finished, with the GIL released meanwhile.
"""
from __future__ import annotations

import os
import threading
import traceback
import warnings

import torch

from ..errors import CommTimeoutError


def run_local(fn, comms, *args, timeout: float = 300.0, check: bool = True):
    """Call ``fn(comm, *args)`` for every comm of a local group, each in its own thread under
    ``torch.cuda.stream(<fresh stream>)``; then wait for the stream and (``check``)
    ``comm.check()``.
    Returns the results by rank; re-raises the lowest failing rank's exception (its traceback
    text attached as a note). Raises RuntimeError if a thread outlives ``timeout``."""
    n = len(comms)
    emulated = comms[0].device.type == "cpu"      # moe_comm/jit/emulator.py: no streams
    if n > 1 and not emulated and (os.environ.get("CUDA_MODULE_LOADING") != "EAGER" or
                                   int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", 8)) < n):
        warnings.warn("ranks as threads of one process need CUDA_MODULE_LOADING=EAGER and "
                      "CUDA_DEVICE_MAX_CONNECTIONS=32 (set before CUDA initialises): a lazily "
                      "loaded kernel or a shared hardware queue can deadlock the group")
    results, errors = [None] * n, {}

    def body(r):
        comm = comms[r]
        try:
            if emulated:
                results[r] = fn(comm, *args)
                if check:
                    comm.check()
                return
            torch.cuda.set_device(comm.device)
            stream = torch.cuda.Stream(comm.device)
            with torch.cuda.stream(stream):
                results[r] = fn(comm, *args)
                stream.synchronize()
                if check:
                    comm.check()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors[r] = (e, traceback.format_exc())

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank{r}")
               for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if alive:
        raise RuntimeError(f"rank thread(s) {alive} did not finish within {timeout} s")
    if errors:
        # the cause first: a rank's own failure, not the deadlines it made its peers miss
        rank = min(errors, key=lambda r: (isinstance(errors[r][0], CommTimeoutError), r))
        exc, text = errors[rank]
        if hasattr(exc, "add_note"):
            exc.add_note(f"(rank {rank} of {n})\n{text}")
        raise exc
    return results
