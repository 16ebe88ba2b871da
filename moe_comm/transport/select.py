"""Open a transport: pick the engine, exchange addresses and the job secret, connect.

Choice of engine (the same on every rank, decided from what all ranks report):

- ``kind`` argument ``"tcp"``, ``"verbs"`` or ``"nixl"`` wins; ``"auto"`` (default) defers to
  the ``MOE_COMM_TRANSPORT`` environment variable (``auto``/``tcp``/``verbs``/``nixl``;
  ``ibgda`` there is for CUDA groups, moe_comm/ibgda/path.py, and means ``auto`` here);
- ``auto`` (:func:`choose`): NIXL when every rank has it installed and an RDMA device for
  one of its backends (UCX verbs, LIBFABRIC EFA); else verbs when every rank has an RDMA
  device with an active port and pyverbs imports; else TCP. A rank that asked for ``verbs``
  or ``nixl`` makes every rank raise if some rank cannot do it (rather than silently running
  slower than asked). (IBGDA comes before all of these, for CUDA groups: ibgda/path.py.)

The chosen engine and why is logged once per process (logger ``moe_comm.transport``).

Exchange: one ``all_gather_object`` over ``group`` carries each rank's listener address,
region size, remote list and device capability, plus a secret candidate; rank 0's candidate
becomes the job secret unless ``secret`` is given. The group's own channel is the trust root:
whoever is in the process group is in the job. Verbs needs a second gather (queue-pair
numbers, rkeys), then a barrier so no rank posts before every peer's QP is ready; NIXL a
second gather of the agents' metadata, then a hello notice each way.
"""
from __future__ import annotations

import logging
import os
import secrets as _secrets
import time

import torch.distributed as dist

from ..logs import info_once
from . import nixl as nixl_mod
from .addr import local_address
from .nixl import NixlEngine
from .proxy import ProxyTransport
from .receiver import Region
from .tcp import TcpEngine, listen
from .verbs import VerbsEngine, probe

log = logging.getLogger("moe_comm.transport")

PROXY_KINDS = ("auto", "tcp", "verbs", "nixl")     # what the host proxy runs
KINDS = PROXY_KINDS + ("ibgda",)             # what a Buffer takes (ibgda: CUDA groups)
ENV = "MOE_COMM_TRANSPORT"


def requested_kind(kind: str = "auto", cuda: bool = False) -> str:
    """The kind asked for: ``kind``, or for ``"auto"`` ``$MOE_COMM_TRANSPORT``. ``"ibgda"`` is
    a CUDA group's choice (moe_comm/ibgda/path.py): with ``cuda`` False an explicit one
    raises, and one from the environment means ``"auto"`` (host code has only its proxy)."""
    if kind not in KINDS:
        raise ValueError(f"transport kind must be one of {KINDS}, got {kind!r}")
    if kind == "ibgda" and not cuda:
        raise ValueError("transport 'ibgda' is for CUDA tensors (GPU-initiated RDMA); the "
                         f"host proxy runs one of {PROXY_KINDS}")
    if kind != "auto":
        return kind
    env = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if env not in KINDS:
        raise ValueError(f"{ENV} must be one of {KINDS}, got {env!r}")
    return "auto" if env == "ibgda" and not cuda else env


def choose(want: str, infos: list) -> tuple:
    """``(engine, why)`` from the requested kind and every rank's probes (``infos[r]`` has
    ``want``, ``nixl``/``nixl_why``, ``verbs``/``why``). Pure: every rank computes the same
    answer; raises where a rank asked for an engine some rank lacks."""
    for name, ok, why in (("nixl", "nixl", "nixl_why"), ("verbs", "verbs", "why")):
        lacking = [r for r, i in enumerate(infos) if not i[ok]]
        if any(i["want"] == name for i in infos):
            if lacking:
                raise RuntimeError(f"transport '{name}' was requested but ranks {lacking} "
                                   f"cannot use it: {infos[lacking[0]][why]}")
            return name, "requested"
    if any(i["want"] == "tcp" for i in infos):
        return "tcp", "requested"
    reasons = []
    for name, ok, why in (("nixl", "nixl", "nixl_why"), ("verbs", "verbs", "why")):
        lacking = [r for r, i in enumerate(infos) if not i[ok]]
        if not lacking:
            return name, f"{infos[0][why]} on every rank"
        reasons.append(f"no {name}: rank {lacking[0]}: {infos[lacking[0]][why]}")
    return "tcp", "; ".join(reasons)


