"""Route logical top-k expert ids to physical slots chosen by the EPLB policy."""

from __future__ import annotations

import torch

__all__ = ["map_logical_to_physical", "active_slot_mask"]


def active_slot_mask(active_ranks, num_physical_experts):
    """Per-slot health mask from per-rank health.

    Args:
        active_ranks: ``[num_ranks]`` int/bool tensor, 0 = failed rank.
        num_physical_experts: ``P`` slots, a multiple of ``num_ranks``; rank ``g``
            holds slots ``g*P/num_ranks .. (g+1)*P/num_ranks - 1``.

    Returns:
        ``[P]`` bool tensor on ``active_ranks.device``, True = healthy slot.
    """
    if not isinstance(active_ranks, torch.Tensor):
        raise TypeError(f"active_ranks must be a torch.Tensor, got {type(active_ranks).__name__}")
    if active_ranks.dim() != 1 or active_ranks.numel() == 0:
        raise ValueError(f"active_ranks must be 1-D and non-empty, got shape {tuple(active_ranks.shape)}")
    if isinstance(num_physical_experts, bool) or not isinstance(num_physical_experts, int):
        raise TypeError("num_physical_experts must be an int")
    R = active_ranks.numel()
    if num_physical_experts <= 0 or num_physical_experts % R:
        raise ValueError(f"num_physical_experts ({num_physical_experts}) must be a positive "
                         f"multiple of len(active_ranks) ({R})")
    return (active_ranks != 0).repeat_interleave(num_physical_experts // R)


def map_logical_to_physical(topk_idx, log2phy, logcnt, *, phy_active=None,
                            topk_weights=None, renormalize=False):
    """Pick a physical replica for every (token, k) logical expert id.

    Replica choice is a round-robin over the *occurrences* of each expert in
    row-major ``(token, k)`` order: the o-th occurrence of expert ``e`` goes to its
    ``o mod c``-th healthy replica (``c`` healthy replicas, ascending slot order).
    That is deterministic and gives every replica of an expert the same number
    of tokens within 1, whatever the token order.

    Args:
        topk_idx: ``[T, K]`` int tensor of logical ids, ``-1`` = no expert.
        log2phy: ``[L, W]`` int tensor, slots of each logical expert (entries at
            index ``>= logcnt[e]`` and ``-1`` entries are ignored).
        logcnt: ``[L]`` int tensor, replicas of each expert.
        phy_active: optional ``[P]`` bool/int tensor, 0 = failed slot (see
            :func:`active_slot_mask`); by default every slot is healthy.
        topk_weights: optional ``[T, K]`` float tensor of gate weights.
        renormalize: if True, rescale each token's surviving weights so they
            sum to the total of its valid (``!= -1``) input weights.

    Returns:
        phy_idx: ``[T, K]`` int64 physical slot, ``-1`` where the input is ``-1``
            or the expert has no healthy replica.
        weights: None without ``topk_weights``; else ``[T, K]`` of its dtype where
            entries dropped for lack of a healthy replica are 0, entries that
            were ``-1`` on input are unchanged, and (``renormalize``) the rest are
            rescaled; a token that lost all its experts gets all-zero weights
            on its valid entries.
    """
    ids, table, cnt = _check(topk_idx, log2phy, logcnt, phy_active, topk_weights)
    dev = ids.device
    L, W = table.shape
    T, K = ids.shape

    # Healthy replicas of each expert, compacted to the front in ascending slot order.
    usable = (torch.arange(W, device=dev) < cnt.unsqueeze(1)) & (table >= 0)
    if phy_active is not None:
        act = phy_active.to(dev) != 0
        if bool((table[usable] >= act.numel()).any()):
            raise ValueError(f"log2phy refers to slots beyond phy_active's length {act.numel()}")
        usable &= act[table.clamp(min=0).clamp(max=act.numel() - 1)]
    n_ok = usable.sum(1)
    front = torch.sort((~usable).to(torch.int8), dim=1, stable=True).indices
    healthy = table.gather(1, front)

    # Occurrence number of each (token, k) among the entries with the same expert.
    flat = ids.reshape(-1)
    key = torch.where(flat >= 0, flat, L)  # -1 entries sort last under a dummy id
    order = torch.sort(key, stable=True).indices
    sk = key[order]
    first = torch.searchsorted(sk, sk, right=False)
    occ = torch.empty_like(flat)
    occ[order] = torch.arange(flat.numel(), device=dev) - first

    e = flat.clamp(min=0)
    c = n_ok[e]
    served = (flat >= 0) & (c > 0)
    col = torch.where(served, occ % c.clamp(min=1), 0)
    phy = torch.where(served, healthy[e, col], -1).view(T, K)

    if topk_weights is None:
        return phy, None
    w = topk_weights
    dropped = (ids >= 0) & (phy < 0)
    out = w.masked_fill(dropped, 0)
    if renormalize:
        valid = ids >= 0
        before = torch.where(valid, w, 0).sum(1, keepdim=True)
        after = torch.where(phy >= 0, w, 0).sum(1, keepdim=True)
        scale = torch.where(after != 0, before / torch.where(after != 0, after, 1), 0)
        # Rows that lost everything (after == 0) get zeros on their valid entries.
        out = torch.where(valid, out * scale, w)
    return phy, out


def _check(topk_idx, log2phy, logcnt, phy_active, topk_weights):
    for name, t in (("topk_idx", topk_idx), ("log2phy", log2phy), ("logcnt", logcnt)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype.is_floating_point or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [T, K], got shape {tuple(topk_idx.shape)}")
    if log2phy.dim() != 2:
        raise ValueError(f"log2phy must be [L, max_replicas], got shape {tuple(log2phy.shape)}")
    L = log2phy.shape[0]
    if tuple(logcnt.shape) != (L,):
        raise ValueError(f"logcnt must have shape [{L}], got {tuple(logcnt.shape)}")
    dev = topk_idx.device
    ids = topk_idx.long()
    if ids.numel() and bool(((ids < -1) | (ids >= L)).any()):
        raise ValueError(f"topk_idx entries must be in [-1, {L})")
    if phy_active is not None:
        if not isinstance(phy_active, torch.Tensor):
            raise TypeError(f"phy_active must be a torch.Tensor, got {type(phy_active).__name__}")
        if phy_active.dim() != 1 or phy_active.dtype.is_floating_point:
            raise ValueError(f"phy_active must be a 1-D bool/int mask, got {phy_active.dtype} "
                             f"shape {tuple(phy_active.shape)}")
    if topk_weights is not None:
        if not isinstance(topk_weights, torch.Tensor):
            raise TypeError(f"topk_weights must be a torch.Tensor, got {type(topk_weights).__name__}")
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} != topk_idx shape "
                             f"{tuple(topk_idx.shape)}")
    return ids, log2phy.to(dev).long(), logcnt.to(dev).long()
