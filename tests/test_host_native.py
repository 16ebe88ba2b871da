"""The host backend's C loops (moe_comm/host/native.py, csrc/host/host_ops.c) give the bits of
the torch code they stand in for: the fp8 cast of quant.py, the float32 sums of reduce.py.
Inputs are chosen to hit every rounding edge (midpoints between e4m3 values and their
neighbours, subnormals, the clamp at 448, zeros, infinities) and ragged routing (tokens
without rows, empty segments)."""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

import numpy as np
import pytest
import torch

from moe_comm.host import exchange, ll, native, reduce
from moe_comm.quant import quantize_fp8
from moe_comm.wire import LLLayout

# where a compiler exists the library must build (the first test): a build that
# fails fails these tests rather than skipping them
pytestmark = pytest.mark.skipif(native._compiler() is None,
                                reason="no C compiler: the host backend uses torch's loops")


def test_the_library_builds_where_a_compiler_exists():
    assert native.library() is not None, "host_ops.c did not build: see the log's warning"


def _edge_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours, and the floats just either
    side of each midpoint, both signs."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[torch.isfinite(codes)].unique().sort().values
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    edges = torch.cat([values, mids, torch.nextafter(mids, up), torch.nextafter(mids, down)])
    return torch.cat([edges, -edges, torch.tensor([500.0, -1e6, 1e-12, float("inf")])])


