"""A CUDA group's IBGDA path: whether to take it, and its buffers in the NVSHMEM symmetric heap.

How a CUDA group reaches a rank (``moe_comm.cuda.groups.from_group``'s ``transport``, else the
``MOE_COMM_TRANSPORT`` environment variable; decided the same on every rank):

- one host, ``auto``/``tcp``/``verbs``: CUDA IPC mappings, plain stores (no transport at all);
- ``ibgda``, or ``auto`` when the group spans hosts and every rank can do IBGDA (a GPU,
  nvshmem4py, NVSHMEM's headers and device library, nvcc, a ConnectX RDMA NIC): NVSHMEM over
  the group. (Whether the NIC can reach GPU memory, nvidia_peermem or dma-buf, is not probed:
  where it cannot, set ``MOE_COMM_TRANSPORT=verbs`` or ``tcp``.) Peers NVSHMEM maps
  (NVLink/P2P) are stores; the others are network ranks, put to by the GPU itself from
  mirrors in the symmetric heap (csrc/kernels/transport.cuh). Asked for explicitly it needs no NIC (NVSHMEM then serves what it can by P2P), and a rank that cannot
  do it makes every rank raise rather than run slower than asked;
- otherwise across hosts: the host proxy over ``tcp``/``verbs`` (moe_comm/cuda/kernel_proxy.py).

The choice and its reason are logged once per process (logger ``moe_comm``).

:class:`NvshmemBuffers` holds the symmetric buffers of one ``CudaComm`` and loads the IBGDA
builds of its kernels; :class:`EmulatedNvshmemBuffers` is the same on the CPU kernel emulator
(csrc/emu/nvshmem_emu.h), where every peer is made a network rank so the IBGDA build of the
mode kernels runs against the reference in CI.
"""
from __future__ import annotations

import logging
from pathlib import Path
import threading

import torch
import torch.distributed as dist

from ..jit import emulator
from ..jit.nvcc import kernel_program
from ..jit.toolchain import NvshmemNotFoundError, nvcc_path, nvshmem_install
from ..logs import info_once
from .bases import encode_bases
from .runtime import (active_context, cuda_device_count, init_nvshmem, nvshmem4py_available,
                      rdma_devices)

log = logging.getLogger("moe_comm")

IPC, IBGDA, PROXY = "ipc", "ibgda", "proxy"


def probe() -> dict:
    """What this rank can do: ``{"software": why-not or "", "nic": bool}``. Needs no GPU and
    never initialises NVSHMEM."""
    why = ""
    if cuda_device_count() == 0:
        why = "no CUDA GPU"
    elif not nvshmem4py_available():
        why = "nvshmem4py is not installed"
    else:
        try:
            nvshmem_install()
            nvcc_path()                 # the IBGDA kernels are built with nvcc -rdc
        except NvshmemNotFoundError as e:
            why = str(e)
    return {"software": why, "nic": any(_is_connectx(d) for d in rdma_devices())}


def _is_connectx(name: str) -> bool:
    """IBGDA drives the NIC's queues from the GPU, which NVSHMEM does for NVIDIA (Mellanox)
    ConnectX NICs: PCI vendor 0x15b3."""
    try:
        vendor = (Path("/sys/class/infiniband") / name / "device" / "vendor").read_text()
    except OSError:
        return name.startswith("mlx5")
    return vendor.strip().lower() == "0x15b3"


def choose(kind: str, spans_hosts: bool, probes: list) -> tuple:
    """``(path, why)`` with path ``"ipc"``, ``"ibgda"`` or ``"proxy"``, from the requested
    ``kind`` (moe_comm.transport.requested_kind with ``cuda=True``), whether the group spans
    hosts, and every rank's :func:`probe` (rank order). Pure: every rank computes the same
    answer."""
    if kind == "ibgda":
        lacking = [(r, p["software"]) for r, p in enumerate(probes) if p["software"]]
        if lacking:
            raise RuntimeError(f"transport 'ibgda' was requested but rank {lacking[0][0]} "
                               f"cannot use it: {lacking[0][1]}")
        return IBGDA, "requested"
    if not spans_hosts:
        return IPC, "one host"
    if kind == "auto":
        for r, p in enumerate(probes):
            if p["software"] or not p["nic"]:
                return PROXY, f"no IBGDA on rank {r}: {p['software'] or 'no ConnectX NIC'}"
        return IBGDA, "every rank has a GPU, NVSHMEM and a ConnectX NIC"
    return PROXY, f"{kind} requested"


def log_once(path: str, why: str) -> None:
    info_once(log, ("cuda group path", path), "moe_comm CUDA group transport: %s (%s)", path,
              why)


