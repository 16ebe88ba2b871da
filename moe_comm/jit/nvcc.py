"""Build device code that calls NVSHMEM (IBGDA) into a cubin, cached on disk.

NVRTC cannot link NVSHMEM's signal entry points and compiles IBGDA out (shared/TOOLING.md), so
this uses nvcc, in two steps, with no GPU or driver involved:

1. ``nvcc -rdc=true -arch=sm_XY -std=c++17 -lineinfo -DMOE_WITH_NVSHMEM -D<macros>
   -I csrc/kernels -I <nvshmem>/include -c <source> -o prog.o``  (relocatable device code)
2. ``nvcc -arch=sm_XY -dlink -cubin prog.o -L <nvshmem>/lib -lnvshmem_device -o prog.cubin``
   (device link against the static device library: a self-contained cubin)

The cubin is loaded with ``cuda.core.ObjectCode.from_cubin`` and must then be registered with
NVSHMEM (``nvshmem.core.library_init``; see moe_comm/ibgda/runtime.py) before a launch. It must
run with the host library of the same NVSHMEM version it was built against (the version is in
the cache key, and runtime.py checks it).

Programs: :func:`selftest_program` (csrc/ibgda/selftest.cu) and :func:`kernel_program`, any
variant of moe_comm/jit/variants.py, i.e. the mode kernels with the NVSHMEM remote branch of
``Transport`` switched on.

Cache key = sha256 over every source file of csrc/kernels and csrc/ibgda (names and bytes), the
program and its macros, the arch, the NVSHMEM version, the nvcc version and this module's
options. Files live in ``$MOE_COMM_CACHE_DIR/ibgda`` (default ``~/.cache/moe_comm/ibgda``),
written atomically (ranks that build the same program at once do not corrupt each other).
"""
from __future__ import annotations

from pathlib import Path
import subprocess
import tempfile

from . import device_header, elf
from .cache import cache_dir, csrc_dir, key, sources_digest, write_atomic
from .toolchain import nvcc_path, nvcc_version, nvshmem_install
from .variants import Variant, thread_defines

OPTIONS_VERSION = "2"            # bump when the commands below change
_STD = "c++17"
_TIMEOUT_S = 900


class IbgdaBuildError(RuntimeError):
    """nvcc rejected the program (or, in strict mode, warned), or the link left symbols open."""


# One translation unit of an nvcc build: a Variant whose ``source`` is relative to csrc/ (not
# csrc/kernels), compiled with its ``defines`` (MOE_WITH_NVSHMEM implied); it holds ``kernels``.
Program = Variant


SELFTEST_KERNELS = ("moe_ibgda_test_send", "moe_ibgda_test_wait", "moe_ibgda_test_wait_remote",
                    "moe_ibgda_test_pingpong")


def selftest_program() -> Program:
    return Program("ibgda/selftest.cu", thread_defines(SELFTEST_KERNELS), SELFTEST_KERNELS)


def kernel_program(variant) -> Program:
    """The NVSHMEM build of a ``moe_comm.jit.variants.Variant``."""
    return Program(f"kernels/{variant.source}", tuple(variant.defines), tuple(variant.kernels))


def cache_key(program: Program, arch: str, root: Path | None = None) -> str:
    root = root or csrc_dir()
    nv = nvshmem_install()
    digest = sources_digest([root / "kernels", root / "ibgda"],
                            label=lambda folder, f: f"{folder.name}/{f.name}")
    return key(OPTIONS_VERSION, _STD, digest, device_header.header_text(), program.source,
               repr(program.defines), arch,
               nv.version, nv.device_lib.stat().st_size, nvcc_version(nvcc_path()))


def _commands(program: Program, arch: str, root: Path, obj: Path, cubin: Path):
    nv, nvcc = nvshmem_install(), nvcc_path()
    macros = [f"-D{k}={v}" for k, v in program.defines]
    # -lineinfo: sanitizer reports name source lines. (No --warn-on-spills here: NVSHMEM's own
    # quiet/flush functions spill a few bytes; our kernels' frames are checked from the cubin.)
    compile_cmd = [nvcc, "-rdc=true", f"-arch={arch}", f"-std={_STD}", "-lineinfo",
                   "-DMOE_WITH_NVSHMEM", *macros,
                   "-I", str(root / "kernels"),
                   "-I", str(device_header.include_dir(cache_dir("ibgda"))),
                   "-I", str(nv.include),
                   "-c", str(root / program.source), "-o", str(obj)]
    link_cmd = [nvcc, f"-arch={arch}", "-dlink", "-cubin", str(obj), "-L", str(nv.lib),
                "-lnvshmem_device", "-o", str(cubin)]
    return compile_cmd, link_cmd


def _run(cmd, what: str) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise IbgdaBuildError(f"{what}: nvcc ran past {_TIMEOUT_S} s") from None
    log = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        raise IbgdaBuildError(f"{what} failed (exit {done.returncode}):\n{' '.join(cmd)}\n{log}")
    return log


def build_cubin(program: Program, arch: str, *, strict: bool = False, use_cache: bool = True,
                log_sink: list | None = None) -> bytes:
    """Device-linked cubin bytes of ``program`` for ``arch`` (``"sm_90"``, ``"sm_100"``, ...).

    ``strict``: any compiler or linker output (a warning) is an error (the CI test uses it).
    ``log_sink``: a list that receives the compile and link logs of a fresh build.
    Raises :class:`IbgdaBuildError`, or ``locate.NvshmemNotFoundError`` when NVSHMEM or nvcc
    is missing. Needs no GPU.
    """
    root = csrc_dir()
    digest = cache_key(program, arch, root)
    stem = Path(program.source).stem
    path = cache_dir("ibgda") / f"{stem}-{arch}-{digest[:40]}.cubin"
    if use_cache and path.is_file():
        return path.read_bytes()
    with tempfile.TemporaryDirectory(prefix="moe_ibgda_") as tmp:
        obj, cubin = Path(tmp) / f"{stem}.o", Path(tmp) / f"{stem}.cubin"
        compile_cmd, link_cmd = _commands(program, arch, root, obj, cubin)
        logs = [_run(compile_cmd, f"{program.label} for {arch}: nvcc -rdc compile")]
        logs.append(_run(link_cmd, f"{program.label} for {arch}: device link"))
        data = cubin.read_bytes()
    text = "\n".join(log for log in logs if log)
    if log_sink is not None:
        log_sink.append(text)
    if strict and text:
        raise IbgdaBuildError(f"{program.label} for {arch} built with diagnostics (warnings "
                              f"are errors here):\n{text}")
    missing = elf.unresolved(data)
    if missing:
        raise IbgdaBuildError(f"{program.label} for {arch}: device link left symbols "
                              f"unresolved: {sorted(missing)}")
    if use_cache:
        write_atomic(path, data)
    return data
