"""The ``bases[R]`` words kernels built with ``MOE_WITH_NVSHMEM`` receive: how each rank is
reached (csrc/ibgda/transport_nvshmem.cuh has the device side).

==================  ===========================================================================
word                meaning
==================  ===========================================================================
``0``               no transport to that rank (kernels report ``kErrNoTransport``)
pointer (bit 0 = 0) this GPU stores to it directly: own buffer, CUDA IPC mapping, or
                    ``nvshmem_ptr`` of an NVLink/P2P peer
``sym | 1``         network peer: NVSHMEM PE = the rank, destination = symmetric address
                    ``sym + offset`` (``sym`` = this rank's own symmetric buffer)
==================  ===========================================================================

Pure Python: CI tests it without a GPU.
"""
from __future__ import annotations

REMOTE_TAG = 1                       # csrc/ibgda/transport_nvshmem.cuh: kRemoteTag
KIND_NONE, KIND_POINTER, KIND_REMOTE = "none", "pointer", "remote"


def encode_bases(rank: int, own_ptr: int, peer_ptrs) -> list:
    """``bases`` words for rank ``rank`` whose symmetric buffer starts at ``own_ptr``.

    ``peer_ptrs[r]``: what ``nvshmem_ptr(own_ptr, r)`` returned for rank r (a local mapping of
    r's buffer, or 0 when r is reachable only over the network); entry ``rank`` is ignored.
    Raises ``ValueError`` for a buffer whose address has the tag bit set (never happens with
    nvshmem_malloc, which aligns far more) or a bad rank.
    """
    peer_ptrs = [int(p) for p in peer_ptrs]
    if not 0 <= rank < len(peer_ptrs):
        raise ValueError(f"rank {rank} outside a group of {len(peer_ptrs)}")
    own_ptr = int(own_ptr)
    if own_ptr <= 0 or own_ptr & REMOTE_TAG:
        raise ValueError(f"own_ptr must be a non-null, 2-byte aligned device address, got "
                         f"{own_ptr:#x}")
    words = []
    for r, p in enumerate(peer_ptrs):
        if r == rank:
            words.append(own_ptr)
        elif p:
            if p & REMOTE_TAG:
                raise ValueError(f"peer pointer of rank {r} is odd: {p:#x}")
            words.append(p)
        else:
            words.append(own_ptr | REMOTE_TAG)
    return words


def decode_base(word: int):
    """``(kind, address)`` of one word: ``("none", 0)``, ``("pointer", ptr)`` or
    ``("remote", symmetric address)``."""
    word = int(word)
    if word == 0:
        return KIND_NONE, 0
    if word & REMOTE_TAG:
        return KIND_REMOTE, word & ~REMOTE_TAG
    return KIND_POINTER, word


def network_ranks(words) -> list:
    """Ranks a group of ``bases`` words reaches over the network (IBGDA / NVSHMEM proxy)."""
    return [r for r, w in enumerate(words) if decode_base(w)[0] == KIND_REMOTE]
