"""Mutual HMAC challenge-response on a fresh TCP connection.

Only processes of the same job know the per-job secret (it travels over the job's own
process group, never over these sockets). Each side sends a random nonce and proves
knowledge of the secret by a MAC over both nonces and the claimed ranks, so

- a process without the secret cannot connect (the server refuses and logs it),
- a recorded handshake cannot be replayed (the server's nonce is new each time),
- a process squatting on a listener address cannot receive data (the client checks the
  server's proof before sending any command).

Messages (``MAGIC`` guards against a stray protocol talking to the port):
  server -> client: MAGIC | server_nonce[16]
  client -> server: MAGIC | src_rank i32 | dst_rank i32 | client_nonce[16] | mac_c[32]
  server -> client: mac_s[32]        (only when mac_c verified)
with ``mac_c = HMAC-SHA256(secret, "client" | server_nonce | client_nonce | ranks)`` and
``mac_s`` the same with ``"server"``. Each side gives the whole handshake one deadline (not a
timeout per read), so neither a silent peer nor one that dribbles a byte at a time can hold a
handshake - and the listener's slot for it - past that deadline.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

MAGIC = b"MOECOMM1"
NONCE = 16
MAC = 32
_RANKS = struct.Struct("<ii")
CLIENT_HELLO = len(MAGIC) + _RANKS.size + NONCE + MAC


class AuthError(Exception):
    """The peer failed the handshake (wrong secret, wrong protocol, wrong rank)."""


def _mac(secret: bytes, role: bytes, n1: bytes, n2: bytes, ranks: bytes) -> bytes:
    return hmac.new(secret, role + n1 + n2 + ranks, hashlib.sha256).digest()


def _bound(sock: socket.socket, deadline: float, got: int, n: int) -> None:
    """Give the socket's next call what is left until ``deadline`` (time.monotonic)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise AuthError(f"handshake not done by its deadline ({got} of {n} bytes in)")
    sock.settimeout(left)


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        _bound(sock, deadline, got, n)
        try:
            k = sock.recv_into(view[got:])
        except socket.timeout:
            raise AuthError(f"handshake not done by its deadline ({got} of {n} bytes in)") \
                from None
        if k == 0:
            raise AuthError(f"connection closed after {got} of {n} handshake bytes")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    _bound(sock, deadline, 0, len(data))
    try:
        sock.sendall(data)                 # the timeout bounds the whole call
    except socket.timeout:
        raise AuthError("handshake not done by its deadline (peer not reading)") from None


def client_handshake(sock: socket.socket, secret: bytes, src_rank: int, dst_rank: int,
                     deadline: float) -> None:
    """Run on the connecting side; raises :class:`AuthError` if the server is not genuine or
    the handshake is not done by ``deadline`` (time.monotonic)."""
    hello = recv_exact(sock, len(MAGIC) + NONCE, deadline)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthError("peer does not speak the moe_comm transport protocol")
    server_nonce = hello[len(MAGIC):]
    client_nonce = os.urandom(NONCE)
    ranks = _RANKS.pack(src_rank, dst_rank)
    _send(sock, MAGIC + ranks + client_nonce +
          _mac(secret, b"client", server_nonce, client_nonce, ranks), deadline)
    proof = recv_exact(sock, MAC, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"server", client_nonce, server_nonce, ranks)):
        raise AuthError(f"listener of rank {dst_rank} failed to prove the job secret")


def server_handshake(sock: socket.socket, secret: bytes, my_rank: int, allowed,
                     deadline: float) -> int:
    """Run on the accepting side; returns the authenticated source rank or raises
    :class:`AuthError` (the caller logs and closes), also when the handshake is not done by
    ``deadline`` (time.monotonic)."""
    server_nonce = os.urandom(NONCE)
    _send(sock, MAGIC + server_nonce, deadline)
    hello = recv_exact(sock, CLIENT_HELLO, deadline)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthError("bad magic (not a moe_comm transport client)")
    at = len(MAGIC)
    ranks = hello[at:at + _RANKS.size]
    src, dst = _RANKS.unpack(ranks)
    client_nonce = hello[at + _RANKS.size:at + _RANKS.size + NONCE]
    mac = hello[at + _RANKS.size + NONCE:]
    # Verify the MAC before trusting any claimed field.
    if not hmac.compare_digest(mac, _mac(secret, b"client", server_nonce, client_nonce, ranks)):
        raise AuthError(f"bad MAC (claimed rank {src}): secret unknown to the peer")
    if dst != my_rank:
        raise AuthError(f"connection meant for rank {dst}, this is rank {my_rank}")
    if src not in allowed:
        raise AuthError(f"rank {src} is not a peer of rank {my_rank}")
    _send(sock, _mac(secret, b"server", client_nonce, server_nonce, ranks), deadline)
    return src
