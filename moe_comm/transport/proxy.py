"""The host proxy: producers push commands into rings, proxy threads execute them on an engine.

``put``/``signal`` validate their arguments (``ValueError``/``TypeError`` before anything is
queued), then push one fixed-size command into the ring of the destination's channel and
return: the caller never waits on the network. Each channel has one daemon proxy thread that
takes commands in batches, groups consecutive ones by destination and hands them to the
engine (TCP, verbs or NIXL). Destinations map to channels by position in ``remote_ranks``, or by
``channel_groups`` (one channel per group, e.g. the ranks of one remote host, so a slow host
holds up only its own channel), so all commands to one rank go through one ring, one thread
and one connection, in push order -- which is what orders a put before a later signal to the
same rank.

A peer whose connection fails is marked lost (logged once): its queued and future commands
are dropped (their credits returned), and ``flush`` reports it. Nothing here raises because a
peer died -- the receiver-side deadline-bounded waits name the silent rank, and elastic mode
can carry on without it.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from ..errors import CommTimeoutError
from .commands import INT64_MAX, INT64_MIN, OP_PUT, OP_SIGNAL
from .ring import CommandRing, RingTimeout

log = logging.getLogger("moe_comm.transport")

BATCH = 256
IDLE_S = 0.05           # idle poll of engines that need none
POLL_MIN_S = 50e-6      # first idle poll after activity, for engines that need polling


def as_bytes(src):
    """A flat byte memoryview of a contiguous CPU numpy array / torch tensor, and its address."""
    if isinstance(src, torch.Tensor):
        if src.device.type != "cpu":
            raise TypeError(f"src must be a CPU tensor (the host proxy reads host memory), "
                            f"got device {src.device}")
        if not src.is_contiguous():
            raise ValueError("src must be contiguous")
        src = src.detach().reshape(-1).view(torch.uint8).numpy()
    if not isinstance(src, np.ndarray):
        raise TypeError(f"src must be a numpy array or torch tensor, got {type(src).__name__}")
    if not src.flags.c_contiguous:
        raise ValueError("src must be contiguous")
    flat = src.reshape(-1).view(np.uint8)
    return memoryview(flat), flat.ctypes.data


class ProxyTransport:
    """See the package docstring for the interface."""

    def __init__(self, engine, rank: int, remote_ranks, region_sizes: dict, timeout_s: float,
                 channels: int = 1, depth: int = 1024, channel_groups=None):
        self.engine = engine
        self.kind = engine.kind
        self.rank = rank
        self.remote_ranks = list(remote_ranks)
        self.region_sizes = dict(region_sizes)
        self.timeout_s = float(timeout_s)
        if channel_groups is not None:
            groups = [list(g) for g in channel_groups if len(g)]
            if sorted(r for g in groups for r in g) != sorted(self.remote_ranks):
                raise ValueError(f"channel_groups {channel_groups} must hold every remote rank "
                                 f"{self.remote_ranks} exactly once")
        else:
            channels = max(1, min(int(channels), len(self.remote_ranks) or 1))
            groups = [self.remote_ranks[i::channels] for i in range(channels)]
        self.rings = [CommandRing(depth) for _ in groups]
        self.channel_of = {r: ring for ring, g in zip(self.rings, groups) for r in g}
        self.lost: dict = {}                     # rank -> why
        self.closed = False
        self.threads = [threading.Thread(target=self._proxy_loop, args=(ring,), daemon=True,
                                         name=f"moe_comm-proxy-{i}")
                        for i, ring in enumerate(self.rings)]
        for t in self.threads:
            t.start()

    # -- producer API ----------------------------------------------------------------------
    def _ring(self, dst_rank: int) -> CommandRing:
        if self.closed:
            raise RuntimeError("transport is closed")
        ring = self.channel_of.get(dst_rank)
        if ring is None:
            raise ValueError(f"dst_rank must be one of remote_ranks {self.remote_ranks}, "
                             f"got {dst_rank}")
        return ring

    def put(self, dst_rank: int, dst_offset: int, src) -> None:
        """Queue a write of ``src``'s bytes at ``dst_offset`` of ``dst_rank``'s region."""
        ring = self._ring(dst_rank)
        view, addr = as_bytes(src)
        n = view.nbytes
        size = self.region_sizes[dst_rank]
        if not isinstance(dst_offset, (int, np.integer)) or dst_offset < 0 or \
                dst_offset + n > size:
            raise ValueError(f"dst_offset {dst_offset} + {n} bytes does not fit rank "
                             f"{dst_rank}'s registered region of {size} bytes")
        if n == 0 or dst_rank in self.lost:
            return
        self._push(ring, OP_PUT, dst_rank, int(dst_offset), n, 0, addr, view)

    def signal(self, dst_rank: int, word_offset_bytes: int, value: int) -> None:
        """Queue: store int64 ``value`` at byte ``word_offset_bytes`` of ``dst_rank``'s
        region, after every earlier put/signal from this rank to ``dst_rank``."""
        ring = self._ring(dst_rank)
        size = self.region_sizes[dst_rank]
        off = word_offset_bytes
        if not isinstance(off, (int, np.integer)) or off < 0 or off % 8 or off + 8 > size:
            raise ValueError(f"word_offset_bytes must be an 8-byte aligned word inside rank "
                             f"{dst_rank}'s region of {size} bytes, got {off}")
        if not INT64_MIN <= int(value) <= INT64_MAX:
            raise ValueError(f"value must fit int64, got {value}")
        if dst_rank in self.lost:
            return
        self._push(ring, OP_SIGNAL, dst_rank, int(off), 8, int(value), 0, None)

    def _push(self, ring, op, dst, offset, nbytes, value, addr, ref) -> None:
        try:
            ring.push(op, dst, offset, nbytes, value, addr, ref,
                      time.monotonic() + self.timeout_s)
        except RingTimeout:
            raise CommTimeoutError("transport/queue", [dst], self.timeout_s) from None

    def flush(self, dst_rank=None, raise_on_timeout: bool = True) -> set:
        """Wait until every command queued before this call (to ``dst_rank``: a rank, a list
        of ranks, or None for every remote rank) was handed to the wire and its source may be
        reused. Returns the set of ranks that did not get there (lost peers, or still pending
        at the deadline) when ``raise_on_timeout`` is False; else raises
        :class:`CommTimeoutError` naming them."""
        dsts = self.remote_ranks if dst_rank is None else \
            [dst_rank] if isinstance(dst_rank, int) else list(dst_rank)
        for d in dsts:
            self._ring(d)
        failed = self._flush(dsts, self.timeout_s)
        if failed and raise_on_timeout:
            raise CommTimeoutError("transport/flush", failed, self.timeout_s)
        return failed

    def _flush(self, dsts, timeout_s: float) -> set:
        targets = {d: self.channel_of[d].target(d) for d in dsts}
        deadline = time.monotonic() + timeout_s
        failed = set()
        for d in dsts:
            if not self.channel_of[d].wait_done(d, targets[d], deadline) or \
                    not self.engine.quiet(d, deadline):
                failed.add(d)
        return failed | {d for d in dsts if d in self.lost}

    def lost_ranks(self) -> dict:
        """Ranks whose connection failed, with the reason."""
        return dict(self.lost)

    # -- proxy thread ------------------------------------------------------------------------
    def _proxy_loop(self, ring: CommandRing) -> None:
        # An engine that completes work only when polled (NIXL: its transfers, and over TCP
        # the peers' writes into this process) says how long an idle thread may wait between
        # polls (``poll_s``, read each time: it may lengthen when the engine has been idle);
        # the wait starts short after activity and doubles up to that. Engines with threads
        # of their own (TCP, verbs) are polled every 50 ms.
        engine = self.engine
        wait = POLL_MIN_S
        while True:
            batch = ring.take(BATCH, wait)
            if not batch:
                if ring.closed:
                    return
                wait = POLL_MIN_S if engine.progress() else \
                    min(2 * wait, getattr(engine, "poll_s", IDLE_S))
                continue
            wait = POLL_MIN_S
            start = 0
            for i in range(1, len(batch) + 1):   # runs of one destination, in order
                if i == len(batch) or batch[i][1] != batch[start][1]:
                    self._execute(batch[start][1], batch[start:i])
                    start = i
            ring.finish(batch)
            self.engine.progress()

    def _execute(self, dst: int, cmds: list) -> None:
        if dst in self.lost:
            return
        try:
            self.engine.send(dst, cmds)
        except Exception as e:  # noqa: BLE001 - any failure loses the peer, never the thread
            self.lost[dst] = str(e)
            # a peer that closed first (Buffers are destroyed without a barrier) is no fault
            (log.info if getattr(e, "closed", False) else log.warning)(
                "rank %d: lost rank %d (%s); its commands are dropped", self.rank, dst, e)
            self.engine.drop(dst)

    # -- teardown ----------------------------------------------------------------------------
    def close(self, flush_s: float | None = None) -> None:
        """Hand queued commands to the wire (bounded), stop the threads, release sockets and
        registrations. Idempotent; never blocks longer than about ``flush_s + 5`` seconds."""
        if self.closed:
            return
        flush_s = min(self.timeout_s, 5.0) if flush_s is None else flush_s
        self._flush(self.remote_ranks, flush_s)
        self.closed = True
        for ring in self.rings:
            ring.close()
        self._join(2.0)
        if any(t.is_alive() for t in self.threads):
            self.engine.abort_sends()        # a send stuck on a silent peer: wake it
            self._join(1.0)
        # Only now may sockets be closed: closing an fd another thread is still sending on
        # could hand its number to a new file and the bytes to the wrong place.
        self.engine.close()

    def _join(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
