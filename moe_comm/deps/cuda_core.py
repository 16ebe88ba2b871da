"""cuda.core (compiling, loading, launching), imported on first use."""
from __future__ import annotations

import functools


@functools.cache
def cuda_core():
    """The cuda.core namespace: ``cuda.core`` (>= 0.5), else ``cuda.core.experimental``
    (older images name the same classes there)."""
    try:
        import cuda.core as cc
        cc.Program  # noqa: B018 - present from 0.5 on
        return cc
    except (ImportError, AttributeError):
        import cuda.core.experimental as cc
        return cc
