"""Reuse of output tensors the caller has dropped.

On the CPU, fresh output memory costs a page fault per 4 KiB on first touch, which dominates
low-latency calls (a 58 MB recv_x of which a few MB are written). The pool keeps one base
tensor per key and hands out views of it; a view holds a reference to the storage, so while
the caller keeps any tensor of an earlier call, the storage's use count is above our own and
a fresh tensor is allocated instead. Without torch's use-count hook it always allocates.
"""
from __future__ import annotations

import torch

from . import native

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_users(storage: torch.UntypedStorage) -> int:
    """How many hold ``storage`` (the caller's own reference counted; a large number where
    torch has no use-count hook, so nothing is ever taken for unused)."""
    return _use_count(storage._cdata) if _use_count is not None else 1 << 30


def _only_ours(base: torch.Tensor) -> bool:
    # our base tensor + the temporary UntypedStorage object of this query
    return storage_users(base.untyped_storage()) <= 2


def _on(base: torch.Tensor, at: int, shape, dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` on ``base``'s storage from byte ``at`` (a multiple
    of the dtype's size): not a view of base, so autograd lets the caller change it in place
    (a view returned by a custom Function may not be), and its use of the storage still
    counts (_only_ours)."""
    return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), at // dtype.itemsize,
                                            shape)


class OutputPool:
    def __init__(self):
        self._bases = {}
        self._spans = {}

    def carve(self, key, shapes) -> list:
        """Tensors of ``shapes`` (``(rows, cols, dtype)`` each; 64-byte aligned, one base
        tensor under them), for outputs whose shapes change from call to call (host/small.py,
        the normal combine): a base of ``key`` that no tensor of the caller still uses and is
        large enough is reused (its pages are touched already: a fresh one of a few MB costs a
        page fault every 4 KiB, as much as the call's copies); two per key, so the results the
        caller holds while it makes the next call do not force a new one each call."""
        offsets, total = [], 0
        for r, c, dt in shapes:
            offsets.append(total)
            total += -(-(r * c * dt.itemsize) // 64) * 64
        bases = self._spans.setdefault(key, [])
        base = next((b for b in bases if b.numel() >= total and _only_ours(b)), None)
        if base is None:
            # (not a view of another tensor: its _base would count as a use of the storage)
            base = native.advise_huge_pages(torch.empty(total, dtype=torch.uint8))
            bases.insert(0, base)
            del bases[2:]
        return [_on(base, at, (r, c), dt) for at, (r, c, dt) in zip(offsets, shapes)]

    def empty(self, key, shape, dtype) -> torch.Tensor:
        base = self._bases.get(key)
        if base is None or tuple(base.shape) != tuple(shape) or base.dtype != dtype or \
                not _only_ours(base):
            base = self._bases[key] = torch.empty(shape, dtype=dtype)
        return _on(base, 0, tuple(shape), dtype)

    def clear(self):
        self._bases.clear()
        self._spans.clear()


# outputs smaller than this come from torch's allocator, whose memory glibc reuses
POOLED_BYTES = 1 << 20


def outputs(pool: OutputPool, key: str, shapes, poison=None) -> list:
    """Output tensors of ``shapes`` (``(rows, cols, dtype)`` each, or None) carved from one
    reused base of ``pool`` (OutputPool.carve) when they come to POOLED_BYTES or more: a fresh
    output of that size faults in a page every 4 KiB on first touch (a 1024 x 7168 bf16 combine
    output: 300-360 faults a call on this machine, where a VM's host fault made one call in a few
    take 7 ms instead of 2); filled with ``poison`` where a test asked for it (unwritten rows
    show up)."""
    wanted = [s for s in shapes if s is not None]
    sizes = [r * c * dt.itemsize for r, c, dt in wanted]
    if sum(sizes) < POOLED_BYTES:        # the allocator's own reuse: no fresh pages
        outs = [torch.empty(r, c, dtype=dt) for r, c, dt in wanted]
    else:
        outs = pool.carve(key, wanted)
    for t in outs if poison is not None else ():
        t.view(torch.uint8).fill_(poison)
    outs = iter(outs)
    return [None if s is None else next(outs) for s in shapes]
