"""NIXL (the ``nixl`` package with its ``nixl-cu13``/``nixl-cu12`` build), imported on first use.

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
import importlib.util
import os


def installed() -> bool:
    """Whether ``nixl`` can be imported, without importing it (``auto`` asks this on
    machines that never use NIXL)."""
    try:
        return importlib.util.find_spec("nixl") is not None
    except (ImportError, ValueError):
        return False


def efa_present() -> bool:
    return bool(glob.glob("/sys/class/infiniband/efa*"))


@functools.cache
def api():
    """``nixl._api`` (``nixl_agent``, ``nixl_agent_config``); raises what its import raises."""
    if "UCX_MODULES" not in os.environ and not efa_present():
        os.environ["UCX_MODULES"] = "^efa"
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from nixl import _api
    return _api


def import_error() -> str | None:
    """Why NIXL cannot be used here, or None when it imports."""
    if not installed():
        return "NIXL is not installed (pip install 'moe_comm[nixl]')"
    try:
        api()
    except Exception as e:  # noqa: BLE001 - anything its import raises
        return f"NIXL does not import: {type(e).__name__}: {e}"
    return None
