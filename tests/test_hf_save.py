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

from moe_comm import replace_moe_blocks  # noqa: E402
from moe_comm.nn import (gather_full_state_dict, load_full_state_dict,  # noqa: E402
                         save_pretrained)
from moe_comm.nn.checkpoint import moe_layers  # noqa: E402
from ranks import run_ranks  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_hf_adapter import H, LegacyBlock, configs, randomize  # noqa: E402

N_RANKS = 2
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM"}
# (name, model kind, replace_moe_blocks arguments, rebalance to a skewed load afterwards)
CASES = [("mixtral", "mixtral", {}, False),
         ("qwen2_moe", "qwen2_moe", {}, False),
         ("mixtral_eplb", "mixtral", dict(num_redundant_experts=2), True),
         ("deepseek_v3_eplb", "deepseek_v3", dict(num_redundant_experts=2), False)]
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
    for name, kind, extra, rebalance in CASES:
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
        save_pretrained(model, saved_dir)                      # collective, rank 0 writes

        reloaded = getattr(transformers, CLASSES[kind]).from_pretrained(
            saved_dir, attn_implementation="eager").eval()
        fresh = _tiny_model(kind, seed=2)                     # other weights, then the full ones
        replace_moe_blocks(fresh, max_tokens_per_rank=64, **extra)
        load_result = load_full_state_dict(fresh, full)
        with torch.no_grad():
            unsharded, refilled = reloaded(ids).logits, fresh(ids).logits
        res[name] = dict(
            original=original, full=full, on_rank0=on_rank0, sharded=sharded,
            unsharded=unsharded, refilled=refilled, load_result=load_result,
            replicas=[int(layer.experts.logcnt.max()) for _, layer in layers],
            files=(_files(reference_dir), _files(saved_dir)) if rank == 0 else None)
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
        r = res[case]
        torch.testing.assert_close(r["unsharded"], r["sharded"], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{case} rank {rank} from_pretrained: {m}")
        assert not r["load_result"].missing_keys and not r["load_result"].unexpected_keys
        torch.testing.assert_close(r["refilled"], r["sharded"], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{case} rank {rank} load_full: {m}")


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


def _run_legacy(rank, n, tmp):
    model = randomize(LegacyModel(), 3).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    replace_moe_blocks(model, max_tokens_per_rank=64)
    x = torch.randn(2, 6 + rank, H, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        sharded = model(x)
    path = os.path.join(tmp, "legacy.pt")
    full = gather_full_state_dict(model)
    if rank == 0:
        torch.save(full, path)
    torch.distributed.barrier()
    plain = LegacyModel().eval()                   # plain torch: strict load by the old names
    plain.load_state_dict(torch.load(path), strict=True)
    with torch.no_grad():
        unsharded = plain(x)
    return dict(original=original, full=full, sharded=sharded, unsharded=unsharded)


def test_legacy_blocks_roundtrip(tmp_path):
    for rank, r in enumerate(run_ranks(_run_legacy, N_RANKS, str(tmp_path), timeout=120)):
        if rank == 0:
            assert list(r["full"]) == list(r["original"])
            for key, want in r["original"].items():
                assert torch.equal(r["full"][key], want), key
        torch.testing.assert_close(r["unsharded"], r["sharded"], rtol=1e-4, atol=1e-4)
