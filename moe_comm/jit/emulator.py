"""The CUDA kernels on the CPU: csrc/kernels built as host C++ with csrc/emu (g++), run by a
fiber scheduler, driven by the same Python code as on a GPU.

Why: the CUDA backend (kernels + moe_comm/cuda/*.py) is checked against moe_comm.reference in
CI on a machine without a GPU, so a GPU session starts from code whose protocol, indexing and
argument lists have already run. A ``CudaComm`` on device ``cpu`` uses it (tests only; a
Buffer with CPU tensors uses the host backend). What the emulator does and does not model is
in csrc/emu/cuda_emu.h.

A variant (moe_comm/jit/variants.py) becomes one shared library, built with the variant's
``-D`` macros plus ``-DMOE_EMU`` and cached like the cubins (key: sources of both folders,
macros, compiler version). ``nvshmem=True`` builds the IBGDA variant (``-DMOE_WITH_NVSHMEM``)
against csrc/emu/nvshmem_emu.h, NVSHMEM's device calls on the CPU; a group using it registers
its buffers as a symmetric heap (:func:`register_symmetric`).
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
import shutil
import subprocess
import threading

from . import device_header
from .cache import cache_dir, kernel_dir, key, sources_digest, write_atomic
from .variants import THREADS, Variant

ERR_CHARS = 512
_U64 = (1 << 64) - 1                 # kernel arguments travel as 64-bit words (two's complement)
_FLAGS = ("-std=c++17", "-O1", "-fPIC", "-shared", "-pthread", "-Wall", "-Werror",
          "-Wno-unknown-pragmas", "-DMOE_EMU")


class EmulatorError(RuntimeError):
    """The emulator could not build or run a kernel (no compiler, a stuck barrier, ...)."""


def emu_dir() -> Path:
    return kernel_dir().parent / "emu"


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise EmulatorError("the kernel emulator needs a C++17 compiler (g++); set CXX")
    return cxx


def available() -> bool:
    try:
        compiler()
        return True
    except EmulatorError:
        return False


@functools.lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout


def _key(source: Path, defines: tuple, cxx: str) -> str:
    folders = dict.fromkeys((kernel_dir(), kernel_dir().parent / "ibgda", emu_dir(),
                             source.parent))
    return key(sources_digest(folders), source, repr(defines), _compiler_version(cxx),
               " ".join(_FLAGS), device_header.header_text())


NVSHMEM_DEFINE = ("MOE_WITH_NVSHMEM", 1)


def build(variant: Variant, nvshmem: bool = False) -> Path:
    """Path of the shared library of ``variant`` (built on first use, then cached);
    ``nvshmem``: its IBGDA build on the emulated NVSHMEM."""
    defines = variant.defines + ((NVSHMEM_DEFINE,) if nvshmem else ())
    return build_source(kernel_dir() / variant.source, defines)


def build_source(source: Path, defines=()) -> Path:
    """Build any kernel source file for the emulator (``defines``: ``(name, value)`` pairs)."""
    cxx = compiler()
    digest = _key(source, tuple(defines), cxx)
    path = cache_dir("emu") / f"{source.stem}-{digest[:40]}.so"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    emu = emu_dir()
    generated = device_header.include_dir(cache_dir())
    cmd = [cxx, *_FLAGS, *(f"-D{k}={v}" for k, v in defines), f"-I{emu}", f"-I{generated}",
           "-include",
           str(emu / "cuda_emu.h"), "-x", "c++", str(source), "-x", "c++",
           str(emu / "runtime.cpp"), str(emu / "nvshmem_emu.cpp"), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise EmulatorError(f"building {source.name} {list(defines)} for the emulator "
                            f"failed:\n{done.stderr[-4000:]}")
    write_atomic(path, tmp.read_bytes())
    tmp.unlink(missing_ok=True)
    return path


class EmuKernel:
    """One kernel of a built variant; :func:`launch_emu` runs it. ``max_threads``: its launch
    bound (variants.THREADS; None for a test kernel outside the table)."""

    def __init__(self, lib: ctypes.CDLL, name: str):
        self.lib, self.name = lib, name
        self.address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        self.max_threads = THREADS.get(name)


_loaded: dict = {}
_by_variant: dict = {}
_libraries: dict = {}                # path -> library (each has its own NVSHMEM registry)
_symmetric: dict = {}                # first base -> (bases, bytes) of each registered group
_lock = threading.Lock()


def load_kernels(variant: Variant, nvshmem: bool = False) -> dict:
    """``{kernel name: EmuKernel}`` of ``variant`` (built or taken from the cache on first use,
    then kept: the mode modules ask for their kernels on every call)."""
    hit = _by_variant.get((variant, nvshmem))
    if hit is None:
        hit = _by_variant[(variant, nvshmem)] = load_library(build(variant, nvshmem),
                                                             variant.kernels)
    return hit


def _register(lib, bases, nbytes, local_bytes) -> None:
    words = (ctypes.c_uint64 * len(bases))(*bases)
    lib.moe_emu_nvshmem_register(words, len(bases), ctypes.c_uint64(nbytes),
                                 ctypes.c_uint64(local_bytes))


def register_symmetric(bases, nbytes: int, local_bytes: int) -> None:
    """Make the buffers at ``bases`` (PE order, ``nbytes`` each) one symmetric heap for the
    emulated NVSHMEM of every library, loaded now or later; ``local_bytes`` from each base are
    that PE's NIC-registered memory (the only place a put may read from)."""
    bases = [int(b) for b in bases]
    with _lock:
        _symmetric[bases[0]] = (bases, int(nbytes), int(local_bytes))
        for lib in _libraries.values():
            _register(lib, bases, nbytes, local_bytes)


