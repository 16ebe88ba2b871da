"""Swap every Hugging Face MoE block of a model for a sharded MoELayer.

Its own module because it needs both sides: :mod:`moe_comm.nn.hf` to find the blocks and
:class:`moe_comm.nn.layer.MoELayer` to build their replacements (the layer imports hf, so hf
cannot import the layer).
"""
from __future__ import annotations

from torch import nn

from . import hf
from ..eplb import ExpertLoadRecorder
from .checkpoint import route_save_pretrained
from .layer import MoELayer


def replaceable(module: nn.Module) -> bool:
    """A recognised Hugging Face MoE block; a MoELayer looks like one (a gate and packed
    experts) but is already a replacement."""
    return not isinstance(module, MoELayer) and hf.is_moe_block(module)


def replace_moe_blocks(model: nn.Module, group=None, **kwargs) -> list:
    """Replace every recognised MoE block in ``model`` by a sharded :class:`MoELayer` (in
    place; collective: every rank calls it on an identical model).

    All replaced layers share the group's Buffer (pass ``shared_buffers=`` to choose where it
    is kept). With ``num_redundant_experts > 0`` and no ``load_recorder`` given, one
    :class:`ExpertLoadRecorder` with a row per replaced layer is shared by them. ``config``
    defaults to ``model.config``; other keyword arguments go to :meth:`MoELayer.from_hf`.
    ``model.save_pretrained(path)`` then writes the full, unsharded checkpoint (collective:
    every rank calls it; moe_comm/nn/checkpoint.py). Returns the qualified names of the
    replaced modules.
    """
    kwargs.setdefault("config", getattr(model, "config", None))
    names = [name for name, m in model.named_modules() if name and replaceable(m)]
    # a block nested in another recognised block is replaced along with its parent
    names = [n for n in names if not any(n.startswith(p + ".") for p in names)]
    if names and kwargs.get("num_redundant_experts") and kwargs.get("load_recorder") is None:
        first = model.get_submodule(names[0])
        num_experts = hf.expert_weights(first.experts)[0].shape[0]
        kwargs["load_recorder"] = ExpertLoadRecorder(len(names), num_experts)
    for i, name in enumerate(names):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = MoELayer.from_hf(getattr(parent, child), group=group, layer_index=i, **kwargs)
        setattr(parent, child, layer)
    if names:      # transformers alone would write this rank's shard of the experts
        route_save_pretrained(model)
    return names
