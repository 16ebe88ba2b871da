"""Host-proxy transport over TCP: ranks in separate network namespaces ("hosts") exchange
puts and signals; forged and out-of-bounds traffic is refused; a dead or unreachable host is
reported within the deadline. Unit tests of the pieces (ring, frames, handshake, selection)
run without namespaces."""
from __future__ import annotations

import logging
import mmap
import os
import pickle
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from moe_comm.testing import netns
from moe_comm.errors import CommTimeoutError
from moe_comm.shm import atomics
from moe_comm.transport import open_transport, requested_kind
from moe_comm.transport import select as select_mod
from moe_comm.transport import tcp as tcp_mod
from moe_comm.transport.addr import local_address, route_address
from moe_comm.transport.auth import (CLIENT_HELLO, MAGIC, AuthError, client_handshake,
                                     server_handshake)
from moe_comm.transport.commands import FRAME, OP_PUT, OP_SIGNAL
from moe_comm.transport.proxy import ProxyTransport
from moe_comm.transport.receiver import Refused, Region, serve_connection
from moe_comm.transport.ring import CommandRing, RingTimeout
from moe_comm.wire import tag
from ranks import run_ranks

SECRET = b"moe_comm-test-secret-0123456789"


@pytest.fixture
def hosts():
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    with netns.Hosts(2) as h:
        yield h


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.msgs = []

    def emit(self, record):
        self.msgs.append(record.getMessage())


def _capture_logs() -> _Records:
    h = _Records()
    lg = logging.getLogger("moe_comm.transport")
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    return h


# -- puts and signals across hosts ------------------------------------------------------------
REGION = 16 << 20
DATA_BASE = 4096
# Each round ends with a large put right before its signal: if a signal ever overtook its
# data, the reader would have milliseconds to see the word while the data is still missing.
ROUNDS = [[0, 1, 7, 4099, 65541, 300_000, 2 << 20]] * 4 + [[17 + i % 83 for i in range(600)]] \
    + [[1 << 20, 5, 3 << 19]]


def _plan():
    """Every put: (round, index, offset, nbytes); the rounds' areas never overlap."""
    puts, off = [], DATA_BASE
    for r, sizes in enumerate(ROUNDS):
        for i, n in enumerate(sizes):
            off += 3                               # odd offsets: nothing assumes alignment
            puts.append((r, i, off, n))
            off += n
    assert off < REGION
    return puts


def _payload(r, i, n):
    return np.random.default_rng(1000 * r + i).integers(0, 256, n, dtype=np.uint8)


def _reader(region, out_fd):
    """Another process polling the signal words (acquire), checking each round's data."""
    words = region[:8 * len(ROUNDS)].view(np.int64)
    bad = []
    try:
        plan = _plan()
        for r in range(len(ROUNDS)):
            atomics.wait_words({0: words[r:r + 1]}, 1, time.monotonic() + 30, "reader", 30)
            for rr, i, off, n in plan:
                if rr == r and not np.array_equal(region[off:off + n], _payload(r, i, n)):
                    bad.append((r, i))
    except Exception as e:  # noqa: BLE001
        bad.append(repr(e))
    os.write(out_fd, pickle.dumps(bad))
    os._exit(0)


