"""Where the device sources are, and the on-disk cache every kernel build writes to.

One cache for the three builds (NVRTC cubins, nvcc IBGDA cubins, emulator libraries): a file
is named by a sha256 key over everything that could change its bytes (the source folders'
files, the macros, the tool and its version, the options), and written atomically (temporary
file + rename), so ranks that build the same kernel at once never see half a file. Root:
``$MOE_COMM_CACHE_DIR``, default ``~/.cache/moe_comm/kernels`` (IBGDA builds in ``ibgda``
beside it: the default layout of earlier versions, kept so caches stay warm).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
import tempfile

SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")


def csrc_dir() -> Path:
    """``$MOE_COMM_CSRC_DIR`` or the repository's csrc/ (kernels/, ibgda/, emu/ are siblings:
    transport.cuh includes ../ibgda/transport_nvshmem.cuh)."""
    env = os.environ.get("MOE_COMM_CSRC_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "csrc"
    if not (path / "kernels").is_dir() or not (path / "ibgda").is_dir():
        raise FileNotFoundError(f"device sources not found at {path} (expected kernels/ and "
                                "ibgda/; set MOE_COMM_CSRC_DIR)")
    return path


def kernel_dir() -> Path:
    """The folder of the mode kernels: ``$MOE_COMM_KERNEL_DIR`` or csrc/kernels."""
    env = os.environ.get("MOE_COMM_KERNEL_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "csrc" / "kernels"
    if not path.is_dir():
        raise FileNotFoundError(f"kernel sources not found at {path} (set MOE_COMM_KERNEL_DIR)")
    return path


def cache_dir(kind: str = "") -> Path:
    """The cache folder of one build kind: ``""`` NVRTC cubins, ``"emu"`` emulator libraries
    (inside it), ``"ibgda"`` nvcc builds (beside it)."""
    env = os.environ.get("MOE_COMM_CACHE_DIR")
    if kind == "ibgda":
        return (Path(env) if env else Path.home() / ".cache" / "moe_comm") / "ibgda"
    root = Path(env) if env else Path.home() / ".cache" / "moe_comm" / "kernels"
    return root / kind if kind else root


def sources_digest(folders, label=lambda folder, f: f.name) -> str:
    """sha256 over the names (as ``label`` gives them) and bytes of every source file in
    ``folders``: editing any header changes the key of every build that might include it."""
    h = hashlib.sha256()
    for folder in folders:
        for f in sorted(Path(folder).iterdir()):
            if f.is_file() and f.suffix in SOURCE_SUFFIXES:
                h.update(label(folder, f).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def key(*parts) -> str:
    """sha256 over ``parts`` (each as text)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(str(part).encode() + b"\0")
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> bool:
    """Write a cache file so readers never see half of it; False if it could not be written
    (a read-only cache only costs a rebuild next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError:
        return False
