"""MoELayer.from_hf / replace_moe_blocks against real transformers blocks built from small
configs (no downloads): Mixtral, Qwen2-MoE (sigmoid-gated shared expert), Qwen3-MoE,
DeepSeek-V3 (sigmoid, group-limited top-k, correction bias, scaling, shared experts) in the
packed v5 layout, and v4-style blocks with ModuleList experts (w1/w2/w3 and
gate_proj/up_proj/down_proj) that return router logits. Each rank runs the full block on its
own tokens as the reference and the sharded layer on 1, 2 and 4 ranks, in bf16 (low-latency
path for small batches, normal path for larger ones) and fp32, plus a tiny whole model whose
MoE blocks are replaced in place."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from moe_comm import MoELayer, replace_moe_blocks  # noqa: E402
from moe_comm.nn.router import TopKRouter
from ranks import run_ranks  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds  # noqa: E402
from transformers.models.mixtral import modeling_mixtral as mx  # noqa: E402
from transformers.models.qwen2_moe import modeling_qwen2_moe as q2  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as q3  # noqa: E402

H, I, E = 128, 64, 8
SMALL = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=96, max_position_embeddings=64)


def configs():
    cfgs = {
        "mixtral": transformers.MixtralConfig(**SMALL, intermediate_size=I, num_local_experts=E,
                                              num_experts_per_tok=2),
        "qwen2_moe": transformers.Qwen2MoeConfig(**SMALL, intermediate_size=96,
                                                 moe_intermediate_size=I,
                                                 shared_expert_intermediate_size=96,
                                                 num_experts=E, num_experts_per_tok=2,
                                                 norm_topk_prob=False),
        "qwen3_moe": transformers.Qwen3MoeConfig(**SMALL, intermediate_size=96,
                                                 moe_intermediate_size=I, num_experts=E,
                                                 num_experts_per_tok=3, norm_topk_prob=True),
        "deepseek_v3": transformers.DeepseekV3Config(
            **SMALL, intermediate_size=96, moe_intermediate_size=I, n_routed_experts=E,
            num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0,
            kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=32),
    }
    for c in cfgs.values():          # standalone blocks: name the (reference) implementation
        c._experts_implementation = "eager"
    return cfgs


class LegacyExpert(nn.Module):
    def __init__(self, names):
        super().__init__()
        self.names = names
        g, u, d = names
        setattr(self, g, nn.Linear(H, I, bias=False))
        setattr(self, u, nn.Linear(H, I, bias=False))
        setattr(self, d, nn.Linear(I, H, bias=False))
        self.act_fn = nn.SiLU()

    def forward(self, x):
        g, u, d = (getattr(self, n) for n in self.names)
        return d(self.act_fn(g(x)) * u(x))


class LegacyBlock(nn.Module):
    """A transformers-v4-style sparse MoE block: Linear gate, ModuleList experts, returns
    (hidden, router_logits)."""

    def __init__(self, names, top_k=2, norm_topk_prob=True):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(LegacyExpert(names) for _ in range(E))

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        router_logits = self.gate(x)
        probs = F.softmax(router_logits, dim=1, dtype=torch.float)
        w, sel = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(sel == e)
            out.index_add_(0, tok, (expert(x[tok]) * w[tok, slot, None]).to(x.dtype))
        return out.view(b, s, h), router_logits


@torch.no_grad()
def randomize(module, seed):
    """Weights large enough that routing is decisive and outputs are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        fan_in = p.shape[-1] if p.dim() > 1 else 1
        std = 1.0 if name.endswith("gate.weight") else fan_in ** -0.5
        p.copy_(torch.randn(p.shape, generator=gen) * std)
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return module


def make_block(kind, seed, dtype):
    cfgs = configs()
    if kind == "legacy_w123":
        block = LegacyBlock(("w1", "w3", "w2"))
    elif kind == "legacy_proj":
        block = LegacyBlock(("gate_proj", "up_proj", "down_proj"), top_k=3, norm_topk_prob=False)
    else:
        cls = {"mixtral": mx.MixtralSparseMoeBlock, "qwen2_moe": q2.Qwen2MoeSparseMoeBlock,
               "qwen3_moe": q3.Qwen3MoeSparseMoeBlock, "deepseek_v3": ds.DeepseekV3MoE}[kind]
        block = cls(cfgs[kind])
    return randomize(block, seed).to(dtype).eval()


KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "legacy_w123", "legacy_proj"]


