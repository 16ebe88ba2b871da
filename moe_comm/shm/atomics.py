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


CROWDED_MAX_SLEEP_S = 1e-3


class Backoff:
    """Spin briefly, then yield, then sleep: ranks often outnumber cores, and a spinning rank
    must not starve the peer it waits for.

    ``crowded``: this host runs more ranks than it has cores (e.g. 64 ranks on 2). Then a
    wait is as long as the work of many peers sharing the cores, and every poll of a waiting
    rank takes a slice from a rank with work to do: it yields only briefly, then sleeps,
    doubling the sleep up to :data:`CROWDED_MAX_SLEEP_S` (a poll costs ~10 us, so polling
    takes ~1% of a core, and a wait ends at most that much late).

    ``woken``: the caller sleeps on a doorbell its writers ring (host/doorbell.py), so a
    sleep ends when the words come: :meth:`pause` returns the seconds to sleep instead of
    sleeping, and a crowded wait polls and yields only a few times before it sleeps.
    """

    __slots__ = ("spins", "crowded", "sleep_s", "polls", "yields", "woken")

    def __init__(self, crowded: bool = False, woken: bool = False):
        self.spins = 0
        self.crowded = crowded
        self.sleep_s = 20e-6
        # spins that only poll, then (until ``yields``) that yield; the sleeps after
        self.polls, self.yields = (4, 8) if crowded and woken else (32, 64)
        self.woken = woken

    def pause(self) -> float:
        """One step; the seconds to sleep where the caller sleeps (``woken``), else 0."""
        self.spins += 1
        if self.spins < self.polls:
            return 0.0
        if self.crowded:
            return self._pause_crowded()
        if self.spins < 1024:
            os.sched_yield()
            return 0.0
        return self._sleep(20e-6 if self.spins < 4096 else 200e-6)

    def _pause_crowded(self) -> float:
        if self.spins < self.yields:
            os.sched_yield()
            return 0.0
        slept = self._sleep(self.sleep_s)
        self.sleep_s = min(2 * self.sleep_s, CROWDED_MAX_SLEEP_S)
        return slept

    def _sleep(self, seconds: float) -> float:
        if self.woken:
            return seconds
        time.sleep(seconds)
        return 0.0


def _root(view: np.ndarray) -> np.ndarray:
    """The array at the bottom of ``view``'s chain of numpy views (the mapping's own)."""
    while isinstance(view.base, np.ndarray):
        view = view.base
    return view


def _gathered(views: list):
    """``(words, index)``: ``words`` int64 over the memory every view lies in and ``index``
    [n, width] the word positions of each view, so one fancy-index load reads them all; None
    when the views are not C-contiguous int64 runs of one width at 8-byte offsets of one
    buffer (then each is read on its own)."""
    if not views:
        return None
    root, width = _root(views[0]), views[0].size
    if any(v.dtype != np.int64 or v.size != width or not v.flags.c_contiguous
           or _root(v) is not root for v in views):
        return None
    if root.ndim != 1 or not root.flags.c_contiguous or root.nbytes % 8:
        return None
    offsets = np.array([v.ctypes.data for v in views], dtype=np.int64) - root.ctypes.data
    if (offsets % 8).any():
        return None
    words = root.view(np.int64)
    return words, offsets[:, None] // 8 + np.arange(width, dtype=np.int64)


GATHER_MIN_SLOTS = 4    # fewer slots are read one by one: finding their addresses costs more


