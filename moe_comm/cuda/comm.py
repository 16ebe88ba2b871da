"""``CudaComm``: one rank's view of the CUDA communication buffers of a group.

Every rank owns one device allocation ``[header | data region | low-latency region]`` laid out
by moe_comm/wire.py (``HeaderLayout`` for the signal slots, a normal-mode data region of
``heap_bytes``, an ``LLLayout`` region of ``ll_bytes``), zeroed at creation. Each rank maps
every peer's allocation into its address space (CUDA IPC, ``cuIpcOpenMemHandle``) and hands
the kernels a device array ``bases[R]`` of those addresses, so a kernel writes a peer's buffer
with plain stores (NVLink/PCIe peer access). A group spanning hosts keeps its buffers in host
memory instead (/dev/shm segments mapped by the ranks of a host, registered with the driver)
and reaches the other hosts' ranks through mirrors and the host proxy (moe_comm/cuda/kernel_proxy.py).

Two ways to build a group:

* :meth:`CudaComm.from_group` - one process per rank (the real deployment): allocations are
  exchanged as IPC handles over the torch.distributed group (``all_gather_object``).
* :meth:`CudaComm.local_group` - all ranks in one process, each driven by its own thread and
  CUDA stream (tests and the single-GPU benchmark): the same kernels, pointers shared
  directly. Kernels of different streams run concurrently on one GPU, whereas kernels of
  different processes on one GPU time-slice (no MPS), which makes spinning peers slow.
  With ``device="cpu"`` the buffers are host memory and the kernels run in the CPU kernel
  emulator (moe_comm/jit/emulator.py): the whole CUDA backend, checked without a GPU.

Errors: kernels never trap. A wait that passes its deadline writes the silent rank into an
error word in pinned host memory; :meth:`CudaComm.check` (called at the start of every
operation and after every host synchronisation) raises ``moe_comm.CommTimeoutError`` naming the
silent ranks. The first error a rank's kernels report stops its later kernels (they skip their
work) and is what it raises; its signals to peers then carry a failure mark, so a peer raises
``CudaCommError`` naming it at once rather than at its deadline. After an error the group is
out of step: destroy it.

Rank masking: ``active`` (int32 [R] on the device, 1 = taking part) once a rank can be masked
(``elastic=True``, or after :meth:`CudaComm.mask`). Kernels send nothing to and await nothing
from a rank at 0. Elastic, a wait past its deadline masks the rank instead of reporting it,
and moe_comm/cuda/elastic.py makes the survivors agree on the mask.
"""
from __future__ import annotations

import ctypes
import logging
import socket

import numpy as np
import torch

from .. import signature
from ..errors import CommTimeoutError, RankMaskedError
from ..wire import (CALL_WORDS, LINE_WORDS, LL_CALL_FIELDS, MAX_EPOCH, NORMAL_CALL_FIELDS, PAGE,
                    VALUE_MASK, HeaderLayout, round_up)
from ..ibgda import path as ibgda
from ..jit.variants import MAX_RANKS

log = logging.getLogger("moe_comm")

IPC_HANDLE_BYTES = 64
ERROR_HEADER = 4                 # csrc/kernels/sync.cuh: kErrorHeader
MAX_ERROR_RANKS = 64             # ... kMaxErrorRanks
ERR_TIMEOUT, ERR_OVERFLOW, ERR_NO_TRANSPORT, ERR_MASKED, ERR_PROXY, ERR_PEER_FAILED = \
    1, 2, 3, 4, 5, 6
ERR_MISMATCH = 7

# Phase ids passed to kernels (the `op` argument) and the names errors report.
OPS = ("", "dispatch/notify", "dispatch/send", "dispatch/payload", "combine/notify",
       "combine/send", "combine/payload", "low_latency_dispatch/send",
       "low_latency_dispatch/recv", "low_latency_combine/send", "low_latency_combine/recv")
OP = {name: i for i, name in enumerate(OPS)}

# Block counters (csrc/kernels/sync.cuh last_block_arrives), one per kernel that uses one, so
# kernels that may run on different streams (LL send vs. a later receive hook) never share.
SIGNAL_STRIDE = LINE_WORDS * 8   # bytes between one-per-rank signal slots (one line each)

