"""The generated header (moe_comm/jit/device_header.py) is the kernels' one copy of the wire
constants and of every kernel's parameter list.

A kernel that read another slot than the host writes would wait for a word that never comes;
a kernel whose parameters differ from what the host packs would read garbage. So: the header
carries wire.py's values (checked against wire.py here, independently of the generator's
table), no file of csrc/ keeps a copy of its own, every kernel of csrc/ is declared with its
generated list, and the header is part of every build's cache key.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_comm import logfmt, wire
from moe_comm.jit import cache, device_header, emulator, nvcc, nvrtc, variants
from moe_comm.jit.kernel_args import KERNEL_ARGS

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# What each generated constant must equal, in the kernels' units (bytes where they address).
EXPECTED = {
    "kPage": wire.PAGE,
    "kSlabAlign": wire.SLAB_ALIGN,
    "kSignalStride": wire.LINE_WORDS * 8,
    "kValueBits": wire.VALUE_BITS,
    "kMaxEpoch": wire.MAX_EPOCH,
    "kMaskBits": wire.MASK_BITS,
    "kCallWords": wire.CALL_WORDS,
    "kFenceOffset": wire.HeaderLayout(num_ranks=2).fence * 8,
    "kFailedValue": wire.FAILED_VALUE,
    "kErrorHeader": wire.ERROR_HEADER, "kMaxErrorRanks": wire.MAX_ERROR_RANKS,
    "kErrTimeout": wire.ERR_TIMEOUT, "kErrOverflow": wire.ERR_OVERFLOW,
    "kErrNoTransport": wire.ERR_NO_TRANSPORT, "kErrMasked": wire.ERR_MASKED,
    "kErrProxy": wire.ERR_PROXY, "kErrPeerFailed": wire.ERR_PEER_FAILED,
    "kErrMismatch": wire.ERR_MISMATCH,
    "kProxyHead": wire.PROXY_HEAD, "kProxyDepth": wire.PROXY_DEPTH,
    "kProxyTimeout": wire.PROXY_TIMEOUT, "kProxyTail": wire.PROXY_TAIL,
    "kProxyHeaderWords": wire.PROXY_HEADER_WORDS, "kProxySlotWords": wire.PROXY_SLOT_WORDS,
    "kProxyOpPut": wire.PROXY_OP_PUT, "kProxyOpSignal": wire.PROXY_OP_SIGNAL,
    "kExpertsPerBlock": variants.EXPERTS_PER_LAYOUT_BLOCK, "kMaxRanks": variants.MAX_RANKS,
    "kDoneLogfmt": wire.LL_DONE_LOGFMT, "kLogfmtBlock": logfmt.BLOCK,
    "kLogfmtLevels": logfmt.LEVELS, "kLogfmtLogRange": logfmt.LOG_RANGE,
    "kLogfmtHeaderBytes": logfmt.HEADER_BYTES, "kLogfmtCodeBytes": logfmt.CODE_BYTES,
}


def _sources():
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp"))


def test_header_carries_the_wire_values():
    text = device_header.header_text()
    found = {name: int(value) for name, value in
             re.findall(r"constexpr \w+ (k\w+) = (\d+)(?:ull|u)?;", text)}
    assert found == EXPECTED


def test_no_source_keeps_its_own_copy():
    names = "|".join(EXPECTED)
    own = re.compile(rf"(?:constexpr|#define)\s+(?:\w+\s+)?({names})\b|#define MOE_\w+_ARGS\b")
    for path in _sources():
        hits = own.findall(path.read_text())
        assert not hits, f"{path.relative_to(CSRC)} defines {hits}: use moe_generated.cuh"


def test_every_kernel_is_declared_with_its_generated_list():
    text = device_header.header_text()
    for name, sig in KERNEL_ARGS.items():
        assert f"#define MOE_ARGS_{name} {sig.declaration()}\n" in text
    defined = set()
    head = r"MOE_KERNEL void __launch_bounds__\([^)]*\)\s+"
    for path in _sources():
        src = path.read_text().replace("\\\n", " ")       # join macro lines
        for name, params in re.findall(head + r"(\w+)\(([^)]*)\)", src):
            if name != "NAME":
                defined.add(name)
                assert params == f"MOE_ARGS_{name}", (path.name, name, params)
        if re.search(head + r"NAME\(MOE_ARGS_##NAME\)", src):   # MOE_*REDUCE_KERNEL macros
            defined |= set(re.findall(r"^MOE_\w*REDUCE_KERNEL\((\w+),", src, re.MULTILINE))
    assert defined == set(KERNEL_ARGS), set(KERNEL_ARGS) ^ defined
    listed = {k for v in variants.all_variants() for k in v.kernels}
    assert listed | set(nvcc.SELFTEST_KERNELS) == set(KERNEL_ARGS)


def test_include_dir_holds_the_header(tmp_path):
    folder = device_header.include_dir(tmp_path)
    assert (folder / device_header.HEADER_NAME).read_text() == device_header.header_text()
    assert device_header.include_dir(tmp_path) == folder


def test_header_is_in_every_cache_key(monkeypatch):
    v = variants.ll_combine(0)
    before_emu = emulator._key(cache.kernel_dir() / v.source, v.defines, "c++")
    try:
        before_nvrtc = nvrtc.cache_key(v, "sm_90")
    except ImportError:
        before_nvrtc = None                     # no NVRTC here: its key cannot be computed
    monkeypatch.setattr(device_header, "header_text", lambda: "// another header\n")
    assert emulator._key(cache.kernel_dir() / v.source, v.defines, "c++") != before_emu
    if before_nvrtc is not None:
        assert nvrtc.cache_key(v, "sm_90") != before_nvrtc
    try:
        program = nvcc.kernel_program(v)
        before = nvcc.cache_key(program, "sm_90")
    except Exception:  # noqa: BLE001 - NVSHMEM/nvcc missing: nothing to compare
        pytest.skip("nvcc or NVSHMEM not installed")
    monkeypatch.undo()
    assert nvcc.cache_key(program, "sm_90") != before
