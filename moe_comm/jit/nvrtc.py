"""Run-time compilation of csrc/kernels with NVRTC (cuda.core), cached on disk.

``compile_cubin(variant, arch)`` returns cubin bytes. It works without a GPU or driver
(CI compiles every variant this way), because it only ever touches ``ObjectCode.code``. On a
CPU-only machine never call ``load_kernels`` (``ObjectCode.get_kernel`` needs a driver, and a
failed attempt leaves a cuda.core lock held: later driver calls hang) and never print/repr an
``ObjectCode``.

Cache key = sha256 over every file of the kernel folder (names and bytes), the variant's source
and macros, the target architecture, the NVRTC version and this module's compile options, so
editing any header invalidates every cubin that might include it. Cubins live in
``$MOE_COMM_CACHE_DIR`` (default ``~/.cache/moe_comm/kernels``), written atomically (temporary
file + rename), so ranks that compile the same variant at once do not corrupt each other.
"""
from __future__ import annotations

import io
import logging
from pathlib import Path
import threading

import torch

from . import cache, device_header, emulator
from ..deps.cuda_bindings import driver, nvrtc
from ..deps.cuda_core import cuda_core
from .launch import make_current
from .resources import check_loaded
from .variants import Variant

# Bump when the options below change in a way the key would not see.
OPTIONS_VERSION = "2"
logger = logging.getLogger("moe_comm")
_STD = "c++17"


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel variant (or, in strict mode, warned about it)."""


def _nvrtc_version() -> str:
    _, major, minor = nvrtc().nvrtcVersion()
    return f"{major}.{minor}"


def cache_key(variant: Variant, arch: str, folder: Path | None = None) -> str:
    folder = folder or cache.kernel_dir()
    return cache.key(OPTIONS_VERSION, _STD, cache.sources_digest([folder]),
                     device_header.header_text(), arch,
                     variant.source, repr(variant.defines), _nvrtc_version())


def _program_options(variant: Variant, arch: str, folder: Path):
    """Line info (compute-sanitizer and cuda-gdb name source lines; no run-time cost), and
    ptxas warns when a kernel spills registers (a warning fails the strict CI compile)."""
    ProgramOptions = cuda_core().ProgramOptions
    defines = [(name, str(value)) for name, value in variant.defines]
    return ProgramOptions(name=variant.source, arch=arch, std=_STD,
                          include_path=[str(folder),
                                        str(device_header.include_dir(cache.cache_dir()))],
                          define_macro=defines or None,
                          lineinfo=True, ptxas_options=["--warn-on-spills"])


def _clean_log(text: str) -> str:
    return text.replace("\x00", "").strip()


def compile_cubin(variant: Variant, arch: str, *, strict: bool = False, use_cache: bool = True,
                  log_sink: list | None = None) -> bytes:
    """Cubin bytes of ``variant`` for ``arch`` (``"sm_90"``, ``"sm_100"``, ...).

    ``strict``: treat any compiler warning as an error (the CI test does). ``log_sink``: a list
    that receives the compiler log of a fresh compile. Raises :class:`KernelCompileError`.
    """
    folder = cache.kernel_dir()
    key = cache_key(variant, arch, folder)
    path = cache.cache_dir() / f"{variant.source.rsplit('.', 1)[0]}-{arch}-{key[:40]}.cubin"
    if use_cache and path.is_file():
        logger.debug("moe_comm: %s for %s from the kernel cache %s", variant.label, arch, path)
        return path.read_bytes()
    logger.info("moe_comm: compiling %s for %s with NVRTC (cached afterwards in %s)",
                variant.label, arch, cache.cache_dir())
    source = (folder / variant.source).read_text()
    log = io.StringIO()
    program = cuda_core().Program(source, "c++", _program_options(variant, arch, folder))
    try:
        obj = program.compile("cubin", logs=log)
    except Exception as e:  # noqa: BLE001 - cuda.core raises NVRTCError (its module moved)
        if type(e).__name__ != "NVRTCError":
            raise
        raise KernelCompileError(f"{variant.label} for {arch}: {e}") from None
    text = _clean_log(log.getvalue())
    if log_sink is not None:
        log_sink.append(text)
    if strict and text:
        raise KernelCompileError(f"{variant.label} for {arch} compiled with diagnostics "
                                 f"(warnings are errors here):\n{text}")
    if text:                        # e.g. a spill warning: slow, not wrong
        logger.warning("moe_comm: %s for %s compiled with diagnostics:\n%s", variant.label,
                           arch, text)
    data = bytes(obj.code)          # only .code: see the module docstring
    if use_cache:
        cache.write_atomic(path, data)
    return data


# ---- loading (GPU only) ---------------------------------------------------------------------
_loaded: dict = {}
_lock = threading.Lock()


def device_arch(device) -> str:
    """``sm_XY`` of a torch CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def load_kernels(variant: Variant, device) -> dict:
    """``{kernel name: cuda.core Kernel}`` of ``variant`` for torch ``device`` (compiled or
    taken from the cache on first use, then kept for the process).

    Every kernel is loaded into the device's context *here*, not lazily at its first launch:
    with CUDA lazy loading a first launch may synchronise the context, and a context
    synchronisation while a peer's kernel spins waiting for this rank (ranks as streams of one
    process) would deadlock until the deadline."""
    device = torch.device(device)
    if device.type == "cpu":                    # the kernel emulator (tests without a GPU)
        return emulator.load_kernels(variant)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    arch = device_arch(device)
    with _lock:
        hit = _loaded.get((variant, arch, device.index))
        if hit is None:
            make_current(device)
            cubin = compile_cubin(variant, arch)
            try:
                obj = cuda_core().ObjectCode.from_cubin(cubin, name=variant.label)
            except TypeError:                   # cuda.core <= 0.2 has no name=
                obj = cuda_core().ObjectCode.from_cubin(cubin)
            hit = {name: obj.get_kernel(name) for name in variant.kernels}
            for name, kernel in hit.items():
                force_load(kernel, name)
            hit["__object__"] = obj             # keeps the library loaded
            _loaded[(variant, arch, device.index)] = hit
        return hit


def force_load(kernel, name: str) -> None:
    """Resolve kernel ``name``'s function in the current context now (see load_kernels), and
    check that it can run the block it will be launched with (moe_comm/jit/resources.py)."""
    cu = driver()
    try:
        err, _ = cu.cuKernelGetFunction(kernel.handle)  # a CUkernel: load into this context
    except (TypeError, AttributeError):                 # older cuda.core: a CUfunction handle
        err = None                                      # (reading an attribute resolves it)
    if err is not None and err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuKernelGetFunction({name}) failed: {err}")
    check_loaded(kernel, name)


def preload(variant_list, device) -> None:
    """Load ``variant_list`` on ``device`` now (before ranks start spinning on each other)."""
    for v in variant_list:
        load_kernels(v, device)