def _exchange(rank, world):
    logs = _capture_logs()
    mm = mmap.mmap(-1, REGION)                     # shared: the reader process maps it too
    region = np.frombuffer(mm, dtype=np.uint8)
    reader = None
    if rank == 1:
        rfd, wfd = os.pipe()
        reader = os.fork()
        if reader == 0:
            _reader(region, wfd)
        os.close(wfd)
    t = open_transport(None, region, [1 - rank], timeout_s=30)
    back = _payload(99, 0, 123_457)
    if rank == 0:
        for r, i, off, n in _plan():
            t.put(1, off, _payload(r, i, n))
            if i == len(ROUNDS[r]) - 1:
                t.signal(1, 8 * r, tag(1, r))      # right after the round's last put
        t.flush()
        atomics.wait_words({1: region[:8].view(np.int64)}, 2, time.monotonic() + 30, "back", 30)
        result = {"back_ok": bool(np.array_equal(region[DATA_BASE:DATA_BASE + back.size],
                                                 back))}
    else:
        t.put(0, DATA_BASE, back)                  # the other direction at the same time
        t.signal(0, 0, tag(2, 0))
        last = len(ROUNDS) - 1
        atomics.wait_words({0: region[8 * last:8 * last + 8].view(np.int64)}, 1,
                           time.monotonic() + 30, "last", 30)
        expect = np.zeros(REGION, dtype=np.uint8)
        for r, i, off, n in _plan():
            expect[off:off + n] = _payload(r, i, n)
        for r in range(len(ROUNDS)):
            expect[8 * r:8 * r + 8] = np.array([tag(1, r)], dtype=np.int64).view(np.uint8)
        chunks = []
        while True:
            c = os.read(rfd, 1 << 16)
            if not c:
                break
            chunks.append(c)
        os.waitpid(reader, 0)
        result = {"reader_bad": pickle.loads(b"".join(chunks)),
                  "exact": bool(np.array_equal(region, expect))}
    import torch.distributed as dist
    dist.barrier()
    t.close()
    result["logs"] = logs.msgs
    result["kind"] = t.kind
    return result


def _small_window_listen(host):
    s = tcp_mod.listen(host)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)   # inherited by accepted sockets
    return s


def test_puts_and_signals_land_byte_exact_and_signal_after_data(hosts, monkeypatch):
    # A small receive window makes each round's last put trickle in over many round trips,
    # so a signal that overtook its data would be seen by the reader (checked: reordering
    # signals ahead of puts in the sender's batches fails this test).
    monkeypatch.setattr(select_mod, "listen", _small_window_listen)   # forked ranks inherit
    r0, r1 = hosts.run(_exchange, 1, timeout=90)
    assert r0["kind"] == r1["kind"] == "tcp"
    assert any("transport: tcp" in m for m in r0["logs"]), r0["logs"]
    assert r1["reader_bad"] == [], "a signal was visible before its data (or data is wrong)"
    assert r1["exact"], "rank 1's region differs from the expected image"
    assert r0["back_ok"]


# -- forged and out-of-bounds traffic -------------------------------------------------------------
ATTACK_REGION = 1 << 20


def _closed_by_peer(sock) -> bool:
    """True once the peer closed (EOF or reset); whatever it sent before is skipped."""
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _attack(addr, secret, frame: bytes | None):
    """Connect to ``addr``; handshake with ``secret`` (None: send garbage); send ``frame``.
    Returns what happened."""
    s = socket.create_connection(tuple(addr), timeout=10)
    try:
        if secret is None:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(64))
            return "closed" if _closed_by_peer(s) else "open"
        try:
            client_handshake(s, secret, 0, 1, time.monotonic() + 10)
        except AuthError:
            return "auth refused"
        try:
            s.sendall(frame)
        except (ConnectionResetError, BrokenPipeError):
            return "closed"
        return "closed" if _closed_by_peer(s) else "open"
    finally:
        s.close()