COUNTER = {"dispatch_send": 0, "combine_send": 1, "ll_dispatch_recv": 2, "ll_combine_send": 3,
           "ll_combine_recv": 4}


class CudaCommError(RuntimeError):
    """A device-side failure other than a timeout (receive overflow, missing transport)."""


def _cu(result, what: str):
    """Unwrap a cuda.bindings ``(CUresult, *values)`` tuple."""
    from cuda.bindings import driver as cu
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    return result[1] if len(result) == 2 else result[1:]


def _set_current(device: torch.device) -> None:
    if device.type == "cpu":            # the kernel emulator: no context
        return
    from ..jit.nvrtc import cuda_core
    cuda_core().Device(device.index).set_current()


def _register_host(ptr: int, nbytes: int, registered: list) -> int:
    """Make host memory at ``ptr`` reachable by kernels (page-locked, mapped); returns its
    device address (the same under UVA). Appends ``ptr`` to ``registered``."""
    from cuda.bindings import driver as cu
    portable, devicemap = 0x01, 0x02          # CU_MEMHOSTREGISTER_PORTABLE / _DEVICEMAP
    _cu(cu.cuMemHostRegister(ptr, nbytes, portable | devicemap), "cuMemHostRegister")
    registered.append(ptr)
    return int(_cu(cu.cuMemHostGetDevicePointer(ptr, 0), "cuMemHostGetDevicePointer"))


def _unregister_host(registered: list) -> None:
    if registered:
        from cuda.bindings import driver as cu
        for ptr in registered:
            cu.cuMemHostUnregister(ptr)
        registered.clear()


def bases_tensor(first_word: int, pointers, device) -> torch.Tensor:
    """The kernels' ``bases`` (csrc/kernels/transport.cuh): an int64 device tensor viewed from
    word 1, so that ``bases[-1]`` is ``first_word``; u64 words stored two's complement."""
    words = [int(w) for w in [first_word] + list(pointers)]
    words = [w - (1 << 64) if w >= 1 << 63 else w for w in words]
    return torch.tensor(words, dtype=torch.int64, device=device)[1:]


def _barrier(group) -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier(group=group)


