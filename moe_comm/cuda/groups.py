"""Building a CUDA group: each rank's buffer, how it reaches every peer, one ``CudaComm`` each.

Every rank owns one allocation ``[header | data region | low-latency region]`` (laid out by
moe_comm/wire.py), zeroed before any peer can write it. How peers are reached decides where
it lives (moe_comm/ibgda/path.py makes the choice, the same on every rank):

* :func:`from_group`, one process per rank (the real deployment), over a torch.distributed
  group: one host - device memory mapped by every peer through CUDA IPC handles exchanged
  with ``all_gather_object``; hosts with IBGDA - the NVSHMEM symmetric heap
  (:func:`_over_nvshmem`); otherwise across hosts - /dev/shm segments the ranks of a host map,
  registered with the driver, and a mirror plus the host proxy for every rank elsewhere
  (:func:`_in_host_memory`; also the emulator's path for ``device="cpu"``).
* :func:`local_group`, all ranks in one process, each driven by its own thread and CUDA stream
  (tests and the single-GPU benchmark: moe_comm/testing/local_cuda.py): the same kernels,
  pointers shared directly. Kernels of different streams run concurrently on one GPU, whereas
  kernels of different processes on one GPU time-slice (no MPS), which makes spinning peers
  slow. With ``device="cpu"`` the buffers are host memory and the kernels run in the CPU
  kernel emulator (moe_comm/jit/emulator.py).
"""
from __future__ import annotations

import secrets

import torch
import torch.distributed as dist

from . import memory
from ..ibgda import path as ibgda
from ..jit.variants import check_num_ranks
from ..shm.identity import host_identity, ranks_by_host
from ..shm.segment import Segment, reclaim_stale_segments, segment_name
from ..transport import open_transport
from ..transport.select import requested_kind
from ..wire import PAGE, HeaderLayout, round_up
from .comm import CudaComm
from .kernel_proxy import KernelProxy

IPC_HANDLE_BYTES = 64


def buffer_bytes(num_ranks: int, heap_bytes: int, ll_bytes: int) -> int:
    """One rank's allocation: header, data region, low-latency region."""
    return HeaderLayout(num_ranks).nbytes + round_up(heap_bytes, PAGE) + round_up(ll_bytes,
                                                                                 PAGE)


def host_index(identities) -> list:
    """Each rank's host as an index (hosts numbered in the order of their first rank)."""
    hosts = list(dict.fromkeys(identities))
    return [hosts.index(h) for h in identities]


def _check_sizes(infos, index: int) -> None:
    sizes = [i[index] for i in infos]
    if len(set(sizes)) != 1:
        raise ValueError("num_nvl_bytes/num_rdma_bytes must be equal on every rank; "
                         f"buffer sizes differ: {sizes}")


