"""This rank's experts: gated MLPs (SwiGLU by default) with weights batched per expert.

Weights use the Hugging Face v5 packed layout, so loading a checkpoint slice is one index:
``gate_up_proj [L, 2I, H]`` (gate rows first, then up rows) and ``down_proj [L, H, I]``,
where L is the number of expert slots this rank holds.

Two entry points, one per dispatch layout:

* :meth:`LocalExperts.compute_rows` for normal mode: received tokens ``[N, H]`` each with up to
  K local expert ids; (row, slot) pairs are sorted by expert so every expert runs one matmul
  over a contiguous block, and the outputs are weighted and summed per row.
* :meth:`LocalExperts.compute_packed` for low-latency mode: rows already packed per expert
  ``[L, M, H]`` with a count each; unweighted (the owner applies the weights in combine).
"""
from __future__ import annotations

import functools

import torch
from torch import nn
import torch.nn.functional as F

from ..quant import dequantize_fp8

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def resolve_activation(activation):
    """A name from :data:`ACTIVATIONS` or a callable (e.g. a transformers ``act_fn``)."""
    if callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)} or a callable, got "
                         f"{activation!r}")
    return ACTIVATIONS[activation]


class LocalExperts(nn.Module):
    """The expert slots one rank holds.

    Args:
        num_local: L, expert slots on this rank.
        hidden_size: H. intermediate_size: I (per expert).
        activation: applied to the gate projection ("silu" = SwiGLU), a name or a callable.
        dtype: parameter dtype (default: torch's default dtype).
        init_std: std of the normal initialisation (HF's ``initializer_range``).
    """

    def __init__(self, num_local: int, hidden_size: int, intermediate_size: int,
                 activation="silu", *, dtype: torch.dtype | None = None, init_std: float = 0.02):
        super().__init__()
        for name, v in (("num_local", num_local), ("hidden_size", hidden_size),
                        ("intermediate_size", intermediate_size)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.num_local, self.hidden_size, self.intermediate_size = (num_local, hidden_size,
                                                                    intermediate_size)
        # a transformers act_fn is a parameter-free module: registering it adds no state
        self.act_fn = resolve_activation(activation)
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * intermediate_size,
                                                     hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden_size, intermediate_size,
                                                  dtype=dtype))
        nn.init.normal_(self.gate_up_proj, std=init_std)
        nn.init.normal_(self.down_proj, std=init_std)

    @torch.no_grad()
    def load_experts(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                     expert_ids) -> None:
        """Copy the weights of logical experts ``expert_ids`` (one per local slot) out of full
        tensors ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``."""
        ids = torch.as_tensor(expert_ids, dtype=torch.int64)
        if ids.shape != (self.num_local,):
            raise ValueError(f"expert_ids must name {self.num_local} experts, got {tuple(ids.shape)}")
        want_gu = (2 * self.intermediate_size, self.hidden_size)
        if gate_up_proj.dim() != 3 or tuple(gate_up_proj.shape[1:]) != want_gu:
            raise ValueError(f"gate_up_proj must be [E, {want_gu[0]}, {want_gu[1]}], got "
                             f"{tuple(gate_up_proj.shape)}")
        if down_proj.dim() != 3 or tuple(down_proj.shape[1:]) != (self.hidden_size,
                                                                  self.intermediate_size):
            raise ValueError(f"down_proj must be [E, {self.hidden_size}, "
                             f"{self.intermediate_size}], got {tuple(down_proj.shape)}")
        self.gate_up_proj.copy_(gate_up_proj[ids.to(gate_up_proj.device)])
        self.down_proj.copy_(down_proj[ids.to(down_proj.device)])

    def expert_mlp(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``slot`` on rows ``x [n, H]`` -> [n, H] in the weights' dtype."""
        gate, up = F.linear(x, self.gate_up_proj[slot]).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj[slot])

    def compute_rows(self, x: torch.Tensor, topk_idx: torch.Tensor,
                     topk_weights: torch.Tensor) -> torch.Tensor:
        """Normal-mode expert computation, differentiable.

        Args:
            x: [N, H] received tokens.
            topk_idx: int64 [N, K] local slot ids, -1 for slots served elsewhere.
            topk_weights: float [N, K] routing weights (ignored where the id is -1).
        Returns:
            [N, H] in x's dtype: ``sum_k w[n, k] * expert_{idx[n, k]}(x[n])``, summed in float32.
        """
        N, K = topk_idx.shape
        L = self.num_local
        flat = topk_idx.reshape(-1)
        key = torch.where(flat >= 0, flat, L)             # -1 sorts last, under a dummy slot
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=L + 1)[:L]
        order = order[:int(counts.sum())]
        rows = torch.div(order, K, rounding_mode="floor")
        # index_select saves only the indices for backward: the received tensor (which lives
        # in the communication buffer) is not kept alive by the autograd graph
        xs = x.index_select(0, rows).to(self.gate_up_proj.dtype)
        # every slot runs, even with no rows: the output then always depends on x and on all
        # weights, so every rank's autograd graph has the same communication nodes
        outs = [self.expert_mlp(e, seg) for e, seg in enumerate(xs.split(counts.tolist()))]
        ys = torch.cat(outs).float() * topk_weights.reshape(-1)[order].float().unsqueeze(1)
        out = torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device)
        return out.index_add(0, rows, ys).to(x.dtype)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """HF v5 experts contract with *local* slot ids: see :meth:`compute_rows`."""
        return self.compute_rows(hidden_states, top_k_index, top_k_weights)

    @torch.no_grad()
    def compute_packed(self, x: torch.Tensor, counts: torch.Tensor,
                       out: torch.Tensor | None = None,
                       scales: torch.Tensor | None = None) -> torch.Tensor:
        """Low-latency-mode expert computation (inference only).

        Args:
            x: [L, M, H] rows packed per local slot, bf16 or float8_e4m3fn.
            counts: int [L], valid rows per slot; rows past the count are ignored.
            out: optional bf16 [L, M, H] to write into (e.g. the zero-copy combine buffer).
            scales: float32 [L, M, H/128] when x is fp8 (dequantised row block by block).
        Returns:
            ``out`` (bf16 [L, M, H]); rows past each count are left untouched.
        """
        if out is None:
            out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        for e, c in enumerate(counts.tolist()):
            if c:
                rows = x[e, :c] if scales is None else dequantize_fp8(x[e, :c], scales[e, :c])
                out[e, :c] = self.expert_mlp(e, rows.to(self.gate_up_proj.dtype))
        return out

    def extra_repr(self) -> str:
        return (f"num_local={self.num_local}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}")
