"""Ranks as threads of one process on one GPU: the GPU tests' and the single-GPU benchmark's
way to run a group (``moe_comm.cuda.groups.local_group``).

Each rank runs in its own thread with its own CUDA stream, so its kernels can run
concurrently with its peers' (a spinning notify of rank 0 does not block rank 1's kernels, as
it would with processes time-slicing one GPU without MPS). Host waits (``.cpu()``,
``synchronize``) release the GIL, so a rank blocked on its count matrix does not stop its
peers from queueing theirs.

Such a process needs three settings, made before torch is imported (tests/conftest.py and
bench/gpu_check.py make them; :data:`SHARED_GPU_ENV`). Each avoids a host call that waits for
the device's running kernels, among them a peer's kernel spinning until this very rank's
signal arrives: the group then deadlocks until its deadline.

- ``CUDA_MODULE_LOADING=EAGER``: with lazy loading (torch's default) the first launch of any
  kernel - a torch fill as much as ours - may synchronise the context. moe_comm's own kernels
  are loaded eagerly anyway (compiler.load_kernels).
- ``CUDA_DEVICE_MAX_CONNECTIONS=32``: a process has 8 hardware queues by default, and two
  ranks' streams that share one queue serialise, so a kernel queued behind a spinning notify
  could keep a peer's notify from starting. The driver hands queues to streams round robin in
  the order they are made, so the ranks' streams are made one after another
  (:func:`rank_streams`), at most 32 ranks. Not from torch's pool: torch makes its pool
  interleaving its priority levels (up to 4: the H100's range is 6), so its 32 default-priority
  streams sit on 8 queues. Seen on the first GPU run: 8 ranks passed and 16 ranks timed out,
  half of them never reaching their notify.
- ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``: a tensor allocation that misses torch's
  cache calls ``cudaMalloc``, which waits for the running kernels. Seen on the first GPU run
  (H100, 2026-11-26): the normal-mode reference cases timed out from 2 ranks up with the
  default allocator and passed with the stream-ordered one, which never waits for other
  streams.

One rank per GPU needs none of this: its host calls wait only for its own device, whose peers
progress on their own GPUs.

When a rank meets a deadline, the Python stacks of the ranks still running are attached to its
error (:func:`run_local`): they show where a rank that never signalled was held.

With comms on device ``cpu`` (the kernel emulator) each call simply runs in its thread: an
emulated launch returns when the kernel has finished, with the GIL released meanwhile.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
import warnings

import torch

from ..cuda import memory
from ..errors import CommTimeoutError


def run_local(fn, comms, *args, timeout: float = 300.0, check: bool = True):
    """Call ``fn(comm, *args)`` for every comm of a local group, each in its own thread under
    ``torch.cuda.stream(<its own stream>)`` (:func:`rank_streams`); then wait for the stream
    and (``check``) ``comm.check()``.
    Returns the results by rank; re-raises the lowest failing rank's exception (its traceback
    text attached as a note). Raises RuntimeError if a thread outlives ``timeout``."""
    n = len(comms)
    emulated = comms[0].device.type == "cpu"      # moe_comm/jit/emulator.py: no streams
    missing = "" if n == 1 or emulated else missing_settings(n)
    if missing:
        warnings.warn(f"ranks as threads of one process need {missing} (set "
                      "before torch is imported): a host call that waits for the device "
                      "can deadlock the group (moe_comm/testing/local_cuda.py)")
    results, errors = [None] * n, {}
    threads = []
    streams = None if emulated else rank_streams(n, comms[0].device)

    def body(r):
        comm = comms[r]
        try:
            if emulated:
                results[r] = fn(comm, *args)
                if check:
                    comm.check()
                return
            torch.cuda.set_device(comm.device)
            stream = streams[r]
            with torch.cuda.stream(stream):
                results[r] = fn(comm, *args)
                stream.synchronize()
                if check:
                    comm.check()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            text = traceback.format_exc()
            if isinstance(e, CommTimeoutError):
                text += _stacks_of(threads, r)
            errors[r] = (e, text)

    threads += [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank{r}")
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


# what ranks sharing one GPU as threads need (see the module docstring)
SHARED_GPU_ENV = {"CUDA_MODULE_LOADING": "EAGER", "CUDA_DEVICE_MAX_CONNECTIONS": "32",
                  "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}


MAX_RANK_STREAMS = 32          # the hardware queues a process can have
_rank_streams: dict = {}       # device index -> its MAX_RANK_STREAMS streams
_streams_lock = threading.Lock()


def rank_streams(n: int, device: torch.device) -> list:
    """The first ``n`` of the device's rank streams, as torch streams: non-blocking streams
    made once per process, all 32 one after another, so that each has its own hardware queue
    (see the module docstring), and kept: never destroyed, since tensors a rank allocated on
    its stream (torch's stream-ordered allocator) are freed on that stream when they die."""
    if n > MAX_RANK_STREAMS:
        raise ValueError(f"{n} ranks sharing one GPU: a process has {MAX_RANK_STREAMS} "
                         f"hardware queues at most")
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        made = _rank_streams.get(index)
        if made is None:
            at = torch.device("cuda", index)
            made = _rank_streams[index] = [
                torch.cuda.ExternalStream(memory.new_stream(at), device=at)
                for _ in range(MAX_RANK_STREAMS)]
    return made[:n]


def missing_settings(n: int) -> str:
    """Which of :data:`SHARED_GPU_ENV` this process lacks for ``n`` ranks ('' if none). The
    allocator is read from torch (it chose its backend at import), the rest from the
    environment."""
    missing = []
    if os.environ.get("CUDA_MODULE_LOADING") != "EAGER":
        missing.append("CUDA_MODULE_LOADING=EAGER")
    if int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", 8)) < n:
        missing.append("CUDA_DEVICE_MAX_CONNECTIONS=32")
    if torch.cuda.get_allocator_backend() != "cudaMallocAsync":
        missing.append("PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync")
    return " and ".join(missing)


def _stacks_of(threads, me: int) -> str:
    """The Python stacks of the rank threads other than ``me`` that are still running: where
    a rank that never signalled was held (a host call waiting for the device, the GIL, ...)."""
    frames = sys._current_frames()
    out = []
    for r, t in enumerate(threads):
        if r != me and t.is_alive() and t.ident in frames:
            stack = "".join(traceback.format_stack(frames[t.ident]))
            out.append(f"\n-- rank {r} was still at:\n{stack}")
    return "".join(out)
