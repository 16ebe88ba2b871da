"""Launch a compiled kernel on torch's current CUDA stream with cuda.core.

A launch takes the kernel's arguments packed by name (moe_comm/jit/kernel_args.py ``pack``:
declared names, declared order, kinds checked). Every parameter is 8 bytes, so each converts
on its own: a tensor (or None) becomes ``np.uint64(data_ptr)`` (0 for None), a Python int or
bool ``np.int64``; numpy scalars pass through (raw device pointers are handed over as
``np.uint64`` by the caller).
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from ..deps.cuda_core import cuda_core
from .emulator import EmuKernel, launch_emu
from .kernel_args import PackedArgs

_tls = threading.local()


class _TorchStream:
    """A torch stream seen through the ``__cuda_stream__`` protocol cuda.core accepts."""

    __slots__ = ("handle",)

    def __init__(self, stream: torch.cuda.Stream):
        self.handle = stream.cuda_stream

    def __cuda_stream__(self):
        return (0, self.handle)


def _arg(a):
    if isinstance(a, torch.Tensor):
        return np.uint64(a.data_ptr())
    if a is None:
        return np.uint64(0)
    if isinstance(a, (bool, int)):
        return np.int64(int(a))
    if isinstance(a, (np.int64, np.uint64)):
        return a
    raise TypeError(f"kernel arguments are tensors, None, ints or np.int64/np.uint64, got "
                    f"{type(a).__name__}")


def make_current(device: torch.device) -> None:
    """cuLaunchKernel needs the device's (primary) context current in the calling thread;
    torch makes it current lazily, cuda.core does it here once per thread and device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    done = getattr(_tls, "devices", None)
    if done is None:
        done = _tls.devices = set()
    if index not in done:
        cuda_core().Device(index).set_current()
        done.add(index)


def launch(kernel, grid, block, args: PackedArgs, *, shmem: int = 0, device=None,
           stream=None) -> None:
    """Launch ``kernel`` (a cuda.core Kernel) with ``grid``/``block`` (int or tuple) and
    ``args`` (``kernel_args.pack(name, ...)`` of the same kernel) on ``stream`` (default:
    torch's current stream of ``device``)."""
    if not isinstance(args, PackedArgs):
        raise TypeError("kernel arguments are passed packed by name: kernel_args.pack(...)")
    if isinstance(kernel, EmuKernel):           # CPU emulator: runs now, no stream
        if kernel.name != args.kernel:
            raise TypeError(f"{kernel.name} launched with the arguments of {args.kernel}")
        launch_emu(kernel, grid, block, [_arg(a) for a in args.values])
        return
    cc = cuda_core()
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    make_current(device)
    stream = torch.cuda.current_stream(device) if stream is None else stream
    config = cc.LaunchConfig(grid=grid, block=block, shmem_size=shmem)
    cc.launch(_cc_stream(cc, stream), config, kernel, *[_arg(a) for a in args.values])


_streams: dict = {}


def _cc_stream(cc, stream):
    """The cuda.core view of a torch stream, made once per stream handle: ``Stream.from_handle``
    (non-owning) where cuda.core has it - it warns when handed a foreign object on every launch
    - else the ``__cuda_stream__`` wrapper older releases take."""
    handle = stream.cuda_stream
    s = _streams.get(handle)
    if s is None:
        from_handle = getattr(cc.Stream, "from_handle", None)
        s = _streams[handle] = from_handle(handle) if from_handle else _TorchStream(stream)
    return s
