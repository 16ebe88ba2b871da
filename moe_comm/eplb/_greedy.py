"""Greedy primitives shared by the EPLB policy, batched over a leading dimension.

Every function here works on a batch ``B`` of independent problems (layers, or
layers x nodes) with one Python loop over the *items* of a problem and torch ops
across the batch, so the cost grows with the number of items, not with
``B * items``.  Tie-breaking is fixed (first index wins everywhere) so results
are deterministic and can be reproduced by a plain-Python reference.
"""

from __future__ import annotations

import torch

__all__ = ["replicate_greedy", "pack_greedy", "greedy_match"]


def replicate_greedy(weight: torch.Tensor, num_items: int, max_count: int):
    """Give ``num_items - n`` extra replicas to the experts with the highest load per replica.

    Args:
        weight: ``[B, n]`` float64, load of each expert.
        num_items: total number of replicas (physical items) per problem, ``>= n``.
        max_count: cap on replicas of one expert (the number of packs it may be
            spread over without two copies sharing a pack).  Experts at the cap
            are skipped; the caller guarantees ``num_items <= n * max_count``.

    Returns:
        count: ``[B, n]`` int64, replicas per expert (each ``>= 1``).
        items: ``[B, num_items]`` int64 expert id of each item: ``0..n-1`` first,
            then the extra replicas in the order they were handed out.
    """
    B, n = weight.shape
    count = torch.ones(B, n, dtype=torch.int64)
    extras = torch.empty(B, num_items - n, dtype=torch.int64)
    rows = torch.arange(B)
    neg_inf = torch.tensor(float("-inf"), dtype=weight.dtype)
    for i in range(num_items - n):
        score = torch.where(count < max_count, weight / count, neg_inf)
        best = score.argmax(dim=1)  # first maximum wins on ties
        extras[:, i] = best
        count[rows, best] += 1
    items = torch.cat([torch.arange(n).expand(B, n), extras], dim=1)
    return count, items


def pack_greedy(item_expert: torch.Tensor, item_weight: torch.Tensor, num_experts: int,
                num_packs: int, capacity: int, *, prefer=None, pull: float = 0.0):
    """Heaviest item first into the lightest pack that has room and lacks that expert.

    Every pack ends with exactly ``capacity`` items and no pack holds two items
    of the same expert.  When no pack is eligible (all packs with room already
    hold the expert) a swap repairs it, see :func:`_repair`.

    Args:
        item_expert: ``[B, M]`` int64 expert id (``0..num_experts-1``) of each item,
            ``M == num_packs * capacity``; an expert appears at most ``num_packs`` times.
        item_weight: ``[B, M]`` float64 load of each item.
        num_experts: number of distinct expert ids.
        num_packs: packs per problem.
        capacity: items per pack.
        prefer: optional ``[B, num_packs, num_experts]`` bool, pack p would like
            expert e (it held it before).  Such a pack looks lighter by
            ``pull * item weight`` when choosing where an item of e goes, a
            nudge towards keeping placements that costs little balance.
        pull: strength of that nudge (0 = plain greedy).

    Returns:
        slot_expert: ``[B, num_packs, capacity]`` int64 expert id in each pack slot,
            slots filled in insertion order.
        pack_load: ``[B, num_packs]`` float64 summed item weight per pack.
    """
    B, M = item_expert.shape
    assert M == num_packs * capacity
    order = torch.sort(item_weight, dim=1, descending=True, stable=True).indices
    exp_sorted = item_expert.gather(1, order)
    w_sorted = item_weight.gather(1, order)

    slot_expert = torch.full((B, num_packs, capacity), -1, dtype=torch.int64)
    slot_weight = torch.zeros(B, num_packs, capacity, dtype=item_weight.dtype)
    load = torch.zeros(B, num_packs, dtype=item_weight.dtype)
    fill = torch.zeros(B, num_packs, dtype=torch.int64)
    has = torch.zeros(B, num_packs, num_experts, dtype=torch.bool)
    rows = torch.arange(B)
    inf = torch.tensor(float("inf"), dtype=item_weight.dtype)
    for i in range(M):
        e, w = exp_sorted[:, i], w_sorted[:, i]
        ok = (fill < capacity) & ~has[rows, :, e]
        key = load if prefer is None else load - (pull * w).unsqueeze(1) * prefer[rows, :, e]
        p = torch.where(ok, key, inf).argmin(dim=1)  # lightest eligible, first on ties
        stuck = ~ok[rows, p]
        r = rows
        if bool(stuck.any()):  # rare: fix those problems one by one in Python
            for b in rows[stuck].tolist():
                _repair(b, int(e[b]), float(w[b]), slot_expert, slot_weight, load, fill, has)
            r = rows[~stuck]
            e, w, p = e[r], w[r], p[r]
        _put(slot_expert, slot_weight, load, fill, has, r, p, e, w)
    return slot_expert, load


