"""MPICH's exchange as the second baseline: ``all_to_all_single`` over an MPI communicator.

a2a_baseline's exchanges (normal_exchange: permute, exchange counts, exchange payload rows,
unpermute; PaddedExchange: the fixed-shape low-latency exchange) take the all_to_all as an
argument, so the MPI baseline is the same algorithm on the same data with only the transport
swapped: equal splits go through ``Alltoall``, uneven ones through ``Alltoallv``, both on the
tensors' bytes (any dtype, no MPI datatype per tensor). CPU tensors are handed to MPI without
a copy; CUDA tensors are staged through host memory (the MPICH wheel is not CUDA-aware), and
the staging counts in the baseline's time.
"""
from __future__ import annotations

import itertools
import math

import torch


def _bytes(t):
    """A CPU tensor's memory as a flat numpy uint8 array (shared, not copied)."""
    if not t.is_contiguous():
        raise ValueError("MPI exchanges need contiguous tensors")
    return t.reshape(-1).view(torch.uint8).numpy()


def _row_bytes(t):
    return math.prod(t.shape[1:]) * t.element_size()


def mpi_all_to_all_single(comm):
    """``a2a(out, inp, out_splits=None, in_splits=None)`` with
    torch.distributed.all_to_all_single's meaning (splits count rows of dim 0; None: equal
    parts), carried out by ``comm`` (an mpi4py communicator)."""

    def a2a(out, inp, out_splits=None, in_splits=None):
        host_out = out if out.device.type == "cpu" else torch.empty_like(out, device="cpu")
        host_in = inp if inp.device.type == "cpu" else inp.cpu()
        recv, send = _bytes(host_out), _bytes(host_in)
        if out_splits is None and in_splits is None:
            comm.Alltoall(send, recv)
        else:
            send_counts = [c * _row_bytes(inp) for c in in_splits]
            recv_counts = [c * _row_bytes(out) for c in out_splits]
            comm.Alltoallv([send, (send_counts, _offsets(send_counts))],
                           [recv, (recv_counts, _offsets(recv_counts))])
        if host_out is not out:
            out.copy_(host_out)

    return a2a


def _offsets(counts):
    """Where each peer's part starts: the running sum of the counts before it."""
    return [0, *itertools.accumulate(counts)][:-1]