def _attacks(rank, world):
    import torch.distributed as dist
    logs = _capture_logs()
    region = np.full(ATTACK_REGION, 0xAB, dtype=np.uint8)
    t = open_transport(None, region, [1 - rank], timeout_s=20, secret=SECRET)
    addrs = [None, None]
    dist.all_gather_object(addrs, t.address)
    good = np.arange(256, dtype=np.uint8)
    if rank == 0:
        oob = FRAME.pack(OP_PUT, 0, ATTACK_REGION - 10, 100) + bytes(100)
        out = {
            "wrong secret": _attack(addrs[1], b"not-the-secret-" * 2, b""),
            "garbage": _attack(addrs[1], None, None),
            "oob put": _attack(addrs[1], SECRET, oob),
            "huge put": _attack(addrs[1], SECRET, FRAME.pack(OP_PUT, 0, 64, 1 << 62)),
            "misaligned signal": _attack(addrs[1], SECRET, FRAME.pack(OP_SIGNAL, 0, 12, 1)),
            "signal past end": _attack(addrs[1], SECRET,
                                       FRAME.pack(OP_SIGNAL, 0, ATTACK_REGION, 1)),
            "reserved flags": _attack(addrs[1], SECRET, FRAME.pack(OP_SIGNAL, 1, 0, 1)),
        }
        try:
            t.put(1, ATTACK_REGION - 10, np.zeros(100, dtype=np.uint8))
            out["api oob"] = "accepted"
        except ValueError:
            out["api oob"] = "ValueError"
        t.put(1, 4096, good)                      # the real link still works
        t.signal(1, 0, tag(1, 1))
        t.flush()
    else:
        atomics.wait_words({0: region[:8].view(np.int64)}, 1, time.monotonic() + 20, "t", 20)
        expect = np.full(ATTACK_REGION, 0xAB, dtype=np.uint8)
        expect[4096:4096 + 256] = good
        expect[:8] = np.array([tag(1, 1)], dtype=np.int64).view(np.uint8)
        out = {"untouched": bool(np.array_equal(region, expect)),
               "refused": t.engine.refused}
    dist.barrier()
    t.close()
    out["logs"] = logs.msgs
    return out


def test_forged_and_out_of_bounds_traffic_is_refused(hosts):
    r0, r1 = hosts.run(_attacks, 1, timeout=60)
    assert r0["wrong secret"] == "auth refused"
    for what in ("garbage", "oob put", "huge put", "misaligned signal", "signal past end",
                 "reserved flags"):
        assert r0[what] == "closed", (what, r0[what])
    assert r0["api oob"] == "ValueError"
    assert r1["untouched"], "a refused write changed the region"
    assert r1["refused"] == 7
    refused_conn = [m for m in r1["logs"] if "refused connection" in m]
    refused_data = [m for m in r1["logs"] if "refused data" in m]
    assert len(refused_conn) == 2 and "bad MAC" in refused_conn[0], r1["logs"]
    assert len(refused_data) == 5, r1["logs"]
    assert any("outside the registered region" in m for m in refused_data)


# -- dead and unreachable hosts ---------------------------------------------------------------
def _wait_file(path, timeout=30.0):
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(path)
        time.sleep(0.01)


