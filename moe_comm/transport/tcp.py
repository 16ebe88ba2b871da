"""TCP engine of the host proxy: one authenticated stream per (sender, receiver) pair.

Each rank listens on one port (``addr.py`` picks the interface) and connects once to every
remote rank, so rank A's commands to B travel on A's outbound stream, in order: a put is
always applied before a later signal to the same rank because TCP delivers in order and one
receiver thread applies the stream in order (``receiver.py``).

Sending: the proxy thread hands a batch of commands per destination to :meth:`send`, which
writes headers and payloads with gather ``sendmsg`` calls of about 256 KiB (no copy of the
payload in Python; many small commands share one call). The socket timeout bounds every call: no progress for ``timeout_s`` means the peer
is dead or unreachable, the engine raises :class:`PeerLost` and the proxy drops that peer.

Receiving: an acceptor thread hands each new connection to its own thread, which runs the
handshake (``auth.py``; at most ``MAX_UNAUTHENTICATED`` at a time, each with one deadline), then
applies frames until the stream ends. All threads are daemons; :meth:`close` shuts the
sockets down (which wakes every blocked call) and joins with a timeout.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

from ..errors import CommTimeoutError
from .auth import AuthError, client_handshake, server_handshake
from .commands import FRAME, FRAME_BYTES, OP_PUT
from .receiver import Refused, Region, serve_connection

log = logging.getLogger("moe_comm.transport")

MAX_UNAUTHENTICATED = 64
HANDSHAKE_S = 10.0              # at most this long for a connection's whole handshake
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
CALL_BYTES = int(os.environ.get("MOE_COMM_TCP_CALL_BYTES", 256 << 10))


class PeerLost(Exception):
    """A send to ``rank`` failed; ``closed``: the peer said it was closing its transport
    (an orderly teardown, not a fault)."""

    def __init__(self, rank: int, why: str, closed: bool = False):
        self.rank = rank
        self.closed = closed
        super().__init__(f"rank {rank}: {why}")


def listen(host: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    s.listen(128)
    return s


def sendv(sock: socket.socket, bufs: list, call_bytes: int | None = None) -> None:
    """Send every buffer of ``bufs`` (memoryviews), in order, handling partial sends.
    Each ``sendmsg`` carries at most about ``call_bytes`` (default 256 KiB,
    ``MOE_COMM_TCP_CALL_BYTES``): over veth, 128-256 KiB writes ran 1.2-1.5x faster than
    writes of 4 MiB or more (bench/hosts.py), which one big gather-write of a batch would be."""
    call_bytes = call_bytes or CALL_BYTES
    pieces = []
    for b in bufs:                          # split large payloads (views, no copy)
        if len(b) <= call_bytes:
            pieces.append(b)
        else:
            pieces.extend(b[o:o + call_bytes] for o in range(0, len(b), call_bytes))
    i = 0
    while i < len(pieces):
        j, size = i, 0
        while j < len(pieces) and j - i < IOV_MAX and size < call_bytes:
            size += len(pieces[j])
            j += 1
        n = sock.sendmsg(pieces[i:j])
        while n:
            k = len(pieces[i])
            if n >= k:
                n -= k
                i += 1
            else:
                pieces[i] = pieces[i][n:]
                n = 0


def frames(cmds: list) -> list:
    """Header + payload buffers for ``cmds``; adjacent headers share one buffer entry."""
    hdr = bytearray(FRAME_BYTES * len(cmds))
    hv = memoryview(hdr)
    bufs, run = [], 0                   # run: start of the headers not yet in bufs
    for i, (op, _dst, offset, nbytes, value, _addr, ref) in enumerate(cmds):
        at = i * FRAME_BYTES
        if op == OP_PUT:
            FRAME.pack_into(hdr, at, op, 0, offset, nbytes)
            bufs.append(hv[run:at + FRAME_BYTES])
            bufs.append(ref)
            run = at + FRAME_BYTES
        else:
            FRAME.pack_into(hdr, at, op, 0, offset, value)
    if run < len(hdr):
        bufs.append(hv[run:])
    return bufs


class TcpEngine:
    kind = "tcp"

    def __init__(self, rank: int, region: Region, remote_ranks, secret: bytes,
                 timeout_s: float, listener: socket.socket):
        self.rank = rank
        self.region = region
        self.remote = set(remote_ranks)
        self.secret = secret
        self.timeout_s = timeout_s
        self.listener = listener
        self.address = listener.getsockname()
        self.out = {}                       # dst -> socket
        self.inbound = {}                   # src -> live authenticated connections
        self.heard = set()                  # srcs that ever authenticated (start() waits)
        self.conns = set()                  # every accepted socket, for close()
        self.cond = threading.Condition()
        self.unauthenticated = 0
        self.refused = 0
        self.closing = False
        self.threads = []

    # -- setup ---------------------------------------------------------------------------
    def start(self, peers: dict, deadline: float) -> None:
        """Accept peers' connections, connect to every peer (``rank -> (host, port)``), and
        return once both directions to every remote rank are authenticated."""
        self._thread(self._accept_loop, "moe_comm-accept")
        for dst in sorted(self.remote):
            self.out[dst] = self._connect(dst, peers[dst], deadline)
        with self.cond:
            # `heard`, not the live `inbound`: a fast peer may finish its own start, and even
            # close again (a Buffer destroyed at once), before this rank gets here
            while self.remote - self.heard:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError("transport/connect", self.remote - self.heard,
                                           self.timeout_s)
                self.cond.wait(min(left, 0.05))

    def _connect(self, dst: int, where, deadline: float) -> socket.socket:
        while True:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                attempt = time.monotonic() + max(0.05, min(10.0, deadline - time.monotonic()))
                s.settimeout(attempt - time.monotonic())
                s.connect(tuple(where))
                client_handshake(s, self.secret, self.rank, dst, attempt)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(self.timeout_s)    # bounds every later send: no progress = lost
                return s
            except AuthError as e:
                s.close()
                raise RuntimeError(f"rank {self.rank} could not authenticate with rank {dst} "
                                   f"at {where}: {e} (different `secret` on the ranks?)")
            except OSError:
                s.close()
                if time.monotonic() >= deadline:
                    raise CommTimeoutError("transport/connect", [dst], self.timeout_s)
                time.sleep(0.02)

    def _thread(self, target, name, *args):
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def _accept_loop(self):
        while not self.closing:
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return                          # listener shut down by close()
            with self.cond:
                if self.closing or self.unauthenticated >= MAX_UNAUTHENTICATED:
                    log.warning("rank %d: refused connection from %s: too many pending "
                                "handshakes", self.rank, peer)
                    sock.close()
                    continue
                self.unauthenticated += 1
                self.conns.add(sock)
            self._thread(self._serve, f"moe_comm-recv-{peer}", sock, peer)

    def _serve(self, sock: socket.socket, peer) -> None:
        src = None
        try:
            # one deadline for the whole handshake: a silent or dribbling client cannot hold
            # one of the MAX_UNAUTHENTICATED slots past it
            until = time.monotonic() + min(self.timeout_s, HANDSHAKE_S)
            try:
                src = server_handshake(sock, self.secret, self.rank, self.remote, until)
            except (AuthError, OSError) as e:
                self._count_refusal()
                log.warning("rank %d: refused connection from %s: %s", self.rank, peer, e)
                return
            finally:
                with self.cond:
                    self.unauthenticated -= 1
            sock.settimeout(None)              # idle peers are normal; close() wakes us
            with self.cond:
                self.inbound[src] = self.inbound.get(src, 0) + 1
                self.heard.add(src)
                self.cond.notify_all()
            try:
                why = serve_connection(sock, self.region)
                if not self.closing:            # the peer closed (teardown) or died
                    (log.info if why == "closed" else log.warning)(
                        "rank %d: stream from rank %d %s", self.rank, src, why)
            except Refused as e:
                self._count_refusal()
                log.error("rank %d: refused data from rank %d (%s): %s; connection dropped",
                          self.rank, src, peer, e)
            except OSError as e:
                if not self.closing:
                    log.warning("rank %d: stream from rank %d failed: %s", self.rank, src, e)
        finally:
            with self.cond:
                self.conns.discard(sock)
                if src is not None and src in self.inbound:
                    self.inbound[src] -= 1
                    if not self.inbound[src]:
                        del self.inbound[src]
            sock.close()

    def _count_refusal(self) -> None:
        with self.cond:
            self.refused += 1

    # -- data ------------------------------------------------------------------------------
    def send(self, dst: int, cmds: list) -> None:
        try:
            sendv(self.out[dst], frames(cmds))
        except OSError as e:                    # includes socket.timeout: no progress
            raise PeerLost(dst, f"send failed ({e or type(e).__name__})") from None

    def quiet(self, dst: int, deadline: float) -> bool:
        return True                             # sendmsg returning = handed to the kernel

    def progress(self) -> None:
        pass                                    # nothing completes asynchronously

    def drop(self, dst: int) -> None:
        s = self.out.pop(dst, None)
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def abort_sends(self) -> None:
        """Wake a proxy thread blocked in ``sendmsg`` (its send fails at once)."""
        for s in list(self.out.values()):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self, join_s: float = 2.0) -> None:
        """Called once the proxy threads stopped. Receiver threads close their own
        sockets after ``shutdown`` wakes them."""
        self.closing = True
        for s in self.out.values():             # clean end of stream for the peers
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            s.close()
        self.out = {}
        try:
            self.listener.shutdown(socket.SHUT_RDWR)   # wakes accept()
        except OSError:
            pass
        with self.cond:
            conns = list(self.conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)     # wakes recv() in the receiver threads
            except OSError:
                pass
        end = time.monotonic() + join_s
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        self.listener.close()                   # after the acceptor left accept()
