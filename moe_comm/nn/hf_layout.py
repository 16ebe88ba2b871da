"""How a Hugging Face MoE block names its weights in a state dict, and the renaming between
those names and a MoELayer's *full state*, so that a checkpoint of a model whose blocks were
replaced is the original model's checkpoint.

A MoELayer's full state is its own state dict with the experts unsharded and one tensor per
logical expert, and without moe_comm's placement buffers:

    gate.*   experts.gate_up_proj [E, 2I, H]   experts.down_proj [E, H, I]
    shared_experts.*   shared_expert_gate.*

(:mod:`moe_comm.nn.checkpoint` gathers it over the group.) A :class:`BlockLayout`, read from
the block a layer replaced, turns that into the block's own state dict and back. Pure
renaming and reshaping, no communication.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import hf

GATE_UP = "experts.gate_up_proj"
DOWN = "experts.down_proj"
EXPERT_KEYS = (GATE_UP, DOWN)
SHARED = "shared_experts"          # the MoELayer attribute holding the shared experts


@dataclass(frozen=True)
class BlockLayout:
    """How one block stores what a MoELayer holds.

    ``expert_linears``: (gate, up, down) names of the Linear layers of ModuleList experts
    (v4 style, ``experts.{e}.{name}.weight``), or None for packed experts.
    ``transposed``: packed experts stored ``[E, H, 2I]`` / ``[E, I, H]``.
    ``shared_name``: the block's attribute for its shared experts (Qwen2-MoE says
    ``shared_expert``).
    ``block_keys``: the block's state dict keys in order, or None (a layer not built from a
    block). When known, every conversion must produce exactly these: a weight the layer
    does not hold (an expert bias, a gate bias) then fails loudly instead of being left out
    of a checkpoint."""
    expert_linears: tuple[str, str, str] | None = None
    transposed: bool = False
    shared_name: str = SHARED
    block_keys: tuple[str, ...] | None = None

    @property
    def expert_prefixes(self) -> tuple[str, ...]:
        """Prefixes of the block keys that hold routed expert weights."""
        return ("experts.",) if self.expert_linears else EXPERT_KEYS

    # -- layer full state -> block state ---------------------------------------------------
    def to_block(self, full: dict) -> dict:
        """The block's state dict for a layer's full state (tensors may be views of it)."""
        out = {}
        for key, value in full.items():
            if key == GATE_UP:
                out.update(self._gate_up_to_block(value))
            elif key == DOWN:
                out.update(self._down_to_block(value))
            else:
                out[self._shared_to_block(key)] = value
        return self._in_block_order(out)

    def _gate_up_to_block(self, gate_up: torch.Tensor) -> dict:
        if self.expert_linears is None:
            return {GATE_UP: gate_up.transpose(1, 2).contiguous() if self.transposed
                    else gate_up}
        g, u, _ = self.expert_linears
        gate, up = gate_up.chunk(2, dim=1)
        # clones: views of one storage would look like tied weights to a checkpoint writer
        return {**{f"experts.{e}.{g}.weight": gate[e].clone() for e in range(len(gate))},
                **{f"experts.{e}.{u}.weight": up[e].clone() for e in range(len(up))}}

    def _down_to_block(self, down: torch.Tensor) -> dict:
        if self.expert_linears is None:
            return {DOWN: down.transpose(1, 2).contiguous() if self.transposed else down}
        d = self.expert_linears[2]
        return {f"experts.{e}.{d}.weight": down[e].clone() for e in range(len(down))}

    def _shared_to_block(self, key: str) -> str:
        if key.startswith(SHARED + "."):
            return self.shared_name + key[len(SHARED):]
        return key

    def _in_block_order(self, block_state: dict) -> dict:
        if self.block_keys is None:
            return block_state
        missing = [k for k in self.block_keys if k not in block_state]
        extra = [k for k in block_state if k not in set(self.block_keys)]
        if missing or extra:
            raise ValueError(f"the MoELayer's weights do not make up the block it replaced: "
                             f"missing {missing}, unexpected {extra}")
        return {k: block_state[k] for k in self.block_keys}

    # -- block state -> layer full state ---------------------------------------------------
    def from_block(self, block_state: dict) -> dict:
        """A layer's full state from (part of) the block's state dict. The routed experts
        come out only when all their weights are given; the caller's strict load then
        reports them missing."""
        out, expert_state = {}, {}
        for key, value in block_state.items():
            if key.startswith(self.expert_prefixes):
                expert_state[key] = value
            elif key.startswith(self.shared_name + "."):
                out[SHARED + key[len(self.shared_name):]] = value
            else:
                out[key] = value
        if expert_state:
            out.update(self._experts_from_block(expert_state))
        return out

    def _experts_from_block(self, expert_state: dict) -> dict:
        if self.expert_linears is None:
            if set(expert_state) != set(EXPERT_KEYS):
                raise KeyError(f"partial expert weights: got {sorted(expert_state)}, need "
                               f"{list(EXPERT_KEYS)}")
            gate_up, down = expert_state[GATE_UP], expert_state[DOWN]
            if self.transposed:
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            return {GATE_UP: gate_up, DOWN: down}
        g, u, d = self.expert_linears
        num_experts = len(expert_state) // 3
        want = {f"experts.{e}.{n}.weight" for e in range(num_experts) for n in (g, u, d)}
        if set(expert_state) != want:
            raise KeyError(f"expert weights must be experts.{{0..E-1}}.{{{g},{u},{d}}}.weight; "
                           f"missing {sorted(want - set(expert_state))}, unexpected "
                           f"{sorted(set(expert_state) - want)}")
        w = [{n: expert_state[f"experts.{e}.{n}.weight"] for n in (g, u, d)}
             for e in range(num_experts)]
        return {GATE_UP: torch.stack([torch.cat([x[g], x[u]]) for x in w]),
                DOWN: torch.stack([x[d] for x in w])}


NATIVE_LAYOUT = BlockLayout()
"""A MoELayer's own names (HF v5's packed layout): for layers not built from a block."""


def layout_of(block: nn.Module) -> BlockLayout:
    """The layout of a recognised Hugging Face MoE block (see :mod:`moe_comm.nn.hf`)."""
    experts = block.experts
    shared_name = SHARED if getattr(block, SHARED, None) is not None else (
        "shared_expert" if getattr(block, "shared_expert", None) is not None else SHARED)
    packed = isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
    return BlockLayout(
        expert_linears=None if packed else hf.legacy_linear_names(experts[0]),
        transposed=packed and bool(getattr(experts, "is_transposed", False)),
        shared_name=shared_name,
        block_keys=tuple(block.state_dict().keys()))
