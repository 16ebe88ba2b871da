"""The pure-torch, single-process reference of dispatch/combine semantics.

Every backend is tested against these functions. They take every rank's inputs at once
(lists indexed by rank) and return every rank's outputs, written for clarity, not speed.

Normal mode order: a destination receives tokens ordered by source rank, then by the token's
index on the source; each token once per destination rank (deduplicated).
"""
from __future__ import annotations

import torch

from .layout import local_topk


def reference_dispatch(xs, topk_idxs, num_experts, topk_weights=None, scales=None):
    """``xs[r]`` [T_r, H] (any dtype), ``topk_idxs[r]`` [T_r, K] int64 with -1 for unused
    slots, ``topk_weights[r]`` [T_r, K] float32 or None, ``scales[r]`` [T_r, S] or None (any
    dtype and layout, float32 or UE8M0-packed int32: rows are taken as they are, and
    ``recv_scales`` is row-major in that dtype).

    Returns a list (per destination rank) of dicts with ``recv_x``, ``recv_scales``,
    ``recv_topk_idx`` (local ids / -1), ``recv_topk_weights`` (0 where -1),
    ``recv_src`` int64 [N, 2] of (source rank, token index), ``num_recv_tokens_per_expert``
    (list of ints, unaligned)."""
    num_ranks = len(xs)
    num_local = num_experts // num_ranks
    outs = []
    for dst in range(num_ranks):
        rows_x, rows_s, rows_i, rows_w, src = [], [], [], [], []
        for s in range(num_ranks):
            ids, w = local_topk(topk_idxs[s], None if topk_weights is None else topk_weights[s],
                                dst, num_local)
            tok = (ids >= 0).any(1).nonzero().flatten()
            rows_x.append(xs[s][tok])
            if scales is not None:
                rows_s.append(scales[s][tok])
            rows_i.append(ids[tok])
            if w is not None:
                rows_w.append(w[tok])
            src.append(torch.stack([torch.full_like(tok, s), tok], 1))
        recv_i = torch.cat(rows_i)
        outs.append(dict(
            recv_x=torch.cat(rows_x),
            recv_scales=torch.cat(rows_s) if scales is not None else None,
            recv_topk_idx=recv_i,
            recv_topk_weights=torch.cat(rows_w) if topk_weights is not None else None,
            recv_src=torch.cat(src),
            num_recv_tokens_per_expert=torch.bincount(recv_i[recv_i >= 0],
                                                      minlength=num_local).tolist()))
    return outs


def reference_combine(recv_ys, dispatched, num_tokens, out_dtype=None, bias=None):
    """Sum, for every token, the rows its destination ranks send back.

    ``recv_ys[d]`` [N_d, H] rows returned by rank ``d`` in its received order,
    ``dispatched`` the output of :func:`reference_dispatch`, ``num_tokens[r]`` T_r,
    ``bias[r]`` an optional [T_r, H] tensor (or tuple of tensors) added to the sum.
    Accumulates in float32; returns per-rank [T_r, H] in ``out_dtype`` (default: recv_ys')."""
    num_ranks = len(recv_ys)
    hidden = recv_ys[0].shape[1]
    dtype = out_dtype or recv_ys[0].dtype
    acc = [torch.zeros(num_tokens[r], hidden, dtype=torch.float32) for r in range(num_ranks)]
    for d in range(num_ranks):
        src = dispatched[d]["recv_src"]
        for row in range(src.shape[0]):
            s, t = src[row].tolist()
            acc[s][t] += recv_ys[d][row].float()
    if bias is not None:
        for r in range(num_ranks):
            for b in (bias[r] if isinstance(bias[r], (tuple, list)) else (bias[r],)):
                acc[r] += b.float()
    return [a.to(dtype) for a in acc]


def reference_ll_dispatch(xs, topk_idxs, num_experts, max_tokens):
    """Low-latency dispatch: one row per (token, expert), packed per local expert.

    Returns per destination rank a dict with ``recv_x`` [E_local, R*max_tokens, H] (rows past
    the count are zero), ``recv_count`` int32 [E_local], and ``recv_src`` int64
    [E_local, R*max_tokens, 3] of (source rank, token, top-k slot), -1 past the count. Rows of
    one expert are ordered by source rank, then token index."""
    num_ranks = len(xs)
    num_local = num_experts // num_ranks
    hidden = xs[0].shape[1]
    outs = []
    for dst in range(num_ranks):
        recv = torch.zeros(num_local, num_ranks * max_tokens, hidden, dtype=xs[0].dtype)
        src = torch.full((num_local, num_ranks * max_tokens, 3), -1, dtype=torch.int64)
        count = torch.zeros(num_local, dtype=torch.int32)
        for le in range(num_local):
            e = dst * num_local + le
            for s in range(num_ranks):
                hits = (topk_idxs[s] == e).nonzero()          # (token, slot), token-sorted
                for t, k in hits.tolist():
                    i = int(count[le])
                    recv[le, i] = xs[s][t]
                    src[le, i] = torch.tensor([s, t, k])
                    count[le] += 1
        outs.append(dict(recv_x=recv, recv_count=count, recv_src=src))
    return outs


def reference_ll_combine(recv_ys, dispatched, topk_idxs, topk_weights):
    """``recv_ys[d]`` [E_local, R*max_tokens, H]: expert outputs in the received layout.
    Returns per rank [T, H] bf16: sum over k of weight[t, k] * output of expert k for token t
    (float32 accumulation; -1 slots contribute nothing)."""
    num_ranks = len(recv_ys)
    hidden = recv_ys[0].shape[-1]
    acc = [torch.zeros(t.shape[0], hidden) for t in topk_idxs]
    for d in range(num_ranks):
        src, count = dispatched[d]["recv_src"], dispatched[d]["recv_count"]
        for le in range(src.shape[0]):
            for i in range(int(count[le])):
                s, t, k = src[le, i].tolist()
                acc[s][t] += topk_weights[s][t, k] * recv_ys[d][le, i].float()
    return [a.bfloat16() for a in acc]