def _survivor(rank, world, folder, deadline_s):
    region = np.zeros(1 << 20, dtype=np.uint8)
    t = open_transport(None, region, [1 - rank], timeout_s=deadline_s)
    if rank == 1:
        open(os.path.join(folder, "ready"), "w").close()
        time.sleep(120)                           # killed or cut off by the test
        return None
    _wait_file(os.path.join(folder, "go"))
    out = {}
    t0 = time.monotonic()
    try:
        atomics.wait_words({1: region[:8].view(np.int64)}, 1, t0 + deadline_s,
                           "test/wait", deadline_s)
        out["wait"] = "no error"
    except CommTimeoutError as e:
        out["wait"] = e.silent_ranks
    out["wait_s"] = time.monotonic() - t0
    src = np.ones(1 << 20, dtype=np.uint8)
    t0 = time.monotonic()
    failed = set()
    while not failed and time.monotonic() - t0 < 4 * deadline_s:
        for _ in range(16):
            t.put(1, 0, src)
        failed = t.flush(raise_on_timeout=False)
    out["flush"] = sorted(failed)
    out["flush_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    t.close()
    out["close_s"] = time.monotonic() - t0
    return out


@pytest.mark.parametrize("how", ["kill", "cut"])
def test_dead_or_unreachable_host_is_reported_within_deadline(hosts, how):
    """kill: every process of host 1 is SIGKILLed (its kernel resets the connections);
    cut: host 1's link goes down (silence: sends stall until their deadline)."""
    check_host_loss(hosts, how, 1.5, env=None)


def check_host_loss(hosts, how, deadline_s, env):
    """Host 1 dies (``how`` "kill") or loses its link ("cut") while host 0's rank waits on
    it: the wait names it within its deadline, flush and close stay bounded (``env``: the
    ranks' environment, e.g. another transport)."""
    folder = hosts.tmpdir
    job = hosts.start(_survivor, 1, folder, deadline_s, timeout=60, env=env)
    _wait_file(os.path.join(folder, "ready"))
    if how == "kill":
        hosts.kill_host(1)
    else:
        hosts.set_link(1, False)
    open(os.path.join(folder, "go"), "w").close()
    r0 = job.wait(expect_exit={1})[0]
    assert r0["wait"] == [1]
    assert r0["wait_s"] < deadline_s + 1.0
    assert r0["flush"] == [1]
    assert r0["flush_s"] < 3 * deadline_s + 1.0
    assert r0["close_s"] < deadline_s + 4.0


# -- the harness -----------------------------------------------------------------------------------
def _ping(rank, world):
    """Module-level: mode="exec" imports it by reference in a fresh interpreter."""
    region = np.zeros(4096, dtype=np.uint8)
    t = open_transport(None, region, [1 - rank], timeout_s=20)
    t.put(1 - rank, 64, np.full(10, rank + 1, dtype=np.uint8))
    t.signal(1 - rank, 0, tag(1, rank))
    atomics.wait_words({1 - rank: region[:8].view(np.int64)}, 1, time.monotonic() + 20, "p", 20)
    import torch.distributed as dist
    dist.barrier()
    t.close()
    return (os.environ["MOE_COMM_NETNS_ADDR"], t.address[0], region[64:74].tolist(),
            socket.gethostname())


def test_exec_mode_runs_ranks_through_ip_netns_exec(hosts):
    res = hosts.run(_ping, 1, mode="exec", timeout=90)
    for rank, (host_addr, bound, got, name) in enumerate(res):
        assert host_addr == hosts.addr(rank) and name == netns.hostname(rank)
        assert bound == host_addr                 # listener on the veth address, not 0.0.0.0
        assert got == [2 - rank] * 10


def _fail(rank, world):
    if rank == 1:
        raise RuntimeError("boom")
    return rank


def test_namespaces_are_removed_on_failure_and_stale_ones_reclaimed():
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}{dead.pid}xdeadh0"      # a run whose process is gone
    subprocess.run(["ip", "netns", "add", stale], check=True)
    with pytest.raises(netns.RankFailure, match="boom"):
        with netns.Hosts(2) as h:
            names = [h.switch, *h.names]
            h.run(_fail, 1, timeout=30)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert stale not in listed
    assert not any(n in listed for n in names)


# -- pieces, no namespaces ------------------------------------------------------------------
def _serve(region, frames: bytes):
    a, b = socket.socketpair()
    a.sendall(frames)
    a.shutdown(socket.SHUT_WR)
    try:
        return serve_connection(b, region)
    finally:
        a.close()
        b.close()


def test_receiver_applies_frames_in_order_and_refuses_bad_ones():
    mem = np.zeros(1 << 17, dtype=np.uint8)
    region = Region(mem)
    big = np.random.default_rng(0).integers(0, 256, 70_000, dtype=np.uint8)
    frames = (FRAME.pack(OP_PUT, 0, 100, 5) + b"hello" + FRAME.pack(OP_SIGNAL, 0, 8, -3) +
              FRAME.pack(OP_PUT, 0, 1000, big.size) + big.tobytes() +
              FRAME.pack(OP_PUT, 0, 7, 0) + FRAME.pack(OP_SIGNAL, 0, 16, tag(4, 2)))
    assert _serve(region, frames) == "closed"
    assert bytes(mem[100:105]) == b"hello" and mem[8:16].view(np.int64)[0] == -3
    assert np.array_equal(mem[1000:1000 + big.size], big)
    assert mem[16:24].view(np.int64)[0] == tag(4, 2)
    before = mem.copy()
    size = mem.size
    for bad in (FRAME.pack(OP_PUT, 0, size - 1, 2) + b"xx", FRAME.pack(OP_SIGNAL, 0, 4, 1),
                FRAME.pack(OP_SIGNAL, 0, size - 4, 1), FRAME.pack(9, 0, 0, 0),
                FRAME.pack(OP_PUT, 2, 0, 1) + b"x"):
        with pytest.raises(Refused):
            _serve(region, bad)
    assert np.array_equal(mem, before)
    assert _serve(region, FRAME.pack(OP_PUT, 0, 0, 10) + b"abc") == "closed mid-frame"


