"""Full (unsharded) checkpoints of a model whose MoE blocks are MoELayers.

``model.state_dict()`` stays rank-local: each MoELayer gives its own expert slots and
placement, which is what a per-rank resume needs. A checkpoint other code can read needs the
model as it was before :func:`~moe_comm.nn.replace.replace_moe_blocks`:

* :func:`gather_full_state_dict` (collective) gathers every layer's expert slots over its
  group, keeps one copy of each logical expert (the first slot holding it: EPLB replicas
  start equal and rebalancing copies them exactly, but training updates each replica with
  its own tokens' gradients, so replicas trained apart are not averaged), drops moe_comm's placement buffers and renames the layer's weights to the
  replaced block's (:mod:`moe_comm.nn.hf_layout`): the result has the original model's
  ``state_dict()`` names and shapes.
* :func:`save_pretrained` (collective) writes that with transformers' ``save_pretrained``
  on the group's rank 0; ``from_pretrained`` of the unreplaced class reads it back.
  :func:`~moe_comm.nn.replace.replace_moe_blocks` routes the model's own
  ``model.save_pretrained(path)`` there (:func:`route_save_pretrained`).
* :func:`load_full_state_dict` (not collective) loads such a state dict into a replaced
  model: every rank takes its own slots under its current placement.
"""
from __future__ import annotations

import os
import types

import torch
import torch.distributed as dist
from torch import nn

from .hf_layout import DOWN, EXPERT_KEYS, GATE_UP
from .layer import PLACEMENT_BUFFERS, MoELayer

_PLACEMENT_KEYS = tuple(f"experts.{b}" for b in PLACEMENT_BUFFERS)


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """(qualified name, layer) of every MoELayer in ``model``, outermost only, in module
    order (the same on every rank, so collectives over them pair up)."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, MoELayer)]
    return [(n, m) for n, m in found
            if not any(p == "" or n.startswith(p + ".") for p, _ in found if p != n)]


def model_group(model: nn.Module):
    """The process group all of ``model``'s MoELayers are sharded over (None: no layers)."""
    groups = {id(m.experts.group): m.experts.group for _, m in moe_layers(model)}
    if len(groups) > 1:
        raise ValueError("the model's MoELayers are sharded over different process groups; "
                         "a full state dict needs one group")
    return next(iter(groups.values()), None)


def _gather_slots(local: torch.Tensor, group, dst: int | None) -> torch.Tensor | None:
    """[R*S, ...] every rank's slots in rank order, on ``dst`` (group rank; None = all)."""
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    if dst is None:
        dist.all_gather(parts, local, group=group)
    else:
        receiving = dist.get_rank(group) == dst
        dist.gather(local, parts if receiving else None, dst=dist.get_global_rank(group, dst),
                    group=group)
        if not receiving:
            return None
    return torch.cat(parts)


@torch.no_grad()
def layer_full_state(layer: MoELayer, dst: int | None = 0) -> dict | None:
    """``layer``'s full state (see :mod:`moe_comm.nn.hf_layout`) on group rank ``dst``
    (None = every rank), None on the others. Collective over the layer's group."""
    experts = layer.experts
    # the first physical slot of each logical expert: one copy per expert, replicas dropped
    first_slot = experts.log2phy[:, 0]
    gathered = {}
    for key, param in ((GATE_UP, experts.gate_up_proj), (DOWN, experts.down_proj)):
        physical = _gather_slots(param, experts.group, dst)
        if physical is not None:
            gathered[key] = physical[first_slot.to(physical.device)]
    if not gathered:
        return None
    full = {}
    for key, value in layer.state_dict().items():
        if key in EXPERT_KEYS:
            full[key] = gathered[key]
        elif key not in _PLACEMENT_KEYS:
            full[key] = value
    return full


