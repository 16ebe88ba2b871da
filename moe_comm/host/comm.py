"""The host backend's communicator: every rank's segment mapped, signal slots, deadlines.

It knows nothing about dispatch or combine; the mode modules (``normal.py``, ``ll.py``) build
their protocols from three primitives: :meth:`HostComm.signal` (release-store a tagged word
into a peer's header), :meth:`HostComm.wait` (deadline-bounded wait for tagged words in a
header) and :meth:`HostComm.peer_heap` (a byte tensor over a peer's heap, written directly:
the CPU analog of a CUDA IPC pointer).
"""
from __future__ import annotations

import secrets
import socket
import time

import numpy as np
import torch
import torch.distributed as dist

from ..wire import MAGIC, PAGE, VERSION, HeaderLayout, MAX_EPOCH, round_up, tag
from . import atomics
from .heap import PageHeap
from .segment import Segment, reclaim_stale_segments, segment_name


class HostComm:
    def __init__(self, group, heap_bytes: int, ll_bytes: int, timeout_s: float):
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.timeout_s = float(timeout_s)
        self.layout = HeaderLayout(self.num_ranks)
        self.heap_offset = self.layout.nbytes
        self.heap_bytes = round_up(int(heap_bytes), PAGE)
        self.ll_offset = self.heap_offset + self.heap_bytes
        self.ll_bytes = round_up(int(ll_bytes), PAGE)
        size = self.ll_offset + self.ll_bytes
        self.epoch = 0
        self.notify_seq = 0
        self.segments = []
        self._own = None

        reclaim_stale_segments()
        # Agree on a job id, check all ranks are on this host and sized alike.
        info = (socket.gethostname(), size, secrets.token_hex(8))
        infos = [None] * self.num_ranks
        dist.all_gather_object(infos, info, group=group)
        hosts = {i[0] for i in infos}
        if len(hosts) != 1:
            raise ValueError(f"the host backend needs every rank of `group` on one machine, "
                             f"got hosts {sorted(hosts)}")
        if len({i[1] for i in infos}) != 1:
            raise ValueError("num_nvl_bytes/num_rdma_bytes/num_experts must be equal on every "
                             f"rank; segment sizes differ: {[i[1] for i in infos]}")
        job = infos[0][2]
        self.job = job
        self._own = Segment.create(segment_name(job, self.rank), size)
        words = self._own.bytes[:self.layout.nbytes].view(np.int64)
        words[:4] = (MAGIC, VERSION, self.num_ranks, self.heap_offset)
        names = [None] * self.num_ranks
        dist.all_gather_object(names, self._own.name, group=group)
        try:
            for r, name in enumerate(names):
                self.segments.append(self._own if r == self.rank else Segment.open(name))
            dist.barrier(group=group)
        finally:
            self._own.unlink()          # mapped by all: the name is no longer needed
        self.words = [s.bytes[:self.layout.nbytes].view(np.int64) for s in self.segments]
        for r, w in enumerate(self.words):
            if w[0] != MAGIC or w[1] != VERSION or w[2] != self.num_ranks:
                raise RuntimeError(f"segment of rank {r} has a foreign header")
        self._heaps = [torch.from_numpy(s.bytes[self.heap_offset:self.ll_offset])
                       for s in self.segments]
        self._ll = [torch.from_numpy(s.bytes[self.ll_offset:size]) for s in self.segments]
        self._ll_words = [s.bytes[self.ll_offset:size].view(np.int64) for s in self.segments]
        self.ll_seq = {"dispatch": 0, "combine": 0}
        self.heap = PageHeap(self._own.bytes, self.heap_offset, self.heap_bytes)

    # -- primitives -----------------------------------------------------------------------
    def next_epoch(self) -> int:
        self.epoch = self.epoch % MAX_EPOCH + 1
        return self.epoch

    def deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def slot(self, rank: int, word: int, n: int = 1) -> np.ndarray:
        """``n`` header words of ``rank``'s segment starting at ``word`` (a live view)."""
        return self.words[rank][word:word + n]

    def signal(self, rank: int, word: int, epoch: int, values) -> None:
        """Publish tagged ``values`` into ``rank``'s header after all earlier writes."""
        vals = np.asarray(values, dtype=np.int64)
        atomics.store_words(self.slot(rank, word, vals.size), (epoch << 32) | vals)

    def wait(self, waits: dict, epoch: int, op: str, deadline: float, on_ready=None):
        return atomics.wait_words(waits, epoch, deadline, op, self.timeout_s, on_ready)

    def peer_heap(self, rank: int) -> torch.Tensor:
        return self._heaps[rank]

    def peer_ll(self, rank: int) -> torch.Tensor:
        """Byte tensor over ``rank``'s low-latency region."""
        return self._ll[rank]

    def ll_slot(self, rank: int, byte_offset: int, n: int) -> np.ndarray:
        """``n`` int64 words of ``rank``'s low-latency region at ``byte_offset``."""
        w = byte_offset // 8
        return self._ll_words[rank][w:w + n]

    def ll_signal(self, rank: int, byte_offset: int, epoch: int, values) -> None:
        vals = np.asarray(values, dtype=np.int64)
        atomics.store_words(self.ll_slot(rank, byte_offset, vals.size), (epoch << 32) | vals)

    def reset_ll(self) -> None:
        """Zero this rank's low-latency region and LL header slots (callers barrier around)."""
        self._ll[self.rank].zero_()
        lay = self.layout
        self.words[self.rank][lay.ll_dispatch_free(0):lay.num_words] = 0
        self.ll_seq = {"dispatch": 0, "combine": 0}

    def poison_free_heap(self, byte: int = 0xFF) -> None:
        """Fill every free heap page with ``byte`` (tests: unwritten output rows show up)."""
        self.heap._drain()
        for start, length in self.heap._free:
            self.heap.view(start, length * PAGE)[:] = byte

    def destroy(self) -> None:
        self._heaps = self._ll = self._ll_words = self.words = None
        self.heap = None
        for s in self.segments:
            s.close()
        self.segments = []
        if self._own is not None:
            self._own.close()
