"""Hugging Face adapter: turn an existing transformers MoE block into a sharded MoELayer.

Recognised blocks (``gate`` + ``experts``, optionally shared experts):

* transformers v5 blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, ...): a router module
  returning ``(router_logits, top_k_weights, top_k_index)`` and packed experts
  ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` (or transposed). The router module
  itself is kept (a copy), so routing semantics (softmax or sigmoid, group-limited top-k,
  correction bias, scaling, dtypes) are the model's own, and transformers' router-logit
  recording (``output_router_logits``) still finds it.
* v4-style blocks: ``gate`` an ``nn.Linear`` and ``experts`` a ``ModuleList`` of gated MLPs
  with ``w1``/``w3``/``w2`` (Mixtral) or ``gate_proj``/``up_proj``/``down_proj`` (Qwen). Routing
  is softmax top-k (renormalised unless ``norm_topk_prob`` is False) by
  :class:`moe_comm.nn.router.TopKRouter`, and the layer returns ``(hidden, router_logits)`` as
  those blocks did.
* shared experts: ``shared_expert`` + ``shared_expert_gate`` (Qwen2-MoE: sigmoid-gated) or
  ``shared_experts`` (DeepSeek-V3: added).

Each rank copies only its own experts' weights out of the block; the block itself is left
unchanged. Not supported (raise NotImplementedError): expert biases, experts without a gate
projection, interleaved gate/up layouts or custom gating (e.g. gpt-oss), and Mixtral's
training-time router jitter.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..eplb import ExpertLoadRecorder
from .layer import MoELayer

_LEGACY_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def _legacy_names(expert: nn.Module):
    for names in _LEGACY_NAMES:
        if all(isinstance(getattr(expert, n, None), nn.Linear) for n in names):
            return names
    return None


def _expert_weights(experts: nn.Module):
    """(gate_up [E, 2I, H], down [E, H, I], activation) of a block's experts."""
    gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3:
        if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) \
                is not None:
            raise NotImplementedError("experts with biases are not supported")
        if not getattr(experts, "has_gate", True):
            raise NotImplementedError("experts without a gate projection are not supported")
        if not getattr(experts, "is_concatenated", True):
            raise NotImplementedError("interleaved gate/up weights are not supported")
        apply_gate = getattr(type(experts), "_apply_gate", None)
        if apply_gate is not None and apply_gate.__name__ != "_default_apply_gate":
            raise NotImplementedError(f"{type(experts).__name__} has a custom gating function")
        if getattr(experts, "is_transposed", False):           # [E, H, 2I] / [E, I, H]
            gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
        return gu.detach(), dn.detach(), experts.act_fn
    if isinstance(experts, nn.ModuleList) and len(experts) and _legacy_names(experts[0]):
        g, u, d = _legacy_names(experts[0])
        gu = torch.stack([torch.cat([getattr(e, g).weight, getattr(e, u).weight]) for e in experts])
        dn = torch.stack([getattr(e, d).weight for e in experts])
        return gu.detach(), dn.detach(), experts[0].act_fn
    raise TypeError(f"{type(experts).__name__}: expected packed gate_up_proj/down_proj experts "
                    "or a ModuleList of gated MLPs (w1/w2/w3 or gate_proj/up_proj/down_proj)")


def is_moe_block(module: nn.Module) -> bool:
    """Whether :func:`from_hf` recognises ``module``."""
    if isinstance(module, MoELayer) or not hasattr(module, "gate"):
        return False
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module):
        return False
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return True
    return isinstance(experts, nn.ModuleList) and len(experts) > 0 and \
        _legacy_names(experts[0]) is not None


def _pick(name, *sources, default=None):
    for s in sources:
        v = getattr(s, name, None) if s is not None else None
        if v is not None:
            return v
    return default


def from_hf(block: nn.Module, group=None, config=None, **kwargs) -> MoELayer:
    """Build a MoELayer that computes what ``block`` computes, its experts sharded over
    ``group``.

    Args:
        block: a transformers MoE block (see the module doc for the recognised kinds).
        group: process group of the expert-parallel ranks (None = world); every rank calls
            this with an identical block.
        config: the model config, read for routing settings a v4-style block does not carry
            (``num_experts_per_tok``, ``norm_topk_prob``).
        **kwargs: passed to :class:`MoELayer` (mode, num_redundant_experts, buffer,
            num_nvl_bytes, max_tokens_per_rank, ll_max_tokens, load_recorder, layer_index, ...).
    Returns:
        a MoELayer in the dtype of the block's expert weights.
    """
    if not is_moe_block(block):
        raise TypeError(f"{type(block).__name__} is not a recognised MoE block (needs a gate and "
                        "packed or ModuleList experts)")
    config = getattr(config, "text_config", config)
    if getattr(block, "jitter_noise", 0) and block.training:
        raise NotImplementedError("router jitter noise (training-time) is not supported")
    gate_up, down, act = _expert_weights(block.experts)
    E, two_i, H = gate_up.shape
    legacy = isinstance(block.gate, nn.Linear)
    top_k = _pick("top_k", block.gate, block, default=None) or \
        _pick("num_experts_per_tok", config)
    if top_k is None:
        raise ValueError("cannot tell top_k: the block has no top_k; pass config=model.config")
    shared = _pick("shared_experts", block) or _pick("shared_expert", block)
    layer = MoELayer(
        E, int(top_k), H, two_i // 2, group=group, scoring_func="softmax",
        norm_topk_prob=bool(_pick("norm_topk_prob", block, config, default=True)),
        shared_experts=copy.deepcopy(shared),
        shared_expert_gate=copy.deepcopy(getattr(block, "shared_expert_gate", None)),
        activation=act, dtype=gate_up.dtype, **kwargs)
    with torch.no_grad():
        if legacy:
            layer.gate.weight.copy_(block.gate.weight)
            layer.return_router_logits = True      # v4 blocks returned (hidden, router_logits)
        else:
            layer.gate = copy.deepcopy(block.gate)
        layer.experts.load_from_full(gate_up, down)
    return layer.train(block.training)


def replace_moe_blocks(model: nn.Module, group=None, **kwargs) -> list:
    """Replace every recognised MoE block in ``model`` by a sharded :class:`MoELayer` (in
    place; collective: every rank calls it on an identical model).

    All replaced layers share the group's Buffer. With ``num_redundant_experts > 0`` and no
    ``load_recorder`` given, one :class:`ExpertLoadRecorder` with a row per replaced layer is
    shared by them. ``config`` defaults to ``model.config``.
    Returns the qualified names of the replaced modules.
    """
    kwargs.setdefault("config", getattr(model, "config", None))
    names = [name for name, m in model.named_modules() if name and is_moe_block(m)]
    # a block nested in another recognised block is replaced along with its parent
    names = [n for n in names if not any(n.startswith(p + ".") for p in names)]
    if names and kwargs.get("num_redundant_experts") and kwargs.get("load_recorder") is None:
        first = model.get_submodule(names[0])
        kwargs["load_recorder"] = ExpertLoadRecorder(len(names),
                                                     _expert_weights(first.experts)[0].shape[0])
    for i, name in enumerate(names):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = from_hf(getattr(parent, child), group=group, layer_index=i, **kwargs)
        setattr(parent, child, layer)
    return names
