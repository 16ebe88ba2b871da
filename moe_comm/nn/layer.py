"""MoELayer: a drop-in expert-parallel MoE block.

    hidden [T, H] -> gate (router) -> top-k logical ids, weights
                  -> experts:  [EPLB: logical -> physical slot, load recorded]
                               -> dispatch -> this rank's expert slots -> combine
                  -> + shared experts (computed while the low-latency dispatch is in flight)

Each rank holds only its own expert slots. ``MoELayer.experts`` on its own follows the HF v5
experts contract ``experts(hidden, top_k_index, top_k_weights) -> [T, H]`` with *logical*
expert ids, so it can also replace the ``experts`` of an existing transformers block.

Modes: "normal" (any dtype, differentiable, any token count), "low_latency" (bf16, H % 128 == 0,
at most ``ll_max_tokens`` tokens per rank, inference only) and "auto": low-latency when it is
possible and every rank has at most ``ll_max_tokens`` tokens (one small all-reduce agrees on
that, since all ranks must take the same path), normal otherwise.

All layers on one group share one :class:`moe_comm.Buffer`, held by the
:class:`~moe_comm.nn.shared_buffers.SharedBuffers` a layer is given (by default the
process-wide one; moe_comm/nn/shared_buffers.py says why one per group is enough).

:meth:`MoELayer.from_hf` rebuilds a Hugging Face block from what :mod:`moe_comm.nn.hf` reads
out of it.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
import torch.distributed as dist

from . import autograd as ag
from . import hf, hf_layout
from ..buffer import Buffer
from ..eplb import ExpertLoadRecorder, map_logical_to_physical, rebalance_experts
from ..wire import LL_MAX_TOPK, LLLayout
from .experts import LocalExperts
from .router import TopKRouter
from .shared_buffers import DEFAULT_SHARED_BUFFERS, SharedBuffers, world_if_none

MODES = ("auto", "normal", "low_latency")
# the experts' EPLB placement (physical slot <-> logical expert): moe_comm's own state, kept in
# the state dict so a rank's shard reloads with its placement, never part of a HF checkpoint
PLACEMENT_BUFFERS = ("phy2log", "log2phy", "logcnt")


class ExpertParallelExperts(LocalExperts):
    """This rank's expert slots plus the communication around them (HF v5 experts contract).

    Args:
        num_experts: logical experts E. top_k: K. hidden_size: H. intermediate_size: I.
        group: process group (None = world); rank r holds physical slots [r*S, (r+1)*S).
        mode: "auto", "normal" or "low_latency" (see module doc).
        num_redundant_experts: extra physical slots for replicas of busy experts; P = E + this
            must be a multiple of the group size, S = P / R slots per rank. Placement and
            replica routing come from :mod:`moe_comm.eplb`.
        activation: gate activation ("silu" = SwiGLU) or a callable.
        buffer: a Buffer to use instead of the per-group shared one.
        shared_buffers: where the per-group shared Buffer is kept (default:
            :data:`~moe_comm.nn.shared_buffers.DEFAULT_SHARED_BUFFERS`, shared by every layer
            of the process); unused with ``buffer``.
        num_nvl_bytes: normal-mode heap size for the shared Buffer; default sized for
            ``max_tokens_per_rank`` tokens per rank in the worst routing.
        ll_max_tokens: low-latency capacity M, tokens per rank per call.
        ll_use_fp8: cast to fp8 for low-latency dispatch (less traffic, less accuracy).
        load_recorder, layer_index: an :class:`ExpertLoadRecorder` (over logical experts) and
            this layer's row in it; one is created when replicas are used and none is given.
        dtype, init_std: parameter dtype and initialisation.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 *, group=None, mode: str = "auto", num_redundant_experts: int = 0,
                 activation="silu", buffer: Buffer | None = None,
                 shared_buffers: SharedBuffers | None = None, num_nvl_bytes: int | None = None,
                 max_tokens_per_rank: int = 1024, ll_max_tokens: int = 128,
                 ll_use_fp8: bool = False, load_recorder: ExpertLoadRecorder | None = None,
                 layer_index: int = 0, dtype: torch.dtype | None = None, init_std: float = 0.02):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(num_redundant_experts, int) or num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be an int >= 0, got "
                             f"{num_redundant_experts!r}")
        group = world_if_none(group)
        R, rank = dist.get_world_size(group), dist.get_rank(group)
        P = num_experts + num_redundant_experts
        if P % R:
            raise ValueError(f"num_experts + num_redundant_experts = {P} must be divisible by the "
                             f"group size {R}")
        super().__init__(P // R, hidden_size, intermediate_size, activation, dtype=dtype,
                         init_std=init_std)
        self.num_experts, self.top_k, self.group, self.rank, self.num_ranks = (
            num_experts, top_k, group, rank, R)
        self.num_physical = P
        self.mode, self.ll_max_tokens, self.ll_use_fp8 = mode, ll_max_tokens, ll_use_fp8
        self.layer_index = layer_index
        self.last_mode = None              # the path the last call took (for tests and logs)
        self._init_placement(num_redundant_experts)
        if load_recorder is None and num_redundant_experts:
            load_recorder = ExpertLoadRecorder(1, num_experts)
            self.layer_index = 0
        self.load_recorder = load_recorder

        ll_possible = hidden_size % 128 == 0 and top_k <= LL_MAX_TOPK
        if mode == "low_latency" and not ll_possible:
            raise ValueError(f"mode='low_latency' needs hidden_size % 128 == 0 (got {hidden_size})"
                             f" and top_k <= {LL_MAX_TOPK} (got {top_k})")
        self._ll_bytes = 0
        if mode != "normal" and ll_possible:
            self._ll_bytes = LLLayout(ll_max_tokens, hidden_size, R, P).nbytes
        self._own_buffer = buffer
        self.shared_buffers = (DEFAULT_SHARED_BUFFERS if shared_buffers is None
                               else shared_buffers)
        if buffer is not None and self._ll_bytes and not (
                buffer.low_latency_mode and buffer.num_rdma_bytes >= self._ll_bytes):
            if mode == "low_latency":
                raise ValueError(f"buffer needs low_latency_mode=True and num_rdma_bytes >= "
                                 f"{self._ll_bytes} for mode='low_latency'")
            self._ll_bytes = 0                     # auto: that buffer can only do normal mode
        if buffer is None:
            if num_nvl_bytes is None:
                wide = (dtype or torch.get_default_dtype()).itemsize >= 4
                # keep_alive=2: the backward's dispatch may run while a result is still held
                num_nvl_bytes = Buffer.get_normal_buffer_size_hint(
                    max_tokens_per_rank, hidden_size, R, top_k, elem_size=4 if wide else 2,
                    keep_alive=2)
            self.shared_buffers.for_group(group, num_nvl_bytes, self._ll_bytes)

    # -- placement (EPLB) --------------------------------------------------------------------
    def _init_placement(self, redundant: int):
        E, P, R = self.num_experts, self.num_physical, self.num_ranks
        if redundant:
            phy2log, log2phy, logcnt = rebalance_experts(torch.ones(1, E), P, 1, 1, R)
            phy2log, log2phy, logcnt = phy2log[0], log2phy[0], logcnt[0]
        else:
            phy2log = torch.arange(E)
            log2phy, logcnt = phy2log.view(E, 1).clone(), torch.ones(E, dtype=torch.int64)
        for name, value in zip(PLACEMENT_BUFFERS, (phy2log, log2phy, logcnt)):
            self.register_buffer(name, value)

    @property
    def redundant(self) -> bool:
        return self.num_physical > self.num_experts

    @property
    def local_expert_ids(self) -> torch.Tensor:
        """int64 [S]: the logical expert held by each of this rank's slots."""
        S = self.num_local
        return self.phy2log[self.rank * S:(self.rank + 1) * S]

    @property
    def buffer(self) -> Buffer:
        return self.buffer_for(None)

    def buffer_for(self, device) -> Buffer:
        """The Buffer this layer's calls use, serving ``device`` (the call's tensors; None:
        whichever the shared Buffer serves)."""
        if self._own_buffer is not None:
            return self._own_buffer
        return self.shared_buffers.for_group(self.group, device=device)

    def load_from_full(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        """Take this rank's slots out of full logical weights [E, 2I, H] / [E, H, I]."""
        self.load_experts(gate_up_proj, down_proj, self.local_expert_ids)

    def global_load(self) -> torch.Tensor:
        """float64 [E]: this layer's recorded load summed over the group (collective)."""
        load = self.load_recorder.load()[self.layer_index].to(torch.float64)
        dist.all_reduce(load, group=self.group)
        return load

    @torch.no_grad()
    def rebalance(self, load: torch.Tensor | None = None) -> int:
        """Re-place the replicas for ``load`` ([E], default: :meth:`global_load`) and move the
        weights (collective). Returns how many of this rank's slots changed expert.

        Weights move with one all-gather per slot position (R slots at a time in memory)."""
        if not self.redundant:
            raise RuntimeError("rebalance needs num_redundant_experts > 0")
        load = self.global_load() if load is None else load.to(torch.float64)
        old = self.phy2log.clone()
        phy2log, log2phy, logcnt = rebalance_experts(load.view(1, -1), self.num_physical, 1, 1,
                                                     self.num_ranks, old_phy2log=old.view(1, -1))
        S, me = self.num_local, self.rank
        want = phy2log[0, me * S:(me + 1) * S]
        # where each wanted expert can be read: the first old slot holding it
        src = torch.stack([(old == e).nonzero()[0, 0] for e in want.tolist()])
        new_gu, new_down = self.gate_up_proj.detach().clone(), self.down_proj.detach().clone()
        for pos in range(S):
            gu = [torch.empty_like(self.gate_up_proj[pos]) for _ in range(self.num_ranks)]
            dn = [torch.empty_like(self.down_proj[pos]) for _ in range(self.num_ranks)]
            dist.all_gather(gu, self.gate_up_proj[pos].detach().contiguous(), group=self.group)
            dist.all_gather(dn, self.down_proj[pos].detach().contiguous(), group=self.group)
            for j in (src % S == pos).nonzero().flatten().tolist():
                new_gu[j], new_down[j] = gu[int(src[j]) // S], dn[int(src[j]) // S]
        self.gate_up_proj.copy_(new_gu)
        self.down_proj.copy_(new_down)
        self.phy2log.copy_(phy2log[0])
        self.log2phy, self.logcnt = log2phy[0], logcnt[0]
        return int((want != old[me * S:(me + 1) * S]).sum())

    # -- forward -----------------------------------------------------------------------------
    def _pick_mode(self, x: torch.Tensor, weights: torch.Tensor) -> str:
        if self.mode == "normal":
            return "normal"
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or weights.requires_grad or
            any(p.requires_grad for p in (self.gate_up_proj, self.down_proj)))
        possible = self._ll_bytes > 0 and x.dtype == torch.bfloat16 and not needs_grad
        if self.mode == "low_latency":
            if not possible:
                raise RuntimeError("low-latency mode needs bf16 input and no gradient (run under "
                                   "torch.no_grad() or use mode='normal'/'auto')")
            if x.shape[0] > self.ll_max_tokens:
                raise ValueError(f"{x.shape[0]} tokens exceed ll_max_tokens={self.ll_max_tokens}")
            return "low_latency"
        if not possible:
            return "normal"
        # every rank must take the same path: agree on the largest token count
        most = torch.tensor([x.shape[0]], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        return "low_latency" if int(most) <= self.ll_max_tokens else "normal"

    def run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor, during=None):
        """:meth:`forward` that also runs ``during()`` (e.g. the shared experts) while the
        dispatch is in flight; returns ``(out [T, H], during's result or None)``."""
        x = hidden_states
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [T, {self.hidden_size}], got "
                             f"{tuple(x.shape)}")
        if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0] or \
                tuple(top_k_weights.shape) != tuple(top_k_index.shape):
            raise ValueError(f"top_k_index and top_k_weights must both be [T={x.shape[0]}, K], "
                             f"got {tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
        idx = top_k_index.to(torch.int64)
        w = top_k_weights.float()
        if self.redundant:
            idx, _ = map_logical_to_physical(idx, self.log2phy, self.logcnt)
        if self.load_recorder is not None:
            self.load_recorder.record(self.layer_index,
                                      torch.bincount(idx[idx >= 0], minlength=self.num_physical),
                                      self.phy2log)
        mode = self.last_mode = self._pick_mode(x, w)
        if mode == "low_latency":
            return self._low_latency(x, idx, w, during)
        buf = self.buffer_for(x.device)
        recv_x, recv_idx, recv_w, handle = ag.dispatch(buf, x.contiguous(), idx, w,
                                                      self.num_physical)
        extra = during() if during is not None else None
        y = self.compute_rows(recv_x, recv_idx, recv_w)
        del recv_x                       # return the received region to the heap early
        return ag.combine(buf, y, handle), extra

    @torch.no_grad()
    def _low_latency(self, x, idx, w, during):
        buf = self.buffer_for(x.device)
        recv, counts, handle, _, hook = buf.low_latency_dispatch(
            x.contiguous(), idx, self.ll_max_tokens, self.num_physical,
            use_fp8=self.ll_use_fp8, return_recv_hook=True)
        extra = during() if during is not None else None
        hook()
        scales = None
        if self.ll_use_fp8:
            recv, scales = recv
        y = buf.get_next_low_latency_combine_buffer(handle)
        self.compute_packed(recv, counts, out=y, scales=scales)
        out, _, _ = buf.low_latency_combine(y, idx, w, handle, zero_copy=True)
        return out.to(x.dtype), extra

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """HF v5 experts contract over the group.

        Args:
            hidden_states: [T, H] this rank's tokens.
            top_k_index: int [T, K] logical expert ids (-1 = unused slot).
            top_k_weights: float [T, K] routing weights.
        Returns:
            [T, H] in hidden_states' dtype: each token's weighted sum of its experts' outputs.
        """
        return self.run(hidden_states, top_k_index, top_k_weights)[0]

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", num_experts={self.num_experts}, "
                f"num_physical={self.num_physical}, ranks={self.num_ranks}, mode={self.mode!r}")


