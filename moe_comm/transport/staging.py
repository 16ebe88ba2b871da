"""Registered staging memory for engines that send from memory the NIC (or NIXL) knows.

A put's source is any host buffer; registering each one would cost more than copying it, so
the verbs and NIXL engines copy sources into one buffer registered once and send from there.
Space is taken at the head and returned at the tail, in the order it was taken: a send that
completes early marks its ticket done, and the tail moves past it only once every earlier
ticket is done too. A reservation never wraps (the remainder of the buffer is skipped), so
each one is one contiguous descriptor.
"""
from __future__ import annotations

import collections

import numpy as np


def aligned(nbytes: int, align: int = 4096) -> np.ndarray:
    """Zeroed uint8 memory of ``nbytes`` starting at an ``align``-byte boundary."""
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    at = -raw.ctypes.data % align
    return raw[at:at + nbytes]


class Staging:
    """``nbytes`` of page-aligned memory handed out as in-order reservations. Not
    thread-safe: the engine holds its lock around every call."""

    def __init__(self, nbytes: int, align: int = 64):
        self.bytes = aligned(nbytes)
        self.size = nbytes
        self.align = align
        self.head = self.tail = 0            # only grow; position = counter % size
        self.tickets = collections.deque()   # [end, done], in the order taken

    @property
    def address(self) -> int:
        return self.bytes.ctypes.data

    def take(self, n: int):
        """``(offset, ticket)`` of ``n`` free bytes, or None while too few are free."""
        n = (n + self.align - 1) // self.align * self.align
        if n > self.size:
            raise ValueError(f"a staging reservation of {n} bytes exceeds the {self.size} "
                             "bytes of staging memory")
        pos = self.head % self.size
        skip = self.size - pos if pos + n > self.size else 0
        if self.head + skip + n - self.tail > self.size:
            return None
        self.head += skip + n
        ticket = [self.head, False]
        self.tickets.append(ticket)
        return (0 if skip else pos), ticket

    def done(self, ticket) -> None:
        """The send from ``ticket``'s bytes completed (or will never start)."""
        ticket[1] = True
        while self.tickets and self.tickets[0][1]:
            self.tail = self.tickets.popleft()[0]

    def busy(self) -> bool:
        return bool(self.tickets)