def _run_blocks(rank, n):
    res = []
    for k, kind in enumerate(KINDS):
        for dtype in (torch.bfloat16, torch.float32):
            block = make_block(kind, 10 + k, dtype)
            extra = dict(num_redundant_experts=n) if kind == "deepseek_v3" and n > 1 else {}
            layer = MoELayer.from_hf(block, ll_max_tokens=16, max_tokens_per_rank=64, **extra)
            gen = torch.Generator().manual_seed(100 * k + rank)
            for t in (5 + rank, 40 - 3 * rank):     # LL-sized (bf16) and normal-sized batches
                x = torch.randn(2, t, H, generator=gen).to(dtype)
                with torch.no_grad():
                    want, got = block(x), layer(x)
                    logits_want = logits_got = None
                    if isinstance(want, tuple):
                        (want, logits_want), (got, logits_got) = want, got
                    elif hasattr(block.gate, "top_k"):      # v5 router: compare its logits
                        logits_want = block.gate(x.view(-1, H))[0]
                        logits_got = layer.gate(x.view(-1, H))[0]
                    only = None
                    if hasattr(block.experts, "gate_up_proj"):   # the HF v5 experts contract
                        _, w, idx = block.gate(x.view(-1, H))
                        only = (block.experts(x.view(-1, H), idx, w),
                                layer.experts(x.view(-1, H), idx, w))
                res.append(dict(kind=kind, dtype=dtype, t=t, want=want, got=got,
                                logits=(logits_want, logits_got), only=only,
                                mode=layer.experts.last_mode))
    return res


def _close(got, want, dtype, what):
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    scale = max(1.0, float(want.float().abs().max()))
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_from_hf_matches_block(n):
    results = run_ranks(_run_blocks, n, timeout=150)
    for rank, res in enumerate(results):
        modes = set()
        for r in res:
            what = f"{r['kind']} {r['dtype']} T={r['t']} rank {rank}/{n}"
            assert r["got"].shape == r["want"].shape and r["got"].dtype == r["want"].dtype, what
            _close(r["got"], r["want"], r["dtype"], what)
            lw, lg = r["logits"]
            if lw is not None:
                _close(lg, lw, r["dtype"], what + " router logits")
            if r["only"] is not None:
                _close(r["only"][1], r["only"][0], r["dtype"], what + " experts()")
            modes.add((r["dtype"], r["mode"]))
        # bf16 small batches went low-latency, everything else normal
        assert modes == {(torch.bfloat16, "low_latency"), (torch.bfloat16, "normal"),
                         (torch.float32, "normal")}, modes


def test_router_matches_hf_routers():
    """moe_comm.nn.router reproduces the HF v5 routers' choices and weights."""
    cfgs = configs()
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    pairs = [
        (mx.MixtralTopKRouter(cfgs["mixtral"]), TopKRouter(H, E, 2)),
        (q2.Qwen2MoeTopKRouter(cfgs["qwen2_moe"]), TopKRouter(H, E, 2, norm_topk_prob=False)),
        (ds.DeepseekV3TopkRouter(cfgs["deepseek_v3"]),
         TopKRouter(H, E, 3, scoring_func="sigmoid", n_group=4, topk_group=2,
                    routed_scaling_factor=2.5, correction_bias=True, router_dtype=torch.float32)),
    ]
    for hf, mine in pairs:
        randomize(hf, 5)
        hf, mine = hf.bfloat16(), mine.bfloat16()
        with torch.no_grad():
            mine.load_state_dict(hf.state_dict())
            (lw, ww, iw), (lg, wg, ig) = hf(x), mine(x)
        assert torch.equal(lw, lg), type(hf).__name__
        sw, sg = iw.sort(1), ig.sort(1)
        assert torch.equal(sw.values, sg.values), type(hf).__name__
        torch.testing.assert_close(wg.gather(1, sg.indices), ww.float().gather(1, sw.indices),
                                   rtol=1e-2, atol=1e-6)


def _tiny_model(kind, dtype):
    cfg = configs()[kind]
    cfg._attn_implementation = "eager"
    cls = {"qwen2_moe": transformers.Qwen2MoeForCausalLM,
           "mixtral": transformers.MixtralForCausalLM}[kind]
    torch.manual_seed(0)
    return randomize(cls(cfg), 1).to(dtype).eval()


def _run_model(rank, n):
    out = {}
    for kind in ("qwen2_moe", "mixtral"):
        model = _tiny_model(kind, torch.float32)
        ids = torch.randint(0, 96, (2, 9 + rank), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            want = model(ids, output_router_logits=True)
        names = replace_moe_blocks(model, max_tokens_per_rank=64)
        with torch.no_grad():
            got = model(ids, output_router_logits=True)
        out[kind] = dict(names=names, want=want.logits, got=got.logits,
                         rl_want=want.router_logits, rl_got=got.router_logits,
                         aux=(want.aux_loss, got.aux_loss),
                         types={type(m).__name__ for m in model.modules()})
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
def test_replace_moe_blocks_in_tiny_model(n):
    for rank, res in enumerate(run_ranks(_run_model, n, timeout=150)):
        for kind, r in res.items():
            assert r["names"] == ["model.layers.0.mlp", "model.layers.1.mlp"], r["names"]
            assert "MoELayer" in r["types"]
            assert not any(t.endswith("SparseMoeBlock") for t in r["types"])
            torch.testing.assert_close(r["got"], r["want"], rtol=1e-4, atol=1e-4)
            # transformers still records the router logits of the kept router modules
            assert len(r["rl_got"]) == len(r["rl_want"]) == 2
            for a, b in zip(r["rl_got"], r["rl_want"]):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(r["aux"][1], r["aux"][0])