def _inputs(dtype, tokens=48, hidden=1024, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over 2^-20 .. 2^20 between rows, so scales and subnormals vary
    x = torch.randn(tokens, hidden, generator=g) * torch.exp2(
        torch.randint(-20, 20, (tokens, 1), generator=g).float())
    edges = _edge_values()
    x[0, :min(hidden, edges.numel())] = edges[:hidden]
    x[1, :128] = 0                                     # an all-zero block: the scale floor
    x[2, 128:256] = edges[-256:-128] if edges.numel() >= 256 else 1.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_cast_is_torchs_bit_for_bit(dtype, round_scale, cast_version):
    x = _inputs(dtype)
    before = x.clone()
    data, scales = quantize_fp8(x, round_scale)
    assert torch.equal(x, before)                      # the torch cast leaves its input alone
    # a message row: the bytes past the payload must stay as they were
    msgs = torch.full((x.shape[0], x.shape[1] + 96), 0xA5, dtype=torch.uint8)
    got = native.quantize_fp8(x, round_scale, msgs)
    assert torch.equal(got, scales)
    assert torch.equal(msgs[:, :x.shape[1]], data.view(torch.uint8))
    assert (msgs[:, x.shape[1]:] == 0xA5).all()
    # a low-latency message: the scales right after the data, the padding left alone
    hidden, cols = x.shape[1], x.shape[1] // 32
    native.quantize_fp8(x, round_scale, msgs, scales_at=hidden)
    assert torch.equal(msgs[:, hidden:hidden + cols], scales.view(torch.uint8))
    assert (msgs[:, hidden + cols:] == 0xA5).all()
    with pytest.raises(IndexError, match="cannot hold the scales"):
        native.quantize_fp8(x, round_scale, msgs, scales_at=hidden + 90)


def _with_and_without(switch, request):
    """Run a test with a C loop's AVX-512 version (``switch``: its native switch; skipped
    where the CPU has none) and without it, and restore the setting after."""
    if native.library() is None:
        pytest.fail("the host backend's C library did not build (see its warning)")
    before = switch()
    if request.param and not before:
        pytest.skip("no AVX-512 here")
    switch(request.param)
    yield request.param
    switch(before)


@pytest.fixture(params=[True, False], ids=["avx512", "plain"])
def cast_version(request):
    """Each test of the cast runs with the AVX-512 version and without."""
    yield from _with_and_without(native.fp8_avx512, request)


@pytest.fixture(params=[True, False], ids=["lines", "sse2"])
def stream_version(request):
    """Each test of the non-temporal copies runs with 64-byte AVX-512 stores and with
    16-byte ones."""
    yield from _with_and_without(native.stream_avx512, request)


@pytest.fixture(params=[True, False], ids=["avx512", "plain"])
def sum_version(request):
    """Each test of the per-token sums runs with their AVX-512 version and without (asked
    for before monkeypatch, which may turn the C library off until its own teardown)."""
    yield from _with_and_without(native.sum_avx512, request)


def _near_edges(dtype, blocks=4096, seed=1) -> torch.Tensor:
    """Blocks of 128 whose quotients by their scale land on, and a few ulps either side of,
    the e4m3 rounding edges (midpoints, the subnormal range, the clamp): the first value
    sets the block's amax, hence its scale, to a random one."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[torch.isfinite(codes) & (codes >= 0)].unique().sort().values
    mids = torch.cat([(values[1:] + values[:-1]) / 2, values])
    scale = torch.exp2(torch.rand(blocks, 1, generator=g) * 40 - 20)
    pick = mids[torch.randint(0, mids.numel(), (blocks, 128), generator=g)]
    x = (pick * scale).to(dtype).float()
    # nudge by -4..4 ulps of the input's own precision
    ulps = torch.randint(-4, 5, x.shape, generator=g)
    step = torch.nextafter(x, torch.full_like(x, float("inf"))) - x
    if dtype == torch.bfloat16:
        step = step * 65536
    x = x + ulps * step
    x = torch.where(torch.rand(x.shape, generator=g) < 0.5, -x, x)
    x[:, 0] = 448 * scale[:, 0]
    return x.to(dtype).view(-1, 1024)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_cast_near_rounding_edges(dtype, cast_version):
    x = _near_edges(dtype)
    data, scales = quantize_fp8(x)
    msgs = torch.zeros(x.shape[0], x.shape[1], dtype=torch.uint8)
    assert torch.equal(native.quantize_fp8(x, False, msgs), scales)
    assert torch.equal(msgs, data.view(torch.uint8))


def test_fp8_cast_of_strided_rows_and_nan(cast_version):
    x = _inputs(torch.bfloat16, hidden=2048)[:, :1024]   # rows 2048 elements apart
    msgs = torch.zeros(x.shape[0], 1024, dtype=torch.uint8)
    native.quantize_fp8(x, False, msgs)
    assert torch.equal(msgs, quantize_fp8(x)[0].view(torch.uint8))
    x = x.contiguous()
    x[5, 300] = float("nan")                            # the block's scale and codes are NaN
    scales = native.quantize_fp8(x, False, msgs)
    assert scales[5, 2].isnan() and ((msgs[5, 256:384] & 0x7F) == 0x7F).all()


def _cast_rows(x_row, scales, avx512: bool) -> torch.Tensor:
    """moe_fp8_cast of ``x_row`` (one bf16 row, read again for every row: stride 0) at
    ``scales`` [n, groups], by the AVX-512 version or the plain loop."""
    hidden, n = x_row.numel(), scales.shape[0]
    out = torch.empty(n, hidden, dtype=torch.uint8)
    scratch = torch.empty(hidden, dtype=torch.float32)
    native.fp8_avx512(avx512)
    native.library().moe_fp8_cast(x_row.data_ptr(), native.DTYPES[torch.bfloat16], n, hidden,
                                  0, scales.data_ptr(), out.data_ptr(), hidden,
                                  scratch.data_ptr(), -1)
    return out


def test_fp8_cast_of_every_bf16_at_every_scale():
    """The AVX-512 cast's short path for normal codes (and its fallback to the full one) gives
    the plain loop's bytes - which the tests above hold to torch's - for every bf16 value, NaN
    and infinity included, at every scale a block of bf16 can have: max(amax, 1e-4) / 448 for
    each finite amax. 18096 scales x 65536 values, in chunks."""
    before = native.fp8_avx512()
    if not before:
        pytest.skip("no AVX-512 here")
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    amax = values.float()
    amax = amax[torch.isfinite(amax) & (amax >= 1e-4)]
    scales = torch.cat([torch.tensor([1e-4]), amax]) / 448
    groups = values.numel() // 128
    try:
        for lo in range(0, scales.numel(), 512):
            chunk = scales[lo:lo + 512, None].expand(-1, groups).contiguous()
            fast, plain = _cast_rows(values, chunk, True), _cast_rows(values, chunk, False)
            bad = (fast != plain).nonzero()
            assert bad.numel() == 0, (
                f"scale {chunk[bad[0, 0], 0].item()!r}, value "
                f"{values[bad[0, 1]].item()!r}: {fast[tuple(bad[0])]:#x} against "
                f"{plain[tuple(bad[0])]:#x}")
    finally:
        native.fp8_avx512(before)


def test_fp8_cast_ignores_the_threads_rounding_mode():
    """The AVX-512 cast rounds to 3 mantissa bits with the instruction's own rounding
    (nearest even), not the thread's: under fesetround(FE_UPWARD) or FE_TOWARDZERO its bytes
    are still the plain loop's, quotients just above 448 included (with the thread's
    rounding, 450 took NaN's code)."""
    before = native.fp8_avx512()
    if not before or platform.machine() != "x86_64":
        pytest.skip("no AVX-512 here")
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    to_nearest, upward, toward_zero = 0, 0x800, 0xC00          # x86's <fenv.h>
    g = torch.Generator().manual_seed(5)
    row = torch.cat([torch.arange(448, 466, 2, dtype=torch.float32).repeat(15)[:128],
                     torch.randn(896, generator=g) * 3]).bfloat16()
    scales = torch.tensor([[1.0] + [0.02] * 7, [1.0] * 8, [3.0 / 448] * 8])
    try:
        for mode in (upward, toward_zero):
            assert libm.fesetround(mode) == 0
            fast, plain = _cast_rows(row, scales, True), _cast_rows(row, scales, False)
            libm.fesetround(to_nearest)
            assert torch.equal(fast, plain), mode
    finally:
        libm.fesetround(to_nearest)
        native.fp8_avx512(before)


def _segments(dtype, hidden, seed):
    """Ragged per-source segments, ids ascending within each, some tokens in none."""
    g = torch.Generator().manual_seed(seed)
    tokens, segs, ids = 70, [], []
    for n in (0, 33, 70, 5):
        chosen = torch.randperm(tokens, generator=g)[:n].sort().values
        segs.append((torch.randn(n, hidden, generator=g) * 3).to(dtype))
        ids.append(chosen)
    return tokens, segs, ids


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.float32)])
def test_sums_are_torchs_bit_for_bit(sum_version, dtype, out_dtype, monkeypatch):
    tokens, segs, ids = _segments(dtype, 384, seed=1)
    bias = [torch.randn(tokens, 384), torch.randn(tokens, 384)]
    fast = reduce.sum_rows_per_token(segs, ids, tokens, out_dtype, bias)
    monkeypatch.setenv(native.ENV, "0")
    assert native.library() is None
    slow = reduce.sum_rows_per_token(segs, ids, tokens, out_dtype, bias)
    assert torch.equal(fast.view(torch.uint8), slow.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,rows_n", [(50, 160), (12, 140)])
def test_weighted_sums_are_torchs_bit_for_bit(sum_version, dtype, tokens, rows_n, monkeypatch):
    """A few rows a token, and a dozen or more (a top-8 low-latency combine sums 8: GCC once
    compiled the loop for more than 7 into other code than for fewer)."""
    g = torch.Generator().manual_seed(2)
    hidden = 512
    rows = (torch.randn(rows_n, hidden, generator=g) * 5).to(dtype)
    tok = torch.randint(0, tokens - 3, (rows_n,), generator=g)      # unsorted; 3 tokens empty
    w = torch.rand(rows_n, generator=g)
    poison = torch.full((tokens, hidden), float("nan")).bfloat16()
    fast = reduce.weighted_sum_rows(rows, tok, w, poison.clone())
    monkeypatch.setenv(native.ENV, "0")
    slow = reduce.weighted_sum_rows(rows, tok, w, poison.clone())
    assert torch.equal(fast.view(torch.uint8), slow.view(torch.uint8))
    assert (fast[tokens - 3:] == 0).all()


@pytest.mark.parametrize("hidden", [1, 7, 255, 256, 257, 600, 1040])
@pytest.mark.parametrize("weighted", [False, True])
def test_sums_over_chunk_edges_strided_rows_and_signed_zeros(sum_version, hidden, weighted,
                                                            monkeypatch):
    """The C sum takes the channels 256 at a time (its AVX-512 version 128, in registers of
    16, widths of 16 only): widths around those edges, segments that are
    views with a row stride of their own (a combine sums a rank's own rows straight from its
    x), unsorted ids, a token whose rows are all -0.0 (0 + -0 is +0: the sum starts at 0)."""
    g = torch.Generator().manual_seed(hidden)
    tokens = 40
    wide = (torch.randn(30, hidden + 9, generator=g) * 4).bfloat16()
    segs = [wide[:, 3:3 + hidden], (torch.randn(25, hidden, generator=g) * 4).bfloat16(),
            wide[:0, :hidden]]
    ids = [torch.randint(0, tokens - 2, (30,), generator=g), torch.randperm(tokens - 2)[:25],
           torch.zeros(0, dtype=torch.long)]
    segs[0][0], ids[0][0] = -0.0, tokens - 1           # the last token: only a -0 row
    weights = [torch.rand(s.shape[0], generator=g) for s in segs] if weighted else None
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv(native.ENV, flag)
        out = native.sum_rows(segs, ids, tokens, torch.bfloat16, weights=weights)
        if out is None:                                  # the torch code the C loops replace
            ref = torch.zeros(tokens, hidden)
            for i, (seg, tok) in enumerate(zip(segs, ids)):
                for r in range(seg.shape[0]):
                    w = 1.0 if weights is None else weights[i][r]
                    ref[tok[r]] += seg[r].float() * w if weighted else seg[r].float()
            out = ref.bfloat16()
        results.append(out)
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))
    assert (results[0][tokens - 1].view(torch.int16) == 0).all()     # +0, not -0
    assert (results[0][tokens - 2] == 0).all()                        # no rows: 0


