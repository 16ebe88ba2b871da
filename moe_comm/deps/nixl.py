"""NIXL, imported on first use: the build wheel's module (``nixl_cu13``, else ``nixl_cu12``),
else the ``nixl`` meta package's.

The build wheel is imported directly because the meta package picks the build by the CUDA
major version torch was built with and raises when that build is not the installed one (a
CUDA 12 torch next to nixl-cu13); the engine uses host memory only, so any build serves.

Importing it is cheap, but the first UCX backend loads UCX's transport modules; next to
Debian's rdma-core, UCX's ``efa`` module brings a second copy of libnl and every process
segfaulted at exit (../shared/TOOLING.md section 8). Where no EFA device exists that module
has nothing to drive, so :func:`api` switches it off -- only when the user did not set
``UCX_MODULES`` -- before any backend starts. NIXL's own INFO lines (one per agent and
backend, on stdout) are lowered to warnings unless ``NIXL_LOG_LEVEL`` says otherwise.
"""
from __future__ import annotations

import functools
import glob
import importlib
import importlib.util
import os

MODULES = ("nixl_cu13", "nixl_cu12", "nixl")


def installed() -> bool:
    """Whether a NIXL module is installed, without importing it."""
    return _module() is not None


def _module():
    """The first of :data:`MODULES` that is installed, or None."""
    for name in MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def efa_present() -> bool:
    return bool(glob.glob("/sys/class/infiniband/efa*"))


@functools.cache
def api():
    """NIXL's ``_api`` module (``nixl_agent``, ``nixl_agent_config``); raises ImportError
    when none is installed, else what its import raises."""
    if "UCX_MODULES" not in os.environ and not efa_present():
        os.environ["UCX_MODULES"] = "^efa"
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    name = _module()
    if name is None:
        raise ImportError(f"none of {MODULES} is installed")
    return importlib.import_module(f"{name}._api")


def import_error() -> str | None:
    """Why NIXL cannot be used here, or None when it imports."""
    if not installed():
        return "NIXL is not installed (pip install 'moe_comm[nixl]')"
    try:
        api()
    except Exception as e:  # noqa: BLE001 - anything its import raises
        return f"NIXL does not import: {type(e).__name__}: {e}"
    return None
