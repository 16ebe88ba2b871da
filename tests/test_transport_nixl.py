"""Host-proxy transport over NIXL (moe_comm/transport/nixl.py): ranks in separate network
namespaces ("hosts") over UCX's TCP transport on the veth links.

- puts and signals land byte-exact, a signal never before its data;
- normal and low-latency dispatch/combine match the reference on the host backend and on the
  emulated CUDA backend (its kernel proxy hands the kernels' commands to the NIXL engine);
- a dead or unreachable host is reported within the deadline, and masked in elastic mode;
- a foreign agent, a forged or replayed notice and out-of-bounds writes are refused;
- create/destroy cycles leave no thread, fd, agent or registration behind.

Unit tests of the pieces (notices, staging, the choice of engine) need neither NIXL nor
namespaces. UCX settings for the hosts: ``netns.UCX_ENV`` (TCP on the veth link).
"""
from __future__ import annotations

import gc
import importlib.util
import io
import logging
import os
import pathlib
import threading
import time
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moe_comm.deps import nixl as nixl_dep
from moe_comm.jit import emulator
from moe_comm.quant import quantize_fp8
from moe_comm.shm import atomics
from moe_comm.testing import netns
from moe_comm.transport import notices, open_transport
from moe_comm.transport import nixl as nixl_mod
from moe_comm.transport import select as select_mod
from moe_comm.transport.commands import OP_PUT
from moe_comm.transport.receiver import Region
from moe_comm.transport.staging import Staging
from moe_comm.transport.tcp import PeerLost
from moe_comm.wire import tag
from checks import check_ll, check_normal
from test_low_latency import _cases as ll_cases
from test_multihost import HOSTS, N, PER_HOST, _both_modes, _killed_host
from test_normal_mode import _cases as normal_cases
from test_transport_tcp import _capture_logs, _exchange, check_host_loss

NIXL = {"MOE_COMM_TRANSPORT": "nixl", **netns.UCX_ENV}
SECRET = b"moe_comm-test-secret-0123456789"

needs_hosts = pytest.mark.skipif(
    not nixl_dep.installed() or netns.available() is not None,
    reason=f"needs NIXL (pip install 'moe_comm[nixl]') and network namespaces "
           f"({netns.available()})")


@pytest.fixture
def hosts():
    with netns.Hosts(2) as h:
        yield h


# -- pieces ------------------------------------------------------------------------------------
def test_notices_need_the_pair_key_and_apply_in_order():
    key = notices.pair_key(SECRET, 0, 1)
    inbox = notices.Inbox(key)
    msgs = [notices.encode(key, s, [(8 * s, -s)]) for s in range(4)]
    assert inbox.accept(msgs[0]) == [(0, [(0, 0)])]
    assert inbox.accept(msgs[2]) == []                      # held for the gap
    assert inbox.accept(msgs[1]) == [(0, [(8, -1)]), (0, [(16, -2)])]
    for bad, why in [(msgs[1], "replayed"), (msgs[2], "replayed"),
                     (notices.encode(notices.pair_key(SECRET, 1, 0), 3, []), "bad MAC"),
                     (notices.encode(notices.pair_key(b"another job's key", 0, 1), 3, []),
                      "bad MAC"),
                     (msgs[3][:-1] + bytes([msgs[3][-1] ^ 1]), "bad MAC"),
                     (b"short", "too short"),
                     (notices.encode(key, 3 + notices.WINDOW, []), "ahead")]:
        with pytest.raises(notices.Refused, match=why):
            inbox.accept(bad)
    assert inbox.accept(msgs[3]) == [(0, [(24, -3)])]
    assert inbox.accept(notices.encode(key, 4, [], notices.BYE)) == [(notices.BYE, [])]
    with pytest.raises(notices.Refused, match="malformed"):
        inbox.accept(notices.encode(key, 5, [], 2))          # an unknown flag


def test_staging_returns_space_in_order_and_never_wraps_a_reservation():
    s = Staging(1024, align=64)
    a = s.take(500)                     # 512 bytes at 0
    b = s.take(300)                     # 320 at 512
    assert a[0] == 0 and b[0] == 512 and s.take(256) is None
    s.done(b[1])                        # completes first, but a still holds the tail
    assert s.take(256) is None
    s.done(a[1])
    c = s.take(256)                     # 192 bytes left at the end: skipped, starts at 0
    assert c[0] == 0 and not s.take(1024 - 256 + 1)
    s.done(c[1])
    assert not s.busy()
    with pytest.raises(ValueError):
        s.take(2048)


