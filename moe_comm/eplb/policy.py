"""Expert-parallel load balancer (EPLB): decide which logical expert each physical slot holds.

Output contract (same as DeepSeek's EPLB ``rebalance_experts``):

* ``phy2log [layers, P]`` int64: logical expert held by each physical slot.  Slot
  ``s`` lives on rank ``s // (P // num_gpus)``; rank ``g`` on node
  ``g // (num_gpus // num_nodes)``.  Slots on failed ranks hold ``-1``.
* ``log2phy [layers, L, P - L + 1]`` int64: slots holding each logical expert,
  ascending, padded with ``-1``.  ``P - L + 1`` bounds any expert's replica count.
* ``logcnt [layers, L]`` int64: replicas of each logical expert.

Policy.  *Hierarchical* when ``num_groups % num_nodes == 0``: pack expert groups
onto nodes (equal group count per node, balanced group load), replicate each
node's experts over its slots, pack those replicas onto the node's ranks, so a
group's traffic never leaves its node.  Otherwise *global*: the same with one
node and one group.  Both steps are greedy: an extra replica goes to the expert
with the highest load per replica; packing puts the heaviest item into the
lightest pack with room (every pack gets exactly its capacity).

Beyond DeepSeek:

* No rank ever holds two replicas of one expert (replicas are capped at the
  number of ranks they can spread over; packing enforces it, with a swap repair).
* ``active_ranks``: failed ranks get no experts.  The hierarchical policy is
  kept only while it stays even: every node that still has a healthy rank must
  have the *same* number of them, the number of such nodes must divide
  ``num_groups``, and each node must fit its experts without duplicates
  (``L / nodes >= slots per rank``, also checked without failures).  So one
  failed GPU per node, or whole-node outages leaving a divisor of
  ``num_groups`` nodes, stay hierarchical; a single failed GPU falls back to
  the global policy over the healthy ranks (an uneven node would either carry
  its full group load on fewer GPUs or need uneven group counts).
* ``old_phy2log``: keep as many (slot, expert) pairs as possible without
  lowering balancedness.  The replica counts are those of the fresh run; packs
  are matched to old nodes/ranks and entries to old slots, and per node a
  re-packing nudged towards old ranks is used if its max rank load does not
  exceed the fresh one (see :func:`_align`).  Balancedness (mean/max rank load,
  the mean being fixed) is therefore equal to or better than without
  ``old_phy2log``, and no layer moves more experts than the fresh placement
  would.
"""

from __future__ import annotations

import torch

from ._greedy import greedy_match, pack_greedy, replicate_greedy

__all__ = ["rebalance_experts", "count_moved_experts", "rank_loads", "balancedness"]