@pytest.mark.parametrize("hidden", [176, 1040])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_sums_of_partial_chunks_nan_and_inf(sum_version, hidden, out_dtype, monkeypatch):
    """Widths whose last chunk is 3 or 1 registers of 16 (the AVX-512 version's tails), into
    either output dtype; NaN rows give 0x7FC0 in bf16 (the C rule: torch's vectorised cast
    gives other NaN bits; rounding this NaN's payload would not), an infinite one inf."""
    g = torch.Generator().manual_seed(hidden)
    tokens = 12
    segs = [(torch.randn(n, hidden, generator=g) * 3).bfloat16() for n in (12, 7)]
    ids = [torch.arange(12), torch.arange(7) * 2 % 12]
    segs[1][1, hidden - 1], segs[0][5, 100] = float("inf"), -0.0
    segs[1][0, 5:6].view(torch.int16).fill_(0x7FFF)     # a NaN with payload bits
    fast = native.sum_rows(segs, ids, tokens, out_dtype)
    monkeypatch.setenv(native.ENV, "0")
    slow = reduce.sum_rows_per_token(segs, ids, tokens, out_dtype)
    nan = fast.isnan()
    assert nan.sum() == 1 and nan[0, 5] and torch.isinf(fast[2, hidden - 1])
    if out_dtype == torch.bfloat16:
        assert fast[0, 5].view(torch.int16) == 0x7FC0
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(fast[~nan].view(bits), slow[~nan].view(bits))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_large_sums_stream_torchs_bits(sum_version, out_dtype, monkeypatch):
    """An output of 2 MiB or more is written with non-temporal stores (whole lines in the
    AVX-512 version): tokens of 0 to 5 rows, a bias, every row of out written."""
    g = torch.Generator().manual_seed(9)
    tokens, hidden = 160, 7168                          # 2.3 MB of bf16
    segs = [(torch.randn(n, hidden, generator=g) * 3).bfloat16() for n in (150, 90, 0, 120, 40)]
    ids = [torch.randperm(tokens - 4, generator=g)[:s.shape[0]].sort().values for s in segs]
    bias = [torch.randn(tokens, hidden, generator=g)]
    fast = reduce.sum_rows_per_token(segs, ids, tokens, out_dtype, bias)
    monkeypatch.setenv(native.ENV, "0")
    slow = reduce.sum_rows_per_token(segs, ids, tokens, out_dtype, bias)
    assert torch.equal(fast.view(torch.uint8), slow.view(torch.uint8))
    assert torch.equal(fast[tokens - 4:], bias[0][tokens - 4:].to(out_dtype))
    # into an out whose rows do not start on 64-byte lines: no non-temporal stores there
    monkeypatch.setenv(native.ENV, "1")
    flat = torch.full((tokens * hidden + 8,), 7.0, dtype=out_dtype)
    out = flat[8:].view(tokens, hidden)
    assert native.sum_rows(segs, ids, tokens, out_dtype, bias, out=out) is out
    assert torch.equal(out.view(torch.uint8), slow.view(torch.uint8)) and (flat[:8] == 7).all()


