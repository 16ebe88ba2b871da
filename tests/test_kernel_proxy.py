"""The kernel proxy (moe_comm/cuda/kernel_proxy.py) drains the kernels' command ring into the
host transport with one lane per transport channel: a remote host whose channel is stuck
(slow, or dead and not yet noticed) must not hold up the commands for the healthy hosts.

The ring is driven here the way the kernels drive it (csrc/kernels/proxy_ring.cuh: fill a
slot, then publish its sequence number), on a plain CPU ring as the kernel emulator uses it;
the transport is the real ProxyTransport with one channel per remote host over an engine that
records what it is handed and can be made to stall for one destination, as a TCP send to a
peer that stopped reading does.
"""
from __future__ import annotations

import threading
import time

import torch

from moe_comm.cuda.kernel_proxy import KernelProxy
from moe_comm.shm import atomics
from moe_comm.transport.commands import OP_PUT, OP_SIGNAL
from moe_comm.transport.proxy import ProxyTransport
from moe_comm.wire import (PROXY_HEADER_WORDS, PROXY_OP_PUT, PROXY_OP_SIGNAL,
                           PROXY_SLOT_WORDS, PROXY_TAIL)
from test_transport_tcp import _FakeEngine

REGION = 4096


class _StallingEngine(_FakeEngine):
    """Records what it is handed; sends to ``stalled`` block until ``release`` is set."""

    def __init__(self, stalled):
        super().__init__()
        self.stalled, self.release, self.lock = set(stalled), threading.Event(), threading.Lock()

    def send(self, dst, cmds):
        if dst in self.stalled:
            self.release.wait(30)
        with self.lock:
            super().send(dst, cmds)

    def abort_sends(self):
        self.release.set()


def _publish(proxy: KernelProxy, op: int, rank: int, offset: int, arg: int) -> None:
    """One command, pushed as a kernel does: reserve, fill the slot, release its sequence."""
    n = int(proxy._head[0])
    proxy._head[0] += 1
    while n - int(proxy.words[PROXY_TAIL]) >= proxy.depth:     # a credit: the slot is free
        time.sleep(1e-4)
    at = PROXY_HEADER_WORDS + (n % proxy.depth) * PROXY_SLOT_WORDS
    proxy.words[at + 1:at + 4] = (op << 32 | rank, offset, arg)
    atomics.release()
    proxy.words[at] = n + 1


def _sent_to(engine, rank):
    with engine.lock:
        return [s[1:] for s in engine.sent if s[0] == rank]


def test_a_stalled_host_does_not_hold_up_the_others():
    engine = _StallingEngine(stalled={2})
    # ranks 1 and 2 on one remote host each; tiny transport rings fill at once
    transport = ProxyTransport(engine, 0, [1, 2], {1: REGION, 2: REGION}, timeout_s=20,
                               depth=4, channel_groups=[[1], [2]])
    mirrors = {r: torch.zeros(REGION, dtype=torch.uint8) for r in (1, 2)}
    proxy = KernelProxy(transport, mirrors, torch.device("cpu"), timeout_s=20, depth=256)
    try:
        mirrors[2][:64] = 7
        for i in range(32):                      # more than rank 2's channel can queue
            _publish(proxy, PROXY_OP_PUT, 2, 0, 64)
        mirrors[1][:16] = torch.arange(16, dtype=torch.uint8)
        _publish(proxy, PROXY_OP_PUT, 1, 0, 16)
        _publish(proxy, PROXY_OP_SIGNAL, 1, 64, 5)
        deadline = time.monotonic() + 5.0
        while len(_sent_to(engine, 1)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _sent_to(engine, 1) == [(OP_PUT, 0, bytes(range(16))), (OP_SIGNAL, 64, 5)]
        assert _sent_to(engine, 2) == []        # still stalled, and it held nobody up
        engine.release.set()
        proxy.flush(10.0)
        transport.flush()
        got = _sent_to(engine, 2)
        assert len(got) == 32 and all(g == (OP_PUT, 0, bytes([7]) * 64) for g in got)
    finally:
        engine.release.set()
        proxy.close()
        transport.close()


def test_puts_copy_the_mirror_when_taken_and_keep_order_per_rank():
    """A put's bytes are what the mirror held when the proxy took it (the kernels may rewrite
    the mirror after a later answer), and one rank's commands keep their order."""
    engine = _StallingEngine(stalled=())
    transport = ProxyTransport(engine, 0, [1, 2, 3], {r: REGION for r in (1, 2, 3)},
                               timeout_s=20, channel_groups=[[1, 2], [3]])
    mirrors = {r: torch.zeros(REGION, dtype=torch.uint8) for r in (1, 2, 3)}
    proxy = KernelProxy(transport, mirrors, torch.device("cpu"), timeout_s=20, depth=64)
    try:
        expect = {1: [], 2: [], 3: []}
        for i in range(40):
            r = 1 + i % 3
            mirrors[r][8 * i:8 * i + 8] = i
            _publish(proxy, PROXY_OP_PUT, r, 8 * i, 8)
            _publish(proxy, PROXY_OP_SIGNAL, r, 2048 + 8 * i, i)
            expect[r] += [(OP_PUT, 8 * i, bytes([i]) * 8), (OP_SIGNAL, 2048 + 8 * i, i)]
        proxy.flush(10.0)
        for r in expect:                         # taken already: rewriting changes nothing
            mirrors[r].fill_(0xEE)
        transport.flush()
        for r, want in expect.items():
            assert _sent_to(engine, r) == want, r
    finally:
        proxy.close()
        transport.close()
