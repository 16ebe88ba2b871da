"""The kernels' copies of wire constants (csrc/kernels/*.cuh, each marked ``// wire.NAME``)
equal moe_comm/wire.py's: a kernel that read another slot than the host writes would wait for
a word that never comes."""
from __future__ import annotations

import pathlib
import re

from moe_comm import wire

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "csrc" / "kernels"
DECL = re.compile(r"constexpr\s+\w+\s+(\w+)\s*=\s*([^;]+);[ \t]*//[ \t]*wire\.(\w+)")
BYTES = {"FENCE_WORD": 8}        # constants the kernels hold in bytes, not words


def _declarations():
    for path in sorted(KERNELS.glob("*.cuh")):
        for name, expr, wire_name in DECL.findall(path.read_text()):
            yield path.name, name, expr, wire_name


def test_every_marked_constant_equals_wire():
    found = list(_declarations())
    assert {w for *_, w in found} >= {"MASK_BITS", "MAX_EPOCH", "CALL_WORDS", "FENCE_WORD"}
    for file, name, expr, wire_name in found:
        value = eval(re.sub(r"(\d+)[uUlL]+", r"\1", expr), {"__builtins__": {}})
        want = getattr(wire, wire_name) * BYTES.get(wire_name, 1)
        assert value == want, f"{file}: {name} = {value}, wire.{wire_name} gives {want}"
