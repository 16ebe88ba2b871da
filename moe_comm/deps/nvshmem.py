"""nvshmem4py, imported on first use (a GPU machine with the wheel; never needed on a CPU)."""
from __future__ import annotations


def core():
    """``nvshmem.core``; raises what its import raises."""
    import nvshmem.core
    return nvshmem.core


def bindings():
    """``nvshmem.bindings`` (the raw host API)."""
    import nvshmem.bindings
    return nvshmem.bindings


def import_error() -> str | None:
    """Why nvshmem4py cannot be imported here, or None when it can."""
    try:
        core()
    except ImportError as e:
        return f"nvshmem4py not installed or not importing ({e})"
    except Exception as e:  # noqa: BLE001 - anything it raises at import
        return f"nvshmem4py does not import: {type(e).__name__}: {e}"
    return None