def _info(want, nixl, verbs):
    return dict(want=want, nixl=nixl, nixl_why="NIXL UCX on mlx5_0" if nixl else "no RDMA",
                verbs=verbs, why="mlx5_0" if verbs else "no device")


def test_auto_prefers_nixl_then_verbs_then_tcp_and_says_why():
    choose = select_mod.choose
    assert choose("auto", [_info("auto", True, True)] * 2) == \
        ("nixl", "NIXL UCX on mlx5_0 on every rank")
    assert choose("auto", [_info("auto", True, True), _info("auto", False, True)]) == \
        ("verbs", "mlx5_0 on every rank")
    engine, why = choose("auto", [_info("auto", False, False), _info("auto", True, True)])
    assert engine == "tcp" and "no nixl: rank 0: no RDMA" in why and "no verbs" in why
    assert choose("tcp", [_info("tcp", False, False), _info("auto", True, True)]) == \
        ("tcp", "requested")
    assert choose("nixl", [_info("nixl", True, False)] * 2) == ("nixl", "requested")
    with pytest.raises(RuntimeError, match="'nixl' was requested but ranks \\[1\\]"):
        choose("nixl", [_info("nixl", True, False), _info("nixl", False, False)])


def test_auto_without_an_rdma_device_does_not_load_nixl(monkeypatch):
    monkeypatch.setattr(nixl_mod, "rdma_devices", lambda: [])
    monkeypatch.setattr(nixl_dep, "api", lambda: pytest.fail("NIXL imported"))
    assert nixl_mod.probe(need_rdma=True) == (False, "no RDMA device for NIXL")
    monkeypatch.setenv("MOE_COMM_NIXL_BACKEND", "verbs")
    with pytest.raises(ValueError, match="MOE_COMM_NIXL_BACKEND"):
        nixl_mod.backend_for([])
    monkeypatch.delenv("MOE_COMM_NIXL_BACKEND")
    assert nixl_mod.backend_for(["efa0"]) == "LIBFABRIC"
    assert nixl_mod.backend_for(["mlx5_0", "efa0"]) == "UCX"


class _FakeHandle:
    def __init__(self, agent, remote, notif):
        self.agent, self.remote, self.notif = agent, remote, notif
        self.state = "PROC"

    def release(self):
        pass


class _FakeAgent:
    """Stands in for ``nixl_agent``: transfers stay in progress until the test says DONE,
    and a transfer's notification goes out when a poll finds it DONE (as NIXL's does)."""

    def __init__(self, name, conf=None):
        self.name, self.events, self.handles = name, [], []
        self.inbound = {"r1": [notices.encode(notices.pair_key(SECRET, 1, 0), 0, [])]}

    def create_backend(self, backend, params):
        pass

    def register_memory(self, descs, mem):
        return descs

    def deregister_memory(self, descs):
        pass

    def get_agent_metadata(self):
        return self.name.encode()

    def add_remote_agent(self, md):
        return md.decode()

    def remove_remote_agent(self, name):
        pass

    def send_notif(self, name, msg):
        notice = notices.decode(notices.pair_key(SECRET, 0, 1), msg)
        self.events.append(("notice", notice))
        if notice[1] & notices.BYE:                     # rank 1 closes too
            self.inbound = {"r1": [notices.encode(notices.pair_key(SECRET, 1, 0), 1, [],
                                                  notices.BYE)]}

    def get_xfer_descs(self, rows, mem):
        return rows

    def initialize_xfer(self, op, local, remote, name, notif):
        h = _FakeHandle(self, [int(r[0]) - 1_000_000 for r in remote], notif)
        self.handles.append(h)
        self.events.append(("write", h.remote))
        return h

    def transfer(self, h):
        return "PROC"

    def check_xfer_state(self, h):
        if h.state == "DONE" and h.notif:
            self.send_notif(None, h.notif)
            h.notif = b""
        return h.state

    def get_new_notifs(self):
        new, self.inbound = self.inbound, {}           # rank 1's hello, then nothing
        return new


