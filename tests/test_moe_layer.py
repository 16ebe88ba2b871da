"""MoELayer on real processes against a dense single-process MoE computed from the same full
weights: normal and low-latency paths (and "auto" picking between them on every rank alike),
fp32/bf16/fp8-LL, softmax and sigmoid group-limited routing, shared experts, [B, S, H] and
[T, H] inputs, ragged token counts including 0, the HF-style experts-only call, replicated
experts with EPLB (mapping, load recording, rebalancing with weight moves), and one Buffer
shared by every layer of a group (unless a layer is given its own SharedBuffers)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_comm import MoELayer
from moe_comm.nn.shared_buffers import DEFAULT_SHARED_BUFFERS, SharedBuffers
from moe_comm.nn.router import TopKRouter, select_experts
from ranks import run_ranks


# -- dense reference ------------------------------------------------------------------------
def dense_moe(x, gate_w, gate_up, down, top_k, route=None, bias=None, router_dtype=None):
    """Every expert on one process. x [T, H] -> [T, H] float32 (differentiable)."""
    route = route or {}
    dt = router_dtype or x.dtype
    logits = x.to(dt) @ gate_w.to(dt).t()
    w, idx = select_experts(logits, top_k, correction_bias=bias, **route)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(gate_up.shape[0]):
        rows, slots = (idx == e).nonzero(as_tuple=True)
        g, u = F.linear(x[rows].float(), gate_up[e].float()).chunk(2, -1)
        y = F.linear(F.silu(g) * u, down[e].float())
        out = out.index_add(0, rows, y * w[rows, slots].unsqueeze(1))
    return out


def full_weights(seed, E, H, I):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(E, H, generator=gen), torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5,
            torch.randn(E, H, I, generator=gen) / I ** 0.5, torch.randn(E, generator=gen) * 0.1)


def rank_input(seed, rank, tokens, H, dtype):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(tokens, H, generator=gen).to(dtype)


def build(case, n, **extra):
    E, H, I, K = case["E"], case["H"], case["I"], case["K"]
    gate_w, gu, dn, bias = full_weights(case["seed"], E, H, I)
    dtype = case["dtype"]
    layer = MoELayer(E, K, H, I, mode=case.get("mode", "auto"), dtype=dtype,
                     router_dtype=case.get("router_dtype"), **case.get("route", {}),
                     ll_max_tokens=case.get("ll_max", 32),
                     num_redundant_experts=case.get("redundant", 0),
                     ll_use_fp8=case.get("fp8", False), max_tokens_per_rank=64, **extra)
    with torch.no_grad():
        layer.gate.weight.copy_(gate_w)
        if layer.gate.e_score_correction_bias is not None:
            layer.gate.e_score_correction_bias.copy_(bias)
        layer.experts.load_from_full(gu.to(dtype), dn.to(dtype))
    return layer, (gate_w.to(dtype), gu.to(dtype), dn.to(dtype),
                   bias if layer.gate.e_score_correction_bias is not None else None)


def tokens(case, rank, n):
    t = case["tokens"]
    return t[rank % len(t)] if isinstance(t, list) else t


CASES = [
    dict(name="fp32_normal", seed=1, E=8, H=64, I=32, K=2, dtype=torch.float32,
         tokens=[37, 0, 12, 5], mode="normal", shape3d=True),
    dict(name="bf16_auto_ll", seed=2, E=8, H=128, I=64, K=3, dtype=torch.bfloat16,
         tokens=[9, 16, 0, 3], expect="low_latency",
         route=dict(scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5),
         router_dtype=torch.float32),
    dict(name="bf16_auto_normal", seed=3, E=8, H=128, I=64, K=2, dtype=torch.bfloat16,
         tokens=[40, 3], ll_max=16, expect="normal"),
    dict(name="bf16_ll_fp8", seed=4, E=8, H=128, I=64, K=2, dtype=torch.bfloat16,
         tokens=[7, 11], mode="low_latency", fp8=True, expect="low_latency"),
    dict(name="fp32_softmax_groups", seed=5, E=8, H=64, I=32, K=2, dtype=torch.float32,
         tokens=[20, 30], route=dict(n_group=2, topk_group=1, norm_topk_prob=False)),
]


def _run_layers(rank, n):
    res = {}
    for case in CASES:
        layer, (gw, gu, dn, bias) = build(case, n)
        x = rank_input(case["seed"], rank, tokens(case, rank, n), case["H"], case["dtype"])
        with torch.no_grad():
            if case.get("shape3d"):
                out = layer(x.view(1, -1, case["H"])).view(-1, case["H"])
            else:
                out = layer(x)
        ref = dense_moe(x, gw, gu, dn, case["K"], case.get("route"), bias,
                        case.get("router_dtype"))
        res[case["name"]] = dict(out=out.float(), ref=ref, mode=layer.experts.last_mode,
                                 dtype=out.dtype)
    # shared experts (Qwen2-style sigmoid gate) and the HF-v5 experts-only call
    case = dict(seed=6, E=8, H=64, I=32, K=2, dtype=torch.float32, tokens=[10, 25, 0, 4])
    gen = torch.Generator().manual_seed(99)
    shared = torch.nn.Linear(64, 64, bias=False)
    sgate = torch.nn.Linear(64, 1, bias=False)
    with torch.no_grad():
        shared.weight.copy_(torch.randn(64, 64, generator=gen) / 8)
        sgate.weight.copy_(torch.randn(1, 64, generator=gen))
    layer, (gw, gu, dn, _) = build(case, n, shared_experts=shared, shared_expert_gate=sgate)
    x = rank_input(6, rank, tokens(case, rank, n), 64, torch.float32)
    with torch.no_grad():
        out = layer(x)
        ref = dense_moe(x, gw, gu, dn, 2) + torch.sigmoid(sgate(x)) * shared(x)
        _, w, idx = layer.gate(x)
        only = layer.experts(x, idx, w)
    res["shared"] = dict(out=out, ref=ref, mode=layer.experts.last_mode, dtype=out.dtype)
    res["experts_only"] = dict(out=only, ref=dense_moe(x, gw, gu, dn, 2), mode="normal",
                               dtype=only.dtype)
    res["one_buffer"] = layer.experts.buffer is DEFAULT_SHARED_BUFFERS.for_group(None) and \
        build(CASES[0], n)[0].experts.buffer is layer.experts.buffer
    apart = SharedBuffers()
    kept_apart = build(CASES[0], n, shared_buffers=apart)[0].experts.buffer
    res["own_shared_buffers"] = kept_apart is apart.for_group(None) and \
        kept_apart is not layer.experts.buffer
    apart.release()
    return res


@pytest.mark.parametrize("n", [1, 2, 4])
def test_layer_matches_dense_moe(n):
    results = run_ranks(_run_layers, n, timeout=120)
    for rank, res in enumerate(results):
        assert res.pop("one_buffer"), "layers of one group must share one Buffer"
        assert res.pop("own_shared_buffers"), "a layer given SharedBuffers must use them"
        for name, r in res.items():
            case = next((c for c in CASES if c["name"] == name), {})
            assert r["mode"] == case.get("expect", r["mode"]), (name, rank, r["mode"])
            assert r["dtype"] == case.get("dtype", torch.float32), (name, r["dtype"])
            tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[case.get("dtype", torch.float32)]
            if case.get("fp8"):
                tol = 8e-2
            torch.testing.assert_close(r["out"], r["ref"], rtol=tol, atol=tol,
                                       msg=lambda m: f"{name} rank {rank}: {m}")


def _run_replicas(rank, n):
    E, H, I, K = 8, 64, 32, 2
    case = dict(seed=7, E=E, H=H, I=I, K=K, dtype=torch.float32, redundant=n, mode="normal")
    layer, (gw, gu, dn, _) = build(case, n)
    ex = layer.experts
    x = rank_input(7, rank, 30 + 7 * rank, H, torch.float32)
    outs, loads = [], []
    with torch.no_grad():
        _, _, idx = layer.gate(x)
        outs.append(layer(x))
        loads.append(ex.load_recorder.load()[0].clone())
        # expert 7 (unreplicated at first: uniform load replicates the lowest ids) turns hot:
        # the rebalance must replicate it, moving weights between ranks
        skew = torch.ones(E, dtype=torch.float64)
        skew[7] = 100.0
        before = ex.logcnt.clone()
        moved = ex.rebalance(skew)
        outs.append(layer(x))
    return dict(outs=outs, ref=dense_moe(x, gw, gu, dn, K), local_ids=ex.local_expert_ids,
                logcnt=ex.logcnt.clone(), phy2log=ex.phy2log.clone(), idx=idx, load=loads[0],
                moved=moved, slots=ex.num_local, before=before)


@pytest.mark.parametrize("n", [2, 4])
def test_replicated_experts_match_and_rebalance(n):
    results = run_ranks(_run_replicas, n, timeout=120)
    E = 8
    for rank, r in enumerate(results):
        assert r["slots"] == (E + n) // n
        for out in r["outs"]:                       # before and after rebalancing
            torch.testing.assert_close(out, r["ref"], rtol=1e-5, atol=1e-5)
        # load recorded per logical expert from this rank's routing
        assert torch.equal(r["load"], torch.bincount(r["idx"].flatten(), minlength=E))
        assert torch.equal(r["local_ids"], r["phy2log"].view(n, -1)[rank])
    p2l = results[0]["phy2log"]
    assert all(torch.equal(r["phy2log"], p2l) for r in results), "ranks disagree on placement"
    assert int(results[0]["before"][7]) == 1
    assert int(results[0]["logcnt"][7]) == n, "the hot expert should be replicated on every rank"
    assert sorted(set(p2l.tolist())) == list(range(E))
    assert sum(r["moved"] for r in results) > 0


def test_router_matches_loop_reference():
    """select_experts against a per-token loop over the DeepSeek group-limited rule."""
    gen = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(40, 16, generator=gen), torch.randn(16, generator=gen) * 0.3
    w, idx = select_experts(logits, 4, scoring_func="sigmoid", n_group=4, topk_group=2,
                            routed_scaling_factor=2.0, correction_bias=bias)
    for t in range(40):
        s = logits[t].sigmoid()
        c = s + bias
        groups = sorted(range(4), key=lambda g: -float(c[4 * g:4 * g + 4].topk(2).values.sum()))
        allowed = [e for g in groups[:2] for e in range(4 * g, 4 * g + 4)]
        best = sorted(allowed, key=lambda e: -float(c[e]))[:4]
        assert sorted(best) == sorted(idx[t].tolist())
        want = s[best] / s[best].sum() * 2.0
        got = dict(zip(idx[t].tolist(), w[t].tolist()))
        assert all(abs(got[e] - float(v)) < 1e-6 for e, v in zip(best, want))
    w, idx = select_experts(logits, 3, norm_topk_prob=False)
    p = logits.softmax(-1)
    torch.testing.assert_close(w, p.topk(3).values)
    with pytest.raises(ValueError, match="topk_group"):
        TopKRouter(16, 8, 2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="scoring_func"):
        select_experts(logits, 2, scoring_func="relu")
