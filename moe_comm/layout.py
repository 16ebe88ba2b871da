"""Dispatch layout: which ranks and experts each token goes to. Pure torch, any device."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DispatchLayout:
    """Where a dispatch's tokens go, computed once per call and handed down the layers.

    ``per_rank`` int32 [R] tokens for each rank (once per token however many of its experts
    live there), ``per_expert`` int32 [E] (token, slot) pairs per expert (None where not
    needed), ``in_rank`` bool [T, R]; ``send_pos`` int32 [T, R] (CUDA backend only, else None):
    token t's row among this rank's rows for rank d, -1 where not sent, which fixes the
    receive order "by source rank, then token index"."""

    per_rank: torch.Tensor
    per_expert: torch.Tensor | None
    in_rank: torch.Tensor
    send_pos: torch.Tensor | None = None


def tokens_per_host(in_rank: torch.Tensor, host_of) -> torch.Tensor | None:
    """DeepEP's ``num_tokens_per_rdma_rank``: int32 [hosts], how many tokens go to at least one
    rank of each host (a token crosses to a host once, however many of its ranks it visits);
    None when the group is on one host. ``host_of``: int64 [R] host index of every rank. Any
    device, no host synchronisation."""
    if host_of is None:
        return None
    host_of = host_of.to(in_rank.device)
    num_hosts = int(host_of.max()) + 1 if host_of.numel() else 1
    hits = torch.zeros(in_rank.shape[0], num_hosts, dtype=torch.int32, device=in_rank.device)
    hits.index_add_(1, host_of, in_rank.to(torch.int32))
    return (hits > 0).sum(0, dtype=torch.int32)


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """Counts and membership for routing ``topk_idx`` ([T, K] int64, -1 = unused slot).

    Returns ``(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E],
    is_token_in_rank bool [T, R])``. A token counts once per destination rank however many of
    its experts live there (normal mode deduplicates per rank)."""
    num_local = num_experts // num_ranks
    valid = topk_idx >= 0
    ranks = torch.where(valid, topk_idx // num_local, num_ranks)      # R = "nowhere" column
    member = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool,
                         device=topk_idx.device)
    member.scatter_(1, ranks, True)
    is_token_in_rank = member[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


def local_topk(topk_idx: torch.Tensor, topk_weights, rank: int, num_local: int):
    """Top-k ids as seen by ``rank``: local expert ids, -1 where the expert lives elsewhere;
    weights zeroed on those slots (so combining weights back sums to the original)."""
    local = topk_idx - rank * num_local
    mine = (topk_idx >= 0) & (local >= 0) & (local < num_local)
    ids = torch.where(mine, local, torch.full_like(local, -1))
    w = None if topk_weights is None else torch.where(mine, topk_weights,
                                                      torch.zeros_like(topk_weights))
    return ids, w


def aligned_expert_counts(recv_topk_idx: torch.Tensor, num_local: int, alignment: int) -> list:
    """Per-local-expert received token counts, each rounded up to ``alignment``."""
    ids = recv_topk_idx[recv_topk_idx >= 0]
    counts = torch.bincount(ids, minlength=num_local).tolist()
    return [(c + alignment - 1) // alignment * alignment for c in counts]
