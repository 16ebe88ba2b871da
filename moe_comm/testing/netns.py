"""Several "hosts" on one machine: Linux network namespaces joined by a virtual switch.

Tests and benchmarks of the inter-host transport need ranks that talk over a real network
stack (their own interfaces, addresses and routes, TCP between kernels' socket layers) rather
than over loopback. Each host is a namespace with one veth interface ``eth0`` at
``10.77.0.(h+1)/24``; the other end of every veth sits in a "switch" namespace holding a
bridge, so any number of hosts reach each other. Nothing is created in the caller's namespace,
so concurrent runs never collide on interface names, addresses or ports.

Usage::

    results = run_on_hosts(fn, num_hosts=2, ranks_per_host=1, *args)   # fn(rank, world, *args)

or, to act on the hosts while ranks run (kill a host, cut its link)::

    with Hosts(2) as hosts:
        job = hosts.start(fn, ranks_per_host=1)
        ...; hosts.kill_host(1)
        results = job.wait(expect_exit={1})

Rank ``r`` runs on host ``r // ranks_per_host`` in a gloo group over the veth addresses
(``GLOO_SOCKET_IFNAME=eth0``; the TCP store lives on host 0); ``MOE_COMM_NETNS_HOST`` and
``MOE_COMM_NETNS_ADDR`` tell it its host index and address, and each host has its own host
name (``mcns-host<h>``, a private UTS namespace), so locality checks by host name see
different machines. The filesystem (/dev/shm included) stays shared. Two ways to start a
rank:

- ``mode="fork"`` (default): fork this process, then ``setns`` the child into the host's
  namespace. Fast (no interpreter start, torch already imported), and exactly what
  ``ip netns exec`` does for networking.
- ``mode="exec"``: ``ip netns exec <ns> python -m moe_comm.testing.netns`` -- a fresh interpreter,
  nothing inherited; ``fn`` must be importable by reference (a module-level function).

Needs root and iproute2. Names carry the creating pid (``mcns<pid>x<tag>...``); namespaces
of a run whose process is gone (killed test) are deleted by the next :class:`Hosts`.
Every run has a deadline: ranks still alive after it are killed and the run fails.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from ..shm.segment import pid_alive

PREFIX = "mcns"
IFNAME = "eth0"
SUBNET = "10.77.0"
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
STORE_PORT = 29400
# For NIXL's UCX backend across the hosts: TCP on the veth link only. Left to itself UCX sees
# the other namespaces as this machine (same host id) and writes through shared memory,
# around the network under test, and its TCP would spread over every interface.
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": IFNAME}


class RankFailure(AssertionError):
    pass


def _ip(*args, check=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


def available() -> str | None:
    """None if namespaces can be made here, else the reason they cannot."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    name = f"{PREFIX}{os.getpid()}xprobe"
    try:
        _ip("netns", "add", name)
    except RuntimeError as e:
        return str(e)
    _ip("netns", "del", name, check=False)
    return None


def _pids_in(ns: str) -> list:
    out = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_ns_processes(ns: str) -> None:
    for _ in range(50):
        pids = [p for p in _pids_in(ns) if p != os.getpid()]
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _creator(name: str):
    try:
        return int(name[len(PREFIX):].split("x", 1)[0])
    except ValueError:
        return None


def reclaim_stale_namespaces() -> list:
    """Delete namespaces (and temporary folders) left by runs whose creating process no
    longer exists -- a test killed before its cleanup ran."""
    tmp = tempfile.gettempdir()
    for entry in os.listdir(tmp):
        pid = _creator(entry) if entry.startswith(PREFIX) else None
        if pid is not None and not pid_alive(pid):
            shutil.rmtree(os.path.join(tmp, entry), ignore_errors=True)
    removed = []
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        pid = _creator(name) if name.startswith(PREFIX) else None
        if pid is not None and not pid_alive(pid):
            _kill_ns_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


_libc = None


def _setns(ns: str) -> None:
    """Move the calling (single-threaded, freshly forked) process into ``ns``'s network."""
    global _libc
    if hasattr(os, "setns"):                      # Python >= 3.12
        fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
        try:
            os.setns(fd, CLONE_NEWNET)
        finally:
            os.close(fd)
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _own_hostname(name: str) -> None:
    """Give the calling (single-threaded) process a UTS namespace and host name of its own,
    so code that tells machines apart by ``socket.gethostname()`` sees different hosts."""
    global _libc
    if hasattr(os, "unshare"):                    # Python >= 3.12
        os.unshare(CLONE_NEWUTS)
    else:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        if _libc.unshare(CLONE_NEWUTS) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWUTS): {os.strerror(err)}")
    socket.sethostname(name)