class SlotPoll:
    """The slots one wait still polls (``rank -> int64 view`` of signal words). A group of
    64 ranks polls 64 slots on every spin of every waiting rank, on a host where ranks
    outnumber cores: reading them with one numpy gather instead of a Python loop per slot
    keeps the waiters from eating the time their peers need to send."""

    def __init__(self, views: dict):
        self.ranks = list(views)
        self._views = [views[r] for r in self.ranks]
        self._gather = _gathered(self._views) if len(self._views) >= GATHER_MIN_SLOTS \
            else None

    def any_ready(self, epoch: int) -> bool:
        """Whether a slot still polled now carries ``epoch`` in every word (nothing taken)."""
        if self._gather is not None:
            words, index = self._gather
            return bool((tag_epoch(words[index]) == epoch).all(1).any())
        return any(all(tag_epoch(w) == epoch for w in v.tolist()) for v in self._views)

    def take(self, epoch: int) -> list:
        """``[(rank, words)]`` of the slots whose every word now carries ``epoch``, removed
        from the poll; ``words`` is the copy the check read (tags and values of one load).
        The caller fences (:func:`acquire`) before trusting data they announce."""
        if not self.ranks:
            return []
        if self._gather is None:
            return self._take_few(epoch)
        words, index = self._gather
        loaded = words[index]                     # one load of every pending slot
        ready = (tag_epoch(loaded) == epoch).all(1)
        if not ready.any():
            return []
        taken = [(self.ranks[i], loaded[i]) for i in np.flatnonzero(ready)]
        keep = np.flatnonzero(~ready)
        self.ranks = [self.ranks[i] for i in keep]
        self._views = [self._views[i] for i in keep]
        self._gather = (words, index[keep])
        return taken


    def _take_few(self, epoch: int) -> list:
        """:meth:`take` of slots read one by one: Python ints and lists, faster than numpy
        calls on arrays of a few words (a low-latency call waits 3-4 times)."""
        loaded = [v.copy() for v in self._views]
        ready = [all(tag_epoch(w) == epoch for w in words.tolist()) for words in loaded]
        if not any(ready):
            return []
        taken = [(r, words) for r, words, ok in zip(self.ranks, loaded, ready) if ok]
        self.ranks = [r for r, ok in zip(self.ranks, ready) if not ok]
        self._views = [v for v, ok in zip(self._views, ready) if not ok]
        return taken


def wait_words(waits: dict, epoch: int, deadline: float, op: str, timeout_s: float,
               on_ready=None, raise_on_timeout: bool = True, check=None,
               crowded: bool = False, bell=None, on_batch=None) -> set:
    """Wait until, for every ``rank -> numpy int64 view`` in ``waits``, all words of the view
    carry ``epoch``. ``on_ready(rank, words)`` runs (after an acquire fence) for each rank as
    soon as its words are complete, with the words as read, so independent work starts early.

    Returns the set of ranks still silent at ``deadline`` (empty on success) when
    ``raise_on_timeout`` is False; otherwise raises :class:`CommTimeoutError` naming them.
    ``check()`` runs while words are missing and may raise (a rank that learns it was masked
    stops waiting). ``crowded``: more ranks than cores on this host (:class:`Backoff`).
    ``bell``: this rank's doorbell (host/doorbell.py Doorbells), which the writers ring: the
    sleeps are on it, and end when it rings. ``on_batch([(rank, words)])``, in place of
    on_ready: every rank found complete in one look at once.
    """
    poll = SlotPoll(waits)
    backoff = Backoff(crowded, woken=bell is not None)
    while poll.ranks:
        arrived = poll.take(epoch)
        if arrived:
            acquire()
            if on_batch is not None:
                on_batch(arrived)
            for rank, words in arrived if on_ready is not None else ():
                on_ready(rank, words)
        if not poll.ranks:
            break
        if check is not None:
            check()
        now = time.monotonic()
        if now > deadline:
            if raise_on_timeout:
                raise CommTimeoutError(op, poll.ranks, timeout_s)
            return set(poll.ranks)
        sleep_s = backoff.pause()
        if sleep_s:                   # (only with a bell) armed, one more look, then asleep
            bell.arm()
            if poll.any_ready(epoch):
                bell.disarm()
            else:
                bell.sleep(min(sleep_s, deadline - now))
    return set()


def store_words(words: np.ndarray, values) -> None:
    """Publish signal words after everything written before (release)."""
    release()
    words[...] = values


def store_each(views, values) -> None:
    """Publish the same signal words into every view of ``views`` after everything written
    before: one release fence for all of them (a rank tells all its peers at once)."""
    release()
    for words in views:
        words[...] = values