def from_group(group, heap_bytes: int, ll_bytes: int, timeout_s: float, device=None,
               elastic: bool = False, transport: str = "auto") -> CudaComm:
    """Collective over ``group`` (one process per rank): this rank's CudaComm, on ``device``
    (default: torch's current device). All ranks must pass the same sizes. ``transport``
    (``auto``/``tcp``/``verbs``/``nixl``/``ibgda``) overrides how other hosts are reached:
    moe_comm/ibgda/path.py."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else \
        torch.device(device)
    group = group if group is not None else dist.group.WORLD
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    check_num_ranks(num_ranks)     # before anything is allocated or connected
    heap_bytes, ll_bytes = round_up(heap_bytes, PAGE), round_up(ll_bytes, PAGE)
    sizes = dict(heap_bytes=heap_bytes, ll_bytes=ll_bytes, timeout_s=timeout_s,
                 elastic=elastic, device=device)
    total = buffer_bytes(num_ranks, heap_bytes, ll_bytes)
    kind = requested_kind(transport, cuda=True)
    engine = kind if kind in ("tcp", "verbs", "nixl") else "auto"   # the proxy's, if it runs
    if device.type == "cpu":
        if kind == "ibgda":
            raise ValueError("transport='ibgda' needs CUDA devices (the emulator runs the "
                             "IBGDA kernels only in local_group(network_hosts=...))")
        return _in_host_memory(group, rank, num_ranks, total, engine, **sizes)
    infos = [None] * num_ranks
    dist.all_gather_object(infos, (host_identity(), ibgda.probe()), group=group)
    path, why = ibgda.choose(kind, len({h for h, _ in infos}) > 1, [p for _, p in infos])
    ibgda.log_once(path, why)
    memory.set_current(device)
    if path == ibgda.PROXY:
        return _in_host_memory(group, rank, num_ranks, total, engine, **sizes)
    if path == ibgda.IBGDA:
        return _over_nvshmem(group, rank, num_ranks, total,
                             host_of=host_index([h for h, _ in infos]), **sizes)
    return _over_ipc(group, rank, num_ranks, total, **sizes)


def _over_ipc(group, rank, num_ranks, total, *, device, **sizes) -> CudaComm:
    """One host: device memory, every peer's mapped through its CUDA IPC handle."""
    ptr = memory.alloc_zeroed(total)
    infos = [None] * num_ranks
    dist.all_gather_object(infos, (host_identity(), total,
                                   memory.ipc_handle(ptr, IPC_HANDLE_BYTES)), group=group)
    opened = []
    try:
        _check_sizes(infos, 1)
        pointers = []
        for r, (_, _, blob) in enumerate(infos):
            if r == rank:
                pointers.append(ptr)
                continue
            peer = memory.ipc_open(blob, f"cuIpcOpenMemHandle(rank {r})")
            opened.append(peer)
            pointers.append(peer)
    except BaseException:
        for p in opened:
            memory.ipc_close(p)
        memory.free(ptr)
        raise
    comm = CudaComm(rank=rank, num_ranks=num_ranks, device=device, pointers=pointers,
                    own_allocation=True, opened=opened, group=group, **sizes)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)      # every buffer zeroed and mapped before any signal
    return comm


def _over_nvshmem(group, rank, num_ranks, total, *, device, host_of, **sizes) -> CudaComm:
    """The buffer and the network ranks' mirrors in the NVSHMEM symmetric heap
    (moe_comm/ibgda/path.py): peers NVSHMEM maps are stores, the others are put to by the GPU
    (IBGDA), and the kernels are the nvcc builds linked against NVSHMEM."""
    bufs = ibgda.NvshmemBuffers(group, device, total)
    comm, error = None, None
    try:
        comm = CudaComm(rank=rank, num_ranks=num_ranks, device=device, pointers=bufs.pointers,
                        own_allocation=False, opened=[], group=group, nvshmem=bufs,
                        host_of=host_of, **sizes)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    failed = [None] * num_ranks       # all ranks free together, or none waits in a free
    dist.all_gather_object(failed, error is not None, group=group)
    if any(failed):
        bufs.close(collective=True)
        if error is not None:
            raise error
        raise RuntimeError(f"CudaComm over NVSHMEM failed on rank(s) "
                           f"{[r for r, f in enumerate(failed) if f]}")
    return comm                      # the gather was the barrier: every buffer zeroed


