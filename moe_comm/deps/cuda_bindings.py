"""The CUDA driver and NVRTC bindings (package cuda-bindings), imported on first use."""
from __future__ import annotations

import functools


@functools.cache
def driver():
    """``cuda.bindings.driver``."""
    from cuda.bindings import driver as cu
    return cu


@functools.cache
def nvrtc():
    """``cuda.bindings.nvrtc``."""
    from cuda.bindings import nvrtc as module
    return module


def check(result, what: str):
    """Unwrap a driver call's ``(CUresult, *values)`` tuple: its value(s), or raise naming
    ``what``."""
    err = result[0]
    if err != driver().CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    return result[1] if len(result) == 2 else result[1:]
