"""Routing: router logits -> top-k expert ids and weights.

Two scoring families cover the models MoELayer targets:

* ``softmax`` (Mixtral, Qwen2/3-MoE, DeepSeek-V2): probabilities over all experts, top-k,
  optionally renormalised over the chosen k.
* ``sigmoid`` (DeepSeek-V3): independent scores; an optional correction bias changes *which*
  experts are chosen but not their weights; weights renormalised (+1e-20, as in V3).

Both support group-limited selection (``n_group``/``topk_group``): first keep the best
``topk_group`` of ``n_group`` contiguous expert groups per token, then pick top-k inside them.
A group's score is its best expert (softmax, DeepSeek-V2) or the sum of its best two (sigmoid,
DeepSeek-V3). ``routed_scaling_factor`` multiplies the final weights.

Weights come back in float32 (what dispatch carries); ids as int64.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

SCORING_FUNCS = ("softmax", "sigmoid")


def check_routing_args(num_experts: int, top_k: int, scoring_func: str, n_group, topk_group):
    """Raise ValueError naming the bad routing argument."""
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(top_k, int) or not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    if (n_group is None) != (topk_group is None):
        raise ValueError("n_group and topk_group must be given together")
    if n_group is not None:
        if not isinstance(n_group, int) or n_group <= 0 or num_experts % n_group:
            raise ValueError(f"n_group must be a positive divisor of num_experts={num_experts}, "
                             f"got {n_group!r}")
        if not isinstance(topk_group, int) or not 0 < topk_group <= n_group:
            raise ValueError(f"topk_group must be an int in [1, n_group={n_group}], got "
                             f"{topk_group!r}")
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"top_k={top_k} exceeds the experts of the {topk_group} kept groups")


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int, per_group_top: int):
    """bool [T, E]: experts inside each token's best ``topk_group`` groups."""
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)
    top = min(per_group_top, E // n_group)
    group_scores = grouped.topk(top, dim=-1).values.sum(-1)                 # [T, G]
    keep = group_scores.topk(topk_group, dim=-1).indices
    mask = torch.zeros(T, n_group, dtype=torch.bool, device=choice.device)
    mask.scatter_(1, keep, True)
    return mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)


def select_experts(logits: torch.Tensor, top_k: int, *, scoring_func: str = "softmax",
                   norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                   n_group: int | None = None, topk_group: int | None = None,
                   correction_bias: torch.Tensor | None = None):
    """Choose each token's top-k experts.

    Args:
        logits: [T, E] router logits (any float dtype; scored in float32).
        top_k: experts per token K.
        scoring_func: "softmax" or "sigmoid".
        norm_topk_prob: renormalise the K weights to sum to 1.
        routed_scaling_factor: multiplies the final weights.
        n_group, topk_group: group-limited selection (both or neither).
        correction_bias: float [E] added to the scores for choosing only (DeepSeek-V3's
            ``e_score_correction_bias``); the weights use the uncorrected scores.
    Returns:
        topk_weights float32 [T, K] (differentiable w.r.t. logits), topk_idx int64 [T, K].
    """
    E = logits.shape[-1]
    check_routing_args(E, top_k, scoring_func, n_group, topk_group)
    scores = logits.float().softmax(-1) if scoring_func == "softmax" else logits.float().sigmoid()
    # the choice never needs a gradient: only the gathered scores do
    choice = scores.detach()
    if correction_bias is not None:
        choice = choice + correction_bias.detach().float()
    if n_group is not None and n_group > 1:
        mask = _group_mask(choice, n_group, topk_group, 2 if scoring_func == "sigmoid" else 1)
        choice = choice.masked_fill(~mask, float("-inf"))
    idx = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, idx)
    if norm_topk_prob:
        denom = weights.sum(-1, keepdim=True)
        weights = weights / (denom + 1e-20 if scoring_func == "sigmoid" else denom)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, idx


class TopKRouter(nn.Module):
    """Linear router + :func:`select_experts`; same call contract as the HF v5 routers.

    Args:
        hidden_size: H. num_experts: E. top_k: K.
        scoring_func, norm_topk_prob, routed_scaling_factor, n_group, topk_group: see
            :func:`select_experts`.
        correction_bias: register an ``e_score_correction_bias`` [E] buffer (zeros) used for
            choosing (DeepSeek-V3).
        router_dtype: dtype of the logits matmul; None = the input's dtype (Mixtral, Qwen),
            torch.float32 = DeepSeek-V3 (bf16 activations, fp32 router). Exact top-k agreement
            with a reference model needs the same choice.
    forward(hidden [T, H] or [..., H]) -> (router_logits [T, E], topk_weights float32 [T, K],
    topk_idx int64 [T, K]).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *,
                 scoring_func: str = "softmax", norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, n_group: int | None = None,
                 topk_group: int | None = None, correction_bias: bool = False,
                 router_dtype: torch.dtype | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        check_routing_args(num_experts, top_k, scoring_func, n_group, topk_group)
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.scoring_func, self.norm_topk_prob = scoring_func, norm_topk_prob
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.n_group, self.topk_group = n_group, topk_group
        self.router_dtype = router_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)
        if correction_bias:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, self.hidden_size)
        if self.router_dtype is not None:
            logits = F.linear(x.to(self.router_dtype), self.weight.to(self.router_dtype))
        else:
            logits = F.linear(x, self.weight.to(x.dtype))
        weights, idx = select_experts(
            logits, self.top_k, scoring_func=self.scoring_func,
            norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor,
            n_group=self.n_group, topk_group=self.topk_group,
            correction_bias=self.e_score_correction_bias)
        return logits, weights, idx

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, scoring_func={self.scoring_func!r}, "
                f"n_group={self.n_group}, topk_group={self.topk_group}")
