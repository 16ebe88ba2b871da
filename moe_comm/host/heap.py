"""A page allocator over the heap part of this rank's segment.

Received tensors of normal-mode dispatch are views of the heap (senders write into them
directly: one copy per token and destination). A region returns to the heap when the last
tensor viewing it is garbage collected: the region is exposed as a numpy array that torch
tensors keep alive, and a ``weakref.finalize`` on that array frees the pages. Finalizers may
run at any point (even inside :meth:`alloc`), so they only append to a queue that
:meth:`alloc` drains.
"""
from __future__ import annotations

import collections
import weakref

import numpy as np
import torch

from ..wire import PAGE


class PageHeap:
    def __init__(self, seg_bytes: np.ndarray, offset: int, size: int):
        self._bytes = seg_bytes
        self.offset = offset
        self.num_pages = size // PAGE
        self._free = [(0, self.num_pages)]          # sorted (start, length)
        self._used = {}                              # start -> length
        self._released = collections.deque()         # pages freed by finalizers
        self.quarantined = {}                        # start -> length, never handed out again

    @property
    def capacity(self) -> int:
        return self.num_pages * PAGE

    def _drain(self) -> None:
        while self._released:
            self.free(self._released.popleft())

    def alloc(self, num_pages: int):
        """First-fit allocation; returns the first page or None if no room."""
        self._drain()
        for i, (start, length) in enumerate(self._free):
            if length >= num_pages:
                if length == num_pages:
                    del self._free[i]
                else:
                    self._free[i] = (start + num_pages, length - num_pages)
                self._used[start] = num_pages
                return start
        return None

    def quarantine(self, start: int) -> None:
        """Never hand the region at ``start`` out again: a rank masked while it held a grant
        to it may still write there (a late writer). Its later free is ignored."""
        if start in self._used:
            self.quarantined[start] = self._used.pop(start)

    def free(self, start: int) -> None:
        if start in self.quarantined:
            return
        length = self._used.pop(start)
        free = self._free
        free.append((start, length))
        free.sort()
        merged = [free[0]]
        for s, n in free[1:]:
            ps, pn = merged[-1]
            if ps + pn == s:
                merged[-1] = (ps, pn + n)
            else:
                merged.append((s, n))
        self._free[:] = merged

    @property
    def bytes_in_use(self) -> int:
        self._drain()
        return sum(self._used.values()) * PAGE

    @property
    def bytes_quarantined(self) -> int:
        return sum(self.quarantined.values()) * PAGE

    def view(self, page: int, nbytes: int) -> np.ndarray:
        start = self.offset + page * PAGE
        return self._bytes[start:start + nbytes]

    def _array_owning(self, page: int, nbytes: int) -> np.ndarray:
        """A uint8 array over ``nbytes`` at ``page`` that returns the pages when it is gone
        (numpy's own views of it do not keep it: they keep the heap's buffer)."""
        arr = np.frombuffer(self._bytes, dtype=np.uint8, count=nbytes,
                            offset=self.offset + page * PAGE)
        weakref.finalize(arr, self._released.append, page)
        return arr

    def tensor_owning(self, page: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``nbytes`` at ``page`` that returns the pages when it (and every
        view of it) is gone."""
        return torch.from_numpy(self._array_owning(page, nbytes))

    def tensors_owning(self, page: int, nbytes: int, parts) -> list:
        """Tensors over parts of the ``nbytes`` at ``page``, ``(byte offset, dtype, rows,
        cols)`` each, that return the pages when the last of them (and of their views) is
        gone: one torch call each (torch.frombuffer keeps the array), where slicing
        tensor_owning's takes three. Empty parts are tensors of their own."""
        arr = self._array_owning(page, nbytes)
        return [torch.frombuffer(arr, dtype=dt, count=rows * cols, offset=at).view(rows, cols)
                if rows * cols else torch.empty(rows, cols, dtype=dt)
                for at, dt, rows, cols in parts]

    @property
    def free_bytes(self) -> int:
        """The longest run of free pages, in bytes: regions that sum to this much can all be
        allocated now (first fit)."""
        self._drain()
        return max((n for _, n in self._free), default=0) * PAGE
