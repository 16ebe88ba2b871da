"""cuda.pathfinder (where NVIDIA's wheels put headers and libraries), imported on first use."""
from __future__ import annotations


def nvidia_header_directory(name: str) -> str | None:
    """``cuda.pathfinder.find_nvidia_header_directory(name)``, or None where pathfinder is
    missing, too old, or finds nothing."""
    try:
        from cuda import pathfinder
        return pathfinder.find_nvidia_header_directory(name)
    except Exception:  # noqa: BLE001 - pathfinder missing or too old
        return None
