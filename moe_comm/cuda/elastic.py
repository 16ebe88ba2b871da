"""Elastic mode on the CUDA backend: the survivors leave every call with the same mask.

Each rank masks a peer when one of its own waits passes the deadline (csrc/kernels/transport.cuh
``wait_from``), so survivors can disagree about a rank that died mid-call. :func:`agree` queues
the agreement kernel (csrc/kernels/elastic.cuh: flooding rounds with an early decision), the
twin of ``HostComm.agree``. The mode modules run it

* after a dispatch's notify (fresh routing): the count matrix's rows and columns of masked
  ranks are zeroed in the same kernel, so every survivor computes the same row offsets before
  any payload moves;
* at the end of every normal call and of both low-latency receive halves.

A rank its peers masked out learns it from their decision (its own bit cleared) and the host
raises ``moe_comm.RankMaskedError`` at the next check.
"""
from __future__ import annotations

from ..jit import variants
from ..jit.kernel_args import pack
from ..jit.launch import launch
from ..jit.variants import THREADS
from ..wire import LINE_WORDS, MAX_EPOCH, agree_round_tag, agree_rounds, round_up
from .comm import CudaComm
from .kernel_inputs import errors, ll_group

AGREE_GRACE_NS = 10**9    # HostComm's AGREE_GRACE_S: the round waits a deadline plus this


def agree(comm: CudaComm, op: str, matrix=None, floors=None, late: int = 0) -> None:
    """Queue the mask agreement of an elastic group on the current stream (a no-op for a
    group that is not elastic). ``matrix``: int32 [R, R] count matrix to zero the masked
    ranks' rows and columns of. ``floors`` (``comm.floors``, at the end of a normal
    operation): moved past this operation's slabs if a rank that may still write there is
    dropped (csrc/kernels/elastic.cuh). ``late``: deadlines more a healthy peer may arrive
    after this rank (a relayed call, whose relays may wait out dead peers before they write:
    moe_comm/cuda/relay.py, like ``HostComm.agree(late=)``)."""
    if not comm.elastic:
        return
    comm.agree_seq = comm.agree_seq % MAX_EPOCH + 1
    lay = comm.layout
    row_stride = round_up(lay.mask_words, LINE_WORDS) * 8
    k = comm.kernels(variants.intranode())
    # A healthy peer may reach a round a full deadline after this rank did (it timed out on
    # a rank whose signals reached this one): each round's wait covers that, and a grace more.
    wait_ns = (1 + late) * comm.timeout_ns + min(comm.timeout_ns, AGREE_GRACE_NS)
    seq, R = comm.agree_seq, comm.num_ranks
    launch(k["moe_agree"], 1, THREADS["moe_agree"],
           pack("moe_agree", **ll_group(comm, timeout_ns=wait_ns), **errors(comm, op),
                active=comm.active, told=comm.told, mask_off=lay.mask(0, 0) * 8,
                decided_off=lay.decided(seq % 2, 0) * 8, fence_off=lay.fence * 8,
                row_stride=row_stride, mask_words=lay.mask_words, seq=seq,
                tag0=agree_round_tag(seq, 1, R), max_rounds=agree_rounds(R), matrix=matrix,
                floors=floors),
           device=comm.device)
