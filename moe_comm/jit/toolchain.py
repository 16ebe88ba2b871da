"""Where NVSHMEM (the ``nvidia-nvshmem-cu13`` wheel) and nvcc are, and their versions.

Search order for NVSHMEM: ``$NVSHMEM_HOME`` (a folder with ``include/`` and ``lib/``), then
``cuda.pathfinder.find_nvidia_header_directory("nvshmem")``, then the installed
``nvidia.nvshmem`` package folder. The version is read from the headers
(``non_abi/nvshmem_version.h``), so nothing here loads NVSHMEM or needs a GPU.

nvcc: ``$MOE_COMM_NVCC``, then ``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``), then ``nvcc`` on
``PATH``, then ``/usr/local/cuda/bin/nvcc``.
"""
from __future__ import annotations

from dataclasses import dataclass
import functools
import importlib.util
import os
from pathlib import Path
import re
import shutil
import subprocess

from ..deps.pathfinder import nvidia_header_directory


class NvshmemNotFoundError(FileNotFoundError):
    """The NVSHMEM wheel (headers + libnvshmem_device.a) or nvcc is not installed."""


@dataclass(frozen=True)
class NvshmemInstall:
    root: Path          # holds include/ and lib/
    include: Path
    lib: Path
    device_lib: Path    # lib/libnvshmem_device.a (static device library for nvcc -dlink)
    version: str        # "3.8.0"


def _candidates():
    env = os.environ.get("NVSHMEM_HOME")
    if env:
        yield Path(env)
        return                      # an explicit choice is not second-guessed
    inc = nvidia_header_directory("nvshmem")
    if inc:
        yield Path(inc).parent
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or ():
            yield Path(loc)


def _header_version(include: Path) -> str:
    header = include / "non_abi" / "nvshmem_version.h"
    text = header.read_text(errors="replace")
    m = re.search(r'#define\s+NVSHMEM_VENDOR_BASE_VERSION_STRING\s+"([^"]+)"', text)
    if m:
        return m.group(1)
    # releases before 3.8 (3.4.5, the GPU image's) define only the numbers
    parts = [re.search(rf"#define\s+NVSHMEM_VENDOR_{p}_VERSION\s+(\d+)", text)
             for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise NvshmemNotFoundError(f"no NVSHMEM version in {header}")
    return ".".join(m.group(1) for m in parts)


@functools.lru_cache(maxsize=None)
def _find(env_home):  # keyed on $NVSHMEM_HOME so tests can switch it
    tried = []
    for root in _candidates():
        include, lib = root / "include", root / "lib"
        device_lib = lib / "libnvshmem_device.a"
        tried.append(str(root))
        if (include / "nvshmem.h").is_file() and device_lib.is_file():
            return NvshmemInstall(root, include, lib, device_lib, _header_version(include))
    where = ", ".join(tried) or "nowhere (no $NVSHMEM_HOME, no nvidia.nvshmem package)"
    raise NvshmemNotFoundError(
        "NVSHMEM headers + libnvshmem_device.a not found (looked in " + where + "); "
        "pip install nvidia-nvshmem-cu13 (or set NVSHMEM_HOME)")


def nvshmem_install() -> NvshmemInstall:
    """The NVSHMEM installation device code is built against. Raises NvshmemNotFoundError."""
    return _find(os.environ.get("NVSHMEM_HOME"))


def nvcc_path() -> str:
    env = os.environ.get("MOE_COMM_NVCC")
    if env:
        return env
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)
    if not found:
        raise NvshmemNotFoundError("nvcc not found (set MOE_COMM_NVCC or CUDA_HOME, or put "
                                   "the CUDA toolkit's bin/ on PATH)")
    return found


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    """``"13.0.88"`` from ``nvcc --version`` (part of every cache key)."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]