def hostname(host: int) -> str:
    return f"{PREFIX}-host{host}"


class Hosts:
    """``num_hosts`` network namespaces on one virtual switch (a context manager)."""

    def __init__(self, num_hosts: int = 2):
        if num_hosts < 1:
            raise ValueError(f"num_hosts must be >= 1, got {num_hosts}")
        self.num_hosts = num_hosts
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.switch = f"{self.tag}sw"
        self.names = [f"{self.tag}h{h}" for h in range(num_hosts)]
        self._created = []
        self._port = STORE_PORT
        self.tmpdir = None
        self.jobs = []

    # -- lifetime ------------------------------------------------------------------------
    def __enter__(self):
        reclaim_stale_namespaces()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _create(self):
        self.tmpdir = tempfile.mkdtemp(prefix=f"{self.tag}.")
        for ns in [self.switch, *self.names]:
            _ip("netns", "add", ns)
            self._created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for h, ns in enumerate(self.names):
            port = f"p{h}"
            # Both ends are created inside namespaces: no name is ever used in the caller's.
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name",
                IFNAME, "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(h)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")

    def close(self):
        for job in self.jobs:                    # reap ranks a failed test left running
            for p in job.procs.values():
                p.stop(0.0)
        self.jobs = []
        for ns in reversed(self._created):
            _kill_ns_processes(ns)
            _ip("netns", "del", ns, check=False)
        self._created = []
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    # -- hosts -----------------------------------------------------------------------------
    def addr(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def kill_host(self, host: int) -> None:
        """SIGKILL every process in the host's namespace (a machine that died)."""
        _kill_ns_processes(self.names[host])

    def set_link(self, host: int, up: bool) -> None:
        """Cut (or restore) the host's network: its peers see silence, not a reset."""
        _ip("-n", self.names[host], "link", "set", IFNAME, "up" if up else "down")

    def exec_argv(self, host: int, argv: list) -> list:
        return ["ip", "netns", "exec", self.names[host], *argv]

    # -- ranks -----------------------------------------------------------------------------
    def start(self, fn, ranks_per_host: int = 1, *args, mode: str = "fork",
              timeout: float = 120.0, env: dict | None = None) -> "Job":
        if mode not in ("fork", "exec"):
            raise ValueError(f"mode must be 'fork' or 'exec', got {mode!r}")
        self._port += 1                 # a fresh store port per job (TIME_WAIT of the last)
        job = Job(self, fn, ranks_per_host, args, mode, timeout, env or {}, self._port)
        self.jobs.append(job)
        return job

    def run(self, fn, ranks_per_host: int = 1, *args, mode: str = "fork",
            timeout: float = 120.0, expect_exit=(), expect_exit_ranks=(),
            env: dict | None = None) -> list:
        return self.start(fn, ranks_per_host, *args, mode=mode, timeout=timeout,
                          env=env).wait(expect_exit=expect_exit,
                                        expect_exit_ranks=expect_exit_ranks)


class Job:
    """Ranks of one ``fn`` running on the hosts. Results come back through files in the
    hosts' temporary folder (the namespaces share the filesystem, not the network)."""

    def __init__(self, hosts, fn, rph, args, mode, timeout, env, port):
        self.hosts, self.rph = hosts, rph
        self.world = hosts.num_hosts * rph
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.dir = tempfile.mkdtemp(dir=hosts.tmpdir, prefix="job.")
        self.procs = {}
        spec = dict(fn=fn, args=args, world=self.world, master=hosts.addr(0), port=port,
                    env={"GLOO_SOCKET_IFNAME": IFNAME, **env})
        for rank in range(self.world):
            host = rank // rph
            spec_r = dict(spec, rank=rank, host=host, ns=hosts.names[host],
                          addr=hosts.addr(host), out=os.path.join(self.dir, f"rank{rank}.pkl"))
            if mode == "fork":
                self.procs[rank] = _ForkedRank(spec_r)
            else:
                self.procs[rank] = _ExecRank(hosts, spec_r, self.dir)

    def host_of(self, rank: int) -> int:
        return rank // self.rph

    def wait(self, expect_exit=(), expect_exit_ranks=()) -> list:
        """Per-rank results. ``expect_exit``: hosts whose ranks may die without a result;
        ``expect_exit_ranks``: single ranks that may (their host's others must finish).
        The first failing rank ends the run at once (its peers would only wait for it)."""
        expected = {r for r in range(self.world) if self.host_of(r) not in set(expect_exit)
                    and r not in set(expect_exit_ranks)}
        results, errors, gone = {}, {}, set()
        while time.monotonic() < self.deadline:
            for r, p in self.procs.items():
                if r in gone or p.alive():
                    continue
                gone.add(r)
                if os.path.exists(p.out):
                    with open(p.out, "rb") as f:
                        ok, val = pickle.load(f)
                    (results if ok else errors)[r] = val
                elif r in expected:
                    errors[r] = f"exited without a result (crashed?){p.log_tail()}"
            if errors or expected <= set(results):
                break
            time.sleep(0.01)
        for p in self.procs.values():
            p.stop(0.0)
        if errors:
            r = min(errors)
            # (the other failures and the rank's own log, where its warnings went: a proxy
            # that cut a peer off, say; the logs go with the hosts' folder)
            others = "".join(f"\n(rank {o} too: {str(errors[o]).partition(chr(10))[0]})"
                             for o in sorted(errors) if o != r)
            raise RankFailure(f"rank {r} failed:\n{errors[r]}{others}{self.procs[r].log_tail()}")
        missing = expected - set(results)
        if missing:
            logs = "".join(self.procs[r].log_tail() for r in sorted(missing))
            raise RankFailure(f"ranks {sorted(missing)} did not finish within {self.timeout} s "
                              f"(hang or crash){logs}")
        return [results.get(r) for r in range(self.world)]


def _rank_main(spec) -> None:
    """Body of a rank (already inside its namespace): gloo group, fn, result file, exit."""
    ok, val = False, "did not run"
    try:
        os.environ.update(spec["env"])
        os.environ["MOE_COMM_NETNS_HOST"] = str(spec["host"])     # which host, its address
        os.environ["MOE_COMM_NETNS_ADDR"] = spec["addr"]
        _own_hostname(hostname(spec["host"]))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}:{spec['port']}",
                                rank=spec["rank"], world_size=spec["world"])
        try:
            ok, val = True, spec["fn"](spec["rank"], spec["world"], *spec["args"])
        finally:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        ok, val = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    try:
        blob = pickle.dumps((ok, val))
    except Exception as e:  # noqa: BLE001
        blob = pickle.dumps((False, f"result of rank {spec['rank']} not picklable: {e}"))
    tmp = spec["out"] + ".tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
    os.rename(tmp, spec["out"])       # atomic: the parent never reads half a result


