"""Full checkpoints of models whose MoE blocks replace_moe_blocks sharded over 2 ranks
(moe_comm.nn.checkpoint): the gathered state dict has the unreplaced model's names, shapes
and values (EPLB replicas collapsed, placement buffers dropped); the directory
moe_comm.nn.save_pretrained writes is the one the unreplaced model's save_pretrained writes,
and from_pretrained of it gives the sharded model's outputs; load_full_state_dict puts a
full state dict back into a replaced model. Tiny transformers models (Mixtral, Qwen2-MoE
with its ``shared_expert``, DeepSeek-V3, packed v5 experts) and a model of v4-style blocks
(ModuleList experts), fp32 on the CPU."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from ranks import run_ranks
from safetensors.torch import load_file
from test_hf_adapter import H, LegacyBlock, configs, randomize

from moe_comm import replace_moe_blocks
from moe_comm.nn import gather_full_state_dict, load_full_state_dict, save_pretrained
from moe_comm.nn.checkpoint import moe_layers
from moe_comm.nn.hf_layout import BlockLayout

N_RANKS = 2
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM"}
# (name, model kind, replace_moe_blocks arguments, rebalance to a skewed load afterwards)
CASES = [("mixtral", "mixtral", {}, False),
         ("qwen2_moe", "qwen2_moe", {}, False),
         ("mixtral_eplb", "mixtral", {"num_redundant_experts": 2}, True),
         ("deepseek_v3_eplb", "deepseek_v3", {"num_redundant_experts": 2}, False)]
SKEWED_LOAD = torch.tensor([50.0, 1, 1, 1, 1, 1, 1, 30])


def _tiny_model(kind, seed):
    cfg = configs()[kind]
    cfg._attn_implementation = "eager"
    if kind == "deepseek_v3":       # its attention does not repeat grouped KV heads
        cfg.num_key_value_heads = cfg.num_attention_heads
    torch.manual_seed(0)
    return randomize(getattr(transformers, CLASSES[kind])(cfg), seed).eval()


def _files(directory):
    """{tensor name: tensor} over a checkpoint directory's safetensors files."""
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