class MoELayer(nn.Module):
    """Expert-parallel MoE block: router -> dispatch -> local experts -> combine -> shared.

    Args:
        num_experts: logical experts E. top_k: experts per token K.
        hidden_size: H. intermediate_size: I of each routed expert.
        group: process group of the expert-parallel ranks (None = world).
        mode: "auto" | "normal" | "low_latency".
        scoring_func, norm_topk_prob, routed_scaling_factor, n_group, topk_group: routing, see
            :func:`moe_comm.nn.router.select_experts`.
        correction_bias: give the router an ``e_score_correction_bias`` (DeepSeek-V3); default
            True for sigmoid scoring.
        router_dtype: dtype of the router matmul (None = input dtype; float32 for DeepSeek-V3).
        shared_experts: optional module [T, H] -> [T, H] added to every token's output.
        shared_expert_gate: optional module [T, H] -> [T, 1]; the shared output is scaled by
            its sigmoid (Qwen2-MoE).
        num_redundant_experts, activation, buffer, shared_buffers, num_nvl_bytes,
        max_tokens_per_rank, ll_max_tokens, ll_use_fp8, load_recorder, layer_index, dtype,
        init_std: see :class:`ExpertParallelExperts`.
    forward(hidden_states [B, S, H] or [T, H]) -> same shape (and the router logits
    [T, E] as a second output when ``return_router_logits`` is set).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 *, group=None, mode: str = "auto", scoring_func: str = "softmax",
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 n_group: int | None = None, topk_group: int | None = None,
                 correction_bias: bool | None = None, router_dtype: torch.dtype | None = None,
                 shared_experts: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, num_redundant_experts: int = 0,
                 activation="silu", dtype: torch.dtype | None = None, init_std: float = 0.02,
                 **experts_kwargs):
        super().__init__()
        if correction_bias is None:
            correction_bias = scoring_func == "sigmoid"
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.gate = TopKRouter(hidden_size, num_experts, top_k, scoring_func=scoring_func,
                               norm_topk_prob=norm_topk_prob,
                               routed_scaling_factor=routed_scaling_factor, n_group=n_group,
                               topk_group=topk_group, correction_bias=correction_bias,
                               router_dtype=router_dtype, dtype=dtype)
        nn.init.normal_(self.gate.weight, std=init_std)
        self.experts = ExpertParallelExperts(
            num_experts, top_k, hidden_size, intermediate_size, group=group, mode=mode,
            num_redundant_experts=num_redundant_experts, activation=activation, dtype=dtype,
            init_std=init_std, **experts_kwargs)
        self.shared_experts = shared_experts
        self.shared_expert_gate = shared_expert_gate
        self.return_router_logits = False
        # how a checkpoint names this layer's weights (moe_comm.nn.checkpoint); from_hf sets
        # the replaced block's
        self.checkpoint_layout = hf_layout.NATIVE_LAYOUT

    @classmethod
    def from_hf(cls, block: nn.Module, group=None, config=None, **kwargs) -> "MoELayer":
        """Build a MoELayer that computes what ``block`` computes, its experts sharded over
        ``group``.

        Args:
            block: a transformers MoE block (see :mod:`moe_comm.nn.hf` for the recognised
                kinds); it is left unchanged.
            group: process group of the expert-parallel ranks (None = world); every rank
                calls this with an identical block.
            config: the model config, read for routing settings a v4-style block does not
                carry (``num_experts_per_tok``, ``norm_topk_prob``).
            **kwargs: passed to :class:`MoELayer` (mode, num_redundant_experts, buffer,
                shared_buffers, num_nvl_bytes, max_tokens_per_rank, ll_max_tokens,
                load_recorder, layer_index, ...).
        Returns:
            a MoELayer in the dtype of the block's expert weights, remembering how the block
            named its weights (``checkpoint_layout``) so that
            :func:`moe_comm.nn.save_pretrained` writes the block's own checkpoint.
        """
        if isinstance(block, MoELayer):     # has a gate and packed experts, but is sharded
            raise TypeError(f"{type(block).__name__} is not a recognised MoE block (it is "
                            "already an expert-parallel MoELayer)")
        spec = hf.read_block(block, config)
        # copies: the layer must not share modules with the block it replaces
        layer = MoELayer(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.intermediate_size, group=group,
            scoring_func="softmax", norm_topk_prob=spec.norm_topk_prob,
            shared_experts=copy.deepcopy(spec.shared_experts),
            shared_expert_gate=copy.deepcopy(spec.shared_expert_gate),
            activation=spec.activation, dtype=spec.gate_up_proj.dtype, **kwargs)
        with torch.no_grad():
            if spec.legacy_gate:
                layer.gate.weight.copy_(spec.gate.weight)
                layer.return_router_logits = True    # v4 blocks returned (hidden, router_logits)
            else:
                layer.gate = copy.deepcopy(spec.gate)
            layer.experts.load_from_full(spec.gate_up_proj, spec.down_proj)
        layer.checkpoint_layout = hf_layout.layout_of(block)
        return layer.train(spec.training)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(x)) * out
        return out

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        if shape[-1] != self.hidden_size or hidden_states.dim() not in (2, 3):
            raise ValueError(f"hidden_states must be [B, S, {self.hidden_size}] or "
                             f"[T, {self.hidden_size}], got {tuple(shape)}")
        x = hidden_states.reshape(-1, self.hidden_size)
        router_logits, weights, idx = self.gate(x)
        during = (lambda: self._shared(x)) if self.shared_experts is not None else None
        out, shared = self.experts.run(x, idx, weights, during=during)
        if shared is not None:
            out = out + shared
        out = out.reshape(shape)
        return (out, router_logits) if self.return_router_logits else out