def test_engine_posts_nothing_past_a_notice_and_sends_it_after_earlier_writes_are_done(
        monkeypatch):
    """The order NIXL itself does not give: a signal's notice leaves only once every
    earlier write to that rank is DONE, and no write is posted ahead of it."""
    class _Api:
        nixl_agent = _FakeAgent

        @staticmethod
        def nixl_agent_config(**kw):
            return kw

    monkeypatch.setattr(nixl_dep, "api", lambda: _Api)
    region = np.zeros(4096, dtype=np.uint8)
    eng = nixl_mod.NixlEngine(0, Region(region), [1], SECRET, 5.0, "r0")
    eng.connect({1: dict(name="r1", md=b"r1", addr=1_000_000, size=4096)}, time.monotonic())
    agent, src = eng.agent, memoryview(np.zeros(8, dtype=np.uint8))
    put = lambda off: (OP_PUT, 1, off, 8, 0, 0, src)            # noqa: E731
    sig = lambda off, v: (2, 1, off, 8, v, 0, None)            # noqa: E731
    agent.events.clear()

    def done(i):
        agent.handles[i].state = "DONE"
        eng.progress()

    eng.send(1, [put(0), put(8), sig(64, 1), put(16), sig(72, 2)])
    assert agent.events == [("write", [0, 8])]                # s1 rides on it; 16 waits
    eng.send(1, [put(24)])
    assert len(agent.events) == 1
    done(0)
    assert agent.events[1:] == [("notice", (1, 0, [(64, 1)])), ("write", [16])]
    done(1)
    assert agent.events[3:] == [("notice", (2, 0, [(72, 2)])), ("write", [24])]
    eng.send(1, [put(32), sig(80, 3)])        # a write is in flight: the notice waits
    assert agent.events[5:] == [("write", [32])]
    done(2)
    assert agent.events[6:] == []            # 32 is still in flight
    assert not eng.quiet(1, time.monotonic() + 0.05)
    done(3)
    assert agent.events[6:] == [("notice", (3, 0, [(80, 3)]))]
    assert eng.quiet(1, time.monotonic() + 1) and not eng.staging.busy()
    eng.close()                              # a goodbye: failing to reach us is no fault
    assert agent.events[7:] == [("notice", (4, notices.BYE, []))]


def test_a_peer_that_said_goodbye_is_lost_quietly(monkeypatch, caplog):
    """Buffers are destroyed without a barrier: a rank whose last notice meets a peer that
    already closed logs it at INFO (that peer said goodbye), not as a failed link."""
    class _Api:
        nixl_agent = _FakeAgent

        @staticmethod
        def nixl_agent_config(**kw):
            return kw

    monkeypatch.setattr(nixl_dep, "api", lambda: _Api)
    eng = nixl_mod.NixlEngine(0, Region(np.zeros(4096, dtype=np.uint8)), [1], SECRET, 5.0,
                              "r0")
    eng.connect({1: dict(name="r1", md=b"r1", addr=1_000_000, size=4096)}, time.monotonic())
    eng.agent.inbound = {"r1": [notices.encode(notices.pair_key(SECRET, 1, 0), 1, [],
                                               notices.BYE)]}

    def disconnected(name, msg):
        raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
    eng.agent.send_notif = disconnected
    with caplog.at_level(logging.INFO, logger="moe_comm.transport"):
        with pytest.raises(PeerLost) as lost:
            eng.send(1, [(2, 1, 0, 8, 5, 0, None)])
    assert lost.value.closed and "closed its transport" in str(lost.value)
    assert [r.levelno for r in caplog.records] == [logging.INFO], caplog.records
    eng.close()


# -- puts and signals across hosts ---------------------------------------------------------------
@needs_hosts
def test_puts_and_signals_land_byte_exact_and_signal_after_data(hosts):
    """End to end. (UCX's TCP transport happens to keep one connection's writes and
    notifications in order, so the engine's own ordering is what the fake-agent test above
    pins down; on RDMA it is what keeps a signal behind its data.)"""
    r0, r1 = hosts.run(_exchange, 1, timeout=120, env=NIXL)
    assert r0["kind"] == r1["kind"] == "nixl"
    assert any("transport: nixl (requested)" in m for m in r0["logs"]), r0["logs"]
    assert r1["reader_bad"] == [], "a signal was visible before its data (or data is wrong)"
    assert r1["exact"], "rank 1's region differs from the expected image"
    assert r0["back_ok"]


# -- dispatch and combine across hosts -----------------------------------------------------------
@pytest.fixture(params=["host", "cuda_emulated"])
def env(request):
    """MOE_COMM_CPU_BACKEND=emulator makes the ranks' CPU Buffers drive the CUDA backend,
    whose kernel proxy reaches the other host through the same engine."""
    if request.param == "host":
        return NIXL
    if not emulator.available():
        pytest.skip("the kernel emulator needs a C++ compiler (g++)")
    import cuda_cases
    cuda_cases.preload("cpu", N, {c["hidden"] for c in ll_cases(N)[:2]} | {128}, ll=True)
    return {**NIXL, "MOE_COMM_CPU_BACKEND": "emulator"}


