"""The ``bases`` words of a CUDA group whose network ranks are reached through NVSHMEM (IBGDA);
csrc/kernels/transport.cuh has the device side.

The kernels get ``bases[-1]`` and ``bases[0..R)``:

==================  ===========================================================================
word                meaning
==================  ===========================================================================
``bases[-1]``       this rank's own buffer in the symmetric heap (``sym``): NVSHMEM names the
                    destination ``offset`` of PE r's buffer as ``sym + offset``
``0``               no transport to that rank (kernels report ``kErrNoTransport``)
pointer (bit 0 = 0) this GPU stores to it directly: own buffer, or ``nvshmem_ptr`` of an
                    NVLink/P2P peer
``mirror | 1``      network rank: messages are built (or copied) in this rank's mirror of that
                    rank's buffer, in the symmetric heap, and put from there to PE r
==================  ===========================================================================

The host proxy (moe_comm/cuda/kernel_proxy.py) uses the same ``mirror | 1`` words, with the proxy's
command ring as ``bases[-1]``. Pure Python: CI tests it without a GPU.
"""
from __future__ import annotations

NETWORK_TAG = 1                      # the low bit of a network rank's word
KIND_NONE, KIND_POINTER, KIND_NETWORK = "none", "pointer", "network"


def _address(value: int, what: str) -> int:
    value = int(value)
    if value <= 0 or value & NETWORK_TAG:
        raise ValueError(f"{what} must be a non-null, 2-byte aligned address, got {value:#x}")
    return value


def encode_bases(rank: int, own_ptr: int, peer_ptrs, mirrors: dict) -> list:
    """``bases[0..R)`` for rank ``rank`` whose buffer starts at ``own_ptr``.

    ``peer_ptrs[r]``: a local mapping of rank r's buffer (``nvshmem_ptr``), or 0 when r is
    reachable only over the network; entry ``rank`` is ignored. ``mirrors[r]``: the address of
    this rank's mirror of r's buffer, for every network rank r. Raises ``ValueError`` for a bad
    rank, an odd address, or a network rank without a mirror.
    """
    peer_ptrs = [int(p) for p in peer_ptrs]
    if not 0 <= rank < len(peer_ptrs):
        raise ValueError(f"rank {rank} outside a group of {len(peer_ptrs)}")
    words = []
    for r, p in enumerate(peer_ptrs):
        if r == rank:
            words.append(_address(own_ptr, "own_ptr"))
        elif p:
            words.append(_address(p, f"the peer pointer of rank {r}"))
        elif r in mirrors:
            words.append(_address(mirrors[r], f"the mirror of rank {r}") | NETWORK_TAG)
        else:
            raise ValueError(f"rank {r} is reachable only over the network and has no mirror")
    return words


def decode_base(word: int):
    """``(kind, address)`` of one word: ``("none", 0)``, ``("pointer", ptr)`` or
    ``("network", mirror address)``."""
    word = int(word)
    if word == 0:
        return KIND_NONE, 0
    if word & NETWORK_TAG:
        return KIND_NETWORK, word & ~NETWORK_TAG
    return KIND_POINTER, word


def network_ranks(words) -> list:
    """Ranks a group of ``bases`` words reaches over the network."""
    return [r for r, w in enumerate(words) if decode_base(w)[0] == KIND_NETWORK]
