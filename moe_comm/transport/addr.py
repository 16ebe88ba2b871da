"""Which local address to listen on: the one that reaches the peers, not 0.0.0.0.

Listening on every interface would expose the port on networks the job does not use. The
address is chosen, first match wins:

1. the ``bind_addr`` argument;
2. ``MOE_COMM_BIND_ADDR``;
3. the IPv4 address of the interface named by ``GLOO_SOCKET_IFNAME`` (the first of a comma
   list): the job already told gloo which network reaches its peers;
4. the source address the kernel would use to reach the torch.distributed store's host (a
   UDP ``connect`` only consults the routing table, it sends nothing);
5. the address the host name resolves to.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct

import torch.distributed as dist

_SIOCGIFADDR = 0x8915


def interface_address(ifname: str) -> str:
    """IPv4 address of ``ifname`` (raises OSError if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("256s", ifname.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])


def route_address(peer_host: str) -> str:
    """Local source address of the route to ``peer_host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(peer_host), 9))
        return s.getsockname()[0]


def store_host(store=None):
    """Host of the TCP store under ``store`` (default: the default group's), or None."""
    if store is None:
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no default group: fall through to other sources
            return None
    for _ in range(16):                      # PrefixStore wraps PrefixStore wraps TCPStore
        if hasattr(store, "host"):
            return store.host
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


def local_address(bind_addr: str | None = None, store=None) -> str:
    if bind_addr:
        return bind_addr
    if os.environ.get("MOE_COMM_BIND_ADDR"):
        return os.environ["MOE_COMM_BIND_ADDR"]
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        try:
            return interface_address(ifname)
        except OSError:
            pass
    host = store_host(store)
    if host:
        try:
            return route_address(host)
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())
