"""Device memory of the CUDA backend through the driver: allocations, page-locked host memory
kernels can reach, memsets and copies. A CPU "device" (the kernel emulator) is plain host
memory, handled here with ctypes so the callers need not know which they have."""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from ..deps.cuda_bindings import check, driver
from ..deps.cuda_core import cuda_core


def set_current(device: torch.device) -> None:
    """Make ``device``'s primary context current in this thread (no-op for the emulator)."""
    if device.type == "cpu":
        return
    cuda_core().Device(device.index).set_current()


def new_stream(device: torch.device) -> int:
    """A non-blocking stream of ``device``'s primary context, made by the driver (not taken from
    torch's pool: see moe_comm/testing/local_cuda.py rank_streams); its handle."""
    set_current(device)
    non_blocking = 0x01                      # CU_STREAM_NON_BLOCKING
    return int(check(driver().cuStreamCreate(non_blocking), "cuStreamCreate"))


def alloc_zeroed(nbytes: int) -> int:
    """A zeroed device allocation (synchronised: zero before any peer maps it)."""
    cu = driver()
    ptr = int(check(cu.cuMemAlloc(nbytes), "cuMemAlloc"))
    check(cu.cuMemsetD8(ptr, 0, nbytes), "cuMemsetD8")
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    return ptr


def free(ptr: int) -> None:
    driver().cuMemFree(ptr)


def register_host(ptr: int, nbytes: int, registered: list) -> int:
    """Make host memory at ``ptr`` reachable by kernels (page-locked, mapped); returns its
    device address (the same under UVA). Appends ``ptr`` to ``registered``."""
    cu = driver()
    portable, devicemap = 0x01, 0x02          # CU_MEMHOSTREGISTER_PORTABLE / _DEVICEMAP
    check(cu.cuMemHostRegister(ptr, nbytes, portable | devicemap), "cuMemHostRegister")
    registered.append(ptr)
    return int(check(cu.cuMemHostGetDevicePointer(ptr, 0), "cuMemHostGetDevicePointer"))


def unregister_host(registered: list) -> None:
    for ptr in registered:
        driver().cuMemHostUnregister(ptr)
    registered.clear()


def host_tensor_address(t: torch.Tensor) -> int:
    """The address kernels use for host tensor ``t`` (pinned: asked of the driver, not assumed
    equal to the host address; a plain CPU tensor serves the kernel emulator as is)."""
    if not t.is_pinned():
        return t.data_ptr()
    return int(check(driver().cuMemHostGetDevicePointer(t.data_ptr(), 0),
                     "cuMemHostGetDevicePointer"))


def ipc_handle(ptr: int, nbytes: int) -> bytes:
    """The CUDA IPC handle of allocation ``ptr`` as ``nbytes`` bytes to send to peers."""
    handle = check(driver().cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
    return ctypes.string_at(handle.getPtr(), nbytes)


def ipc_open(blob: bytes, what: str) -> int:
    """Map a peer's allocation from its IPC handle bytes; returns its address here."""
    cu = driver()
    h = cu.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), blob, len(blob))
    return int(check(cu.cuIpcOpenMemHandle(
        h, cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), what))


def ipc_close(ptr: int) -> None:
    driver().cuIpcCloseMemHandle(ptr)


def memset(device: torch.device, ptr: int, byte: int, nbytes: int, *,
           on_stream: bool = True) -> None:
    """Fill ``nbytes`` at ``ptr`` with ``byte``: on torch's current stream (``on_stream``),
    else synchronously; at once for the emulator's host memory."""
    if device.type == "cpu":
        ctypes.memset(ptr, byte, nbytes)
        return
    cu = driver()
    if on_stream:
        stream = cu.CUstream(torch.cuda.current_stream(device).cuda_stream)
        check(cu.cuMemsetD8Async(ptr, byte, nbytes, stream), "cuMemsetD8Async")
    else:
        check(cu.cuMemsetD8(ptr, byte, nbytes), "cuMemsetD8")


def read_words(device: torch.device, ptr: int, count: int) -> np.ndarray:
    """``count`` int64 words at ``ptr``, copied to the host (the stream must be idle)."""
    if device.type == "cpu":
        return np.frombuffer((ctypes.c_char * (count * 8)).from_address(ptr),
                             dtype=np.int64).copy()
    words = np.empty(count, dtype=np.int64)
    check(driver().cuMemcpyDtoH(words.ctypes.data, ptr, count * 8), "cuMemcpyDtoH")
    return words


def bases_tensor(first_word: int, pointers, device) -> torch.Tensor:
    """The kernels' ``bases`` (csrc/kernels/transport.cuh): an int64 device tensor viewed from
    word 1, so that ``bases[-1]`` is ``first_word``; u64 words stored two's complement."""
    words = [int(w) for w in [first_word] + list(pointers)]
    words = [w - (1 << 64) if w >= 1 << 63 else w for w in words]
    return torch.tensor(words, dtype=torch.int64, device=device)[1:]
