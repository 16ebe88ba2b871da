"""NIXL engine of the host proxy: one NIXL agent per rank, remote writes, signals as notices.

NIXL (NVIDIA's transfer library, shipped with vLLM, SGLang and Dynamo) drives InfiniBand and
RoCE verbs and TCP through its UCX backend and AWS EFA through its LIBFABRIC backend, so this
one engine reaches every NIC those libraries do.

Setup (``select.py``): each rank creates its agent with no progress thread (NIXL's own thread
busy-polls a core), registers the region and a staging buffer once, and publishes its agent
metadata and region address over the job's process group -- the same trust root as the
other engines, no NIXL listener. :meth:`connect` loads the peers' metadata and trades a hello
notice with each (both directions work, within the deadline).

Puts: sources are copied into the registered staging buffer (``staging.py``, as verbs does)
and a run of consecutive puts to one rank becomes one NIXL WRITE transfer with a descriptor
per piece. NIXL checks every remote descriptor against the memory the target registered, so
a write outside the target's region is refused before anything is sent.

Signals: NIXL does not order separate transfers, so a signal is a notice (``notices.py``:
numbered, MAC'd with the job secret) that is handed to NIXL only once every earlier transfer
to that rank reported DONE -- "DONE" means the data landed at the target -- or that rides as
the notification of the transfer right before it when nothing earlier is in flight (NIXL
sends it after that transfer's data). Nothing after a pending notice is posted before it, so
a signal takes effect after every earlier command to its rank and before every later one, as
on TCP; puts between two signals may land in any order among themselves (NIXL runs a
transfer's descriptors in parallel, as RDMA places writes); the backends put each range
once per call, so none relies on it. The receiver applies notices in sequence order, bounds-checks each word and
stores it with a release fence.

Progress: whichever thread calls into the engine -- the proxy threads, between batches and
when idle (``poll_s``), or a flush -- drives the agent under one lock: polls transfer states
(which is also what makes NIXL send a transfer's notification) and takes new notices. Over
TCP, UCX emulates a remote write inside the target process, so the target's proxy threads
polling is what completes its peers' writes.

Faults: a transfer that fails, or is not DONE ``timeout_s`` after it was posted, loses its
rank (:class:`PeerLost` at the next send, ``quiet`` False); its queued commands are dropped.
Teardown: :meth:`close` sends each peer a goodbye notice and waits (at most ``LINGER_S``) for
theirs, so the last messages of ranks destroying their Buffers a little apart still arrive,
and a send that meets a peer which said goodbye is logged as its close, not as a fault.
"""
from __future__ import annotations

import collections
import glob
import logging
import os
import threading
import time

import numpy as np

from ..deps import nixl as nixl_dep
from ..errors import CommTimeoutError
from ..logs import info_once
from ..shm.atomics import Backoff
from .commands import OP_PUT
from .notices import BYE, Inbox, Refused, encode, pair_key
from .receiver import Region
from .staging import Staging
from .tcp import PeerLost

log = logging.getLogger("moe_comm.transport")

CHUNK = 4 << 20             # staging reservation per piece of a large put
POST_BYTES = 8 << 20        # a run of puts is posted once it holds this much
# registered staging memory; room for a run being staged beside runs in flight
STAGING = max(int(os.environ.get("MOE_COMM_NIXL_STAGING_BYTES", 64 << 20)), 4 * POST_BYTES)
# Longest wait of an idle proxy thread between two polls: over TCP a peer's write or notice
# waits for this process to poll, so this bounds the latency it adds. While the engine was
# busy in the last ACTIVE_S: POLL_S; after that IDLE_POLL_S, so a job between calls costs
# little and the first message after a long pause waits at most that long. (An idle rank,
# measured over veth: 6.9% of a core polling at 250 us, 2.8% at 2 ms; the TCP engine 0.3%.)
POLL_S = float(os.environ.get("MOE_COMM_NIXL_POLL_US", 250)) * 1e-6
IDLE_POLL_S = 2e-3
ACTIVE_S = 0.1
LINGER_S = 1.0              # close waits at most this long for the peers' goodbyes
XFER, NOTICE = 0, 1
BACKENDS = ("UCX", "LIBFABRIC")