def _alloc_zeroed(nbytes: int) -> int:
    from cuda.bindings import driver as cu
    ptr = int(_cu(cu.cuMemAlloc(nbytes), "cuMemAlloc"))
    _cu(cu.cuMemsetD8(ptr, 0, nbytes), "cuMemsetD8")
    _cu(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    return ptr


class CudaComm:
    """One rank of a CUDA group. Use :meth:`from_group` or :meth:`local_group`.

    Attributes the mode modules use: ``rank``, ``num_ranks``, ``device``, ``layout``
    (HeaderLayout), ``heap_offset``/``heap_bytes`` (data region), ``ll_offset``/``ll_bytes``,
    ``bases`` (int64 [R] device tensor of buffer addresses), ``timeout_ns``, ``ll_seq``,
    ``active`` (the kernels' mask argument: None, or int32 [R] on the device), ``elastic``.
    """

    def __init__(self, *, rank: int, num_ranks: int, device: torch.device, pointers: list,
                 heap_bytes: int, ll_bytes: int, timeout_s: float, own_allocation: bool,
                 opened: list, group=None, host_buffers=None, elastic: bool = False,
                 proxy=None, nvshmem=None):
        if not 1 <= num_ranks <= MAX_RANKS:
            raise ValueError(f"the CUDA backend maps groups of 1..{MAX_RANKS} ranks, got "
                             f"{num_ranks}")
        self.rank, self.num_ranks, self.group = rank, num_ranks, group
        self.device = torch.device(device)
        self.layout = HeaderLayout(num_ranks)
        self.heap_offset = self.layout.nbytes
        self.heap_bytes = heap_bytes
        self.ll_offset = self.heap_offset + heap_bytes
        self.ll_bytes = ll_bytes
        self.timeout_s = float(timeout_s)
        self.timeout_ns = int(timeout_s * 1e9)
        self.pointers = list(pointers)
        # the kernels' bases[R] (csrc/kernels/transport.cuh): a view from word 1, word 0
        # (bases[-1]) being what network ranks need: the host proxy's command ring, or this
        # rank's own symmetric buffer for IBGDA (moe_comm/ibgda/path.py), else 0
        self.proxy, self.nvshmem = proxy, nvshmem
        first = proxy.address if proxy is not None else \
            self.pointers[rank] if nvshmem is not None else 0
        self.bases = bases_tensor(first, self.pointers, device)
        self._registered = []
        # pinned: the kernels write it through its UVA address, the host reads it any time
        # (a CPU "device" only serves argument checks in CI: nothing runs there)
        self.err_host = torch.zeros(ERROR_HEADER + MAX_ERROR_RANKS, dtype=torch.int32,
                                    pin_memory=self.device.type == "cuda")
        self._err = self.err_host.numpy()
        self.err_dev = torch.zeros(4, dtype=torch.int32, device=device)
        self.counters = torch.zeros(8, dtype=torch.int32, device=device)
        # rank mask (csrc/kernels/transport.cuh Active): None until a rank can be masked, so
        # a plain group's kernels skip every check; else words 1.. of int32 [1 + R], word 0
        # telling the kernels whether a missed deadline masks (elastic) or is reported
        self.elastic = bool(elastic)
        self.active = None
        self.told = None                 # elastic: the ranks the last agreement kept
        self.masked_out = False          # this rank was masked by a mask the host knows
        self.agree_seq = 0
        if self.elastic:
            self._enable_masking()
        self.epoch = 0
        self.notify_seq = 0
        self.last_call = ("normal", 0)    # whose signatures a mismatch error reads (check)
        self.ll_seq = {"dispatch": 0, "combine": 0}
        self._own_allocation = own_allocation
        self._opened = opened                       # peer pointers from cuIpcOpenMemHandle
        self._host_buffers = host_buffers           # emulator: the tensors behind `pointers`
        self._alive = True

    # -- construction ------------------------------------------------------------------------
    @staticmethod
    def buffer_bytes(num_ranks: int, heap_bytes: int, ll_bytes: int) -> int:
        return HeaderLayout(num_ranks).nbytes + round_up(heap_bytes, PAGE) + round_up(ll_bytes,
                                                                                     PAGE)

    @classmethod
    def from_group(cls, group, heap_bytes: int, ll_bytes: int, timeout_s: float,
                   device=None, elastic: bool = False, transport: str = "auto") -> "CudaComm":
        """Collective over ``group`` (one process per rank): allocate this rank's buffer on
        ``device`` (default: torch's current device), exchange CUDA IPC handles, map every
        peer. All ranks must pass the same sizes. A group spanning hosts takes IBGDA where
        every rank can (:meth:`_from_group_nvshmem`), else the host proxy
        (:meth:`_from_group_shared`); ``transport`` (``auto``/``tcp``/``verbs``/``ibgda``)
        overrides the choice: moe_comm/ibgda/path.py."""
        import torch.distributed as dist
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else \
            torch.device(device)
        group = group if group is not None else dist.group.WORLD
        rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
        if not 1 <= num_ranks <= MAX_RANKS:     # before anything is allocated or connected
            raise ValueError(f"the CUDA backend runs groups of 1..{MAX_RANKS} ranks, got "
                             f"{num_ranks}")
        heap_bytes, ll_bytes = round_up(heap_bytes, PAGE), round_up(ll_bytes, PAGE)
        total = cls.buffer_bytes(num_ranks, heap_bytes, ll_bytes)
        from ..transport.select import requested_kind
        kind = requested_kind(transport, cuda=True)
        engine = kind if kind in ("tcp", "verbs") else "auto"     # the proxy's, if it runs
        if device.type == "cpu":
            if kind == "ibgda":
                raise ValueError("transport='ibgda' needs CUDA devices (the emulator runs the "
                                 "IBGDA kernels only in CudaComm.local_group(network_hosts=...))")
            return cls._from_group_shared(group, rank, num_ranks, heap_bytes, ll_bytes, total,
                                          timeout_s, elastic, device, engine)
        from ..shm.identity import host_identity
        infos = [None] * num_ranks
        dist.all_gather_object(infos, (host_identity(), ibgda.probe()), group=group)
        path, why = ibgda.choose(kind, len({h for h, _ in infos}) > 1, [p for _, p in infos])
        ibgda.log_once(path, why)
        _set_current(device)
        if path == ibgda.PROXY:
            return cls._from_group_shared(group, rank, num_ranks, heap_bytes, ll_bytes, total,
                                          timeout_s, elastic, device, engine)
        if path == ibgda.IBGDA:
            return cls._from_group_nvshmem(group, rank, num_ranks, heap_bytes, ll_bytes, total,
                                           timeout_s, elastic, device)
        from cuda.bindings import driver as cu
        ptr = _alloc_zeroed(total)
        handle = _cu(cu.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
        blob = ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)
        infos = [None] * num_ranks
        dist.all_gather_object(infos, (socket.gethostname(), total, blob), group=group)
        opened = []
        try:
            if len({i[1] for i in infos}) != 1:
                raise ValueError("num_nvl_bytes/num_rdma_bytes must be equal on every rank; "
                                 f"buffer sizes differ: {[i[1] for i in infos]}")
            pointers = []
            for r, (_, _, peer_blob) in enumerate(infos):
                if r == rank:
                    pointers.append(ptr)
                    continue
                h = cu.CUipcMemHandle()
                ctypes.memmove(h.getPtr(), peer_blob, IPC_HANDLE_BYTES)
                peer = int(_cu(cu.cuIpcOpenMemHandle(
                    h, cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                    f"cuIpcOpenMemHandle(rank {r})"))
                opened.append(peer)
                pointers.append(peer)
        except BaseException:
            for p in opened:
                cu.cuIpcCloseMemHandle(p)
            cu.cuMemFree(ptr)
            raise
        comm = cls(rank=rank, num_ranks=num_ranks, device=device, pointers=pointers,
                   heap_bytes=heap_bytes, ll_bytes=ll_bytes, timeout_s=timeout_s,
                   own_allocation=True, opened=opened, group=group, elastic=elastic)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)      # every buffer zeroed and mapped before any signal
        return comm

    @classmethod
    def _from_group_nvshmem(cls, group, rank, num_ranks, heap_bytes, ll_bytes, total,
                            timeout_s, elastic, device) -> "CudaComm":
        """from_group with the buffer and the network ranks' mirrors in the NVSHMEM symmetric
        heap (moe_comm/ibgda/path.py): peers NVSHMEM maps are stores, the others are put to by
        the GPU (IBGDA), and the kernels are the nvcc builds linked against NVSHMEM."""
        import torch.distributed as dist
        bufs = ibgda.NvshmemBuffers(group, device, total)
        comm, error = None, None
        try:
            comm = cls(rank=rank, num_ranks=num_ranks, device=device, pointers=bufs.pointers,
                       heap_bytes=heap_bytes, ll_bytes=ll_bytes, timeout_s=timeout_s,
                       own_allocation=False, opened=[], group=group, elastic=elastic,
                       nvshmem=bufs)
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

    @classmethod
    def _from_group_shared(cls, group, rank, num_ranks, heap_bytes, ll_bytes, total, timeout_s,
                           elastic, device, transport) -> "CudaComm":
        """from_group with buffers in host memory: /dev/shm segments (moe_comm/shm/segment.py)
        that the processes of one host map into each other, and a mirror plus the host proxy
        (moe_comm/cuda/kernel_proxy.py) for every rank on another host. Used by the kernel emulator
        (device ``cpu``), and on a GPU when the group spans hosts (segments registered with
        the driver, so kernels reach them over PCIe: the fallback where IBGDA is missing)."""
        import secrets

        import torch.distributed as dist

        from ..shm.identity import host_identity
        from ..shm.segment import Segment, reclaim_stale_segments, segment_name
        reclaim_stale_segments()
        own = Segment.create(segment_name(f"cu{secrets.token_hex(6)}", rank), total)
        me = host_identity()
        infos = [None] * num_ranks
        dist.all_gather_object(infos, (me, total, own.name), group=group)
        remote = [r for r, info in enumerate(infos) if info[0] != me]
        segments, registered, link, proxy = [own], [], None, None
        try:
            try:
                if len({i[1] for i in infos}) != 1:
                    raise ValueError("num_nvl_bytes/num_rdma_bytes must be equal on every rank; "
                                     f"buffer sizes differ: {[i[1] for i in infos]}")
                segments = [own if r == rank else None if r in remote else Segment.open(name)
                            for r, (_, _, name) in enumerate(infos)]
            finally:
                dist.barrier(group=group)   # everybody mapped: names can go
                own.unlink()
            pointers = [0 if seg is None else seg.bytes.ctypes.data for seg in segments]
            if device.type == "cuda":
                pointers = [0 if p == 0 else _register_host(p, total, registered)
                            for p in pointers]
            if remote:
                from ..transport import open_transport
                from .kernel_proxy import KernelProxy
                link = open_transport(group, own.bytes, remote, kind=transport,
                                      timeout_s=timeout_s)
                mirrors = {r: torch.zeros(total, dtype=torch.uint8,
                                          pin_memory=device.type == "cuda") for r in remote}
                proxy = KernelProxy(link, mirrors, device, timeout_s)
                for r in remote:
                    pointers[r] = proxy.mirror_word(r)
            comm = cls(rank=rank, num_ranks=num_ranks, device=device, pointers=pointers,
                       heap_bytes=heap_bytes, ll_bytes=ll_bytes, timeout_s=timeout_s,
                       own_allocation=False, opened=[], group=group, host_buffers=segments,
                       elastic=elastic, proxy=proxy)
        except BaseException:
            if proxy is not None:
                proxy.close()
            if link is not None:
                link.close()
            _unregister_host(registered)
            for seg in set(segments):
                if seg is not None:
                    seg.close()
            raise
        comm._registered = registered
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=group)
        return comm

    @classmethod
    def local_group(cls, num_ranks: int, heap_bytes: int, ll_bytes: int, timeout_s: float,
                    device=None, elastic: bool = False, network_hosts: int = 0) -> list:
        """All ``num_ranks`` ranks in this process on one device; returns their comms. Drive
        rank r from its own thread with its own current stream (see moe_comm/testing/local_cuda.py).
        ``network_hosts`` (emulator only): split the ranks into that many emulated hosts whose
        ranks reach each other as network ranks of the IBGDA build, on the emulated NVSHMEM
        (moe_comm/ibgda/path.py EmulatedNvshmemBuffers); 0: no network."""
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else \
            torch.device(device)
        heap_bytes, ll_bytes = round_up(heap_bytes, PAGE), round_up(ll_bytes, PAGE)
        total = cls.buffer_bytes(num_ranks, heap_bytes, ll_bytes)
        host_buffers = None
        if network_hosts:
            if device.type != "cpu":
                raise ValueError("local_group(network_hosts=...) runs on the kernel emulator "
                                 "only (NVSHMEM has one PE per process; on a GPU use "
                                 "from_group with transport='ibgda')")
            sym = ibgda.EmulatedNvshmemBuffers(num_ranks, total, network_hosts)
            return [cls(rank=r, num_ranks=num_ranks, device=device, pointers=sym.pointers(r),
                        heap_bytes=heap_bytes, ll_bytes=ll_bytes, timeout_s=timeout_s,
                        own_allocation=False, opened=[], host_buffers=sym.tensors,
                        elastic=elastic, nvshmem=sym) for r in range(num_ranks)]
        if device.type == "cpu":        # emulator: plain host memory (64-byte aligned)
            host_buffers = [torch.zeros(total, dtype=torch.uint8) for _ in range(num_ranks)]
            pointers = [b.data_ptr() for b in host_buffers]
        else:
            _set_current(device)
            pointers = [_alloc_zeroed(total) for _ in range(num_ranks)]
        comms = [cls(rank=r, num_ranks=num_ranks, device=device, pointers=pointers,
                    heap_bytes=heap_bytes, ll_bytes=ll_bytes, timeout_s=timeout_s,
                    own_allocation=host_buffers is None, opened=[],
                    host_buffers=host_buffers, elastic=elastic) for r in range(num_ranks)]
        if device.type == "cuda":
            # bases/err_dev/counters were filled on the default stream; the ranks' kernels run
            # on non-blocking streams that would not wait for it
            torch.cuda.synchronize(device)
        return comms

    # -- kernels -----------------------------------------------------------------------------
    def kernels(self, variant) -> dict:
        """``{name: kernel}`` of ``variant`` as this group runs it: the NVRTC build (or the
        emulator's), or the IBGDA build (nvcc + NVSHMEM) when network ranks go through
        NVSHMEM."""
        if self.nvshmem is not None:
            return self.nvshmem.kernels(variant)
        from ..jit.nvrtc import load_kernels
        return load_kernels(variant, self.device)

    # -- per-operation state -----------------------------------------------------------------
    def next_epoch(self) -> int:
        self.epoch = self.epoch % MAX_EPOCH + 1
        return self.epoch

    def next_notify_offsets(self):
        """Byte offsets of NOTIFY[parity][0] and CALL[parity][0] for the next notify (parities
        alternate; every normal op has one notify, which carries its call signature)."""
        parity = self.notify_seq % 2
        self.notify_seq += 1
        self.last_call = ("normal", parity)
        return self.layout.notify(parity, 0) * 8, self.layout.call(parity, 0) * 8

    def _call_rows(self) -> dict:
        """{rank: signature values} of the last call checked (``last_call``: a normal call's
        CALL rows or an LL dispatch's LL_CALL rows), read from this rank's header once the
        stream is idle: what the ranks said about it."""
        kind, which = self.last_call
        first = self.layout.call(which, 0) if kind == "normal" else self.layout.ll_call(which, 0)
        n = self.num_ranks * CALL_WORDS
        base = self.pointers[self.rank]
        if self.device.type == "cpu":            # the emulator: host memory
            words = np.frombuffer((ctypes.c_char * (n * 8)).from_address(base + first * 8),
                                  dtype=np.int64).copy()
        else:
            from cuda.bindings import driver as cu
            words = np.empty(n, dtype=np.int64)
            _cu(cu.cuMemcpyDtoH(words.ctypes.data, base + first * 8, n * 8), "cuMemcpyDtoH")
        rows = words.reshape(self.num_ranks, CALL_WORDS) & VALUE_MASK
        live = self.active_ranks().cpu().tolist()
        return {r: rows[r] for r in range(self.num_ranks) if live[r]}

    def done_offset(self) -> int:
        return self.layout.done(0) * 8

    # -- rank masking --------------------------------------------------------------------------
    def _enable_masking(self) -> None:
        if self.active is not None:
            return
        words = torch.ones(1 + self.num_ranks, dtype=torch.int32, device=self.device)
        words[0] = int(self.elastic)
        self.active = words[1:]                 # the view keeps word 0 alive
        self.told = torch.ones(self.num_ranks, dtype=torch.int32, device=self.device)

    def mask(self, ranks, why: str) -> None:
        """Mask ``ranks`` (a list the host knows, e.g. from set_active_ranks), on the current
        stream: kernels queued after this skip them."""
        ranks = sorted(int(r) for r in ranks)
        if not ranks:
            return
        self._enable_masking()
        self.active[ranks] = 0
        if self.rank in ranks:
            self.masked_out = True
        log.warning("moe_comm rank %d: masking rank(s) %s (%s)", self.rank, ranks, why)

    def mask_where(self, keep: torch.Tensor) -> None:
        """Mask the ranks where ``keep`` (any device, [R]) is 0, without a host
        synchronisation (the Buffer's ``active_ranks=`` argument, Mooncake's device tensor).
        A host tensor that masks this rank makes the call raise RankMaskedError at once; a
        device tensor that does is only seen by the kernels (elastic: the call's agreement
        reports it)."""
        self._enable_masking()
        if keep.device.type == "cpu" and not bool(keep[self.rank]):
            self.masked_out = True
        self.active.mul_((keep.to(self.device, non_blocking=True) != 0).to(torch.int32))

    def _note_masked(self) -> None:
        """A kernel found this rank fenced or dropped by the survivors (kErrMasked, read from
        pinned memory without a synchronisation): this rank is out, in its own mask too."""
        if self._alive and int(self._err[0]) == ERR_MASKED and not self.masked_out:
            self.masked_out = True
            self._enable_masking()
            self.active[self.rank] = 0

    def active_ranks(self) -> torch.Tensor:
        """int32 [R] on the device (a copy; all ones while nothing was masked)."""
        self._note_masked()
        if self.active is None:
            return torch.ones(self.num_ranks, dtype=torch.int32, device=self.device)
        return self.active.clone()

    def begin_call(self) -> None:
        """Start one call (or one half of a low-latency call): raise a pending error, refuse
        a rank masked out."""
        self.check()
        if self.masked_out:
            raise RankMaskedError(f"rank {self.rank} is masked out of this Buffer "
                                  "(active_ranks[rank] == 0); a new Buffer is needed to rejoin")

    def group_args(self):
        """(bases, rank, data offset, data bytes, timeout, active or None) - the normal-mode
        kernels' first arguments."""
        return (self.bases, self.rank, self.heap_offset, self.heap_bytes, self.timeout_ns,
                self.active)

    def error_args(self, op: str):
        return (self.err_host, self.err_dev, OP[op])

    def counter(self, name: str) -> torch.Tensor:
        return self.counters[COUNTER[name]:COUNTER[name] + 1]

    # -- errors --------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise if a kernel of this rank reported an error (reads pinned memory, no sync)."""
        if not self._alive:
            raise RuntimeError("this CUDA communicator was destroyed")
        code = int(self._err[0])
        if code == 0:
            return
        op = OPS[int(self._err[1])] if 0 <= int(self._err[1]) < len(OPS) else "?"
        ranks = np.nonzero(self._err[ERROR_HEADER:ERROR_HEADER + self.num_ranks])[0].tolist()
        if code == ERR_TIMEOUT:
            raise CommTimeoutError(op, ranks, self.timeout_s)
        if code == ERR_MASKED:
            self.masked_out = True
            raise RankMaskedError(f"{op}: rank {self.rank} was masked out by its peers (it "
                                  "missed their deadline); a new Buffer is needed to rejoin")
        if code == ERR_PROXY:
            raise CudaCommError(f"{op}: the host proxy took no command for "
                                f"{2 * self.timeout_s + 5:g} s (moe_comm/cuda/kernel_proxy.py); this "
                                "communicator cannot reach other hosts any more: destroy it")
        if code == ERR_MISMATCH:
            # every rank saw the same signatures and failed this call at its notify, before
            # any payload moved: once this rank's kernels of it are done, it is in step
            # with its peers again and the buffer serves the next call
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            rows = self._call_rows()
            self.err_host.zero_()
            self.err_dev.zero_()
            fields = NORMAL_CALL_FIELDS if self.last_call[0] == "normal" else LL_CALL_FIELDS
            signature.check(op.split("/")[0], rows, fields)
            raise CudaCommError(f"{op}: the ranks' call signatures differ at rank(s) {ranks}")
        if code == ERR_PEER_FAILED:
            raise CudaCommError(f"{op}: rank(s) {ranks} failed this call (an error of their own, "
                                "which they raise); this communicator is out of step: destroy "
                                "it")
        if code == ERR_OVERFLOW:
            raise CudaCommError(f"{op}: more rows than the receive region holds at rank(s) "
                                f"{ranks} (num_worst_tokens or the buffer too small; "
                                f"rows={int(self._err[3])})")
        raise CudaCommError(f"{op}: rank(s) {ranks} are not reachable by pointer and no "
                            "network transport is configured")

    def synchronize(self) -> None:
        """Wait for this rank's current stream, then :meth:`check`."""
        if self.device.type == "cuda":           # emulated kernels are done when launched
            torch.cuda.current_stream(self.device).synchronize()
        self.check()

    # -- tests ---------------------------------------------------------------------------------
    def poison_data(self, byte: int = 0xFF) -> None:
        """Fill this rank's normal-mode data region with ``byte`` on the current stream
        (tests: a row nobody wrote shows up as NaN / -1). Safe between operations: peers write
        there only after this rank's next notify, which the stream runs after the fill. (The
        LL region has no such barrier: a peer may already be writing the next call there.)"""
        if self.device.type == "cpu":
            ctypes.memset(self.pointers[self.rank] + self.heap_offset, byte, self.heap_bytes)
            return
        from cuda.bindings import driver as cu
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _cu(cu.cuMemsetD8Async(self.pointers[self.rank] + self.heap_offset, byte,
                               self.heap_bytes, cu.CUstream(stream)), "cuMemsetD8Async")

    def poison_free_heap(self, byte: int = 0xFF) -> None:
        """The host backend's name for :meth:`poison_data` (the Buffer tests call it)."""
        self.poison_data(byte)

    def poison_ll(self, byte: int = 0xFF) -> None:
        """Fill this rank's low-latency region with ``byte`` (tests; between barriers only)."""
        if self.device.type == "cpu":
            ctypes.memset(self.pointers[self.rank] + self.ll_offset, byte, self.ll_bytes)
            return
        from cuda.bindings import driver as cu
        _cu(cu.cuMemsetD8(self.pointers[self.rank] + self.ll_offset, byte, self.ll_bytes),
            "cuMemsetD8")

    def reset_ll(self) -> None:
        """Zero this rank's low-latency region and LL header slots and restart the LL call
        numbers (Buffer.clean_low_latency_buffer: collective, barriers around it, nothing in
        flight). Waits for the memset, so the caller's second barrier means "all clean"."""
        base = self.pointers[self.rank]
        first = self.layout.ll_first * 8
        if self.device.type == "cpu":
            ctypes.memset(base + first, 0, self.layout.num_words * 8 - first)
            ctypes.memset(base + self.ll_offset, 0, self.ll_bytes)
            self.ll_seq = {"dispatch": 0, "combine": 0}
            return
        from cuda.bindings import driver as cu
        stream = torch.cuda.current_stream(self.device)
        handle = cu.CUstream(stream.cuda_stream)
        _cu(cu.cuMemsetD8Async(base + first, 0, self.layout.num_words * 8 - first, handle),
            "cuMemsetD8Async")
        _cu(cu.cuMemsetD8Async(base + self.ll_offset, 0, self.ll_bytes, handle),
            "cuMemsetD8Async")
        stream.synchronize()
        self.ll_seq = {"dispatch": 0, "combine": 0}

    # -- lifetime ------------------------------------------------------------------------------
    def _destroy_host_buffers(self, barrier: bool) -> None:
        """destroy() of buffers in host memory (emulator, local_group on the CPU, the proxy
        path): hand the proxy's last commands to the wire, meet the peers (nobody sends any
        more), stop the proxy and its transport, then unmap."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.proxy is not None:          # everything queued is on the wire before we meet
            self.proxy.flush(min(self.timeout_s, 5.0))
            self.proxy.transport.flush(raise_on_timeout=False)
        if barrier:
            _barrier(self.group)
        if self.proxy is not None:
            self.proxy.close()
            self.proxy.transport.close()
        _unregister_host(self._registered)
        if self.nvshmem is not None:       # the emulated symmetric heap: its last user frees
            self.nvshmem.release()
        buffers, self._host_buffers = self._host_buffers, None
        for b in buffers:                     # segments of from_group; local tensors just go
            if b is not None and hasattr(b, "close"):
                b.close()

    def destroy(self, barrier: bool = True) -> None:
        """Unmap peers and free this rank's buffer once the device is idle. With
        :meth:`from_group` it is collective (``barrier``): every rank unmaps its peers, meets
        the others, then frees its own buffer, so no allocation is freed while a peer still
        maps it (or, across hosts, still sends to it). Pass ``barrier=False`` when peers are
        gone (teardown after a failure); it is implied once a rank is masked, this one
        included (it may be dead: a group barrier would fail; and the survivors skip it too)."""
        if not self._alive:
            return
        self._note_masked()
        self._alive = False
        barrier = barrier and self.group is not None and not self.masked_out and (
            self.active is None or bool(self.active.all()))
        if self._host_buffers is not None:
            self._destroy_host_buffers(barrier)
            return
        torch.cuda.synchronize(self.device)
        if self.nvshmem is not None:       # symmetric heap: freeing is collective
            if barrier:
                _barrier(self.group)
            self.nvshmem.close(collective=barrier)
            return
        from cuda.bindings import driver as cu
        for p in self._opened:
            cu.cuIpcCloseMemHandle(p)
        self._opened = []
        if barrier:
            _barrier(self.group)
        if self._own_allocation:
            cu.cuMemFree(self.pointers[self.rank])
