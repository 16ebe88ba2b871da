"""Training through dispatch/combine: the backward of dispatch is a combine and vice versa.

* The autograd functions on their own: a rank-dependent nonlinear function between dispatch
  and combine, against a single-process emulation differentiated by torch (gradients of x
  and of the top-k weights, ragged and empty token counts, -1 slots).
* MoELayer against the unsharded computation: gradients of the input, the router, the routed
  experts (each rank's slots scattered into the full tensor and summed over the group, which
  also covers replicated experts) and the shared experts, for a native layer, a Qwen2-MoE
  block and a DeepSeek-V3 block with replicas, on 2 and 4 ranks.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_comm import Buffer, MoELayer
from moe_comm.nn import autograd as ag
from ranks import run_ranks
from test_moe_layer import dense_moe, full_weights


# -- the autograd functions alone --------------------------------------------------------------
def _routing(rank, n, E, K):
    gen = torch.Generator().manual_seed(50 + rank)
    T = [13, 0, 7, 21][rank % 4]
    x = torch.randn(T, 32, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else \
        torch.empty(0, K, dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=gen) < 0.3] = -1
    w = torch.rand(T, K, generator=gen)
    g = torch.randn(T, 32, generator=gen)
    return x, idx, w, g


def _expert_side(d, x, w):
    """What rank ``d`` does to a received row: nonlinear in x and in its local weights."""
    return (d + 1) * x * (1 + w.sum(1, keepdim=True)) + 0.1 * x ** 2


def _run_functions(rank, n, E, K):
    buf = Buffer(None, 4 << 20, timeout_s=60)
    x, idx, w, g = _routing(rank, n, E, K)
    x.requires_grad_(True)
    w.requires_grad_(True)
    rx, ri, rw, handle = ag.dispatch(buf, x, idx, w, E)
    y = _expert_side(rank, rx, rw)
    out = ag.combine(buf, y, handle)
    (out * g).sum().backward()
    return dict(out=out.detach(), gx=x.grad, gw=w.grad)


@pytest.mark.parametrize("n", [2, 4])
def test_dispatch_combine_gradients(n):
    E, K = 4 * n, 3
    results = run_ranks(_run_functions, n, E, K, timeout=60)
    local = E // n
    for r in range(n):
        x, idx, w, g = _routing(r, n, E, K)
        x.requires_grad_(True)
        w.requires_grad_(True)
        out = torch.zeros_like(x)
        for d in range(n):
            mine = (idx >= d * local) & (idx < (d + 1) * local)
            tok = mine.any(1)
            out = out.index_add(0, tok.nonzero().flatten(),
                                _expert_side(d, x[tok], torch.where(mine, w, 0.0)[tok]))
        (out * g).sum().backward()
        got = results[r]
        torch.testing.assert_close(got["out"], out.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["gx"], x.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["gw"], w.grad, rtol=1e-5, atol=1e-5)


# -- whole layers ---------------------------------------------------------------------------
def _rank_batch(seed, rank, H):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    T = [11, 0, 17, 6][rank % 4]
    return torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)


def _expert_grads_full(ex, E):
    """Each rank's slot gradients scattered into [E, ...] by logical id, summed over ranks."""
    full = []
    for p in (ex.gate_up_proj, ex.down_proj):
        t = torch.zeros((E,) + tuple(p.shape[1:]), dtype=p.dtype)
        t.index_add_(0, ex.local_expert_ids, p.grad)
        dist.all_reduce(t)
        full.append(t)
    return full


def _replicated_grads(module):
    """Gradients of replicated (non-expert) parameters, summed over ranks like DDP would."""
    out = {}
    for name, p in module.named_parameters():
        if name.startswith("experts.") or p.grad is None:
            continue
        t = p.grad.clone()
        dist.all_reduce(t)
        out[name] = t
    return out


