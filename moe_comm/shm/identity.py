"""Which ranks share a host: the same identity means the same /dev/shm."""
from __future__ import annotations

import os
import socket


def host_identity() -> str:
    """Ranks with the same identity share /dev/shm and map each other's segments: the host
    name plus the network namespace (ranks in different namespaces talk over the network,
    even on one machine, as on separate hosts)."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{netns}"


def ranks_by_host(identities, ranks) -> list:
    """``ranks`` grouped by the host identity of each (``identities[r]``), hosts in the order
    of their first rank: the transport gives each remote host a channel of its own."""
    groups: dict = {}
    for r in ranks:
        groups.setdefault(identities[r], []).append(r)
    return list(groups.values())
