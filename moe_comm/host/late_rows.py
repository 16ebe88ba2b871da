"""Rows of this rank's low-latency combine region that a masked rank may still write into.

A rank checks its FENCE right before each combine write, but a rank stopped (SIGSTOP, swapped
out) between that check and its copy resumes straight into the copy: its rows land where the
owner's combine rows of the call it was in lay - and where, in a later call, the rows of the
survivors lie (the region is reused every second call, in the owner's message order). The
owner chooses where its rows go: each dispatch tells every expert rank the row its messages'
results start at (the base word of the count row). So the owner holds back the rows a
masked rank could still write and places every later call's rows around them.

A hold ends when the late writer's copy can no longer come: its LL_COMBINE_DONE for that
call arrived (it signals after its copy, release-ordered), or its process is gone (ranks on
this host). Otherwise it lasts until the Buffer is rebuilt; ``clean_low_latency_buffer``
does not end it (a stopped rank may still write after the clean).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..wire import tag_epoch

log = logging.getLogger("moe_comm")


@dataclass
class _Hold:
    start: int                  # bytes [start, end) of the low-latency region
    end: int
    rank: int                   # the masked rank that may still write there
    done: np.ndarray            # its LL_COMBINE_DONE word in this rank's header (a live view)
    seq: int                    # the combine call it was in


class LateRows:
    """Held byte ranges of this rank's low-latency region (absolute: a later call may use
    another layout, whose combine rows lie elsewhere)."""

    def __init__(self, gone):
        self._gone = gone            # gone(rank) -> the rank's process no longer exists
        self._holds = []

    def hold(self, start: int, end: int, rank: int, done: np.ndarray, seq: int) -> None:
        """Bytes [start, end) may still receive ``rank``'s copy of combine call ``seq``."""
        if end > start:
            self._holds.append(_Hold(start, end, rank, done, seq))
            log.warning("moe_comm: %d bytes of low-latency combine rows held back: rank %d "
                        "was masked before its rows of call %d came", end - start, rank, seq)

    @property
    def held(self) -> list:
        """[(start, end, rank)] still held."""
        self._release()
        return [(h.start, h.end, h.rank) for h in self._holds]

    def _release(self) -> None:
        self._holds = [h for h in self._holds
                       if tag_epoch(int(h.done[0])) != h.seq and not self._gone(h.rank)]

    def place(self, rows: int, row_bytes: int, offsets, capacity: int):
        """The first row ``shift`` such that rows [shift, shift + rows) of a combine region
        starting at each of ``offsets`` (one per buffer: the dispatch does not know which
        buffer its combine will use) avoid every hold and stay within ``capacity`` rows;
        None if there is none."""
        self._release()
        if not self._holds:           # (the common case: no masked rank ever wrote late)
            return 0 if rows <= capacity else None
        shifts = {0} | {max(0, -(-(h.end - off) // row_bytes)) for h in self._holds
                        for off in offsets}
        for shift in sorted(shifts):
            spans = [(off + shift * row_bytes, off + (shift + rows) * row_bytes)
                     for off in offsets]
            if shift + rows <= capacity and not any(
                    h.start < end and start < h.end for h in self._holds
                    for start, end in spans):
                return shift
        return None