def _both_modes_logged(rank, n, normal, ll):
    logs = _capture_logs()
    return _both_modes(rank, n, normal, ll), logs.msgs


@needs_hosts
def test_dispatch_combine_across_hosts_match_reference(env):
    normal = normal_cases(N)[::3]
    ll = ll_cases(N)[:2]                        # hidden 128 and 256: kernels stay small
    runs = netns.run_on_hosts(_both_modes_logged, HOSTS, PER_HOST, normal, ll, timeout=300,
                              env=env)
    results = [torch.load(io.BytesIO(blob), weights_only=False) for blob, _ in runs]
    for r, (_, logs) in enumerate(runs):
        assert any("transport: nixl (requested)" in m for m in logs), (r, logs)
    if "MOE_COMM_CPU_BACKEND" in env:
        assert any("in host memory (kernel emulator" in m for m in runs[0][1]), runs[0][1]
    kind = "CudaBackend" if "MOE_COMM_CPU_BACKEND" in env else "HostBackend"
    for r, (path, _, _) in enumerate(results):
        other = [p for p in range(N) if p // PER_HOST != r // PER_HOST]
        assert path == (kind, other, [2, 2]), (r, path)
    check_normal(N, normal, [r[1] for r in results])
    check_ll(N, ll, [r[2] for r in results], quantize_fp8)


# -- dead and unreachable hosts ------------------------------------------------------------------
@needs_hosts
@pytest.mark.parametrize("elastic", [False, True])
def test_a_dead_host_is_reported_within_the_deadline_or_masked(elastic):
    with netns.Hosts(HOSTS) as hosts:
        results = hosts.run(_killed_host, PER_HOST, elastic, expect_exit={1}, timeout=60,
                            env=NIXL)
    for r in range(PER_HOST):
        outcome, elapsed = results[r]
        assert outcome == ([1, 1, 0, 0] if elastic else [PER_HOST, PER_HOST + 1]), (r, outcome)
        assert elapsed < 2.0 + 3.0, (r, elapsed)


@needs_hosts
@pytest.mark.parametrize("how", ["kill", "cut"])
def test_dead_or_unreachable_host_bounds_flush_and_close(hosts, how):
    """kill: host 1's processes die (UCX sees the connection reset); cut: its link goes down
    (silence: transfers stay in progress until their deadline)."""
    check_host_loss(hosts, how, 2.0, env=NIXL)


# -- foreign agents, forged notices, out-of-bounds writes -----------------------------------------
ATTACK_REGION = 1 << 20


def _intrude(name: str, md: bytes, msg: bytes) -> None:
    """An agent outside the job that got hold of rank 1's metadata sends it ``msg``."""
    nx = nixl_dep.api()
    agent = nx.nixl_agent(name, nx.nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {})
    peer = agent.add_remote_agent(md)
    agent.send_notif(peer, msg)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:        # progress it, so the message leaves over TCP
        agent.get_new_notifs()
        time.sleep(0.01)
    agent.remove_remote_agent(peer)


def _attacks(rank, world):
    logs = _capture_logs()
    region = np.full(ATTACK_REGION, 0xAB, dtype=np.uint8)
    t = open_transport(None, region, [1 - rank], timeout_s=20, secret=SECRET)
    eng = t.engine
    infos = [None, None]
    dist.all_gather_object(infos, eng.local_info())
    good = np.arange(256, dtype=np.uint8)
    out = {}
    if rank == 0:
        stranger = notices.pair_key(b"another job's secret!", 0, 1)
        _intrude(f"intruder-{os.getpid()}", infos[1]["md"],
                 notices.encode(stranger, 1, [(0, 666)]))
        _intrude(eng.name, infos[1]["md"],                 # posing as rank 0's agent
                 notices.encode(stranger, 1, [(0, 666)]))
        t.put(1, 4096, good)                               # the real link works
        t.signal(1, 0, tag(1, 1))
        t.flush()
        # a recorded notice played again (the genuine pair key, an old sequence number);
        # the engine's lock: the agent is not thread-safe and the proxy threads poll it
        with eng.lock:
            eng.agent.send_notif(eng.peer[1], notices.encode(eng.out_key[1], 1, [(0, 777)]))
        try:
            t.put(1, ATTACK_REGION - 10, np.zeros(100, dtype=np.uint8))
            out["api oob"] = "accepted"
        except ValueError:
            out["api oob"] = "ValueError"
        # past the API's check, straight to the engine: NIXL refuses the remote descriptor
        try:
            eng.send(1, [(OP_PUT, 1, ATTACK_REGION - 10, 100, 0, 0,
                          memoryview(np.zeros(100, dtype=np.uint8)))])
            out["engine oob"] = "sent"
        except PeerLost as e:
            out["engine oob"] = str(e)
        # a genuine peer storing a signal past the end: refused, and cut off from then on
        with eng.lock:
            eng.agent.send_notif(eng.peer[1], eng._notice(1, [(ATTACK_REGION, 5)]))
            eng.agent.send_notif(eng.peer[1], eng._notice(1, [(8, tag(3, 3))]))
        eng.quiet(1, time.monotonic() + 2)
    else:
        atomics.wait_words({0: region[:8].view(np.int64)}, 1, time.monotonic() + 20, "t", 20)
        end = time.monotonic() + 20
        while eng.refused < 4 and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.2)                                    # nothing more may land
        expect = np.full(ATTACK_REGION, 0xAB, dtype=np.uint8)
        expect[4096:4096 + 256] = good
        expect[:8] = np.array([tag(1, 1)], dtype=np.int64).view(np.uint8)
        out = {"untouched": bool(np.array_equal(region, expect)), "refused": eng.refused,
               "cut": sorted(eng.cut)}
    dist.barrier()
    t.close()
    out["logs"] = logs.msgs
    return out


