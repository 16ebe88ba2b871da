"""Hugging Face adapter: read what a transformers MoE block computes (routing settings, full
expert weights, shared experts) out of it, for :meth:`moe_comm.MoELayer.from_hf` to rebuild it
sharded. This module only reads blocks; it builds nothing (so it needs nothing of the layer).

Recognised blocks (``gate`` + ``experts``, optionally shared experts):

* transformers v5 blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, ...): a router module
  returning ``(router_logits, top_k_weights, top_k_index)`` and packed experts
  ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` (or transposed). The layer keeps the
  router module itself (a copy), so routing semantics (softmax or sigmoid, group-limited
  top-k, correction bias, scaling, dtypes) are the model's own, and transformers' router-logit
  recording (``output_router_logits``) still finds it.
* v4-style blocks: ``gate`` an ``nn.Linear`` and ``experts`` a ``ModuleList`` of gated MLPs
  with ``w1``/``w3``/``w2`` (Mixtral) or ``gate_proj``/``up_proj``/``down_proj`` (Qwen). Routing
  is softmax top-k (renormalised unless ``norm_topk_prob`` is False) by
  :class:`moe_comm.nn.router.TopKRouter`, and the layer returns ``(hidden, router_logits)`` as
  those blocks did.
* shared experts: ``shared_expert`` + ``shared_expert_gate`` (Qwen2-MoE: sigmoid-gated) or
  ``shared_experts`` (DeepSeek-V3: added).

The block itself is left unchanged. Not supported (raise NotImplementedError): expert biases,
experts without a gate projection, interleaved gate/up layouts or custom gating (e.g.
gpt-oss), and Mixtral's training-time router jitter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

_LEGACY_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


@dataclass(frozen=True)
class MoEBlockSpec:
    """What a recognised MoE block computes, read out of it.

    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]: the full expert weights
    (detached; views of packed weights, stacked for a ModuleList). ``gate``: the block's
    router, an ``nn.Linear`` for a v4-style block, else a v5 router module.
    ``shared_experts`` / ``shared_expert_gate``: the block's, or None. The modules are the
    block's own: a layer that keeps them copies them, leaving the block unchanged."""
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    activation: Callable
    top_k: int
    norm_topk_prob: bool
    gate: nn.Module
    shared_experts: nn.Module | None
    shared_expert_gate: nn.Module | None
    training: bool

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.gate_up_proj.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.gate_up_proj.shape[1] // 2

    @property
    def legacy_gate(self) -> bool:
        """A v4-style block: a plain linear gate, routed by moe_comm's own router."""
        return isinstance(self.gate, nn.Linear)


def legacy_linear_names(expert: nn.Module):
    """(gate, up, down) names of a v4-style expert's Linear layers, or None."""
    for names in _LEGACY_NAMES:
        if all(isinstance(getattr(expert, n, None), nn.Linear) for n in names):
            return names
    return None


def expert_weights(experts: nn.Module):
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
    if isinstance(experts, nn.ModuleList) and len(experts) and legacy_linear_names(experts[0]):
        g, u, d = legacy_linear_names(experts[0])
        gu = torch.stack([torch.cat([getattr(e, g).weight, getattr(e, u).weight]) for e in experts])
        dn = torch.stack([getattr(e, d).weight for e in experts])
        return gu.detach(), dn.detach(), experts[0].act_fn
    raise TypeError(f"{type(experts).__name__}: expected packed gate_up_proj/down_proj experts "
                    "or a ModuleList of gated MLPs (w1/w2/w3 or gate_proj/up_proj/down_proj)")


def is_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` has the shape of a recognised MoE block (see the module doc). A
    MoELayer has it too (a gate and packed experts): callers that replace blocks skip those."""
    if not hasattr(module, "gate"):
        return False
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module):
        return False
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return True
    return isinstance(experts, nn.ModuleList) and len(experts) > 0 and \
        legacy_linear_names(experts[0]) is not None


def _pick(name, *sources, default=None):
    for s in sources:
        v = getattr(s, name, None) if s is not None else None
        if v is not None:
            return v
    return default


def read_block(block: nn.Module, config=None) -> MoEBlockSpec:
    """Read what ``block`` computes.

    Args:
        block: a transformers MoE block (see the module doc for the recognised kinds).
        config: the model config, read for routing settings a v4-style block does not carry
            (``num_experts_per_tok``, ``norm_topk_prob``).
    """
    if not is_moe_block(block):
        raise TypeError(f"{type(block).__name__} is not a recognised MoE block (needs a gate and "
                        "packed or ModuleList experts)")
    config = getattr(config, "text_config", config)
    if getattr(block, "jitter_noise", 0) and block.training:
        raise NotImplementedError("router jitter noise (training-time) is not supported")
    gate_up, down, act = expert_weights(block.experts)
    top_k = _pick("top_k", block.gate, block, default=None) or \
        _pick("num_experts_per_tok", config)
    if top_k is None:
        raise ValueError("cannot tell top_k: the block has no top_k; pass config=model.config")
    return MoEBlockSpec(
        gate_up_proj=gate_up, down_proj=down, activation=act, top_k=int(top_k),
        norm_topk_prob=bool(_pick("norm_topk_prob", block, config, default=True)),
        gate=block.gate,
        shared_experts=_pick("shared_experts", block) or _pick("shared_expert", block),
        shared_expert_gate=getattr(block, "shared_expert_gate", None),
        training=block.training)