class _ForkedRank:
    def __init__(self, spec):
        self.out = spec["out"]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:                                   # child
            code = 0
            try:
                _setns(spec["ns"])
                _rank_main(spec)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = 1
            os._exit(code)
        self.pid = pid
        self.status = None

    def alive(self) -> bool:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.status = status
        return self.status is None

    def stop(self, grace: float) -> None:
        end = time.monotonic() + grace
        while self.alive() and time.monotonic() < end:
            time.sleep(0.01)
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.status = -9

    def log_tail(self) -> str:
        return ""


class _ExecRank:
    def __init__(self, hosts, spec, dirname):
        self.out = spec["out"]
        path = os.path.join(dirname, f"spec{spec['rank']}.pkl")
        with open(path, "wb") as f:
            pickle.dump(spec, f)
        self.log = os.path.join(dirname, f"rank{spec['rank']}.log")
        env = dict(os.environ)
        # The child must import fn's module by reference, as this process does.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                hosts.exec_argv(spec["host"],
                                [sys.executable, "-m", "moe_comm.testing.netns", path]),
                stdout=log, stderr=subprocess.STDOUT, env=env)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float) -> None:
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "\n--- " + self.log + " ---\n" + f.read()[-4000:]
        except OSError:
            return ""


def link_tx_bytes() -> int:
    """Bytes the calling process's host (its network namespace) has sent on its link, from
    the interface's own counter (/proc/net/dev shows the reader's namespace)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == IFNAME:
                return int(rest.split()[8])          # transmit bytes: the 9th number
    raise RuntimeError(f"no {IFNAME} in /proc/net/dev: not in a namespace of Hosts")


def run_on_hosts(fn, num_hosts: int, ranks_per_host: int, *args, mode: str = "fork",
                 timeout: float = 120.0, env: dict | None = None) -> list:
    """Run ``fn(rank, world, *args)`` on ``num_hosts`` namespaces x ``ranks_per_host`` ranks;
    returns the results by rank (like :func:`moe_comm.testing.processes.run_ranks`)."""
    with Hosts(num_hosts) as hosts:
        return hosts.run(fn, ranks_per_host, *args, mode=mode, timeout=timeout, env=env)


if __name__ == "__main__":                  # mode="exec": python -m moe_comm.testing.netns <spec>
    with open(sys.argv[1], "rb") as f:
        _rank_main(pickle.load(f))
