"""Release/acquire on shared memory from Python, and deadline-bounded waits on signal words.

Payload bytes are written with ordinary torch copies; what makes them visible before the
signal that announces them is a C11 fence from libatomic (``atomic_thread_fence``), called
through ctypes:

- writer: payload copies -> ``release()`` fence -> 8-byte aligned store of the signal word;
- reader: loads of signal words (numpy, aligned 8-byte = single-copy atomic on x86-64 and
  aarch64) -> on seeing the awaited epoch, ``acquire()`` fence -> payload reads.

That is the fence-fence synchronisation of the C11 model, so it holds on weakly ordered CPUs
too. Where libatomic is missing we fall back to x86-64's TSO (stores are not reordered with
older stores, loads not with older loads; glibc ends non-temporal memcpy with sfence) and
refuse to run on other architectures.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import time

import numpy as np

from ..errors import CommTimeoutError
from ..wire import tag_epoch

_ACQUIRE, _RELEASE, _SEQ_CST = 2, 3, 5


def _load_libatomic():
    for name in (ctypes.util.find_library("atomic"), "libatomic.so.1"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            fence = lib.atomic_thread_fence
            fence.argtypes, fence.restype = [ctypes.c_int], None
            return fence
        except (OSError, AttributeError):
            continue
    return None


_fence = _load_libatomic()
if _fence is None and platform.machine() not in ("x86_64", "AMD64"):
    raise ImportError("moe_comm's host backend needs libatomic (apt-get install libatomic1) "
                      "for memory fences on this architecture")


def release() -> None:
    """Order every earlier store before every later store (call before writing a signal)."""
    if _fence is not None:
        _fence(_RELEASE)


def acquire() -> None:
    """Order every earlier load before every later load (call after a signal was seen)."""
    if _fence is not None:
        _fence(_ACQUIRE)


class Backoff:
    """Spin briefly, then yield, then sleep: ranks often outnumber cores, and a spinning rank
    must not starve the peer it waits for."""

    __slots__ = ("spins",)

    def __init__(self):
        self.spins = 0

    def pause(self) -> None:
        self.spins += 1
        if self.spins < 32:
            return
        if self.spins < 1024:
            os.sched_yield()
        else:
            time.sleep(20e-6 if self.spins < 4096 else 200e-6)


def wait_words(waits: dict, epoch: int, deadline: float, op: str, timeout_s: float,
               on_ready=None, raise_on_timeout: bool = True, check=None) -> set:
    """Wait until, for every ``rank -> numpy int64 view`` in ``waits``, all words of the view
    carry ``epoch``. ``on_ready(rank, words)`` runs (after an acquire fence) for each rank as
    soon as its words are complete, so independent work starts early.

    Returns the set of ranks still silent at ``deadline`` (empty on success) when
    ``raise_on_timeout`` is False; otherwise raises :class:`CommTimeoutError` naming them.
    ``check()`` runs while words are missing and may raise (a rank that learns it was masked
    stops waiting).
    """
    pending = dict(waits)
    backoff = Backoff()
    while pending:
        for rank in list(pending):
            words = pending[rank]
            if (tag_epoch(words) == epoch).all():
                del pending[rank]
                acquire()
                if on_ready is not None:
                    on_ready(rank, words)
        if not pending:
            break
        if check is not None:
            check()
        if time.monotonic() > deadline:
            if raise_on_timeout:
                raise CommTimeoutError(op, pending.keys(), timeout_s)
            return set(pending)
        backoff.pause()
    return set()


def store_words(words: np.ndarray, values) -> None:
    """Publish signal words after everything written before (release)."""
    release()
    words[...] = values