def test_sums_with_ids_past_the_tokens_write_nothing():
    """moe_sum_segments checks every id before it writes: ``out`` keeps its bytes."""
    rows = torch.ones(3, 300).bfloat16()
    out = torch.full((4, 300), 5.0).bfloat16()
    for bad in (torch.tensor([0, 4, 1]), torch.tensor([2, -1, 0])):
        assert native.sum_rows([rows[:1], rows[1:]], [bad[:1], bad[1:]], 4, torch.bfloat16,
                               out=out) is None
        assert (out == 5).all()


def test_large_sum_outputs_ask_for_huge_pages_and_sum_alike(monkeypatch):
    """A sum's output of 32 MiB or more (a fresh mapping: native.empty_output) is advised to
    huge pages over its 2 MiB-aligned inside, and holds the same sums; smaller ones are left
    alone."""
    advised = []
    monkeypatch.setattr(native, "_madvise", lambda: lambda at, n, advice: advised.append(
        (at, n, advice)))
    tokens, hidden = 2400, 7168                         # 34 MB of bf16
    g = torch.Generator().manual_seed(8)
    rows = torch.randn(3, hidden, generator=g).bfloat16()
    ids = torch.tensor([0, 1200, tokens - 1])
    out = native.sum_rows([rows], [ids], tokens, torch.bfloat16)
    assert len(advised) == 1
    at, n, advice = advised[0]
    assert advice == native.MADV_HUGEPAGE and at % native.HUGE_PAGE == 0 and \
        n % native.HUGE_PAGE == 0
    assert out.data_ptr() <= at and at + n <= out.data_ptr() + out.numel() * 2
    assert torch.equal(out[ids], rows) and (out[1:1200] == 0).all()
    native.sum_rows([rows], [torch.tensor([0, 1, 2])], 3, torch.bfloat16)
    assert len(advised) == 1                             # small: not advised