def _run_transformers(rank, n, tmp):
    res = {}
    for i, (name, kind, extra, rebalance) in enumerate(CASES):
        model = _tiny_model(kind, seed=1)
        original = {k: v.clone() for k, v in model.state_dict().items()}
        reference_dir, saved_dir = (os.path.join(tmp, name, d) for d in ("reference", "saved"))
        if rank == 0:           # what the unreplaced model writes
            model.save_pretrained(reference_dir)
        replace_moe_blocks(model, max_tokens_per_rank=64, **extra)
        layers = moe_layers(model)
        if rebalance:
            for _, layer in layers:
                layer.experts.rebalance(SKEWED_LOAD)
        ids = torch.randint(0, 96, (2, 7 + rank), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            sharded = model(ids).logits
        full = gather_full_state_dict(model, dst=None)
        on_rank0 = gather_full_state_dict(model)
        if i % 2:       # the model's own method, which replace_moe_blocks routed to ours
            model.save_pretrained(saved_dir)
        else:
            save_pretrained(model, saved_dir)                  # collective, rank 0 writes

        reloaded = getattr(transformers, CLASSES[kind]).from_pretrained(
            saved_dir, attn_implementation="eager").eval()
        fresh = _tiny_model(kind, seed=2)                     # other weights, then the full ones
        replace_moe_blocks(fresh, max_tokens_per_rank=64, **extra)
        load_result = load_full_state_dict(fresh, full)
        with torch.no_grad():
            unsharded, refilled = reloaded(ids).logits, fresh(ids).logits
        res[name] = {
            "original": original, "full": full, "on_rank0": on_rank0, "sharded": sharded,
            "unsharded": unsharded, "refilled": refilled, "load_result": load_result,
            "replicas": [int(layer.experts.logcnt.max()) for _, layer in layers],
            "files": (_files(reference_dir), _files(saved_dir)) if rank == 0 else None}
    return res


@pytest.fixture(scope="module")
def transformers_results(tmp_path_factory):
    return run_ranks(_run_transformers, N_RANKS, str(tmp_path_factory.mktemp("ckpt")),
                     timeout=240)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_full_state_dict_is_the_unreplaced_models(transformers_results, case):
    for rank, res in enumerate(transformers_results):
        r = res[case]
        # same names in the same order, same shapes and values: replicas collapsed,
        # placement buffers (phy2log, log2phy, logcnt) gone, shared_expert renamed back
        assert list(r["full"]) == list(r["original"]), case
        for key, want in r["original"].items():
            assert torch.equal(r["full"][key], want), f"{case} rank {rank}: {key}"
        if rank == 0:
            assert list(r["on_rank0"]) == list(r["original"])
        else:
            assert r["on_rank0"] is None
        if case.endswith("eplb"):
            assert all(c > 1 for c in r["replicas"]), r["replicas"]     # replicas were used


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_save_pretrained_writes_the_unreplaced_checkpoint(transformers_results, case):
    reference, saved = transformers_results[0][case]["files"]
    assert sorted(saved) == sorted(reference)
    for key, want in reference.items():
        assert torch.equal(saved[key], want), f"{case}: {key}"


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_reloaded_checkpoint_matches_sharded_model(transformers_results, case):
    for rank, res in enumerate(transformers_results):
        r, where = res[case], f"{case} rank {rank}"
        torch.testing.assert_close(r["unsharded"], r["sharded"], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, w=where: f"{w} from_pretrained: {m}")
        assert not r["load_result"].missing_keys and not r["load_result"].unexpected_keys
        torch.testing.assert_close(r["refilled"], r["sharded"], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, w=where: f"{w} load_full_state_dict: {m}")


class LegacyModel(nn.Module):
    """Two v4-style blocks (ModuleList experts, w1/w3/w2 and gate_proj/up_proj/down_proj)
    with residuals."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.blocks = nn.ModuleList([LegacyBlock(("w1", "w3", "w2")),
                                     LegacyBlock(("gate_proj", "up_proj", "down_proj"),
                                                 top_k=3, norm_topk_prob=False)])

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = x + block(x)[0]
        return x


def _run_legacy(rank, n, tmp, dtype):
    model = randomize(LegacyModel(), 3).to(dtype).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    replace_moe_blocks(model, max_tokens_per_rank=64)
    x = torch.randn(2, 6 + rank, H, generator=torch.Generator().manual_seed(rank)).to(dtype)
    with torch.no_grad():
        sharded = model(x)
    path = os.path.join(tmp, "legacy.pt")
    full = gather_full_state_dict(model)
    if rank == 0:
        torch.save(full, path)
    torch.distributed.barrier()
    plain = LegacyModel().to(dtype).eval()         # plain torch: strict load by the old names
    plain.load_state_dict(torch.load(path), strict=True)
    with torch.no_grad():
        unsharded = plain(x)
    return {"original": original, "full": full, "sharded": sharded, "unsharded": unsharded}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_legacy_blocks_roundtrip(tmp_path, dtype):
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    results = run_ranks(_run_legacy, N_RANKS, str(tmp_path), dtype, timeout=120)
    for rank, r in enumerate(results):
        if rank == 0:
            assert list(r["full"]) == list(r["original"])
            for key, want in r["original"].items():
                assert torch.equal(r["full"][key], want), key
        else:
            assert r["full"] is None
        torch.testing.assert_close(r["unsharded"].float(), r["sharded"].float(), rtol=tol,
                                   atol=tol * max(1.0, float(r["sharded"].abs().max())))


def test_transposed_layout_roundtrip():
    """Packed experts stored [E, H, 2I] / [E, I, H] (``is_transposed``) go back transposed."""
    layout = BlockLayout(transposed=True, shared_name="shared_expert",
                         block_keys=("gate.weight", "experts.gate_up_proj", "experts.down_proj",
                                     "shared_expert.w"))
    full = {"gate.weight": torch.randn(4, 6), "experts.gate_up_proj": torch.randn(4, 10, 6),
            "experts.down_proj": torch.randn(4, 6, 5), "shared_experts.w": torch.randn(3)}
    block = layout.to_block(full)
    assert list(block) == list(layout.block_keys)
    assert block["experts.gate_up_proj"].shape == (4, 6, 10)
    assert block["experts.down_proj"].shape == (4, 5, 6)
    back = layout.from_block(block)
    assert sorted(back) == sorted(full)
    for key, value in full.items():
        assert torch.equal(back[key], value), key
    with pytest.raises(ValueError, match="unexpected"):      # a weight the block lacked
        layout.to_block({**full, "gate.bias": torch.zeros(4)})
