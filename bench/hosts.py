"""Inter-host bandwidth on one machine: raw TCP vs the host proxy's engines, same run.

Two network namespaces joined by veth (``moe_comm.testing.netns``), one rank in each. Rank 0 sends
``total`` bytes to rank 1 once per engine per round:

- raw: a plain socket stream, ``sendall`` of put-sized writes capped at the proxy's write
  size (256 KiB: larger writes are slower over veth), the receiver ``recv_into`` its buffer
  as much as arrives, and answers one byte when all arrived;
- tcp / nixl: ``t.put`` of the same chunks into rank 1's registered region through the TCP
  engine, or the NIXL engine over UCX's TCP transport on the same veth link
  (``netns.UCX_ENV``), then ``t.signal``; rank 1 waits for the signal word (acquire) and
  signals back.

All time from the sender's start to the answer, so all include one round trip. The best of
``repeat`` rounds is kept for each (the order rotates by round). Target: proxy >= 70% of raw.
The NIXL engine is measured where NIXL is installed (``--engines tcp`` leaves it out).

    python bench/hosts.py [--total-mb 256] [--put-kb 1024] [--repeat 4] [--engines tcp,nixl]
                          [--json]

Needs root (network namespaces). Ratios are what matter; absolute numbers depend on the
machine (veth copies through the kernel, both ranks share its cores).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_comm.deps import nixl as nixl_dep  # noqa: E402
from moe_comm.shm import atomics  # noqa: E402
from moe_comm.testing.netns import UCX_ENV, Hosts, available  # noqa: E402
from moe_comm.transport import open_transport  # noqa: E402
from moe_comm.transport.tcp import CALL_BYTES  # noqa: E402
from moe_comm.wire import tag  # noqa: E402

WINDOW = 64 << 20          # receive buffer / region size; puts wrap around it


def _raw_round(rank, sock, total, put, src, buf):
    # The best plain stream we found: writes of at most CALL_BYTES (the proxy's own write
    # size; larger writes are slower here), reads of whatever arrived.
    chunk = min(put, CALL_BYTES)
    t0 = time.perf_counter()
    if rank == 0:
        view = memoryview(src)
        for off in range(0, total, chunk):
            at = off % WINDOW
            sock.sendall(view[at:at + min(chunk, total - off)])
        sock.recv(1)
    else:
        view, got = memoryview(buf), 0
        while got < total:
            at = got % WINDOW
            n = sock.recv_into(view[at:at + min(total - got, WINDOW - at)])
            if n == 0:
                raise RuntimeError("raw stream closed early")
            got += n
        sock.sendall(b"k")
    return time.perf_counter() - t0


def _proxy_round(rank, t, region, total, put, src, epoch, timeout):
    word = region[:8].view(np.int64)
    t0 = time.perf_counter()
    if rank == 0:
        for off in range(0, total, put):
            at = off % (WINDOW - 64)
            t.put(1, 64 + at, src[at:at + min(put, total - off)])
        t.signal(1, 0, tag(epoch, 1))
    atomics.wait_words({1 - rank: word}, epoch, time.monotonic() + timeout, "bench", timeout)
    if rank == 1:
        t.signal(0, 0, tag(epoch, 1))
    return time.perf_counter() - t0


def _bench_rank(rank, world, total, put, repeat, timeout, engines):
    import torch.distributed as dist
    src = np.random.default_rng(0).integers(0, 256, WINDOW, dtype=np.uint8)
    regions = {e: np.zeros(WINDOW + 64, dtype=np.uint8) for e in engines}
    # raw stream: rank 1 listens on its veth address
    if rank == 1:
        lst = socket.socket()
        lst.bind((os.environ.get("MOE_COMM_NETNS_ADDR"), 0))
        lst.listen(1)
        where = [lst.getsockname()]
    else:
        where = [None]
    dist.broadcast_object_list(where, src=1)
    if rank == 0:
        sock = socket.create_connection(tuple(where[0]))
    else:
        sock, _ = lst.accept()
        lst.close()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ts = {e: open_transport(None, regions[e], [1 - rank], kind=e, timeout_s=timeout)
          for e in engines}
    times = {w: [] for w in ("raw", *engines)}
    order = list(times)
    for r in range(repeat):
        for which in order[r % len(order):] + order[:r % len(order)]:   # rotate the order
            dist.barrier()
            if which == "raw":
                times[which].append(_raw_round(rank, sock, total, put, src,
                                               regions[engines[0]]))
            else:
                times[which].append(_proxy_round(rank, ts[which], regions[which], total, put,
                                                 src, r + 1, timeout))
    dist.barrier()
    for t in ts.values():
        t.close()
    sock.close()
    return times


def default_engines() -> tuple:
    return ("tcp", "nixl") if nixl_dep.installed() else ("tcp",)


def measure(total_mb: int = 256, put_kb: int = 1024, repeat: int = 4,
            timeout: float = 60.0, engines=None) -> dict:
    """Raw TCP and the engines' put bandwidth between two namespaces: GB/s (1e9 B/s) as
    ``raw_tcp_GBps`` and ``proxy_<engine>_GBps``, and each engine's ratio to raw
    (``ratio`` for tcp, ``<engine>_ratio`` for the others)."""
    engines = tuple(engines or default_engines())
    total, put = total_mb << 20, put_kb << 10
    with Hosts(2) as hosts:
        res = hosts.run(_bench_rank, 1, total, put, repeat, timeout, engines,
                        timeout=timeout * 4, env=UCX_ENV)
    raw = total / min(res[0]["raw"]) / 1e9
    out = {"total_bytes": total, "put_bytes": put, "repeat": repeat,
           "raw_tcp_GBps": round(raw, 3)}
    for e in engines:
        gbps = total / min(res[0][e]) / 1e9
        out[f"proxy_{e}_GBps"] = round(gbps, 3)
        out["ratio" if e == "tcp" else f"{e}_ratio"] = round(gbps / raw, 3)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total-mb", type=int, default=256)
    ap.add_argument("--put-kb", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--engines", default=",".join(default_engines()),
                    help="engines to measure beside raw TCP (default: tcp, and nixl where "
                         "installed)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    why = available()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    r = measure(args.total_mb, args.put_kb, args.repeat, engines=engines)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"2 namespaces over veth, {args.total_mb} MiB in {args.put_kb} KiB puts, "
              f"best of {args.repeat}")
        print(f"  raw TCP stream          {r['raw_tcp_GBps']:7.3f} GB/s   "
              f"({min(args.put_kb << 10, CALL_BYTES) >> 10} KiB writes)")
        for e in engines:
            ratio = r["ratio" if e == "tcp" else f"{e}_ratio"]
            print(f"  proxy put, {e + ' engine':12s} {r[f'proxy_{e}_GBps']:7.3f} GB/s   "
                  f"({100 * ratio:.0f}% of raw; target >= 70%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
