"""NVSHMEM at run time: initialise over a torch.distributed group, allocate the symmetric
heap, load IBGDA cubins, finalize. Everything here but :func:`exchange_unique_id` and the GPU
probes needs a GPU.

``nvshmem.core.init`` on a machine without a usable GPU/driver does not raise: the C library
calls ``exit(-1)`` and the interpreter dies (shared/TOOLING.md). :func:`init_nvshmem` therefore
checks for a GPU first and raises :class:`NvshmemUnavailableError` instead.

Typical use, one process per rank (PE i = rank i of ``group``)::

    ctx = init_nvshmem(group, torch.device("cuda", local_rank))    # collective
    bufs = ctx.comm_buffers(nbytes)          # collective: own buffer + network mirrors, zeroed
    words = [bufs.sym] + bufs.words          # the kernels' bases[-1], bases[0..R)
    k = ctx.load(kernel_program(variants.ll_combine(7168)))        # build/cache + library_init
    ...launch k["moe_ll_combine_send"] with moe_comm.jit.launch.launch...
    ctx.finalize()                                                 # collective
"""
from __future__ import annotations

import os
from pathlib import Path
import threading

import torch
import torch.distributed as dist

from ..deps import nvshmem as nvshmem_dep
from ..deps.cuda_core import cuda_core
from ..jit import toolchain
from ..jit.nvcc import build_cubin
from ..jit.nvrtc import force_load
from .bases import encode_bases

_lock = threading.Lock()
_active = None                       # the process's NvshmemContext (NVSHMEM is per process)


class NvshmemUnavailableError(RuntimeError):
    """No GPU/driver (or no nvshmem4py) here: NVSHMEM cannot be initialised."""


class NvshmemVersionError(RuntimeError):
    """Device code built against a different NVSHMEM than the host library that would run it."""


