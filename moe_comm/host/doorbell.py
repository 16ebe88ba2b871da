"""Doorbells for the Python protocol's waits: a waiting rank sleeps until a peer's words come,
not for a fixed time.

A Python wait (atomics.wait_words) polls its words, yields, then sleeps; a sleep used to last
its full backoff step (20 us to 1 ms) whatever happened meanwhile. Where ranks outnumber the
cores (4 ranks on 2 here) the polls before the first sleep were the larger cost: a wait spun
~30 polls of ~10 us each, and 4-rank low-latency calls spent ~0.6 ms of CPU per call and rank
waiting, CPU their peers needed (docs/PERF.md, session 15). Now a crowded wait sleeps after a
few polls, on the doorbell word of its rank's header (wire.DOORBELL_WORD, shared with
host/small.py's C waits: host_ops.c "Doorbells"), and the writers of the Python protocol ring
the doorbell of the rank they signalled. A sleep is still bounded by the backoff's step: a
writer that does not ring (a transport applying a remote rank's signal) costs what it did.

The order that makes a wake-up certain: the sleeper stores 1 into its doorbell, fences, looks
at its words once more and sleeps only if they are still missing; the writer stores its
words, fences, and wakes the sleeper if its doorbell is set. One of the two sees the other's
store.
"""
from __future__ import annotations

from ..wire import DOORBELL_WORD


class Doorbells:
    """The doorbell of every rank of this host (byte addresses; 0 for a remote rank) and this
    rank's own, driven through the C library ``lib`` (host/native.py)."""

    def __init__(self, words: list, rank: int, lib):
        self.lib = lib
        self.addr = [0 if w is None else w.ctypes.data + 8 * DOORBELL_WORD for w in words]
        self.mine = self.addr[rank]
        self._own_word = words[rank][DOORBELL_WORD:DOORBELL_WORD + 1]

    def ring(self, rank: int) -> None:
        """After words were stored for ``rank``: wake it if it sleeps on its doorbell."""
        if self.addr[rank]:
            self.lib.moe_ring_bell(self.addr[rank])

    def arm(self) -> None:
        """About to sleep: set this rank's doorbell (then look at the words once more)."""
        self.lib.moe_arm_bell(self.mine)

    def disarm(self) -> None:
        """The second look found words: not sleeping after all."""
        self._own_word[0] = 0

    def sleep(self, seconds: float) -> None:
        """Sleep until rung or ``seconds`` passed; the doorbell is clear after."""
        self.lib.moe_bell_sleep(self.mine, max(int(seconds * 1e9), 1))
