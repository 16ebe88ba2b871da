"""Bad input: a clear error naming the argument, raised before anything is sent, and the
buffer keeps working for the next valid call."""
from __future__ import annotations

import re

import torch

import moe_comm
from inputs import make_inputs
from ranks import run_ranks

E, K, H = 8, 2, 256


def _valid_roundtrip(buf, rank, seed):
    case = dict(seed=seed, tokens=[20, 9, 14], hidden=H, experts=E, topk=K, routing="random",
                dtype="bfloat16")
    x, idx, w, _ = make_inputs(case, rank)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    rx, ri, rw, _, h, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                       num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)
    out, _, _ = buf.combine(rx, h)
    return out, x, idx


def _bad_calls(rank, n):
    buf = moe_comm.Buffer(None, 8 << 20, timeout_s=20)
    other = moe_comm.Buffer(None, 8 << 20, timeout_s=20)
    x = torch.randn(10, H).bfloat16()
    idx = torch.randint(0, E, (10, K))
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    kw = dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte)
    _, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, **kw)
    _, _, _, _, foreign, _ = other.dispatch(x, topk_idx=idx, **kw)
    nte_bad = torch.zeros(E + 1, dtype=torch.int32)
    fp8 = torch.randn(10, 200).to(torch.float8_e4m3fn)
    calls = [
        ("transport", ValueError, "transport must be one of",
         lambda: moe_comm.Buffer(None, 8 << 20, transport="nvlink")),
        ("ibgda on cpu", ValueError, "transport='ibgda' needs CUDA tensors",
         lambda: moe_comm.Buffer(None, 8 << 20, transport="ibgda")),
        ("expert id", ValueError, "topk_idx holds expert id 8",
         lambda: buf.dispatch(x, topk_idx=torch.full((10, K), E), **kw)),
        ("expert id -2", ValueError, "topk_idx holds expert id -2",
         lambda: buf.get_dispatch_layout(torch.full((10, K), -2), E)),
        ("topk dtype", TypeError, "topk_idx must have dtype torch.int64",
         lambda: buf.dispatch(x, topk_idx=idx.int(), **kw)),
        ("topk rank", ValueError, "topk_idx must be 2-D",
         lambda: buf.get_dispatch_layout(idx.flatten(), E)),
        ("topk rows", ValueError, "topk_idx has 9 rows but x has 10 tokens",
         lambda: buf.dispatch(x, topk_idx=idx[:9], **kw)),
        ("x 3-D", ValueError, "x must be 2-D",
         lambda: buf.dispatch(x.view(2, 5, H), topk_idx=idx, **kw)),
        ("x dtype", TypeError, "x must have dtype",
         lambda: buf.dispatch(x.long(), topk_idx=idx, **kw)),
        ("weights rows", ValueError, "topk_weights shape",
         lambda: buf.dispatch(x, topk_idx=idx, topk_weights=torch.rand(9, K), **kw)),
        ("weights dtype", TypeError, "topk_weights must have dtype torch.float32",
         lambda: buf.dispatch(x, topk_idx=idx, topk_weights=torch.rand(10, K).double(), **kw)),
        ("experts % ranks", ValueError, "must be divisible by the group size",
         lambda: buf.get_dispatch_layout(idx, 3 * n + 1) if n > 1 else
         buf.get_dispatch_layout(idx, 0)),
        ("num_experts", ValueError, "num_experts",
         lambda: buf.dispatch(x, topk_idx=idx, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                              num_tokens_per_expert=nte_bad) if n > 1 else
         buf.get_dispatch_layout(idx, -4)),
        ("fp8 hidden", ValueError, "multiple of 128",
         lambda: buf.dispatch((fp8, torch.ones(10, 1)), topk_idx=idx, **kw)),
        ("fp8 alone", TypeError, "fp8 x must come with its scales",
         lambda: buf.dispatch(torch.randn(10, H).to(torch.float8_e4m3fn), topk_idx=idx, **kw)),
        ("handle other buffer", ValueError, "handle comes from another Buffer",
         lambda: buf.combine(torch.zeros(foreign.num_recv_tokens, H).bfloat16(), foreign)),
        ("handle tokens", ValueError, "x has 7 tokens but handle was made for 10",
         lambda: buf.dispatch(x[:7], handle=handle)),
        ("handle type", TypeError, "handle must be",
         lambda: buf.combine(x, handle=("not", "a handle"))),
        ("combine rows", ValueError, f"x must have the {handle.num_recv_tokens} rows",
         lambda: buf.combine(torch.zeros(handle.num_recv_tokens + 1, H).bfloat16(), handle)),
        ("bias shape", ValueError, "bias[0] must have shape",
         lambda: buf.combine(torch.zeros(handle.num_recv_tokens, H).bfloat16(), handle,
                             bias=torch.zeros(3, H))),
        ("alignment", ValueError, "expert_alignment",
         lambda: buf.dispatch(x, topk_idx=idx, expert_alignment=0, **kw)),
        ("no routing", ValueError, "without handle and topk_idx needs is_token_in_rank",
         lambda: buf.dispatch(x)),
        ("weights without ids", ValueError, "topk_weights needs the topk_idx",
         lambda: buf.dispatch(x, topk_weights=torch.rand(10, K), **kw)),
        ("hidden 0", ValueError, "x has hidden size 0",
         lambda: buf.dispatch(torch.zeros(10, 0), topk_idx=idx, **kw)),
        ("per rank vs topk", ValueError, "num_tokens_per_rank does not match topk_idx",
         lambda: buf.dispatch(x, topk_idx=idx, **dict(kw, num_tokens_per_rank=ntr + 1))),
        ("per expert vs topk", ValueError, "num_tokens_per_expert does not match topk_idx",
         lambda: buf.dispatch(x, topk_idx=idx, **dict(kw, num_tokens_per_expert=nte.flip(0)))),
        ("in rank vs topk", ValueError, "is_token_in_rank does not match topk_idx",
         lambda: buf.dispatch(x, topk_idx=idx, **dict(kw, is_token_in_rank=~itr))),
        ("cached hidden", ValueError, "x has hidden size 128 but handle was made for 256",
         lambda: buf.dispatch(x[:, :128], handle=handle)),
        ("device before values", ValueError, "topk_idx is on meta",
         lambda: buf.dispatch(x, topk_idx=idx.to("meta"), **kw)),
        ("layout device", ValueError, "topk_idx is on meta",
         lambda: buf.get_dispatch_layout(idx.to("meta"), E)),
    ]
    seen = []
    for name, exc, pattern, call in calls:
        try:
            call()
        except exc as e:
            assert re.search(re.escape(pattern), str(e)), (name, str(e))
            seen.append(name)
        else:
            raise AssertionError(f"{name}: no {exc.__name__}")
    # too small a buffer (a batch larger than it streams through it; a row larger than half
    # of it cannot): every rank learns it from the count matrix, nothing moves
    tiny = moe_comm.Buffer(None, 64 << 10, timeout_s=20)
    big = torch.randn(4, 32768).bfloat16()
    bidx = torch.zeros(4, 1, dtype=torch.int64)             # all to expert 0 (rank 0)
    ntr2, _, nte2, itr2, _ = tiny.get_dispatch_layout(bidx, E)
    try:
        tiny.dispatch(big, topk_idx=bidx, num_tokens_per_rank=ntr2, is_token_in_rank=itr2,
                      num_tokens_per_expert=nte2)
        raise AssertionError("no BufferTooSmallError")
    except moe_comm.BufferTooSmallError as e:
        assert "num_nvl_bytes too small" in str(e) and e.needed > 64 << 10, str(e)
        seen.append("too small")
    small_ok = _valid_roundtrip(tiny, rank, 7)
    result = _valid_roundtrip(buf, rank, 5)
    for b in (buf, other, tiny):
        b.destroy()
    return seen, result, small_ok


def _check_roundtrip(results, idx_in_result, seed, n):
    # combine of the identity "experts" sums each token once per destination rank
    for r in range(n):
        out, x, idx = results[r][idx_in_result]
        ranks_hit = torch.zeros(x.shape[0])
        for t in range(x.shape[0]):
            ranks_hit[t] = len({int(e) // (E // n) for e in idx[t] if e >= 0})
        torch.testing.assert_close(out.float(), x.float() * ranks_hit[:, None], rtol=1e-2,
                                   atol=1e-2)


def test_bad_input_is_named_and_buffer_survives():
    n = 2
    results = run_ranks(_bad_calls, n, timeout=120)
    for r in range(n):
        assert len(results[r][0]) == 31, results[r][0]
    _check_roundtrip(results, 1, 5, n)
    _check_roundtrip(results, 2, 7, n)