def _check_remote(remote_ranks, rank: int, world: int) -> list:
    try:
        remote = [int(r) for r in remote_ranks]
    except (TypeError, ValueError):
        raise TypeError("remote_ranks must be a list of group ranks") from None
    if len(set(remote)) != len(remote) or rank in remote or \
            any(not 0 <= r < world for r in remote):
        raise ValueError(f"remote_ranks must be distinct ranks in [0, {world}) other than "
                         f"this rank {rank}, got {remote_ranks}")
    return remote


def open_transport(group, region, remote_ranks, *, kind: str = "auto",
                   timeout_s: float = 120.0, secret: bytes | None = None,
                   bind_addr: str | None = None, channels: int | None = None,
                   channel_groups=None, depth: int = 1024,
                   device=None) -> ProxyTransport:
    """Collective over ``group``: every rank calls it. See the package docstring.
    ``device``: where the caller's kernels run (the CUDA backend passes it; the NIXL engine
    says once which memory it registers for them)."""

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    reg = Region(region)
    remote = _check_remote(remote_ranks, rank, world)
    if secret is not None and (not isinstance(secret, (bytes, bytearray)) or len(secret) < 16):
        raise ValueError("secret must be bytes, at least 16 of them")
    want = requested_kind(kind)
    verbs_ok, verbs_why = False, "not requested"
    if want in ("auto", "verbs"):
        verbs_ok, verbs_why = probe()
    nixl_ok, nixl_why = False, "not requested"
    if want in ("auto", "nixl"):
        nixl_ok, nixl_why = nixl_mod.probe(need_rdma=want == "auto")
    listener = None if want in ("verbs", "nixl") else listen(local_address(bind_addr))
    try:
        info = dict(want=want, verbs=verbs_ok, why=verbs_why, nixl=nixl_ok, nixl_why=nixl_why,
                    remote=sorted(remote), tcp=listener.getsockname() if listener else None,
                    size=reg.size, nonce=_secrets.token_hex(6),
                    secret=None if secret is not None else _secrets.token_bytes(32))
        infos = [None] * world
        dist.all_gather_object(infos, info, group=group)
        for a, ia in enumerate(infos):                 # every rank checks the same matrix
            for b in ia["remote"]:
                if a not in infos[b]["remote"]:
                    raise ValueError(f"remote_ranks must be symmetric: rank {a} lists rank "
                                     f"{b} but rank {b} does not list rank {a}")
        chosen, why = choose(want, infos)
        job_secret = bytes(secret) if secret is not None else infos[0]["secret"]
        sizes = {r: infos[r]["size"] for r in remote}
        deadline = time.monotonic() + timeout_s
        if chosen == "tcp":
            engine = TcpEngine(rank, reg, remote, job_secret, timeout_s, listener)
            listener = None                              # the engine owns it now
            try:
                engine.start({r: infos[r]["tcp"] for r in remote}, deadline)
            except BaseException:
                engine.close()
                raise
        elif chosen == "nixl":
            engine = NixlEngine(rank, reg, remote, job_secret, timeout_s,
                                f"moe_comm-{infos[0]['nonce']}-r{rank}",
                                nixl_mod.backend_for(nixl_mod.rdma_devices()), device)
            try:
                all_info = [None] * world
                dist.all_gather_object(all_info, engine.local_info(), group=group)
                engine.connect({r: all_info[r] for r in remote}, deadline)
            except BaseException:
                engine.close()
                raise
        else:
            engine = VerbsEngine(rank, reg, remote, timeout_s)
            try:
                local = engine.local_info()
                all_info = [None] * world
                dist.all_gather_object(all_info, local, group=group)
                engine.connect({r: all_info[r] for r in remote})
                dist.barrier(group=group)
            except BaseException:
                engine.close()
                raise
    finally:
        if listener is not None:
            listener.close()
    info_once(log, ("transport", chosen), "moe_comm host proxy transport: %s (%s)", chosen,
              why)
    if channels is None:
        channels = min(4, max(1, len(remote)))
    t = ProxyTransport(engine, rank, remote, sizes, timeout_s, channels=channels, depth=depth,
                       channel_groups=channel_groups)
    t.address = getattr(engine, "address", None)
    return t