def test_a_compiler_that_fails_leaves_torch_in_charge(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")
    native._library.cache_clear()
    monkeypatch.setattr(native, "cache_dir", lambda kind: tmp_path / kind)
    try:
        assert native.library() is None
        tokens, segs, ids = _segments(torch.bfloat16, 128, seed=3)
        out = reduce.sum_rows_per_token(segs, ids, tokens, torch.bfloat16)
        assert out.shape == (tokens, 128)
    finally:
        native._library.cache_clear()


def test_row_copies_gather_and_scatter_like_torch(monkeypatch):
    g = torch.Generator().manual_seed(4)
    src = torch.randint(0, 256, (40, 96), generator=g, dtype=torch.uint8)
    src_rows, dst_rows = torch.randperm(40, generator=g)[:25], torch.randperm(60, generator=g)[:25]
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv(native.ENV, flag)
        dst = torch.full((60, 128), 0xEE, dtype=torch.uint8)      # rows wider than the copy
        native.copy_rows(src[:, 8:72], src_rows, dst, dst_rows)
        native.copy_rows(src[:5, :16], None, dst[50:], None)
        results.append(dst)
    assert torch.equal(results[0], results[1])
    want = torch.full((60, 128), 0xEE, dtype=torch.uint8)
    want[dst_rows, :64] = src[src_rows, 8:72]
    want[50:55, :16] = src[:5, :16]
    assert torch.equal(results[0], want)
    monkeypatch.setenv(native.ENV, "1")
    with pytest.raises(IndexError, match="destination row"):
        native.copy_rows(src, src_rows, torch.empty(10, 96, dtype=torch.uint8), dst_rows)


@pytest.mark.parametrize("with_scales,with_weights", [(False, True), (True, True),
                                                      (True, False)])
def test_dispatch_rows_for_a_destination_are_torchs(with_scales, with_weights):
    """native.put_rows (one C pass) writes what exchange._put_rows_torch writes: payload rows
    of a strided x, scales, top-k ids made local (-1 slots, experts elsewhere, an expert named
    twice) and their weights, zero where the expert is elsewhere or without weights."""
    g = torch.Generator().manual_seed(6)
    tokens, topk, num_local, dst = 30, 6, 4, 2
    x = torch.randint(0, 256, (tokens, 100), generator=g, dtype=torch.uint8)[:, 5:93]
    scales = torch.randn(tokens, 3, generator=g) if with_scales else None
    idx = _routing(tokens, topk, 4 * num_local, seed=7)
    w = torch.rand(tokens, topk, generator=g) if with_weights else None
    ids = torch.tensor([0, 3, 4, 9, 17, 29, 3])

    def outs():
        return (torch.full((7, 88), 0xEE, dtype=torch.uint8),
                torch.full((7, 3), 9.0) if with_scales else None,
                torch.full((7, topk), 99, dtype=torch.int64), torch.full((7, topk), 9.0))

    fast, slow = outs(), outs()
    assert native.put_rows(x, scales, idx, w, ids, dst * num_local, num_local, fast)
    exchange._put_rows_torch(x, scales, idx, w, ids, dst, num_local, slow)
    for a, b in zip(fast, slow):
        assert (a is None and b is None) or _same(a, b)
    assert (fast[2] == -1).any() and (fast[2] >= 0).any()
    with pytest.raises(IndexError, match="token id"):
        native.put_rows(x, scales, idx, w, torch.tensor([1, tokens]), 0, num_local, outs())


def test_a_large_dispatch_payload_streams_like_torch(stream_version):
    """A destination's payload of 2 MiB and more is written with non-temporal stores: the
    same bytes as torch's gather, into rows that start 3 bytes past a 16-byte boundary."""
    g = torch.Generator().manual_seed(8)
    tokens, topk, num_local, row_bytes = 200, 4, 2, 14336 + 6
    x = torch.randint(0, 256, (tokens, row_bytes), generator=g, dtype=torch.uint8)
    idx = _routing(tokens, topk, 4 * num_local, seed=9)
    w = torch.rand(tokens, topk, generator=g)
    ids = torch.randperm(tokens, generator=g)[:190]
    assert ids.numel() * row_bytes >= 2 << 20

    def outs():
        x_out = torch.full((ids.numel() * row_bytes + 3,), 0xEE, dtype=torch.uint8)[3:]
        return (x_out.view(ids.numel(), row_bytes), None,
                torch.full((ids.numel(), topk), 99, dtype=torch.int64),
                torch.full((ids.numel(), topk), 9.0))

    fast, slow = outs(), outs()
    assert native.put_rows(x, None, idx, w, ids, num_local, num_local, fast)
    exchange._put_rows_torch(x, None, idx, w, ids, 1, num_local, slow)
    assert torch.equal(fast[0], x[ids]) and torch.equal(fast[0], slow[0])
    assert _same(fast[2], slow[2]) and _same(fast[3], slow[3])


@pytest.mark.parametrize("tokens,row_bytes", [(70, 88), (400, 14336)])
def test_several_destinations_in_one_pass_are_torchs(tokens, row_bytes, stream_version):
    """native.put_rows_multi (a dispatch's destinations in one pass over x, PUT_BLOCK tokens
    at a time) writes for each destination what _put_rows_torch writes: ascending ids that
    overlap between destinations, unsorted ones, a destination without rows, one of 2 MiB
    and more (non-temporal stores) beside small ones."""
    g = torch.Generator().manual_seed(10)
    topk, num_local = 4, 3
    x = torch.randint(0, 256, (tokens, row_bytes), generator=g, dtype=torch.uint8)
    scales = torch.randn(tokens, 2, generator=g)
    idx = _routing(tokens, topk, 4 * num_local, seed=11)
    w = torch.rand(tokens, topk, generator=g)
    every = torch.arange(tokens)
    ids_of = [every[every % 3 != 1], torch.randperm(tokens, generator=g)[:tokens // 2],
              every[:0], every]
    assert ids_of[3].numel() * row_bytes >= 2 << 20 or tokens < 100

    def outs(n):
        return (torch.full((n, row_bytes), 0xEE, dtype=torch.uint8), torch.full((n, 2), 9.0),
                torch.full((n, topk), 99, dtype=torch.int64), torch.full((n, topk), 9.0))

    fast = [outs(i.numel()) for i in ids_of]
    assert native.put_rows_multi(x, scales, idx, w, num_local,
                                 [(i, d * num_local, o) for d, (i, o) in
                                  enumerate(zip(ids_of, fast))])
    for d, (ids, got) in enumerate(zip(ids_of, fast)):
        want = outs(ids.numel())
        exchange._put_rows_torch(x, scales, idx, w, ids, d, num_local, want)
        assert all(_same(a, b) for a, b in zip(got, want)), d
    with pytest.raises(IndexError, match="token id"):
        native.put_rows_multi(x, scales, idx, w, num_local,
                              [(ids_of[0], 0, fast[0]), (torch.tensor([0, tokens]), 3,
                                                         outs(2))])


def test_a_streamed_copy_is_a_copy(stream_version):
    """native.copy_stream (the bench's copy bar): the bytes of src, unaligned ends included;
    a size mismatch copies nothing."""
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(4))[5:]
    dst = torch.zeros(src.numel() + 16, dtype=torch.uint8)[3:3 + src.numel()]
    assert native.copy_stream(dst, src) and torch.equal(dst, src)
    assert not native.copy_stream(dst[1:], src)


def test_expert_counts_are_torchs():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(-1, 6, (300, 8), generator=gen)           # -1: no local expert
    want = torch.bincount(ids[ids >= 0], minlength=6).tolist()
    assert native.expert_counts(ids, 6) == want
    assert native.expert_counts(ids[:, :3], 6) is None             # not contiguous: torch
    assert native.expert_counts(ids, 5) is None                     # an id past num_local
    assert native.expert_counts(torch.empty(0, 8, dtype=torch.int64), 3) == [0, 0, 0]


def test_inconsistent_arguments_are_refused_not_read_past(monkeypatch):
    """What the callers never pass must still not reach the C loops: wrong dtypes and row
    counts raise, and sums with shapes or ids that do not fit go to torch, which raises."""
    src = torch.zeros(8, 16, dtype=torch.uint8)
    with pytest.raises(TypeError, match="uint8"):
        native.copy_rows(src.view(torch.int16), None, torch.zeros(8, 8, dtype=torch.int16), None)
    with pytest.raises(IndexError, match="row indices"):
        native.copy_rows(src, torch.arange(4), torch.zeros(8, 16, dtype=torch.uint8),
                         torch.arange(3))
    dst = torch.zeros(8, 16, dtype=torch.uint8)
    native.copy_rows(src + 7, torch.arange(4, dtype=torch.int32), dst,
                     torch.arange(4, 8, dtype=torch.int32))     # any integer index dtype
    assert (dst[4:] == 7).all() and (dst[:4] == 0).all()
    rows = torch.ones(4, 128).bfloat16()
    for tokens, ids in ((3, torch.tensor([0, 1, 5, 2])), (8, torch.tensor([0, 1, 2, -1]))):
        assert native.sum_rows([rows], [ids], tokens, torch.bfloat16) is None
        with pytest.raises((IndexError, RuntimeError)):
            reduce.weighted_sum_rows(rows, ids, torch.ones(4), torch.empty(tokens, 128).bfloat16())
    assert native.sum_rows([rows, torch.ones(2, 64).bfloat16()],
                           [torch.arange(4), torch.arange(2)], 4, torch.bfloat16) is None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (random message bytes make NaN scales, which never compare equal)."""
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def _routing(tokens=40, topk=6, experts=24, seed=5):
    """topk_idx with -1 slots and a token naming one expert twice."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, experts, (tokens, topk), generator=g)
    idx[torch.rand(tokens, topk, generator=g) < 0.2] = -1
    idx[3, :2] = 7
    return idx


def test_low_latency_routing_sorts_like_torch(monkeypatch):
    """The sender's counting sort in C: by expert, then token, then slot, as torch's stable
    sort; an id outside [-1, E) is refused before anything is written."""
    idx = _routing()
    fast = ll._route(idx, 24)
    monkeypatch.setenv(native.ENV, "0")
    slow = ll._route(idx, 24)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    monkeypatch.setenv(native.ENV, "1")
    idx[0, 0] = 24
    with pytest.raises(ValueError, match="outside"):
        native.ll_route(idx, 24)


def _region(num_local, R, M, stride, counts, seed=6):
    """A receiver's dispatch blocks: random message bytes and meta, ``counts`` [src, le]."""
    g = torch.Generator().manual_seed(seed)
    slots = num_local * R * M
    rows = torch.randint(0, 256, (slots, stride), generator=g, dtype=torch.uint8)
    meta = torch.randint(0, 1 << 20, (slots,), generator=g).view(torch.uint8)
    rows_in = np.zeros((R, num_local + 1), np.int64)
    rows_in[:, :num_local] = counts.numpy()
    return rows, meta, rows_in


def test_low_latency_pack_and_return_match_torch(monkeypatch):
    """The receive's pack (rows, scales, meta, ranges) and the combine's return of one owner's
    runs give torch's bytes; a count above max_tokens is refused before a byte moves."""
    num_local, R, M, hidden = 3, 4, 5, 256
    stride = hidden + hidden // 32 + 8
    counts = torch.tensor([[0, 5, 2], [1, 0, 3], [5, 5, 0], [2, 1, 4]])
    rows, meta, rows_in = _region(num_local, R, M, stride, counts)
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv(native.ENV, flag)
        x = torch.full((num_local, R * M, hidden), 0xEE, dtype=torch.uint8)
        scales = torch.full((num_local, R * M, hidden // 128), -1.0)
        packed = native.ll_recv(rows, meta, rows_in, M, x, hidden, scales, hidden) \
            if flag == "1" else ll._pack_torch(rows, meta, counts, M, x, hidden, scales, hidden,
                                               False)
        recv_meta, ranges, per_expert = packed
        y = torch.randint(0, 256, (num_local * R * M, 2 * hidden), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(7))
        back = []
        for owner in range(R):
            n = int(ranges[:, owner, 1].sum())
            dst = torch.zeros(n + 2, 2 * hidden, dtype=torch.uint8)
            if not native.ll_return(y, ranges, owner, dst):
                native.copy_rows(y, ll._return_rows(ranges, owner, R * M, n), dst, None)
            back.append(dst)
        outs.append((x, scales, recv_meta, ranges, per_expert, back))
    # rows past an expert's count are left alone (recv_x) or -1 (meta) on both paths
    for a, b in zip(outs[0][:5], outs[1][:5]):
        assert _same(a, b)
    for a, b in zip(outs[0][5], outs[1][5]):
        assert _same(a, b)
    monkeypatch.setenv(native.ENV, "1")
    x = torch.zeros(num_local, R * M, hidden, dtype=torch.uint8)
    rows_in[2, 1] = M + 1                                   # a peer announcing too many rows
    with pytest.raises(ValueError, match="more than 5 rows"):
        native.ll_recv(rows, meta, rows_in, M, x, hidden, None, hidden)
    assert (x == 0).all()
    ranges = outs[0][3].clone()
    ranges[1, 2, 1] = R * M                                 # a run past its expert's block
    with pytest.raises(IndexError, match="outside"):
        native.ll_return(y, ranges, 2, torch.zeros(100, 2 * hidden, dtype=torch.uint8))


def test_low_latency_combine_sum_is_torchs_bit_for_bit(sum_version, monkeypatch):
    """The combine's weighted sum of this rank's returned rows (in its message order) gives
    reduce.weighted_sum_rows's bits on the torch path; tokens without rows get 0."""
    idx = _routing()
    tok, slot, _ = ll._route(idx, 24)
    g = torch.Generator().manual_seed(8)
    rows = (torch.randn(tok.numel(), 384, generator=g) * 4).bfloat16()
    weights = torch.rand(idx.shape, generator=g)
    fast = torch.full((idx.shape[0], 384), float("nan")).bfloat16()
    assert native.ll_combine(rows, tok, slot, weights, fast)
    monkeypatch.setenv(native.ENV, "0")
    slow = reduce.weighted_sum_rows(rows, tok, weights[tok, slot], torch.empty_like(fast))
    assert torch.equal(fast.view(torch.uint8), slow.view(torch.uint8))
    monkeypatch.setenv(native.ENV, "1")
    with pytest.raises(IndexError, match="outside topk_weights"):
        native.ll_combine(rows, tok, slot.clamp(max=0) + 6, weights, fast)


def test_low_latency_pack_reads_own_messages_in_place(monkeypatch):
    """A rank's messages to itself stay in its message rows (host/ll.py): the pack that reads
    them there gives what the pack of a region holding them gives; an own count row that
    disagrees with the messages is refused."""
    num_local, R, M, me, hidden = 6, 4, 40, 2, 256
    stride = hidden + hidden // 32
    lay = LLLayout(M, hidden, R, num_local * R)
    idx = _routing(tokens=M, topk=5, experts=num_local * R)
    tok, slot, first = ll._route(idx, num_local * R)
    g = torch.Generator().manual_seed(9)
    msgs = torch.randint(0, 256, (M, stride), generator=g, dtype=torch.uint8)
    rows, meta, rows_in = _region(num_local, R, M, stride,
                                  torch.zeros(R, num_local, dtype=torch.long))
    counts = (first[1:] - first[:-1]).view(R, num_local)   # as if every rank routed alike
    rows_in[:, :num_local] = counts.numpy()
    own_region = rows.clone(), meta.clone()
    ll._write_messages(msgs, tok, slot, first, me, lay, me, *own_region)
    results = []
    for own in (None, (me, msgs, tok, slot, first)):
        x = torch.full((num_local, R * M, hidden), 0xEE, dtype=torch.uint8)
        scales = torch.full((num_local, R * M, hidden // 128), -1.0)
        region = own_region if own is None else (rows, meta)
        packed = native.ll_recv(*region, rows_in, M, x, hidden, scales, hidden, own=own)
        results.append((x, scales, *packed))
    for a, b in zip(*results):
        assert _same(a, b)
    rows_in[me, 0] += 1
    with pytest.raises(ValueError, match="own count row"):
        native.ll_recv(rows, meta, rows_in, M, x, hidden, scales, hidden,
                       own=(me, msgs, tok, slot, first))


def test_low_latency_send_writes_a_token_once_per_rank(monkeypatch):
    """With ``once``, a sender writes each token's row into its first message to a rank only
    (the other rows keep stale bytes); the receive reads every message of the token from that
    row, in C and with torch, and packs what a region holding every row gives."""
    num_local, R, M, hidden = 6, 4, 40, 256
    stride = hidden + hidden // 32
    lay = LLLayout(M, hidden, R, num_local * R)
    me = 1
    stale = _region(num_local, R, M, stride, torch.zeros(R, num_local, dtype=torch.long))
    full = stale[0].clone(), stale[1].clone()
    once = stale[0].clone(), stale[1].clone()
    rows_in = stale[2]
    for src in range(R):               # every source's messages to rank `me`
        idx = _routing(tokens=M, topk=5, experts=num_local * R, seed=20 + src)
        tok, slot, first = ll._route(idx, num_local * R)
        msgs = torch.randint(0, 256, (M, stride), generator=torch.Generator().manual_seed(src),
                             dtype=torch.uint8)
        ll._write_messages(msgs, tok, slot, first, me, lay, src, *full)
        ll._write_messages(msgs, tok, slot, first, me, lay, src, *once, once=True)
        rows_in[src, :num_local] = (first[1:] - first[:-1]).view(R, num_local)[me].numpy()
    assert not torch.equal(full[0], once[0])           # rows were skipped
    assert torch.equal(full[1], once[1])               # the meta went into every row
    counts = torch.from_numpy(rows_in[:, :num_local])
    results = []
    for region, torch_pack in ((full, False), (once, False), (once, True)):
        x = torch.full((num_local, R * M, hidden), 0xEE, dtype=torch.uint8)
        scales = torch.full((num_local, R * M, hidden // 128), -1.0)
        if torch_pack:
            monkeypatch.setenv(native.ENV, "0")
            packed = ll._pack_torch(*region, counts, M, x, hidden, scales, hidden, False)
            monkeypatch.setenv(native.ENV, "1")
        else:
            packed = native.ll_recv(*region, rows_in, M, x, hidden, scales, hidden)
        results.append((x, scales, *packed))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert _same(a, b)


def test_low_latency_send_with_non_temporal_stores_writes_the_same_region(stream_version):
    """ll_send's ``stream`` (a large call's messages, ll_direct.c): the same rows and meta as
    regular stores, with a token's row once per rank and rows that start off a line."""
    num_local, R, M, hidden, me = 4, 3, 48, 7168, 1
    stride = hidden + hidden // 32 + 8                      # not a multiple of 64
    idx = _routing(tokens=M, topk=6, experts=num_local * R, seed=31)
    tok, slot, first = ll._route(idx, num_local * R)
    msgs = torch.randint(0, 256, (M, stride), generator=torch.Generator().manual_seed(32),
                         dtype=torch.uint8)
    regions = []
    for stream in (False, True):
        rows, meta, _ = _region(num_local, R, M, stride, torch.zeros(R, num_local,
                                                                     dtype=torch.long))
        for dst in range(R):
            native.ll_send(msgs, tok, slot, first, dst * num_local, num_local, R, me, M, rows,
                           meta, once=True, stream=stream)
        regions.append((rows, meta))
    assert torch.equal(regions[0][0], regions[1][0]) and torch.equal(regions[0][1],
                                                                      regions[1][1])


def test_low_latency_large_return_and_pack_stream_like_torch(monkeypatch, stream_version):
    """Runs of 2 MiB and more are written with non-temporal stores (the combine's return, the
    dispatch's pack): the same bytes as torch's copies, unaligned starts included."""
    num_local, R, M, hidden = 2, 2, 96, 7168
    counts = torch.tensor([[96, 90], [95, 93]])
    stride = hidden + hidden // 32 + 16
    rows, meta, rows_in = _region(num_local, R, M, stride, counts)
    x = torch.zeros(num_local, R * M, hidden, dtype=torch.uint8)
    recv_meta, ranges, _ = native.ll_recv(rows, meta, rows_in, M, x, hidden, None, hidden)
    monkeypatch.setenv(native.ENV, "0")
    x_torch = torch.zeros_like(x)
    ll._pack_torch(rows, meta, counts, M, x_torch, hidden, None, hidden, False)
    monkeypatch.setenv(native.ENV, "1")
    assert torch.equal(x, x_torch)
    y = torch.randint(0, 256, (num_local * R * M, 2 * hidden), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(3))
    for owner in range(R):
        n = int(ranges[:, owner, 1].sum())
        assert n * 2 * hidden >= 2 << 20
        # rows 3 bytes past a 16-byte boundary: the copy aligns its stores itself
        dst = torch.zeros((n + 1) * 2 * hidden + 3, dtype=torch.uint8)[3:].view(n + 1, -1)
        assert native.ll_return(y, ranges, owner, dst)
        want = torch.zeros_like(dst)
        native.copy_rows(y, ll._return_rows(ranges, owner, R * M, n), want, None)
        assert torch.equal(dst, want)