def rdma_devices() -> list:
    """RDMA devices (``/sys/class/infiniband``) with an active port: what NIXL's UCX
    (verbs) and LIBFABRIC (EFA) backends would drive."""
    out = []
    for dev in sorted(glob.glob("/sys/class/infiniband/*")):
        for state in glob.glob(os.path.join(dev, "ports", "*", "state")):
            try:
                with open(state) as f:
                    if "ACTIVE" in f.read():
                        out.append(os.path.basename(dev))
                        break
            except OSError:
                continue
    return out


def backend_for(devices: list) -> str:
    """``MOE_COMM_NIXL_BACKEND``, else LIBFABRIC for EFA devices, else UCX."""
    name = os.environ.get("MOE_COMM_NIXL_BACKEND", "").strip().upper()
    if name:
        if name not in BACKENDS:
            raise ValueError(f"MOE_COMM_NIXL_BACKEND must be one of {BACKENDS}, got {name!r}")
        return name
    return "LIBFABRIC" if devices and all(d.startswith("efa") for d in devices) else "UCX"


def probe(need_rdma: bool):
    """``(ok, why)``: whether this rank can run the NIXL engine; with ``need_rdma`` (the
    ``auto`` choice) only where one of its backends has an RDMA device to drive. Machines
    without such a device answer from sysfs alone, without importing NIXL."""
    devices = rdma_devices()
    if need_rdma and not devices:
        return False, "no RDMA device for NIXL"
    why = nixl_dep.import_error()
    if why:
        return False, why
    backend = backend_for(devices)
    try:
        nx = nixl_dep.api()
        agent = nx.nixl_agent("moe_comm-probe", nx.nixl_agent_config(
            enable_prog_thread=False, backends=[]))
        plugins = agent.get_plugin_list()
        del agent
    except Exception as e:  # noqa: BLE001 - any failure means "not here"
        return False, f"NIXL agent: {type(e).__name__}: {e}"
    if backend not in plugins:
        return False, f"NIXL has no {backend} plugin here (has {plugins})"
    return True, f"NIXL {backend}" + (f" on {', '.join(devices)}" if devices else "")


def _descs(rows: list) -> np.ndarray:
    """NIXL descriptor rows ``(address, length, device id)`` as its Nx3 array."""
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


class _Run:
    """Consecutive puts to one rank, staged, waiting to become one transfer."""

    __slots__ = ("local", "remote", "tickets", "nbytes")

    def __init__(self):
        self.local, self.remote, self.tickets, self.nbytes = [], [], [], 0

    def add(self, src: int, dst: int, n: int, ticket) -> None:
        self.local.append((src, n, 0))
        self.remote.append((dst, n, 0))
        self.tickets.append(ticket)
        self.nbytes += n