def _in_host_memory(group, rank, num_ranks, total, transport, *, device, timeout_s,
                    **sizes) -> CudaComm:
    """Buffers in host memory: /dev/shm segments (moe_comm/shm/segment.py) that the processes
    of one host map into each other, and a mirror plus the host proxy
    (moe_comm/cuda/kernel_proxy.py) for every rank on another host. The kernel emulator's path
    (device ``cpu``), and a GPU's when the group spans hosts without IBGDA (segments
    registered with the driver, so kernels reach them over PCIe)."""
    reclaim_stale_segments()
    own = Segment.create(segment_name(f"cu{secrets.token_hex(6)}", rank), total)
    me = host_identity()
    infos = [None] * num_ranks
    dist.all_gather_object(infos, (me, total, own.name), group=group)
    remote = [r for r, info in enumerate(infos) if info[0] != me]
    segments, registered, link, proxy = [own], [], None, None
    try:
        try:
            _check_sizes(infos, 1)
            segments = [own if r == rank else None if r in remote else Segment.open(name)
                        for r, (_, _, name) in enumerate(infos)]
        finally:
            dist.barrier(group=group)   # everybody mapped: names can go
            own.unlink()
        pointers = [0 if seg is None else seg.bytes.ctypes.data for seg in segments]
        if device.type == "cuda":
            pointers = [0 if p == 0 else memory.register_host(p, total, registered)
                        for p in pointers]
        if remote:
            link = open_transport(group, own.bytes, remote, kind=transport, timeout_s=timeout_s,
                                  channel_groups=ranks_by_host([i[0] for i in infos], remote),
                                  device=device)
            mirrors = {r: torch.zeros(total, dtype=torch.uint8,
                                      pin_memory=device.type == "cuda") for r in remote}
            proxy = KernelProxy(link, mirrors, device, timeout_s)
            for r in remote:
                pointers[r] = proxy.mirror_word(r)
        comm = CudaComm(rank=rank, num_ranks=num_ranks, device=device, pointers=pointers,
                        timeout_s=timeout_s, own_allocation=False, opened=[], group=group,
                        host_buffers=segments, proxy=proxy, registered=registered,
                        host_of=host_index([i[0] for i in infos]), **sizes)
    except BaseException:
        if proxy is not None:
            proxy.close()
        if link is not None:
            link.close()
        memory.unregister_host(registered)
        for seg in set(segments):
            if seg is not None:
                seg.close()
        raise
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=group)
    return comm


def local_group(num_ranks: int, heap_bytes: int, ll_bytes: int, timeout_s: float,
                device=None, elastic: bool = False, network_hosts: int = 0) -> list:
    """All ``num_ranks`` ranks in this process on one device; returns their comms. Drive
    rank r from its own thread with its own current stream (moe_comm/testing/local_cuda.py).
    ``network_hosts`` (emulator only): split the ranks into that many emulated hosts whose
    ranks reach each other as network ranks of the IBGDA build, on the emulated NVSHMEM
    (moe_comm/ibgda/path.py EmulatedNvshmemBuffers); 0: no network."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else \
        torch.device(device)
    heap_bytes, ll_bytes = round_up(heap_bytes, PAGE), round_up(ll_bytes, PAGE)
    sizes = dict(heap_bytes=heap_bytes, ll_bytes=ll_bytes, timeout_s=timeout_s,
                 elastic=elastic, device=device, num_ranks=num_ranks, opened=[])
    total = buffer_bytes(num_ranks, heap_bytes, ll_bytes)
    if network_hosts:
        if device.type != "cpu":
            raise ValueError("local_group(network_hosts=...) runs on the kernel emulator "
                             "only (NVSHMEM has one PE per process; on a GPU use "
                             "from_group with transport='ibgda')")
        sym = ibgda.EmulatedNvshmemBuffers(num_ranks, total, network_hosts)
        return [CudaComm(rank=r, pointers=sym.pointers(r), own_allocation=False,
                         host_buffers=sym.tensors, nvshmem=sym, host_of=sym.host_of, **sizes)
                for r in range(num_ranks)]
    host_buffers = None
    if device.type == "cpu":        # emulator: plain host memory (64-byte aligned)
        host_buffers = [torch.zeros(total, dtype=torch.uint8) for _ in range(num_ranks)]
        pointers = [b.data_ptr() for b in host_buffers]
    else:
        memory.set_current(device)
        pointers = [memory.alloc_zeroed(total) for _ in range(num_ranks)]
    comms = [CudaComm(rank=r, pointers=pointers, own_allocation=host_buffers is None,
                      host_buffers=host_buffers, **sizes) for r in range(num_ranks)]
    if device.type == "cuda":
        # bases/err_dev/counters were filled on the default stream; the ranks' kernels run
        # on non-blocking streams that would not wait for it
        torch.cuda.synchronize(device)
    return comms