def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, *,
                      active_ranks=None, old_phy2log=None):
    """Compute a balanced physical placement of logical experts.

    Args:
        weight: ``[layers, L]`` float or int tensor, non-negative load of each logical expert.
        num_replicas: ``P``, physical expert slots per layer; multiple of ``num_gpus``, ``>= L``.
        num_groups: expert groups (``L % num_groups == 0`` when the hierarchical policy is used).
        num_nodes: nodes; ``num_gpus % num_nodes == 0``.
        num_gpus: ranks; each holds ``P // num_gpus`` consecutive slots.
        active_ranks: optional ``[num_gpus]`` int/bool tensor, 0 = failed rank.
        old_phy2log: optional ``[layers, P]`` int tensor, the current placement
            (``-1`` = empty slot); the result keeps as many of its slots as it
            can with the same replica counts and no lower balancedness.

    Returns:
        phy2log: ``[layers, P]`` int64, ``-1`` on failed ranks.
        log2phy: ``[layers, L, P - L + 1]`` int64, ``-1`` padded.
        logcnt: ``[layers, L]`` int64, ``>= 1``.
        All on ``weight.device`` (computed on CPU).

    Raises:
        TypeError / ValueError naming the offending argument; ValueError when the
        healthy slots are fewer than ``L`` (message says how many are missing) or
        when some expert would need two replicas on one rank.
    """
    _check_int("num_replicas", num_replicas)
    _check_int("num_groups", num_groups)
    _check_int("num_nodes", num_nodes)
    _check_int("num_gpus", num_gpus)
    w = _check_weight(weight)
    layers, L = w.shape
    P, R = num_replicas, num_gpus
    if P % R:
        raise ValueError(f"num_replicas ({P}) must be a multiple of num_gpus ({R})")
    if R % num_nodes:
        raise ValueError(f"num_gpus ({R}) must be a multiple of num_nodes ({num_nodes})")
    if P < L:
        raise ValueError(f"num_replicas ({P}) must be >= the number of logical experts ({L})")
    hierarchical = num_groups % num_nodes == 0
    if hierarchical and L % num_groups:
        raise ValueError(f"num_groups ({num_groups}) must divide the number of logical experts ({L})")
    active = _check_active(active_ranks, R)
    old = _check_old(old_phy2log, layers, P, L)
    S, per_node = P // R, R // num_nodes

    healthy = active.nonzero().flatten()
    H = healthy.numel() * S
    if H < L:
        raise ValueError(f"active_ranks leaves {H} healthy slots for {L} logical experts: "
                         f"{L - H} slots missing")
    if S > L:
        raise ValueError(f"num_replicas / num_gpus = {S} slots per rank but only {L} logical "
                         f"experts: some rank would hold two replicas of one expert")

    # Node layout: a list of nodes, each with the same number h of healthy ranks.
    node_count = active.view(num_nodes, per_node).sum(1)
    used = (node_count > 0).nonzero().flatten()
    h = int(node_count[used[0]])
    U = used.numel()
    if hierarchical:
        hierarchical = (bool((node_count[used] == h).all()) and num_groups % U == 0
                        and h * S >= L // U and S <= L // U)
    if hierarchical:
        rank_table = torch.stack([healthy[(healthy // per_node) == n] for n in used.tolist()])
        assign, packing = _hierarchical(w, num_groups, U, h, S)
    else:
        rank_table = healthy.view(1, -1)
        assign, packing = _place_node(w, torch.arange(L).expand(layers, 1, L), healthy.numel(), S)

    if old is None:  # canonical: pack p of node n on the n-th used node's p-th healthy rank
        phy2log = _materialize(assign, rank_table.expand(layers, -1, -1), S, P, None)
    else:  # experts on failed ranks cannot stay; hide them so they never count as kept
        old = old.masked_fill(~active.bool().repeat_interleave(S).expand(layers, P), -1)
        phy2log = _align(assign, packing, rank_table, S, P, old, L)
    log2phy, logcnt = _build_log2phy(phy2log, L, P - L + 1)
    dev = weight.device
    return phy2log.to(dev), log2phy.to(dev), logcnt.to(dev)


def _hierarchical(w, G, U, h, S):
    """Groups -> nodes -> ranks.  Returns what :func:`_place_node` returns."""
    layers, L = w.shape
    gs = L // G
    group_load = w.view(layers, G, gs).sum(-1)
    node_groups, _ = pack_greedy(torch.arange(G).expand(layers, G), group_load, G, U, G // U)
    node_experts = (node_groups.unsqueeze(-1) * gs + torch.arange(gs)).view(layers, U, L // U)
    return _place_node(w, node_experts, h, S)


def _place_node(w, node_experts, h, S):
    """Replicate each node's experts over ``h*S`` slots and pack them on ``h`` ranks.

    Args: w ``[layers, L]`` float64; node_experts ``[layers, U, n]`` logical ids per node.
    Returns: ``[layers, U, h, S]`` int64 logical id per (node, rank, slot), and a
    dict with the packing inputs and pack loads (rows = layers x nodes) so that
    :func:`_align` can re-pack the same replicas.
    """
    layers, U, n = node_experts.shape
    flat = node_experts.reshape(layers * U, n)
    wn = w.repeat_interleave(U, dim=0).gather(1, flat)
    count, items = replicate_greedy(wn, h * S, max_count=h)
    item_w = wn.gather(1, items) / count.gather(1, items)
    slots, load = pack_greedy(items, item_w, n, h, S)
    assign = flat.gather(1, slots.view(layers * U, h * S)).view(layers, U, h, S)
    return assign, dict(experts=flat, items=items, item_w=item_w, load=load)


def _materialize(assign, rank_of, S, P, old):
    """Write ``assign [layers, U, h, S]`` to ``phy2log [layers, P]``.

    ``rank_of [layers, U, h]`` is the physical rank of each pack.  With ``old``
    given, entries that already sit on their rank keep their slot; the rest fill
    the free slots in order.
    """
    layers = assign.shape[0]
    if old is None:
        pos = torch.arange(S).expand_as(assign)
    else:
        old_on_rank = old.view(layers, -1, S).gather(
            1, rank_of.reshape(layers, -1, 1).expand(-1, -1, S)).view_as(assign)
        pos = _slot_match(assign.reshape(-1, S), old_on_rank.reshape(-1, S)).view_as(assign)
    slot = rank_of.unsqueeze(-1) * S + pos
    out = torch.full((layers, P), -1, dtype=torch.int64)
    return out.scatter_(1, slot.reshape(layers, -1), assign.reshape(layers, -1))


def _slot_match(new, old):
    """Position within a rank for each new expert: its old slot if it had one, else the next free slot.

    ``new [B, S]`` holds distinct experts, ``old [B, S]`` may hold ``-1``.  Greedy
    here is optimal: distinct new experts compete for disjoint sets of old slots.
    """
    B, S = new.shape
    match = (new.unsqueeze(2) == old.unsqueeze(1)) & (old.unsqueeze(1) >= 0)
    pos = torch.full((B, S), -1, dtype=torch.int64)
    taken = torch.zeros(B, S, dtype=torch.bool)
    for j in range(S):
        avail = match[:, j] & ~taken
        found = avail.any(1)
        s = avail.to(torch.int8).argmax(1)
        pos[:, j] = torch.where(found, s, -1)
        taken |= torch.nn.functional.one_hot(s, S).bool() & found.unsqueeze(1)
    unmatched = pos < 0
    free_first = torch.sort(taken.to(torch.int8), dim=1, stable=True).indices
    k = (unmatched.cumsum(1) - 1).clamp(min=0)
    return torch.where(unmatched, free_first.gather(1, k), pos)


# How strongly the sticky re-packing favours a replica's old rank (fraction of its load).
_STICKY_PULL = 0.2


def _align(assign, packing, rank_table, S, P, old, L):
    """Placement with the most slots kept from ``old`` and no worse balance, per layer.

    Candidates, all with the greedy replica counts:

    A. the greedy packs, nodes and ranks permuted (greedy max overlap with ``old``);
    B. the greedy packs in canonical order;
    C. per node, a *sticky* re-packing on the ranks chosen in A: the greedy rule,
       but a rank that held the replica's expert looks lighter by
       ``_STICKY_PULL x`` the replica's load.  A node takes C instead of A only
       if C keeps more slots and its max rank load stays <= the greedy max
       rank load of the layer.

    Balancedness is mean/max of rank load and the mean is fixed, so A and B have
    exactly the greedy balancedness and A+C at least that.  The layer gets A+C
    or B, whichever keeps more; every candidate keeps entries on their old slot
    within a rank (see :func:`_slot_match`).
    """
    layers, U, h, _ = assign.shape
    R = P // S
    old_rank = torch.zeros(layers, R, L + 1).scatter_(  # [layers, R, L] 0/1, empty -> column L
        2, torch.where(old >= 0, old, L).view(layers, R, S), 1.0)[:, :, :L]
    new_pack = torch.zeros(layers, U, h, L).scatter_(3, assign, 1.0)  # [layers, U, h, L]
    node_of = torch.arange(U).expand(layers, U)
    if U > 1:  # nodes: match abstract node sets to physical nodes' old sets
        old_node = old_rank[:, rank_table.flatten()].view(layers, U, h, L).amax(2)
        node_of = greedy_match(new_pack.amax(2) @ old_node.transpose(1, 2))
    cand = rank_table[node_of]  # [layers, U, h] candidate physical ranks per abstract node
    old_cand = old_rank.gather(1, cand.view(layers, -1, 1).expand(-1, -1, L)).view(layers, U, h, L)
    overlap = new_pack @ old_cand.transpose(2, 3)  # [layers, U, h, h]
    perm = greedy_match(overlap.view(-1, h, h)).view(layers, U, h)
    a = _materialize(assign, cand.gather(2, perm), S, P, old)
    b = _materialize(assign, rank_table.expand(layers, U, h), S, P, old)

    experts, n = packing["experts"], packing["experts"].shape[1]
    prefer = old_cand.view(layers * U, h, L).gather(2, experts.unsqueeze(1).expand(-1, h, n)) > 0
    slots, load = pack_greedy(packing["items"], packing["item_w"], n, h, S,
                              prefer=prefer, pull=_STICKY_PULL)
    sticky = experts.gather(1, slots.view(layers * U, h * S)).view(layers, U, h, S)
    c = _materialize(sticky, cand, S, P, old)
    bound = packing["load"].view(layers, U * h).amax(1, keepdim=True)  # greedy max rank load
    fits = load.view(layers, U, h).amax(2) <= bound  # [layers, U]

    node_slots = (cand.unsqueeze(-1) * S + torch.arange(S)).view(layers, U, h * S)

    def kept_per_node(x):  # A and C put node u on the same slots, so compare them per node
        return ((x == old) & (x >= 0)).gather(1, node_slots.view(layers, -1)).view(layers, U, -1).sum(2)
    use_c = fits & (kept_per_node(c) > kept_per_node(a))
    slot_use_c = torch.zeros(layers, P, dtype=torch.bool).scatter_(
        1, node_slots.view(layers, -1), use_c.unsqueeze(2).expand(-1, -1, h * S).reshape(layers, -1))
    ac = torch.where(slot_use_c, c, a)

    def kept(x):
        return ((x == old) & (x >= 0)).sum(1, keepdim=True)
    return torch.where(kept(ac) >= kept(b), ac, b)


def _build_log2phy(phy2log, L, width):
    """Inverse map: ``log2phy [layers, L, width]`` (slots ascending, -1 pad) and ``logcnt [layers, L]``."""
    layers, P = phy2log.shape
    valid = phy2log >= 0
    e = torch.where(valid, phy2log, L)  # empty slots sort last under a dummy expert L
    logcnt = torch.zeros(layers, L + 1, dtype=torch.int64).scatter_add_(
        1, e, torch.ones_like(e))[:, :L]
    order = (e * P + torch.arange(P)).argsort(dim=1)
    e_sorted = e.gather(1, order)
    start = torch.cat([torch.zeros(layers, 1, dtype=torch.int64), logcnt.cumsum(1)], 1)
    k = torch.arange(P) - start.gather(1, e_sorted)
    idx = torch.where(e_sorted < L, e_sorted * width + k, L * width)  # spill to a dump column
    log2phy = torch.full((layers, L * width + 1), -1, dtype=torch.int64).scatter_(1, idx, order)
    return log2phy[:, : L * width].view(layers, L, width), logcnt


def count_moved_experts(old_phy2log, new_phy2log):
    """Expert weights that must be loaded to go from ``old`` to ``new``.

    Counts slots that hold an expert in ``new`` and held a different one (or
    none) in ``old``.

    Args:
        old_phy2log: ``[layers, P]`` or ``[P]`` int tensor (``-1`` = empty).
        new_phy2log: same shape as ``old_phy2log``.

    Returns:
        int64 tensor ``[layers]`` (or 0-d for 1-D inputs); ``.sum()`` for a total.
    """
    if not isinstance(old_phy2log, torch.Tensor) or not isinstance(new_phy2log, torch.Tensor):
        raise TypeError("old_phy2log and new_phy2log must be torch tensors")
    if old_phy2log.shape != new_phy2log.shape:
        raise ValueError(f"old_phy2log shape {tuple(old_phy2log.shape)} != new_phy2log shape "
                         f"{tuple(new_phy2log.shape)}")
    new = new_phy2log.to(old_phy2log.device)
    return ((new != old_phy2log) & (new >= 0)).sum(-1)


def rank_loads(weight, phy2log, num_gpus):
    """Per-rank load when each expert's tokens are spread evenly over its replicas.

    Args:
        weight: ``[layers, L]`` float/int load per logical expert.
        phy2log: ``[layers, P]`` int placement (``-1`` = empty slot, contributes 0).
        num_gpus: ranks; each holds ``P // num_gpus`` consecutive slots.

    Returns:
        ``[layers, num_gpus]`` float64.
    """
    w = _check_weight(weight)
    p2l = phy2log.cpu().long()
    layers, P = p2l.shape
    L = w.shape[1]
    e = torch.where(p2l >= 0, p2l, L)
    cnt = torch.zeros(layers, L + 1, dtype=torch.float64).scatter_add_(
        1, e, torch.ones_like(e, dtype=torch.float64))
    per = torch.cat([w, torch.zeros(layers, 1, dtype=torch.float64)], 1) / cnt.clamp(min=1)
    return per.gather(1, e).view(layers, num_gpus, P // num_gpus).sum(-1)


def balancedness(weight, phy2log, num_gpus, active_ranks=None):
    """Mean over max of per-rank load, per layer (1.0 = perfect).

    Args:
        weight: ``[layers, L]`` float/int load per logical expert.
        phy2log: ``[layers, P]`` int placement.
        num_gpus: ranks.
        active_ranks: optional ``[num_gpus]`` 0/1; failed ranks are left out of the mean.

    Returns:
        ``[layers]`` float64 (1.0 for a layer with no load).
    """
    loads = rank_loads(weight, phy2log, num_gpus)
    if active_ranks is not None:
        loads = loads[:, _check_active(active_ranks, num_gpus).bool()]
    mx = loads.amax(1)
    return torch.where(mx > 0, loads.mean(1) / mx.clamp(min=1e-300), torch.ones_like(mx))


# ----------------------------------------------------------------------------- validation

def _check_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v <= 0:
        raise ValueError(f"{name} must be positive, got {v}")


def _check_weight(weight):
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype == torch.bool or weight.is_complex():
        raise TypeError(f"weight must be a float or int tensor, got {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] == 0:
        raise ValueError(f"weight must be [layers, num_logical_experts], got shape {tuple(weight.shape)}")
    w = weight.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weight must be finite and non-negative")
    return w


def _check_active(active_ranks, R):
    if active_ranks is None:
        return torch.ones(R, dtype=torch.int64)
    if not isinstance(active_ranks, torch.Tensor):
        raise TypeError(f"active_ranks must be a torch.Tensor, got {type(active_ranks).__name__}")
    if active_ranks.dtype.is_floating_point or active_ranks.is_complex():
        raise TypeError(f"active_ranks must be an int or bool tensor, got {active_ranks.dtype}")
    if tuple(active_ranks.shape) != (R,):
        raise ValueError(f"active_ranks must have shape [num_gpus] = [{R}], got {tuple(active_ranks.shape)}")
    a = (active_ranks.cpu() != 0).to(torch.int64)
    if not bool(a.any()):
        raise ValueError("active_ranks has no healthy rank")
    return a


def _check_old(old, layers, P, L):
    if old is None:
        return None
    if not isinstance(old, torch.Tensor):
        raise TypeError(f"old_phy2log must be a torch.Tensor, got {type(old).__name__}")
    if old.dtype.is_floating_point or old.is_complex() or old.dtype == torch.bool:
        raise TypeError(f"old_phy2log must be an int tensor, got {old.dtype}")
    if tuple(old.shape) != (layers, P):
        raise ValueError(f"old_phy2log must have shape [layers, num_replicas] = [{layers}, {P}], "
                         f"got {tuple(old.shape)}")
    o = old.cpu().to(torch.int64)
    if bool(((o < -1) | (o >= L)).any()):
        raise ValueError(f"old_phy2log entries must be in [-1, {L})")
    return o