@needs_hosts
def test_foreign_agents_forged_notices_and_out_of_bounds_writes_are_refused(hosts):
    r0, r1 = hosts.run(_attacks, 1, timeout=90, env=NIXL)
    assert r0["api oob"] == "ValueError"
    assert "NIXL refused a write" in r0["engine oob"], r0["engine oob"]
    assert r1["untouched"], "a refused write changed the region"
    assert r1["refused"] == 4 and r1["cut"] == [0], r1
    refused = [m for m in r1["logs"] if "refused a notice" in m]
    assert any("not a peer of this job" in m for m in refused), refused
    assert any("bad MAC" in m for m in refused), refused
    assert any("replayed" in m for m in refused), refused
    assert any("inside the registered region" in m for m in refused), refused


# -- lifecycle -------------------------------------------------------------------------------------
def _census():
    return (len(os.listdir("/proc/self/task")), threading.active_count(),
            len(os.listdir("/proc/self/fd")))


def _cycles(rank, world):
    seen, agents = [], []
    for i in range(4):
        region = np.zeros(1 << 20, dtype=np.uint8)
        t = open_transport(None, region, [1 - rank], timeout_s=20)
        t.put(1 - rank, 64, np.full(1000, i + 1, dtype=np.uint8))
        t.signal(1 - rank, 0, tag(i + 1, 0))
        atomics.wait_words({1 - rank: region[:8].view(np.int64)}, i + 1,
                           time.monotonic() + 20, "cycle", 20)
        ok = bool((region[64:1064] == i + 1).all())
        agents.append(weakref.ref(t.engine.agent))
        dist.barrier()
        t.close()
        gc.collect()
        seen.append((ok, t.engine.registered, t.engine.agent, _census()))
    return seen, [a() is None for a in agents]


@needs_hosts
def test_create_destroy_cycles_leave_nothing_behind(hosts):
    for seen, gone in hosts.run(_cycles, 1, timeout=120, env=NIXL):
        assert all(ok and registered == [] and agent is None
                   for ok, registered, agent, _ in seen), seen
        assert all(gone), "a NIXL agent outlived its transport"
        # the first cycle may start UCX's process-wide threads; after it nothing grows (a
        # socket of an earlier cycle may close late: counts may drop)
        first, last = seen[0][-1], seen[-1][-1]
        assert all(b <= a for a, b in zip(first, last)), seen


# -- the benchmark's link measurement ---------------------------------------------------------------
@needs_hosts
def test_hosts_bench_measures_raw_tcp_and_both_engines_in_one_run():
    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / "hosts.py"
    spec = importlib.util.spec_from_file_location("bench_hosts", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.measure(total_mb=8, put_kb=256, repeat=1, engines=("tcp", "nixl"))
    assert min(r["raw_tcp_GBps"], r["proxy_tcp_GBps"], r["proxy_nixl_GBps"]) > 0, r
    assert abs(r["nixl_ratio"] - r["proxy_nixl_GBps"] / r["raw_tcp_GBps"]) < 0.01, r
