"""The arguments every kernel of a mode shares, by name, from a CudaComm (the names of
moe_comm/jit/kernel_args.py's GROUP, LL_GROUP and ERRORS)."""
from __future__ import annotations

from .comm import CudaComm


def group(comm: CudaComm) -> dict:
    """A normal-mode kernel's view of the group (csrc/kernels/normal.cuh ``Group``)."""
    return {"bases": comm.bases, "rank": comm.rank, "num_ranks": comm.num_ranks,
            "data_off": comm.heap_offset, "capacity": comm.heap_bytes,
            "timeout_ns": comm.timeout_ns, "active": comm.active, "floors": comm.floors}


def ll_group(comm: CudaComm, timeout_ns: int | None = None) -> dict:
    """A low-latency (or agreement) kernel's view of the group (low_latency.cuh ``LLGroup``;
    ``active`` is passed on its own, it sits elsewhere in those lists)."""
    return {"bases": comm.bases, "rank": comm.rank, "num_ranks": comm.num_ranks,
            "timeout_ns": comm.timeout_ns if timeout_ns is None else timeout_ns}


def errors(comm: CudaComm, op: str) -> dict:
    """Where a kernel reports an error, and which phase ``op`` it is (sync.cuh ``ErrorSink``)."""
    err_host, err_dev, op_id = comm.error_args(op)
    return {"err_host": err_host, "err_dev": err_dev, "op": op_id}