def unregister_symmetric(first_base: int) -> None:
    with _lock:
        if _symmetric.pop(int(first_base), None) is not None:
            for lib in _libraries.values():
                lib.moe_emu_nvshmem_unregister(ctypes.c_uint64(int(first_base)))


def load_library(path: Path, kernels) -> dict:
    """``{kernel name: EmuKernel}`` for ``kernels`` of the built library at ``path``."""
    with _lock:
        hit = _loaded.get((path, tuple(kernels)))
        if hit is None:
            lib = ctypes.CDLL(str(path))
            lib.moe_emu_launch.restype = ctypes.c_int
            lib.moe_emu_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [
                ctypes.POINTER(ctypes.c_uint64), ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
            hit = {name: EmuKernel(lib, name) for name in kernels}
            _loaded[(path, tuple(kernels))] = hit
            if path not in _libraries:
                _libraries[path] = lib
                for bases, nbytes, local_bytes in _symmetric.values():
                    _register(lib, bases, nbytes, local_bytes)
        return hit


def _dims(v) -> tuple:
    v = (v,) if isinstance(v, int) else tuple(v)
    return tuple(int(a) for a in v) + (1,) * (3 - len(v))


def launch_emu(kernel: EmuKernel, grid, block, args) -> None:
    """Run ``kernel`` to completion on CPU threads (releases the GIL meanwhile). ``args`` are
    integers (pointers, int64; numpy scalars as moe_comm/jit/launch.py makes them)."""
    threads = _dims(block)[0] * _dims(block)[1] * _dims(block)[2]
    if kernel.max_threads is not None and threads > kernel.max_threads:
        # a GPU refuses it too: the kernel was compiled with __launch_bounds__(max_threads)
        raise EmulatorError(f"{kernel.name}: launched with {threads} threads per block, but it "
                            f"is compiled for at most {kernel.max_threads} (variants.THREADS)")
    words = (ctypes.c_uint64 * max(1, len(args)))(*[int(a) & _U64 for a in args])
    err = ctypes.create_string_buffer(ERR_CHARS)
    rc = kernel.lib.moe_emu_launch(kernel.address, *_dims(grid), *_dims(block), words,
                                   len(args), err, ERR_CHARS)
    if rc != 0:
        raise EmulatorError(f"{kernel.name}: {err.value.decode(errors='replace')}")