# ---- probes (safe without a GPU) -------------------------------------------------------------
def cuda_device_count() -> int:
    """Usable CUDA devices as torch sees them (0 with a CPU build of torch or no driver)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as none
        return 0


def rdma_devices() -> list:
    """RDMA devices of this machine (``/sys/class/infiniband``: mlx5_0, ...), IB or RoCE."""
    root = Path("/sys/class/infiniband")
    try:
        return sorted(p.name for p in root.iterdir())
    except OSError:
        return []


def nvshmem4py_available() -> bool:
    return nvshmem_dep.import_error() is None


def missing_stack() -> str | None:
    """Why the IBGDA build cannot run in this process (no GPU, nvshmem4py missing or not
    importing, no NVSHMEM wheel or nvcc), or None when it can."""
    if cuda_device_count() == 0:
        return "no CUDA GPU (IBGDA runs only on a GPU machine)"
    why = nvshmem_dep.import_error()
    if why is not None:
        return f"{why}; docs/PERF.md: carrying its wheel to a GPU machine"
    try:
        toolchain.nvshmem_install()
        toolchain.nvcc_path()
    except toolchain.NvshmemNotFoundError as e:
        return str(e)
    return None


def _require_gpu() -> None:
    if cuda_device_count() == 0:
        raise NvshmemUnavailableError(
            "NVSHMEM needs a CUDA GPU and driver, and this process sees none (a CPU build of "
            "torch, or no driver). nvshmem.core.init would exit the interpreter here, so it "
            "is not called.")
    if not nvshmem4py_available():
        raise NvshmemUnavailableError("nvshmem4py is not installed: pip install "
                                      "nvshmem4py-cu13 nvidia-nvshmem-cu13")


# ---- bootstrap -------------------------------------------------------------------------------
def exchange_unique_id(group=None):
    """Collective over ``group``: group rank 0 creates an NVSHMEM unique id, every rank returns
    it (``broadcast_object_list``; the id pickles). Works without a GPU."""
    nvshmem = nvshmem_dep.core()
    rank = dist.get_rank(group)
    objs = [nvshmem.get_unique_id() if rank == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(objs, src=src, group=group)
    return objs[0]


def _resolve_device(device):
    if device is None:
        index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        return torch.device("cuda", index)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    return torch.device("cuda", device.index if device.index is not None
                        else torch.cuda.current_device())


def init_nvshmem(group=None, device=None, *, ibgda: bool = True, force_network: bool = False,
                 bootstrap_ifname: str | None = None):
    """Initialise NVSHMEM over ``group`` (collective; default: the default group) on
    ``device`` (default: ``cuda:$LOCAL_RANK`` or the current device). PE numbers equal the
    group's ranks, which is what the kernels' ``bases`` encoding assumes.

    ``ibgda``: ask for GPU-initiated RDMA (``NVSHMEM_IB_ENABLE_IBGDA=1`` unless the variable is
    set already). ``force_network``: ``NVSHMEM_DISABLE_P2P=1``, so even ranks of one node talk
    over the NIC (tests of the IBGDA path on one machine). ``bootstrap_ifname``: the network
    interface of the unique-id bootstrap (``NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME``, e.g. ``lo``).
    Environment variables are only set where still unset, before NVSHMEM reads them.

    Returns the process's :class:`NvshmemContext`. Raises :class:`NvshmemUnavailableError`
    without a GPU (instead of letting NVSHMEM kill the process), ``RuntimeError`` if NVSHMEM is
    already initialised in this process or the PE numbering does not match the group.
    """
    global _active
    if not dist.is_initialized():
        raise RuntimeError("init_nvshmem needs torch.distributed initialised (the unique id "
                           "travels over the group)")
    _require_gpu()
    device = _resolve_device(device)
    with _lock:
        if _active is not None and not _active.closed:
            raise RuntimeError("NVSHMEM is already initialised in this process; finalize the "
                               "existing context first")
        if ibgda:
            os.environ.setdefault("NVSHMEM_IB_ENABLE_IBGDA", "1")
        if force_network:
            os.environ.setdefault("NVSHMEM_DISABLE_P2P", "1")
        if bootstrap_ifname:
            os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", bootstrap_ifname)
        nvshmem = nvshmem_dep.core()
        torch.cuda.set_device(device)
        dev = cuda_core().Device(device.index)
        dev.set_current()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        uid = exchange_unique_id(group)
        nvshmem.init(device=dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")
        ctx = NvshmemContext(group, device, rank, world)
        _active = ctx
        pe, npes = nvshmem.my_pe(), nvshmem.n_pes()
        if (pe, npes) != (rank, world):
            ctx.finalize()
            raise RuntimeError(f"NVSHMEM numbered this rank PE {pe} of {npes}, the group says "
                               f"rank {rank} of {world}")
        return ctx


def active_context():
    """The process's live :class:`NvshmemContext`, or None."""
    return _active if _active is not None and not _active.closed else None


class CommBuffers:
    """A CUDA group's buffers in the symmetric heap (:meth:`NvshmemContext.comm_buffers`):
    ``own`` (the kernels' buffer, uint8 tensor), ``mirrors`` (the network ranks' mirrors, or
    None), ``words`` (the kernels' ``bases[R]``) and ``sym`` (``bases[-1]``: own's address)."""

    def __init__(self, own, mirrors, words):
        self.own, self.mirrors, self.words = own, mirrors, list(words)
        self.sym = own.data_ptr()