class NvshmemBuffers:
    """A CudaComm's buffer and network mirrors in the NVSHMEM symmetric heap (one process per
    rank, PE = group rank), and the IBGDA builds of its kernels.

    ``pointers`` are the kernels' ``bases[0..R)``, ``sym`` their ``bases[-1]``. Unless the
    caller initialised NVSHMEM (``moe_comm.ibgda.init_nvshmem``), the first comm does and the
    last comm using it finalizes it (``ctx.comm_users`` counts them)."""

    def __init__(self, group, device, nbytes: int):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        ctx = active_context()
        # every rank decides from the same facts, so a refusal is raised on all of them (a
        # rank raising alone would leave the others in a collective)
        mine = "none" if ctx is None else \
            "ok" if (ctx.rank, ctx.world_size) == (rank, world) else "other group"
        states = [None] * world
        dist.all_gather_object(states, mine, group=group)
        if len(set(states)) != 1 or states[0] == "other group":
            raise RuntimeError(f"NVSHMEM state differs across the group ({states}): one EP "
                               "group per process can use IBGDA, and every rank of it the same")
        if ctx is None:                    # started here: the last comm finalizes it (one
            ctx = init_nvshmem(group, device)  # the caller started stays the caller's)
            ctx.comm_started = True
        self.ctx = ctx
        self.ctx.comm_users = getattr(ctx, "comm_users", 0) + 1
        try:
            self.buffers = self.ctx.comm_buffers(nbytes)
        except BaseException:
            self._release_context()
            raise
        self.pointers, self.sym = self.buffers.words, self.buffers.sym
        self._kernels = {}

    def kernels(self, variant) -> dict:
        hit = self._kernels.get(variant)      # every call asks: no build key on that path
        if hit is None:
            hit = self._kernels[variant] = self.ctx.load(kernel_program(variant))
        return hit

    def close(self, collective: bool) -> None:
        """Free the symmetric buffers, and NVSHMEM with the last comm using it. Freeing is
        collective in NVSHMEM: after a failure (``collective`` False: a peer may be dead)
        everything is left to process exit instead of hanging in a free."""
        if not collective:
            return
        if self.buffers.mirrors is not None:
            self.ctx.free(self.buffers.mirrors)
        self.ctx.free(self.buffers.own)
        self._release_context()

    def _release_context(self) -> None:
        self.ctx.comm_users -= 1
        if self.ctx.comm_users == 0 and getattr(self.ctx, "comm_started", False):
            self.ctx.finalize()


class EmulatedNvshmemBuffers:
    """The IBGDA path of a ``local_group`` on the CPU kernel emulator: the ranks are split into
    ``hosts`` contiguous blocks; a peer on the same "host" is a pointer (as NVSHMEM's P2P
    mapping would be), a peer on another one a network rank. Every rank gets its buffer plus a
    mirror slot per peer, and the buffers are one symmetric heap of the emulated NVSHMEM
    (csrc/emu/nvshmem_emu.h)."""

    def __init__(self, num_ranks: int, nbytes: int, hosts: int):
        if not 1 <= hosts <= num_ranks:
            raise ValueError(f"hosts must be in 1..{num_ranks}, got {hosts}")
        self.num_ranks, self.nbytes = num_ranks, nbytes
        self.host_of = [r * hosts // num_ranks for r in range(num_ranks)]   # balanced blocks
        # one tensor per rank: [own | mirror of each other rank, in rank order]
        self.tensors = [torch.zeros(num_ranks * nbytes, dtype=torch.uint8)
                        for _ in range(num_ranks)]
        self.own = [t.data_ptr() for t in self.tensors]
        self.users, self._lock = num_ranks, threading.Lock()
        emulator.register_symmetric(self.own, nbytes, num_ranks * nbytes)

    def pointers(self, rank: int) -> list:
        """Rank ``rank``'s ``bases[0..R)``: its own buffer, same-host peers' buffers, mirrors
        for the others."""
        others = [r for r in range(self.num_ranks) if r != rank]
        same = [self.own[r] if self.host_of[r] == self.host_of[rank] and r != rank else 0
                for r in range(self.num_ranks)]
        mirrors = {r: self.own[rank] + (1 + i) * self.nbytes for i, r in enumerate(others)
                   if not same[r]}
        return encode_bases(rank, self.own[rank], same, mirrors)

    @staticmethod
    def kernels(variant) -> dict:
        return emulator.load_kernels(variant, nvshmem=True)

    def release(self) -> None:
        """One rank is done; the last one takes the heap out of the emulated NVSHMEM."""
        with self._lock:
            self.users -= 1
            last = self.users == 0
        if last:
            emulator.unregister_symmetric(self.own[0])

