"""A bounded command ring with credits: many producers, one proxy thread consuming.

Slots are fixed-size records (``commands.COMMAND_DTYPE``) in one numpy array, so the layout
is what a producer outside Python would write. A producer takes a credit (a free slot) per
command; when the ring is full it waits, with a deadline, for the proxy to return credits --
back-pressure instead of unbounded queueing. Host producers also park the source object of a
put beside its slot, which keeps the memory alive until the proxy handed it to the wire.

Counters only grow: ``head`` (commands pushed), ``taken`` (handed to the proxy), ``tail``
(finished, credits returned); slot = counter % depth. Per destination, ``pushed[dst]`` and
``done[dst]`` let ``flush`` wait for exactly the commands pushed before it (FIFO per
destination, so ``done`` passing a target means all earlier ones finished).
"""
from __future__ import annotations

import threading
import time

import numpy as np

from .commands import COMMAND_DTYPE


class RingTimeout(Exception):
    """No credit became free before the deadline (the proxy is stuck on a peer)."""


class CommandRing:
    def __init__(self, depth: int = 1024):
        if depth < 1:
            raise ValueError(f"ring depth must be >= 1, got {depth}")
        self.depth = depth
        self.records = np.zeros(depth, dtype=COMMAND_DTYPE)
        self.refs = [None] * depth
        self.head = self.taken = self.tail = 0
        self.pushed: dict = {}
        self.done: dict = {}
        self.cond = threading.Condition()
        self.closed = False

    # -- producer side -------------------------------------------------------------------
    def push(self, op: int, dst: int, offset: int, nbytes: int, value: int, src_addr: int,
             ref, deadline: float) -> None:
        with self.cond:
            while self.head - self.tail >= self.depth:
                if self.closed:
                    raise RuntimeError("transport is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RingTimeout()
                self.cond.wait(min(left, 0.05))
            if self.closed:
                raise RuntimeError("transport is closed")
            slot = self.head % self.depth
            self.records[slot] = (op, dst, offset, nbytes, value, src_addr)
            self.refs[slot] = ref
            self.head += 1
            self.pushed[dst] = self.pushed.get(dst, 0) + 1
            self.cond.notify_all()

    def target(self, dst: int) -> int:
        with self.cond:
            return self.pushed.get(dst, 0)

    def wait_done(self, dst: int, target: int, deadline: float) -> bool:
        """Wait until ``target`` commands to ``dst`` finished; False at the deadline."""
        with self.cond:
            while self.done.get(dst, 0) < target:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return False
                self.cond.wait(min(left, 0.05))
            return True

    # -- proxy side ----------------------------------------------------------------------
    def take(self, max_n: int, wait_s: float) -> list:
        """Up to ``max_n`` pushed commands as ``(op, dst, offset, nbytes, value, src_addr,
        ref)`` tuples, in order; waits up to ``wait_s`` for the first. Credits stay taken
        until :meth:`finish`."""
        with self.cond:
            if self.head == self.taken and not self.closed:
                self.cond.wait(wait_s)
            n = min(self.head - self.taken, max_n)
            if n <= 0:
                return []
            out = []
            first = self.taken % self.depth
            run = min(n, self.depth - first)           # contiguous part, then the wrap
            for lo, cnt in ((first, run), (0, n - run)):
                if cnt:
                    recs = self.records[lo:lo + cnt].tolist()   # one conversion per batch
                    out.extend(r + (self.refs[lo + i],) for i, r in enumerate(recs))
            self.taken += n
            return out

    def finish(self, cmds: list) -> None:
        """Return the credits of ``cmds`` (the oldest taken ones) and release their refs."""
        with self.cond:
            for c in cmds:
                slot = self.tail % self.depth
                self.refs[slot] = None
                self.tail += 1
                self.done[c[1]] = self.done.get(c[1], 0) + 1
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
