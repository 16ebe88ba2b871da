"""The host proxy of the CUDA backend: ranks on other hosts without IBGDA.

A CUDA group spanning hosts (another machine, or another network namespace) maps the ranks of
its own host as usual. Each rank elsewhere gets a *mirror* here: host memory laid out like
that rank's buffer, whose address, with the low bit set, is the rank's ``bases`` word. Kernels
build messages for it in the mirror and push commands into a ring in host memory
(csrc/kernels/proxy_ring.cuh has the layout and the ordering argument). :class:`KernelProxy`
is the thread that drains the ring in order and hands each command to the host transport
(moe_comm/transport: TCP or verbs, the same engine the host backend uses), which applies puts
and signals to the remote rank's buffer in order. Nothing in the mode kernels changes.

A put's bytes are copied out of the mirror when the command is taken, so the kernels may
rewrite the mirror as soon as the remote rank answers a later signal. Taken commands go to a
*lane* per transport channel (one per remote host where the group says so), whose own thread
hands them to the transport in order: a host whose channel is full (slow, or dead and not yet
noticed) holds up its lane only, never the ring nor the healthy hosts. What waits in a lane is
bounded by the protocol: a kernel sends a rank no more than one call's rows before that rank
answers. A command the transport
refuses (a lost peer, a full queue) cuts that rank off: this and every later command to it are
dropped and logged, so no signal ever announces bytes that did not go, and the remote rank's
silence surfaces as the usual deadline (CommTimeoutError, or masking in elastic mode).
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import torch

from ..shm import atomics
from ..wire import (PROXY_DEPTH, PROXY_HEAD, PROXY_HEADER_WORDS, PROXY_OP_PUT, PROXY_OP_SIGNAL,
                    PROXY_SLOT_WORDS, PROXY_TAIL, PROXY_TIMEOUT)
from .memory import host_tensor_address

log = logging.getLogger("moe_comm")



DEFAULT_DEPTH = 4096
CREDIT_EVERY = 64               # slots taken between two credit (tail) updates


class _Lane:
    """Commands for the ranks of one transport channel, executed in order by a thread of its
    own (``execute(op, rank, offset, payload_or_value)``)."""

    def __init__(self, name: str, execute):
        self._queue = collections.deque()
        self._cv = threading.Condition()
        self._busy = self._stop = False
        self._execute = execute
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    def push(self, cmd) -> None:
        with self._cv:
            self._queue.append(cmd)
            self._cv.notify()

    def idle(self) -> bool:
        with self._cv:
            return not self._queue and not self._busy

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                cmd = self._queue.popleft()
                self._busy = True
            try:
                self._execute(*cmd)
            finally:
                with self._cv:
                    self._busy = False

    def close(self, timeout_s: float) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=timeout_s)


class KernelProxy:
    """Drains one rank's command ring into ``transport``.

    ``mirrors``: {remote rank: uint8 host tensor of its buffer's size}; ``device``: where the
    kernels run (the ring and mirrors are pinned host memory for a GPU, plain memory for the
    kernel emulator)."""

    def __init__(self, transport, mirrors: dict, device: torch.device, timeout_s: float,
                 depth: int = DEFAULT_DEPTH):
        self.transport = transport
        self.mirrors = {r: m.numpy() for r, m in mirrors.items()}
        self._mirror_tensors = mirrors
        self.depth = depth
        pinned = device.type == "cuda"
        self._ring = torch.zeros(PROXY_HEADER_WORDS + depth * PROXY_SLOT_WORDS, dtype=torch.int64,
                                 pin_memory=pinned)
        self._head = torch.zeros(1, dtype=torch.int64, device=device)   # GPU-side counter
        self.words = self._ring.numpy()
        self.words[PROXY_HEAD] = self._head.data_ptr()
        self.words[PROXY_DEPTH] = depth
        # a producer waits longer than any one blocking transport step (a full queue waits
        # timeout_s), so only a proxy that stopped makes it give up
        self.words[PROXY_TIMEOUT] = int((2 * timeout_s + 5.0) * 1e9)
        self.address = host_tensor_address(self._ring)
        self.cut_off: dict = {}                  # rank -> why its commands are dropped
        # one lane per transport channel (ranks sharing a channel are ordered together anyway)
        channel_of = getattr(transport, "channel_of", {})
        lanes: dict = {}                         # id of the transport channel -> its lane
        for r in sorted(mirrors):
            key = id(channel_of.get(r))
            if key not in lanes:
                lanes[key] = _Lane(f"moe_comm-kproxy-lane{len(lanes)}", self._execute)
        self._lane_of = {r: lanes[id(channel_of.get(r))] for r in mirrors}
        self._lanes = list(lanes.values())
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="moe_comm-kproxy")
        self._thread.start()

    def mirror_word(self, rank: int) -> int:
        """The ``bases`` word of a proxied rank: its mirror's address, low bit set."""
        return host_tensor_address(self._mirror_tensors[rank]) | 1

    def _loop(self) -> None:
        words, depth, taken = self.words, self.depth, 0
        backoff = atomics.Backoff()
        while not self._stop:
            n = taken
            while True:                          # every slot published in order
                at = PROXY_HEADER_WORDS + (n % depth) * PROXY_SLOT_WORDS
                if int(words[at]) != n + 1:
                    break
                atomics.acquire()
                op_rank, offset, arg = (int(v) for v in words[at + 1:at + 4])
                self._take(op_rank >> 32, op_rank & 0xffffffff, offset, arg)
                n += 1
                if n % CREDIT_EVERY == 0:         # producers waiting for a slot go on early
                    atomics.release()
                    words[PROXY_TAIL] = n
            if n == taken:
                backoff.pause()
                continue
            backoff = atomics.Backoff()
            taken = n
            atomics.release()                    # credits: the slots may be reused
            words[PROXY_TAIL] = taken

    def _take(self, op: int, rank: int, offset: int, arg: int) -> None:
        """A command taken from the ring: a put's bytes leave the mirror now (see the module
        docstring), then the command waits in its rank's lane."""
        lane = self._lane_of.get(rank)
        if lane is None or rank in self.cut_off:
            if rank not in self.cut_off:
                self.cut_off[rank] = "not a proxied rank"
                log.warning("moe_comm kernel proxy: command for rank %d, which has no mirror; "
                            "dropped", rank)
            return
        if op == PROXY_OP_PUT:
            arg = self.mirrors[rank][offset:offset + arg].copy()
        lane.push((op, rank, offset, arg))

    def _execute(self, op: int, rank: int, offset: int, arg) -> None:
        if rank in self.cut_off:
            return
        try:
            if op == PROXY_OP_PUT:
                self.transport.put(rank, offset, arg)
            elif op == PROXY_OP_SIGNAL:
                self.transport.signal(rank, offset, arg)
            else:
                raise ValueError(f"unknown proxy command {op}")
        except Exception as e:  # noqa: BLE001 - the thread must go on; the peer's wait tells
            self.cut_off[rank] = str(e)
            log.warning("moe_comm kernel proxy: command %d to rank %d failed (%s); this and "
                        "every later command to it are dropped", op, rank, e)

    def flush(self, timeout_s: float) -> None:
        """Wait until the proxy took every command published so far and its lanes handed them
        to the transport (bounded)."""
        head = int(self._head.item())
        deadline = time.monotonic() + timeout_s
        while (int(self.words[PROXY_TAIL]) < head or not all(lane.idle() for lane in
                                                          self._lanes)) and \
                time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(1e-4)

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2.0)
        for lane in self._lanes:         # a lane stuck on a full channel: left to the daemon
            lane.close(timeout_s=1.0)
        # Each lane holds self._execute, a reference cycle that would keep the mirrors (a
        # Buffer's size per remote rank) until the next garbage collection, long after the
        # Buffer was destroyed: a process that makes Buffer after Buffer (tests, elastic
        # rebuilds) grew by GBs. Nothing reads them once the proxy thread stopped.
        self._lanes, self._lane_of = [], {}
        self.mirrors, self._mirror_tensors = {}, {}