# ---- one process's NVSHMEM state --------------------------------------------------------------
class NvshmemContext:
    """NVSHMEM initialised in this process for ``group``: symmetric buffers, loaded cubins."""

    def __init__(self, group, device, rank: int, world_size: int):
        self.group, self.device = group, device
        self.rank, self.world_size = rank, world_size
        self.closed = False
        self._buffers: list = []
        self._libraries: list = []          # (ObjectCode, NvshmemKernelObject)
        self._kernels: dict = {}

    # -- memory
    def alloc(self, nbytes: int):
        """Collective: a zeroed uint8 tensor of ``nbytes`` in the symmetric heap (every rank
        calls with the same size, in the same order). Free with :meth:`free` or finalize."""
        nvshmem = nvshmem_dep.core()
        self._check_open()
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        t = nvshmem.bytetensor((int(nbytes),), dtype=torch.uint8)
        t.zero_()
        torch.cuda.synchronize(self.device)
        self._buffers.append(t)
        return t

    def free(self, tensor) -> None:
        """Collective: return a buffer of :meth:`alloc` to the heap."""
        nvshmem = nvshmem_dep.core()
        for i, t in enumerate(self._buffers):
            if t.data_ptr() == tensor.data_ptr():
                del self._buffers[i]
                nvshmem.free_tensor(t)
                return
        raise ValueError("tensor was not allocated by this context (pass the tensor alloc "
                         "returned, not a view of part of it)")

    def peer_pointers(self, tensor) -> list:
        """``nvshmem_ptr`` of a buffer of :meth:`alloc` on every PE: a local mapping for PEs
        this GPU reaches by load/store (NVLink/P2P), 0 for network PEs and for this rank."""
        bindings = nvshmem_dep.bindings()
        own = tensor.data_ptr()
        return [0 if r == self.rank else int(bindings.ptr(own, r))
                for r in range(self.world_size)]

    def comm_buffers(self, nbytes: int) -> "CommBuffers":
        """Collective: a kernels' buffer of ``nbytes`` and one mirror of ``nbytes`` per network
        rank, in the symmetric heap, with the ``bases`` words that describe them
        (moe_comm/ibgda/bases.py). Every rank allocates as many mirror slots as the rank with
        the most network peers needs (symmetric allocations have one size)."""
        own = self.alloc(nbytes)
        peers = self.peer_pointers(own)
        remote = [r for r, p in enumerate(peers) if r != self.rank and p == 0]
        counts = [None] * self.world_size
        dist.all_gather_object(counts, len(remote), group=self.group)
        slots = max(counts)
        mirrors = self.alloc(slots * nbytes) if slots else None
        where = {r: mirrors.data_ptr() + i * nbytes for i, r in enumerate(remote)}
        words = encode_bases(self.rank, own.data_ptr(), peers, where)
        return CommBuffers(own, mirrors, words)

    # -- code
    def load(self, program, arch: str | None = None) -> dict:
        """``{kernel name: cuda.core Kernel}`` of a build.Program (built or taken from the
        cache), registered with NVSHMEM (library_init) so its device state is set up."""
        nvshmem = nvshmem_dep.core()
        self._check_open()
        major, minor = torch.cuda.get_device_capability(self.device)
        arch = arch or f"sm_{major}{minor}"
        key = (program, arch)
        if key in self._kernels:
            return self._kernels[key]
        built = toolchain.nvshmem_install().version
        running = str(nvshmem.get_version().libnvshmem_version)
        if running and not running.startswith(built):
            raise NvshmemVersionError(f"device code would be built against NVSHMEM {built}, "
                                      f"the host library is {running}")
        cubin = build_cubin(program, arch)
        obj = cuda_core().ObjectCode.from_cubin(cubin, name=program.label)
        kernels = {name: obj.get_kernel(name) for name in program.kernels}
        lib = nvshmem.NvshmemKernelObject.from_obj(obj)
        nvshmem.library_init(lib)
        for name, kernel in kernels.items():  # loaded now, not at a first launch (compiler.py)
            force_load(kernel, name)
        self._libraries.append((obj, lib))
        self._kernels[key] = kernels
        return kernels

    # -- teardown
    def finalize(self) -> None:
        """Collective: release loaded libraries and buffers, then finalize NVSHMEM. Idempotent."""
        global _active
        if self.closed:
            return
        nvshmem = nvshmem_dep.core()
        torch.cuda.synchronize(self.device)
        for _obj, lib in reversed(self._libraries):
            try:
                nvshmem.library_finalize(lib)
            except Exception:  # noqa: BLE001 - keep tearing down
                pass
        self._libraries.clear()
        self._kernels.clear()
        while self._buffers:
            nvshmem.free_tensor(self._buffers.pop())
        nvshmem.finalize()
        self.closed = True
        if _active is self:
            _active = None

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this NVSHMEM context is finalized")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finalize()