def _put(slot_expert, slot_weight, load, fill, has, r, p, e, w):
    """Append item (expert e, weight w) to pack p of problems r."""
    pos = fill[r, p]
    slot_expert[r, p, pos] = e
    slot_weight[r, p, pos] = w
    load[r, p] += w
    fill[r, p] += 1
    has[r, p, e] = True


def _repair(b, e, w, slot_expert, slot_weight, load, fill, has):
    """Place item (expert ``e``, weight ``w``) of problem ``b`` when every pack with room holds ``e``.

    Pick a pack ``q`` with room, a full pack ``p`` without ``e`` and an item ``j``
    of ``p`` whose expert is not in ``q``; move ``j`` to ``q`` and put the new item
    in ``j``'s slot.  Such a triple always exists: ``e`` has fewer placed copies
    than packs, so some pack lacks it (and is full, else it were eligible), and a
    full pack has more distinct experts than ``q``.  Among all triples take the one
    with the smallest resulting max(load p, load q), then lowest ``(q, p, j)``.
    """
    cap = slot_expert.shape[2]
    se, sw = slot_expert[b].tolist(), slot_weight[b].tolist()
    ld, fl = load[b].tolist(), fill[b].tolist()
    best = None
    for q in range(len(fl)):
        if fl[q] >= cap:
            continue
        in_q = set(se[q][: fl[q]])
        for p in range(len(fl)):
            if fl[p] < cap or e in se[p]:
                continue
            for j in range(cap):
                f = se[p][j]
                if f in in_q:
                    continue
                lp, lq = ld[p] - sw[p][j] + w, ld[q] + sw[p][j]
                key = (max(lp, lq), q, p, j)
                if best is None or key < best[0]:
                    best = (key, lp, lq)
    (_, q, p, j), lp, lq = best
    f, wf = se[p][j], sw[p][j]
    slot_expert[b, q, fl[q]], slot_weight[b, q, fl[q]] = f, wf
    slot_expert[b, p, j], slot_weight[b, p, j] = e, w
    load[b, p], load[b, q] = lp, lq
    fill[b, q] += 1
    has[b, p, f], has[b, p, e], has[b, q, f] = False, True, True


def greedy_match(score: torch.Tensor) -> torch.Tensor:
    """Greedy maximum-weight perfect matching of rows to columns.

    Repeatedly takes the largest remaining entry (first in row-major order on
    ties) and removes its row and column.  Not optimal in general, but any
    perfect matching is acceptable to the caller; it only wants a good one.

    Args:
        score: ``[B, k, k]`` non-negative scores (e.g. overlaps).

    Returns:
        ``[B, k]`` int64: column matched to each row.
    """
    B, k, _ = score.shape
    s = score.to(torch.float64).clone()
    match = torch.empty(B, k, dtype=torch.int64)
    rows = torch.arange(B)
    for _ in range(k):
        flat = s.view(B, -1).argmax(dim=1)
        i, j = flat // k, flat % k
        match[rows, i] = j
        # -1 is below every real (non-negative) score, so used rows/cols never win again.
        s[rows, i, :] = -1.0
        s[rows, :, j] = -1.0
    return match