def test_handshake_needs_the_secret_and_a_known_rank():
    def run(client_secret, src, dst, allowed=(0,)):
        a, b = socket.socketpair()
        a.settimeout(5)
        b.settimeout(5)
        out = {}

        def server():
            try:
                out["server"] = server_handshake(b, SECRET, 1, allowed, time.monotonic() + 5)
            except AuthError as e:
                out["server"] = f"refused: {e}"
            b.close()
        th = threading.Thread(target=server)
        th.start()
        try:
            client_handshake(a, client_secret, src, dst, time.monotonic() + 5)
            out["client"] = "ok"
        except AuthError as e:
            out["client"] = f"refused: {e}"
        th.join()
        a.close()
        return out

    assert run(SECRET, 0, 1) == {"server": 0, "client": "ok"}
    bad = run(b"x" * 32, 0, 1)
    assert "bad MAC" in bad["server"] and bad["client"].startswith("refused")
    assert "meant for rank 2" in run(SECRET, 0, 2)["server"]
    assert "not a peer" in run(SECRET, 3, 1)["server"]


def test_a_dribbling_client_is_dropped_at_the_handshake_deadline():
    """A client that sends its hello one byte at a time (each read of the server succeeds long
    before any per-read timeout) is dropped when the whole handshake's deadline passes, which
    frees its listener slot; a per-read timeout would have held the slot for the ~14 s the
    dribble takes."""
    deadline_s, step_s = 1.0, 0.25
    a, b = socket.socketpair()
    out = {}

    def server():
        t0 = time.monotonic()
        try:
            out["result"] = server_handshake(b, SECRET, 1, (0,), t0 + deadline_s)
        except AuthError as e:
            out["result"] = f"refused: {e}"
        out["seconds"] = time.monotonic() - t0
        b.close()

    th = threading.Thread(target=server)
    th.start()
    a.recv(len(MAGIC) + 16)                        # the server's hello
    try:
        for byte in MAGIC + bytes(CLIENT_HELLO - len(MAGIC)):
            if not th.is_alive():
                break
            a.send(bytes([byte]))
            time.sleep(step_s)
    except OSError:
        pass                                       # the server closed on us: dropped
    th.join(CLIENT_HELLO * step_s)
    a.close()
    assert out["result"].startswith("refused") and "deadline" in out["result"], out
    # refused at its deadline, give or take one dribble step and a loaded machine's jitter
    assert out["seconds"] < deadline_s + step_s + 1.0, out


class _FakeEngine:
    kind = "fake"

    def __init__(self, fail_for=()):
        self.sent, self.fail_for = [], set(fail_for)

    def send(self, dst, cmds):
        if dst in self.fail_for:
            raise ConnectionResetError("reset by peer")
        self.sent += [(dst, c[0], c[2], bytes(c[6]) if c[0] == OP_PUT else c[4]) for c in cmds]

    def quiet(self, dst, deadline):
        return True

    def progress(self):
        pass

    def drop(self, dst):
        pass

    def abort_sends(self):
        pass

    def close(self):
        pass