class NixlEngine:
    kind = "nixl"

    def __init__(self, rank: int, region: Region, remote_ranks, secret: bytes,
                 timeout_s: float, name: str, backend: str = "UCX", device=None):
        nx = nixl_dep.api()
        self.rank, self.region, self.timeout_s, self.name = rank, region, timeout_s, name
        self.remote = list(remote_ranks)
        self.backend = backend
        self.lock = threading.RLock()
        self.registered, self.peer, self.inflight = [], {}, {}
        self.closed = False
        self.agent = nx.nixl_agent(name, nx.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[]))
        try:
            self.agent.create_backend(backend, {})
            self.staging = Staging(STAGING)
            for addr, size in ((region.bytes.ctypes.data, region.size),
                               (self.staging.address, self.staging.size)):
                self.registered.append(self.agent.register_memory([(addr, size, 0, "")],
                                                                  "DRAM"))
        except BaseException:
            self.close()
            raise
        if device is not None and getattr(device, "type", "cpu") in ("cuda", "cpu"):
            # The CUDA backend's proxy path keeps buffers and mirrors in (pinned) host
            # memory, so there is no device memory to register as VRAM here.
            info_once(log, "nixl staged", "moe_comm nixl engine: the CUDA group's buffers and mirrors are "
                     "in host memory (%s); transfers go from registered host memory (DRAM), "
                     "not VRAM", "kernel emulator, no GPU" if device.type == "cpu" else
                     "proxy path")
        self.out_key = {d: pair_key(secret, rank, d) for d in self.remote}
        self.inbox = {s: Inbox(pair_key(secret, s, rank)) for s in self.remote}
        self.seq = {d: 1 for d in self.remote}           # 0 was the hello
        # per rank: posted transfers [handle, staging tickets, deadline, carries a notice],
        # and what waits to be handed to NIXL in order: (XFER, _Run) or (NOTICE, signals)
        self.inflight = {d: collections.deque() for d in self.remote}
        self.waiting = {d: collections.deque() for d in self.remote}
        self.rank_of, self.peer_addr = {}, {}
        self.failed: dict = {}
        self.cut = set()          # senders whose notices are no longer applied
        self.gone = set()         # peers that said they were closing
        self.refused = 0
        self.busy_at = time.monotonic()

    # -- connection ------------------------------------------------------------------------
    def local_info(self) -> dict:
        """What every peer needs from this rank (picklable, sent over the group)."""
        return dict(name=self.name, md=self.agent.get_agent_metadata(),
                    addr=self.region.bytes.ctypes.data, size=self.region.size)

    def connect(self, infos: dict, deadline: float) -> None:
        """``infos[r]`` = rank r's :meth:`local_info`. Returns once a hello came from every
        peer and went to every peer; CommTimeoutError naming the silent ones otherwise."""
        with self.lock:
            for dst in self.remote:
                name = self.agent.add_remote_agent(infos[dst]["md"])
                name = name.decode() if isinstance(name, bytes) else name
                if name != infos[dst]["name"]:
                    raise RuntimeError(f"rank {dst}'s NIXL metadata names agent {name!r}, "
                                       f"not {infos[dst]['name']!r}")
                self.peer[dst], self.rank_of[name] = name, dst
                self.peer_addr[dst] = infos[dst]["addr"]
            for dst in self.remote:
                self.agent.send_notif(self.peer[dst], encode(self.out_key[dst], 0, []))
        backoff = Backoff()
        while True:
            with self.lock:
                self._progress()
                silent = [s for s in self.remote if self.inbox[s].next == 0]
            if not silent:
                return
            if time.monotonic() > deadline:
                raise CommTimeoutError("transport/connect", silent, self.timeout_s)
            backoff.pause()

    # -- sending (proxy threads) -----------------------------------------------------------
    def send(self, dst: int, cmds: list) -> None:
        with self.lock:
            if dst in self.failed:
                raise PeerLost(dst, self.failed[dst], dst in self.gone)
            self.busy_at = time.monotonic()
            deadline = self.busy_at + self.timeout_s
            run, signals = _Run(), []
            base = self.peer_addr[dst]
            for op, _dst, offset, nbytes, value, _addr, ref in cmds:
                if op != OP_PUT:
                    if run.local:
                        self.waiting[dst].append((XFER, run))
                        run = _Run()
                    signals.append((offset, value))
                    continue
                if signals:
                    self.waiting[dst].append((NOTICE, signals))
                    signals = []
                src = np.frombuffer(ref, dtype=np.uint8)
                for pos in range(0, nbytes, CHUNK):
                    n = min(CHUNK, nbytes - pos)
                    run, at, ticket = self._stage(dst, run, n, deadline)
                    self.staging.bytes[at:at + n] = src[pos:pos + n]
                    run.add(self.staging.address + at, base + offset + pos, n, ticket)
                    if run.nbytes >= POST_BYTES:
                        self.waiting[dst].append((XFER, run))
                        run = _Run()
            if run.local:
                self.waiting[dst].append((XFER, run))
            if signals:
                self.waiting[dst].append((NOTICE, signals))
            self._issue(dst)
            if dst in self.failed:
                raise PeerLost(dst, self.failed[dst], dst in self.gone)

    def _stage(self, dst: int, run: _Run, n: int, deadline: float):
        """Reserve ``n`` staging bytes, posting what is staged and progressing while the
        staging buffer is full. Returns ``(run to add to, offset, ticket)``."""
        backoff = Backoff()
        while True:
            got = self.staging.take(n)
            if got is not None:
                return (run,) + got
            if run.local:                     # let what is staged go, so space comes back
                self.waiting[dst].append((XFER, run))
                run = _Run()
                self._issue(dst)
            self._progress()
            if dst in self.failed:
                raise PeerLost(dst, self.failed[dst], dst in self.gone)
            if time.monotonic() > deadline:
                raise PeerLost(dst, "staging memory still full at the deadline")
            backoff.pause()

    def _issue(self, dst: int) -> None:
        """Hand queued items to NIXL in order, as far as ordering allows: a notice waits
        until everything before it is DONE; nothing passes a waiting notice."""
        waiting, inflight = self.waiting[dst], self.inflight[dst]
        while waiting and dst not in self.failed:
            if inflight and inflight[-1][3]:
                return                # a notice rides on that transfer: nothing passes it
            what, item = waiting[0]
            if what == NOTICE:
                if inflight:
                    return
                waiting.popleft()
                try:
                    self.agent.send_notif(self.peer[dst], self._notice(dst, item))
                except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
                    self._fail(dst, f"notification failed ({type(e).__name__}: {e})")
                continue
            waiting.popleft()
            notif = b""
            if not inflight and waiting and waiting[0][0] == NOTICE:
                notif = self._notice(dst, waiting.popleft()[1])   # rides on this transfer
            self._post(dst, item, notif)

    def _notice(self, dst: int, signals: list) -> bytes:
        seq = self.seq[dst]
        self.seq[dst] = seq + 1
        return encode(self.out_key[dst], seq, signals)

    def _post(self, dst: int, run: _Run, notif: bytes) -> None:
        handle = None
        try:
            local = self.agent.get_xfer_descs(_descs(run.local), "DRAM")
            remote = self.agent.get_xfer_descs(_descs(run.remote), "DRAM")
            handle = self.agent.initialize_xfer("WRITE", local, remote, self.peer[dst], notif)
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError("transfer posted in error")
        except Exception as e:  # noqa: BLE001 - refused descriptors, a disconnected peer
            for t in run.tickets:
                self.staging.done(t)
            self._release(handle)
            self._fail(dst, f"NIXL refused a write ({type(e).__name__}: {e})")
            return
        # even a transfer that completed at once is polled: that poll sends its notification
        self.inflight[dst].append([handle, run.tickets, time.monotonic() + self.timeout_s,
                                   bool(notif)])

    # -- progress --------------------------------------------------------------------------
    @property
    def poll_s(self) -> float:
        """How long an idle proxy thread may wait before it polls again (see POLL_S)."""
        return POLL_S if time.monotonic() - self.busy_at < ACTIVE_S else IDLE_POLL_S

    def progress(self) -> bool:
        """Poll transfers and notices; True when something completed or arrived."""
        with self.lock:
            return self._progress()

    def _progress(self) -> bool:
        if self.closed:
            return False
        busy, busy_now = self._receive(), False
        now = time.monotonic()
        for dst, inflight in self.inflight.items():
            for entry in list(inflight):
                handle, tickets, end, _ = entry
                try:
                    state = self.agent.check_xfer_state(handle)
                except Exception as e:  # noqa: BLE001
                    state = f"ERR ({type(e).__name__}: {e})"
                if state == "DONE":
                    inflight.remove(entry)
                    self._release(handle)
                    for t in tickets:
                        self.staging.done(t)
                    busy = True
                elif state != "PROC":
                    self._fail(dst, f"transfer failed: {state}")
                    break
                elif now > end:
                    self._fail(dst, f"transfer not done within {self.timeout_s} s")
                    break
            if self.waiting[dst]:
                self._issue(dst)
            if inflight:
                busy_now = True
        if busy or busy_now:
            self.busy_at = now
        return busy

    def _receive(self) -> bool:
        try:
            notifs = self.agent.get_new_notifs()
        except Exception as e:  # noqa: BLE001
            log.warning("rank %d: NIXL notifications: %s", self.rank, e)
            return False
        for name, msgs in notifs.items():
            name = name.decode() if isinstance(name, bytes) else name
            src = self.rank_of.get(name)
            for msg in msgs:
                if src is None:
                    self._refuse(None, f"notice from agent {name!r}, not a peer of this job")
                elif src not in self.cut:
                    self._apply(src, msg)
        return bool(notifs)

    def _apply(self, src: int, msg: bytes) -> None:
        try:
            due = self.inbox[src].accept(msg)
        except Refused as e:                  # forged or replayed: that message only
            self._refuse(src, str(e))
            return
        for flags, signals in due:
            if flags & BYE:
                self.gone.add(src)
            for off, value in signals:
                err = self.region.check_signal(off)
                if err:                       # a genuine peer out of bounds: cut it off
                    self._refuse(src, err)
                    self.cut.add(src)
                    return
                self.region.signal(off, value)

    def _refuse(self, src, why: str) -> None:
        self.refused += 1
        log.error("rank %d: refused a notice%s: %s", self.rank,
                  "" if src is None else f" from rank {src}", why)

    # -- faults and teardown -----------------------------------------------------------------
    def _fail(self, dst: int, why: str) -> None:
        if dst not in self.failed:
            if dst not in self.gone:
                self._receive()               # its goodbye may be waiting to be read
            if dst in self.gone:
                why = f"closed its transport ({why})"
            self.failed[dst] = why
            (log.info if dst in self.gone else log.warning)(
                "rank %d: NIXL link to rank %d failed: %s", self.rank, dst, why)
        for handle, tickets, *_ in self.inflight[dst]:
            self._release(handle)
            for t in tickets:
                self.staging.done(t)
        self.inflight[dst].clear()
        for what, item in self.waiting[dst]:
            if what == XFER:
                for t in item.tickets:
                    self.staging.done(t)
        self.waiting[dst].clear()

    def _release(self, handle) -> None:
        if handle is None:
            return
        try:
            handle.release()
        except Exception as e:  # noqa: BLE001 - an active transfer that cannot be cancelled
            log.debug("rank %d: releasing a NIXL transfer: %s", self.rank, e)

    def quiet(self, dst: int, deadline: float) -> bool:
        """Wait until every transfer and notice to ``dst`` was DONE / handed to NIXL."""
        backoff = Backoff()
        while True:
            with self.lock:
                self._progress()
                if dst in self.failed:
                    return False
                if not self.inflight[dst] and not self.waiting[dst]:
                    return True
            if time.monotonic() > deadline:
                return False
            backoff.pause()

    def drop(self, dst: int) -> None:
        with self.lock:
            self._fail(dst, self.failed.get(dst, "dropped by the proxy"))

    def abort_sends(self) -> None:
        pass                                  # nothing waits past its deadline

    def close(self) -> None:
        """Called once the proxy threads stopped: say goodbye, wait (at most LINGER_S) for
        the peers' goodbyes, cancel what is left, disconnect, deregister, destroy the agent
        (and its UCX worker). The goodbyes let a peer that fails to reach this rank from now
        on take it as the end of the job's use of it, and the wait lets the peers' last
        messages (and goodbyes) arrive before this endpoint goes: Buffers are destroyed
        without a barrier, a few milliseconds apart."""
        with self.lock:
            if self.closed:
                return
            for dst in self.peer:
                if dst not in self.failed:
                    try:
                        self.agent.send_notif(self.peer[dst],
                                              encode(self.out_key[dst], self.seq[dst], [], BYE))
                    except Exception as e:  # noqa: BLE001 - it went first
                        log.debug("rank %d: goodbye to rank %d: %s", self.rank, dst, e)
            end = time.monotonic() + min(LINGER_S, self.timeout_s)
            while self.peer and time.monotonic() < end and \
                    any(d not in self.gone and d not in self.failed for d in self.peer):
                self._receive()               # progress: goodbyes leave and arrive
                time.sleep(1e-3)
            self.closed = True
            for dst in list(self.inflight):
                self.failed.setdefault(dst, "closed")      # no "link failed" warning
                self._fail(dst, self.failed[dst])
            for name in self.peer.values():
                try:
                    self.agent.remove_remote_agent(name)
                except Exception as e:  # noqa: BLE001
                    log.debug("rank %d: NIXL disconnect from %s: %s", self.rank, name, e)
            for descs in self.registered:
                try:
                    self.agent.deregister_memory(descs)
                except Exception as e:  # noqa: BLE001
                    log.warning("rank %d: NIXL deregistration: %s", self.rank, e)
            self.registered = []
            self.agent = None                 # the last reference: the agent is destroyed