def _native(rank, n):
    E, H, I, K = 8, 32, 16, 2
    gw, gu, dn, _ = full_weights(21, E, H, I)
    shared = torch.nn.Linear(H, H, bias=False)
    torch.nn.init.normal_(shared.weight, std=0.2, generator=torch.Generator().manual_seed(1))
    layer = MoELayer(E, K, H, I, max_tokens_per_rank=64, shared_experts=shared)
    with torch.no_grad():
        layer.gate.weight.copy_(gw)
        layer.experts.load_from_full(gu, dn)
    ref_params = [t.clone().requires_grad_(True) for t in (gw, gu, dn, shared.weight.detach())]

    def ref(x, p):
        return dense_moe(x, p[0], p[1], p[2], K) + x @ p[3].t()
    return layer, E, ref, ref_params, H


def _qwen_or_deepseek(kind, n):
    from test_hf_adapter import make_block
    block = make_block(kind, 31, torch.float32).train()
    extra = dict(num_redundant_experts=n) if kind == "deepseek_v3" else {}
    layer = MoELayer.from_hf(block, max_tokens_per_rank=64, **extra)
    return layer, block


def _run_layers(rank, n):
    results = {}
    # native layer vs dense reference
    layer, E, ref, ref_params, H = _native(rank, n)
    x, g = _rank_batch(1, rank, H)
    x.requires_grad_(True)
    (layer(x) * g).sum().backward()
    total = 0
    xr = []
    for r in range(n):
        xi, gi = _rank_batch(1, r, H)
        xi.requires_grad_(True)
        total = total + (ref(xi, ref_params) * gi).sum()
        xr.append(xi)
    total.backward()
    gu, dn = _expert_grads_full(layer.experts, E)
    rep = _replicated_grads(layer)
    results["native"] = dict(
        pairs=[("input", x.grad, xr[rank].grad), ("router", rep["gate.weight"], ref_params[0].grad),
               ("gate_up_proj", gu, ref_params[1].grad), ("down_proj", dn, ref_params[2].grad),
               ("shared", rep["shared_experts.weight"], ref_params[3].grad)],
        mode=layer.experts.last_mode)
    # transformers blocks vs the unsharded block
    for kind in ("qwen2_moe", "deepseek_v3"):
        layer, block = _qwen_or_deepseek(kind, n)
        H = block.experts.hidden_dim
        x, g = _rank_batch(2, rank, H)
        x.requires_grad_(True)
        (layer(x.view(1, -1, H)).view(-1, H) * g).sum().backward()
        total, xr = 0, []
        for r in range(n):
            xi, gi = _rank_batch(2, r, H)
            xi.requires_grad_(True)
            total = total + (block(xi.view(1, -1, H)).view(-1, H) * gi).sum()
            xr.append(xi)
        total.backward()
        E = block.experts.num_experts
        gu, dn = _expert_grads_full(layer.experts, E)
        rep = _replicated_grads(layer)
        pairs = [("input", x.grad, xr[rank].grad),
                 ("gate_up_proj", gu, block.experts.gate_up_proj.grad),
                 ("down_proj", dn, block.experts.down_proj.grad)]
        for name, p in block.named_parameters():
            if not name.startswith("experts."):       # Qwen2's shared_expert -> shared_experts
                mine = name.replace("shared_expert.", "shared_experts.")
                pairs.append((name, rep[mine], p.grad))
        results[kind] = dict(pairs=pairs, mode=layer.experts.last_mode)
    # low-latency mode cannot train: it says so instead of returning gradient-less output
    try:
        layer.experts.mode = "low_latency"
        layer(torch.randn(2, H, requires_grad=True))
        results["ll_error"] = None
    except RuntimeError as e:
        results["ll_error"] = str(e)
    return results


@pytest.mark.parametrize("n", [2, 4])
def test_layer_gradients_match_unsharded(n):
    pytest.importorskip("transformers")
    pytest.importorskip("test_hf_adapter")     # import once here: the forked ranks inherit it
    for rank, res in enumerate(run_ranks(_run_layers, n, timeout=150)):
        assert "no gradient" in res.pop("ll_error")
        for kind, r in res.items():
            assert r["mode"] == "normal", (kind, r["mode"])
            for name, got, want in r["pairs"]:
                assert want is not None and got is not None, (kind, name)
                scale = max([1.0] + want.abs().flatten().tolist())
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale,
                                           msg=lambda m: f"{kind} {name} rank {rank}/{n}: {m}")