def test_proxy_validates_and_keeps_order_per_destination():
    import torch
    eng = _FakeEngine(fail_for={3})
    t = ProxyTransport(eng, 0, [1, 2, 3], {1: 64, 2: 64, 3: 64}, timeout_s=5, channels=2)
    t.put(1, 0, np.arange(4, dtype=np.uint8))
    t.put(2, 8, torch.arange(2, dtype=torch.int16))          # any dtype: its bytes
    t.signal(1, 8, 11)
    t.put(1, 60, np.zeros(0, dtype=np.uint8))                # empty: nothing sent
    t.signal(2, 0, -1)
    t.put(3, 0, np.ones(4, dtype=np.uint8))
    assert t.flush(raise_on_timeout=False) == {3}
    assert 3 in t.lost_ranks()
    with pytest.raises(CommTimeoutError, match=r"\[3\]"):
        t.flush(3)
    t.put(3, 0, np.ones(4, dtype=np.uint8))                  # lost peer: dropped quietly
    by1 = [s[1:] for s in eng.sent if s[0] == 1]
    assert by1 == [(OP_PUT, 0, bytes(range(4))), (OP_SIGNAL, 8, 11)]
    assert [s[1:] for s in eng.sent if s[0] == 2] == [(OP_PUT, 8, b"\0\0\1\0"),
                                                       (OP_SIGNAL, 0, -1)]
    for call, err in [(lambda: t.put(1, 61, np.zeros(4, np.uint8)), ValueError),
                      (lambda: t.put(5, 0, np.zeros(1, np.uint8)), ValueError),
                      (lambda: t.put(1, 0, np.zeros((4, 4), np.uint8)[:, 1]), ValueError),
                      (lambda: t.put(1, 0, [1, 2]), TypeError),
                      (lambda: t.signal(1, 4, 1), ValueError),
                      (lambda: t.signal(1, 64, 1), ValueError),
                      (lambda: t.signal(1, 0, 1 << 63), ValueError)]:
        with pytest.raises(err):
            call()
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.signal(1, 0, 1)


def test_kind_argument_beats_environment(monkeypatch):
    monkeypatch.setenv("MOE_COMM_TRANSPORT", "tcp")
    assert requested_kind("auto") == "tcp" and requested_kind("verbs") == "verbs"
    monkeypatch.setenv("MOE_COMM_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="MOE_COMM_TRANSPORT"):
        requested_kind()
    monkeypatch.delenv("MOE_COMM_TRANSPORT")
    assert requested_kind() == "auto"
    with pytest.raises(ValueError, match="kind"):
        requested_kind("udp")


def test_listen_address_follows_the_job_network(monkeypatch):
    monkeypatch.delenv("MOE_COMM_BIND_ADDR", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert local_address() == "127.0.0.1"
    monkeypatch.setenv("MOE_COMM_BIND_ADDR", "127.0.0.2")
    assert local_address() == "127.0.0.2"
    assert local_address("127.0.0.3") == "127.0.0.3"
    assert route_address("127.0.0.1") == "127.0.0.1"


def _verbs_without_device(rank, n):
    from moe_comm.transport.verbs import probe
    ok, why = probe()
    if ok:
        return "device present"
    try:
        open_transport(None, np.zeros(64, np.uint8), [1 - rank], kind="verbs", timeout_s=5)
    except RuntimeError as e:
        return str(e)
    return "opened"


def test_verbs_requested_without_device_is_a_clear_error():
    res = run_ranks(_verbs_without_device, 2, timeout=60)
    if res[0] == "device present":
        pytest.skip("this machine has an RDMA device")
    assert all("'verbs' was requested" in r for r in res), res


def _local_pair(rank, n):
    region = np.zeros(4096, dtype=np.uint8)
    try:
        open_transport(None, region, [1] if rank == 0 else [], timeout_s=5)
        asym = "opened"
    except ValueError as e:
        asym = str(e)
    # No GLOO_SOCKET_IFNAME here: the listener takes the route to the store's host.
    t = open_transport(None, region, [1 - rank], timeout_s=5)
    t.signal(1 - rank, 8, tag(1, rank))
    atomics.wait_words({1 - rank: region[8:16].view(np.int64)}, 1, time.monotonic() + 5,
                       "pair", 5)
    import torch.distributed as dist
    dist.barrier()
    t.close()
    return asym, t.address[0]


def test_remote_ranks_must_be_symmetric_and_listener_follows_the_store_route(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("MOE_COMM_BIND_ADDR", raising=False)
    res = run_ranks(_local_pair, 2, timeout=60)
    for asym, bound in res:
        assert "must be symmetric: rank 0 lists rank 1" in asym
        assert bound == "127.0.0.1"
