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
rewrite the mirror as soon as the remote rank answers a later signal. A command the transport
refuses (a lost peer, a full queue) cuts that rank off: this and every later command to it are
dropped and logged, so no signal ever announces bytes that did not go, and the remote rank's
silence surfaces as the usual deadline (CommTimeoutError, or masking in elastic mode).
"""
from __future__ import annotations

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
                self._execute(op_rank >> 32, op_rank & 0xffffffff, offset, arg)
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

    def _execute(self, op: int, rank: int, offset: int, arg: int) -> None:
        if rank in self.cut_off:
            return
        try:
            if op == PROXY_OP_PUT:
                self.transport.put(rank, offset, self.mirrors[rank][offset:offset + arg].copy())
            elif op == PROXY_OP_SIGNAL:
                self.transport.signal(rank, offset, arg)
            else:
                raise ValueError(f"unknown proxy command {op}")
        except Exception as e:  # noqa: BLE001 - the thread must go on; the peer's wait tells
            self.cut_off[rank] = str(e)
            log.warning("moe_comm kernel proxy: command %d to rank %d failed (%s); this and "
                        "every later command to it are dropped", op, rank, e)

    def flush(self, timeout_s: float) -> None:
        """Wait until the proxy took every command published so far (bounded)."""
        head = int(self._head.item())
        deadline = time.monotonic() + timeout_s
        while int(self.words[PROXY_TAIL]) < head and time.monotonic() < deadline and \
                self._thread.is_alive():
            time.sleep(1e-4)

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2.0)
