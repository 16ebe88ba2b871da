"""What moe_comm is measured against: its exchanges done with all_to_all_single.

Both bench scripts time these. ``a2a(out, inp, out_splits=None, in_splits=None)`` is
torch.distributed.all_to_all_single on the caller's group (bench_all_to_all.py: gloo, or an
NCCL group on the cuda backend; gpu_check.py: gloo, CUDA tensors staged through host memory
when gloo refuses them). Payloads travel as byte rows, so one call moves every tensor of a
token and any group takes any dtype."""
from __future__ import annotations

import torch


def byte_rows(*tensors):
    """[T, *] tensors side by side as one uint8 [T, bytes] tensor: a token's message."""
    return torch.cat([t.view(torch.uint8) for t in tensors], 1)


def normal_exchange(x, idx, w, is_token_in_rank, num_tokens_per_rank, a2a):
    """Normal mode: permute the tokens by destination rank, exchange the counts, exchange the
    payload rows (x, its fp8 scales if any, top-k ids and weights), and on the way back sum
    each token's returned rows. ``x``: a tensor or (fp8 data, scales); ``is_token_in_rank``
    [T, ranks] and ``num_tokens_per_rank`` [ranks]: the dispatch layout of ``idx``.
    Returns ``dispatch()`` -> the received byte rows, and ``combine(y)`` -> [T, H] in y's
    dtype, for ``y`` [received rows, H] (call dispatch first: combine uses its counts)."""
    data, scales = x if isinstance(x, tuple) else (x, None)
    dev = data.device
    rows = byte_rows(*[t for t in (data, scales, idx, w) if t is not None])
    send_ids = torch.cat([is_token_in_rank[:, d].nonzero().flatten()
                          for d in range(is_token_in_rank.shape[1])])
    counts = {}

    def dispatch():
        send = rows.index_select(0, send_ids)
        send_counts = num_tokens_per_rank.long()
        recv_counts = torch.empty_like(send_counts)
        a2a(recv_counts, send_counts)
        counts.update(send=send_counts.tolist(), recv=recv_counts.tolist())
        recv = torch.empty(sum(counts["recv"]), rows.shape[1], dtype=torch.uint8, device=dev)
        a2a(recv, send, counts["recv"], counts["send"])
        return recv

    def combine(y):
        back = torch.empty(sum(counts["send"]), y.shape[1], dtype=y.dtype, device=dev)
        a2a(back.view(torch.uint8), y.view(torch.uint8), counts["send"], counts["recv"])
        out = torch.zeros(data.shape[0], y.shape[1], dtype=torch.float32, device=dev)
        out.index_add_(0, send_ids, back.float())
        return out.to(y.dtype)

    return dispatch, combine


class PaddedExchange:
    """Low-latency mode: the fixed-shape exchange an all_to_all needs without a count
    exchange (what pplx-kernels compares against). Every rank sends each destination
    ``max_tokens x min(top-k, experts per rank)`` message slots, filled in expert order, the
    rest padding. ``idx``/``w``: this rank's top-k ids and weights [T, K]; -1 ids are unused."""

    def __init__(self, idx, w, num_experts, ranks, max_tokens, a2a):
        self.ranks, self.a2a, self.w = ranks, a2a, w
        self.tokens, self.device = idx.shape[0], idx.device
        self.num_local = num_experts // ranks
        self.slots = max_tokens * min(idx.shape[1], self.num_local)
        tok, k = (idx >= 0).nonzero(as_tuple=True)
        expert = idx[tok, k]
        order = torch.sort(expert, stable=True).indices
        self.tok, self.k, self.expert = tok[order], k[order], expert[order]
        self.dst = self.expert // self.num_local
        # each message's slot at its destination: its place among the messages sent there
        self.pos = (torch.arange(self.tok.numel(), device=self.device) -
                    torch.searchsorted(self.dst, self.dst))

    def dispatch(self, msgs):
        """``msgs`` uint8 [T, bytes], a row per token -> (received uint8 [ranks, slots, bytes],
        int64 [ranks, slots, 2]: each slot's local expert and token at its sender, -1 for
        padding)."""
        send = torch.zeros(self.ranks, self.slots, msgs.shape[1], dtype=torch.uint8,
                           device=self.device)
        meta = torch.full((self.ranks, self.slots, 2), -1, dtype=torch.int64, device=self.device)
        send[self.dst, self.pos] = msgs[self.tok]
        meta[self.dst, self.pos, 0] = self.expert % self.num_local
        meta[self.dst, self.pos, 1] = self.tok
        recv, recv_meta = torch.empty_like(send), torch.empty_like(meta)
        self.a2a(recv, send)
        self.a2a(recv_meta, meta)
        return recv, recv_meta

    def combine(self, back):
        """``back`` bf16 [ranks, slots, H]: the expert outputs in the slots their messages came
        in -> bf16 [T, H], each token's returned rows weighted by its top-k weights."""
        recv = torch.empty_like(back)
        self.a2a(recv.view(torch.uint8), back.view(torch.uint8))
        out = torch.zeros(self.tokens, back.shape[-1], device=self.device)
        out.index_add_(0, self.tok,
                       recv[self.dst, self.pos].float() * self.w[self.tok, self.k, None])
        return out.bfloat16()