def gather_full_state_dict(model: nn.Module, dst: int | None = 0,
                           device: torch.device | str | None = None) -> dict | None:
    """The state dict ``model`` had before its MoE blocks were replaced: the original names
    and shapes, every expert's weights (collective: every rank of the layers' group calls it).

    Args:
        model: a model whose MoE blocks :func:`replace_moe_blocks` replaced (or with
            MoELayers of its own: they keep their names, experts packed [E, ...]).
        dst: the group rank that receives the result (None: every rank); one layer's full
            experts are in flight at a time.
        device: where to put the returned tensors (default: where they are), e.g. "cpu" to
            keep a large model's full weights off the accelerator.
    Returns:
        the full state dict on ``dst``, None on the other ranks.
    """
    group = model_group(model)
    receiving = dst is None or group is None or dist.get_rank(group) == dst
    layers = moe_layers(model)
    local = model.state_dict()
    block_states = {}
    for name, layer in layers:
        full = layer_full_state(layer, dst)
        if full is not None:
            block_states[name] = layer.checkpoint_layout.to_block(full)
    if not receiving:
        return None
    # rebuild in the model's key order, each layer's keys where its first key was
    out, emitted = {}, set()
    for key, value in local.items():
        owner = next((n for n, _ in layers if n == "" or key.startswith(n + ".")), None)
        if owner is None:
            out[key] = value
        elif owner not in emitted:
            emitted.add(owner)
            prefix = owner + "." if owner else ""
            out.update((prefix + k, v) for k, v in block_states[owner].items())
    if device is not None:
        out = {k: v.to(device) for k, v in out.items()}
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict, strict: bool = True):
    """Load a full state dict (as :func:`gather_full_state_dict` returns, or the unreplaced
    model's) into ``model`` whose MoE blocks were replaced: each rank copies in its own
    expert slots under its current placement. Not collective; returns what
    ``model.load_state_dict`` returns."""
    layers = moe_layers(model)
    local = model.state_dict()
    by_layer = {name: {} for name, _ in layers}
    loadable = {}
    for key, value in state_dict.items():
        owner = next((n for n, _ in layers if n == "" or key.startswith(n + ".")), None)
        if owner is None:
            loadable[key] = value
        else:
            by_layer[owner][key[len(owner) + 1:] if owner else key] = value
    for name, layer in layers:
        prefix = name + "." if name else ""
        full = layer.checkpoint_layout.from_block(by_layer[name])
        slots = layer.experts.local_expert_ids
        for key, value in full.items():
            if key in EXPERT_KEYS:
                value = value[slots.to(value.device)]
            loadable[prefix + key] = value
        for key in _PLACEMENT_KEYS:          # moe_comm's own: kept as it is
            loadable[prefix + key] = local[prefix + key]
    return model.load_state_dict(loadable, strict=strict)


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs) -> None:
    """``model.save_pretrained(save_directory, ...)`` of the full model, as it was before its
    MoE blocks were replaced (collective: every rank of the layers' group calls it; returns
    on every rank once the files are written).

    The state dict is gathered on group rank 0 (on the CPU) and written there by
    transformers, which converts it to the checkpoint format as it would the unreplaced
    model's; ``from_pretrained`` of the model's class reads it back. transformers writes
    only from global rank 0 once torch.distributed is up: with several expert-parallel
    groups, the one holding global rank 0 writes. ``kwargs`` go to ``save_pretrained``.
    """
    group = model_group(model)
    full = gather_full_state_dict(model, dst=0, device="cpu")
    try:
        if full is not None:    # the class's method: the instance's may be ours (route_...)
            type(model).save_pretrained(model, save_directory, state_dict=full, **kwargs)
    finally:            # a failed write raises on rank 0; the other ranks must not hang
        if group is not None:
            dist.barrier(group=group)


def route_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained(path, ...)`` write the full checkpoint, as
    :func:`save_pretrained` does (collective: every rank calls it), instead of transformers
    writing rank 0's shard of the experts under the original names' neighbours. A call that
    passes its own ``state_dict=`` gets transformers' method unchanged. Bound to the
    instance (a deepcopy rebinds it to the copy); models without ``save_pretrained`` are
    left alone."""
    if not callable(getattr(type(model), "save_pretrained", None)):
        return
    model.save_pretrained = types.MethodType(_save_full, model)


def _save_full(model: nn.Module, save_directory, *args, state_dict=None, **kwargs):
    if state_dict is not None or args:
        return type(model).save_pretrained(model, save_directory, *args,
                                           state_dict=state_dict, **kwargs)
    return save_pretrained(model, save_directory, **kwargs)
