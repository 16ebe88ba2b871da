"""Ranks that disagree about a call: every rank raises CallMismatchError naming the field and
the ranks, before any payload moves, and the Buffer serves the next call on which they agree
(with exact results). One rank at a time passes another hidden size, dtype, fp8 instead of
bf16, int32 scales instead of float32 or fewer scale columns, top-k, num_worst_tokens, or a
cached handle of another dispatch; in low-latency mode another hidden size, fp8 flag, or
num_max_dispatch_tokens_per_rank.

Both backends: the host backend, and the CUDA backend on the CPU kernel emulator (ranks as
processes). The CUDA backend reports a mismatch when the call next meets the host: at once for
a dispatch that reads its counts, else at the next call, which raises instead of running (its
kernels are asynchronous); either way exactly one CallMismatchError per rank, then the next
call works.
"""
from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm.jit import emulator
from ranks import run_ranks

R, E, K, H, T = 3, 6, 2, 256, 12


@pytest.fixture(params=["host", "cuda_emulated"])
def backend(request, monkeypatch):
    if request.param == "cuda_emulated":
        if not emulator.available():
            pytest.skip("the kernel emulator needs a C++ compiler (g++)")
        import cuda_cases
        cuda_cases.preload("cpu", R, {256, 384}, ll=True)   # built before any deadline
        monkeypatch.setenv("MOE_COMM_CPU_BACKEND", "emulator")
    return request.param


def _inputs(rank, T=T, H=H):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, idx


def _fp8(x):
    blocks = x.float().view(x.shape[0], -1, 128)
    s = blocks.abs().amax(-1).clamp(min=1e-4) / 448.0
    return ((blocks / s.unsqueeze(-1)).view(x.shape).to(torch.float8_e4m3fn), s)


CASES = {  # name: (field the error names, what the odd rank changes)
    "hidden": ("hidden", "x"),
    "dtype": ("dtype", "x"),
    "fp8": ("dtype", "x"),
    "scale_dtype": ("scale_cols", "x"),
    "scale_cols": ("scale_cols", "x"),
    "topk": ("topk", "idx"),
    "num_worst_tokens": ("num_worst_tokens", "worst"),
    "handle": ("handle", "handle"),
    "combine_hidden": ("hidden", "combine"),
}
ODD = 1


def _attempt(errors):
    """A caller of ``call()`` that records a CallMismatchError in ``errors`` (None returned)."""
    def attempt(call):
        try:
            return call()
        except moe_comm.CallMismatchError as e:
            errors.append(str(e))
    return attempt


# rows beyond an eager slot (16 KB, ~300 a pair; the narrower ones 12 KB): granted regions,
# whose payload phases run in C (host/granted.py)
LARGE = dict(T=512, H=8192, narrow=6144)


def _normal_worker(rank, n, case, large=False):
    buf = moe_comm.Buffer(None, (96 if large else 16) << 20, timeout_s=20)
    x, idx = _inputs(rank, *((LARGE["T"], LARGE["H"]) if large else ()))
    narrow = LARGE["narrow"] if large else 128
    odd = rank == ODD
    layout = buf.get_dispatch_layout(idx, E)
    args = dict(topk_idx=idx, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                num_tokens_per_expert=layout[2])
    rx, _, _, _, handle, _ = buf.dispatch(x, **args)           # an agreeing call first
    errors = []
    attempt = _attempt(errors)

    if case == "hidden":
        attempt(lambda: buf.dispatch(x[:, :narrow].contiguous() if odd else x, **args))
    elif case == "dtype":
        attempt(lambda: buf.dispatch(x.float() if odd else x, **args))
    elif case == "fp8":
        attempt(lambda: buf.dispatch(_fp8(x) if odd else x, **args))
    elif case == "scale_dtype":      # UE8M0-packed int32 words instead of float32 scales
        data, s = _fp8(x)
        attempt(lambda: buf.dispatch((data, s.view(torch.int32) if odd else s), **args))
    elif case == "scale_cols":       # one scale per 256 channels instead of per 128
        data, s = _fp8(x)
        attempt(lambda: buf.dispatch((data, s[:, :1] if odd else s), **args))
    elif case == "topk":
        small = buf.get_dispatch_layout(idx[:, :1], E)
        attempt(lambda: buf.dispatch(x, topk_idx=idx[:, :1], num_tokens_per_rank=small[0],
                                     is_token_in_rank=small[3],
                                     num_tokens_per_expert=small[2]) if odd else
                buf.dispatch(x, **args))
    elif case == "num_worst_tokens":
        attempt(lambda: buf.dispatch(x, num_worst_tokens=64 if odd else 0, **args))
    elif case == "handle":
        _, _, _, _, second, _ = buf.dispatch(x, **args)
        attempt(lambda: buf.dispatch(x, handle=handle if odd else second))
    elif case == "combine_hidden":
        y = rx.float()[:, :narrow].bfloat16().contiguous() if odd else rx
        attempt(lambda: buf.combine(y, handle) if not odd else buf._be.normal.combine(
            buf._comm, x=y, handle=handle, topk_weights=None, bias=()))
    # the next agreeing calls: the first may still report the mismatch (the CUDA backend's
    # asynchronous calls); the one after must work and be exact
    for _ in range(2):
        got = attempt(lambda: buf.dispatch(x, **args))
        if got is not None:
            break
    rx, _, _, _, h, _ = got
    out, _, _ = buf.combine(rx, h)
    buf.destroy()
    return errors, out, x, idx


@pytest.mark.parametrize("case", list(CASES))
def test_normal_calls_that_disagree_raise_on_every_rank(backend, case, large=False):
    field = CASES[case][0]
    results = run_ranks(_normal_worker, R, case, large, timeout=120)
    for rank, (errors, out, x, idx) in enumerate(results):
        assert len(errors) == 1, (rank, errors)
        assert "the ranks disagree about this call" in errors[0], errors[0]
        assert f"{field}: " in errors[0] and f"rank {ODD} has" in errors[0], errors[0]
        # identity experts: each token comes back once per distinct rank of its experts
        copies = torch.tensor([len({int(e) // (E // R) for e in row}) for row in idx])
        torch.testing.assert_close(out.float(), (x.float() * copies[:, None]).bfloat16().float(),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", ["hidden", "handle", "combine_hidden"])
def test_granted_calls_that_disagree_raise_on_every_rank(case, monkeypatch):
    """Host backend, rows beyond a slot: the dispatch's count exchange in C, the payload
    phases in C (a cached dispatch's and a combine's check each receiver's signature before
    writing there). Combines granted regions, not streamed through the slots (ring.py: its
    own test, tests/test_ring_combine.py)."""
    monkeypatch.setenv("MOE_COMM_RING", "0")
    test_normal_calls_that_disagree_raise_on_every_rank("host", case, large=True)


LL_CASES = {"hidden": "hidden", "fp8": "use_fp8", "max_tokens": "num_max_dispatch_tokens_per_rank"}


def _ll_worker(rank, n, case):
    M = 16
    buf = moe_comm.Buffer(None, 8 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        2 * M, 512, n, E), low_latency_mode=True, timeout_s=20)
    x, idx = _inputs(rank)
    odd = rank == ODD
    errors = []
    attempt = _attempt(errors)

    if case == "hidden":
        xx = torch.randn(T, 384).bfloat16() if odd else x
        attempt(lambda: buf.low_latency_dispatch(xx, idx, M, E, use_fp8=False))
    elif case == "fp8":
        attempt(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=odd))
    else:
        attempt(lambda: buf.low_latency_dispatch(x, idx, 2 * M if odd else M, E, use_fp8=False))
    outs = []
    for _ in range(4):                    # both LL buffers, and the flow control, still work
        got = attempt(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False))
        if got is None:                   # the CUDA backend reports it at the next call
            continue
        rx, _, handle, _, _ = got
        out, _, _ = buf.low_latency_combine(rx, idx, torch.ones(T, K), handle)
        outs.append(out)
    buf.destroy()
    return errors, outs, x


@pytest.mark.parametrize("case", list(LL_CASES))
def test_low_latency_calls_that_disagree_raise_on_every_rank(backend, case):
    field = LL_CASES[case]
    results = run_ranks(_ll_worker, R, case, timeout=120)
    for rank, (errors, outs, x) in enumerate(results):
        assert len(errors) == 1, (rank, errors)
        assert len(outs) >= 3, (rank, len(outs))
        assert f"{field}: " in errors[0] and f"rank {ODD} has" in errors[0], errors[0]
        for out in outs:                  # identity experts, weight 1 per slot, top-2
            torch.testing.assert_close(out.float(), 2 * x.float(), rtol=1e-2, atol=1e-2)


def _in_flight_worker(rank, n):
    """Call A waits for its receive hook in buffer 1 while call B, in buffer 0, disagrees:
    rank ODD passes hidden 6144 instead of 256, a layout whose buffer 0 alone is larger than
    both buffers of the others'. B's messages stay in buffer 0's half of the region, so A's
    hook then receives exact rows (with buffers laid out back to back by each rank's own
    layout, B's rows land on A's)."""
    M, big = 8, 6144
    buf = moe_comm.Buffer(None, 8 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        M, big, n, E), low_latency_mode=True, timeout_s=20)
    x, idx = _inputs(rank)
    x, idx = x[:M], idx[:M]
    rx, count, handle, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False,
                                                          return_recv_hook=True)
    xb = torch.randn(M, big).bfloat16() if rank == ODD else x * 3
    try:
        buf.low_latency_dispatch(xb, idx, M, E, use_fp8=False)
        error = None
    except moe_comm.CallMismatchError as e:
        error = str(e)
    hook()
    out, _, _ = buf.low_latency_combine(rx, idx, torch.ones(M, K), handle)
    buf.destroy()
    return error, out, x


def test_a_call_that_disagrees_cannot_touch_a_call_in_flight():
    """Host backend (the CUDA backend would report B's mismatch at A's hook, the next call)."""
    for rank, (error, out, x) in enumerate(run_ranks(_in_flight_worker, R, timeout=120)):
        assert error and "hidden: " in error, (rank, error)
        torch.testing.assert_close(out.float(), 2 * x.float(), rtol=1e-2, atol=1e-2)


def _unchecked_worker(rank, n, eager, large):
    """With the signature check switched off (as if it had a bug), rank ODD dispatches rows
    twice as wide as its peers expect: its peers' grants are too small for them, so it writes
    nothing into them (MOE_COMM_EAGER=0, or rows beyond an eager slot: ``large``, 16 KB rows,
    ~300 a pair, whose payload phase runs in C, granted.py), or its rows go into its eager
    slots at them, whose flags say a size the receivers do not expect; every rank involved
    raises, a tensor a receiver holds is unchanged, and the next call works."""
    import os
    from moe_comm import signature
    os.environ["MOE_COMM_EAGER"] = eager
    signature.check = lambda *a, **k: None
    buf = moe_comm.Buffer(None, (96 if large else 16) << 20, timeout_s=20)
    x, idx = _inputs(rank, *((512, 8192) if large else ()))
    layout = buf.get_dispatch_layout(idx, E)
    args = dict(topk_idx=idx, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                num_tokens_per_expert=layout[2])
    held, _, _, _, handle, _ = buf.dispatch(x, **args)
    before = held.clone()
    try:
        buf.dispatch(torch.cat([x, x], 1) if rank == ODD else x, **args)
        error = None
    except RuntimeError as e:
        error = str(e)
    rx, _, _, _, h, _ = buf.dispatch(x, **args)
    out, _, _ = buf.combine(rx, h)
    same = torch.equal(held, before)
    buf.destroy()
    return error, same, out, x, idx


@pytest.mark.parametrize("eager, large", [("0", False), ("1", False), ("1", True)])
def test_rows_never_leave_the_granted_region(eager, large):
    """Host backend: the grant carries its size, the bound the sender obeys; an eager slot's
    flag carries the size the sender wrote, which the receiver checks."""
    odd_idx = _inputs(ODD, *((512, 8192) if large else ()))[1]
    odd_sends_to = {int(e) // (E // R) for e in odd_idx.flatten()} - {ODD}
    for rank, (error, same, out, x, idx) in enumerate(run_ranks(_unchecked_worker, R, eager,
                                                                 large, timeout=120)):
        assert same, rank
        if rank == ODD:
            assert error and ("nothing written to rank(s)" if eager == "0" or large else
                              "nothing received from rank(s)") in error, error
        elif rank in odd_sends_to:
            assert error and f"nothing received from rank(s) [{ODD}]" in error, (rank, error)
        copies = torch.tensor([len({int(e) // (E // R) for e in row}) for row in idx])
        torch.testing.assert_close(out.float(), (x.float() * copies[:, None]).bfloat16().float(),
                                   rtol=1e-2, atol=1e-2)


def _near_a_slot_worker(rank, n, small):
    """Ranks whose combines differ in topk only: 292 rows of H=7168 fit a slot without
    weights, 291 with 4 of them, so rank 0 sends its rows eagerly while rank 1 waits for a
    grant, and each waits for words the other never sends. At the deadline both raise
    CallMismatchError naming topk (the signatures came), and the next combine is exact."""
    import os
    import time
    os.environ["MOE_COMM_SMALL"] = small
    buf = moe_comm.Buffer(None, 64 << 20, timeout_s=2)
    T, E = 292, 8
    idx = torch.full((T, 2), -1, dtype=torch.int64)
    idx[:, 0] = 4 if rank == 0 else 0     # every token to the other rank
    layout = buf.get_dispatch_layout(idx, E)
    x = torch.randn(T, 7168).bfloat16()
    rx, _, _, _, handle, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=torch.rand(T, 2), num_tokens_per_rank=layout[0],
        is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
    t0 = time.monotonic()
    try:
        buf.combine(rx, handle, topk_weights=torch.rand(rx.shape[0], 4) if rank == 1 else None)
        error = None
    except moe_comm.CallMismatchError as e:
        error = str(e)
    elapsed = time.monotonic() - t0
    out, _, _ = buf.combine(rx, handle)
    buf.destroy()
    return error, elapsed, out, x


@pytest.mark.parametrize("small", ["1", "0"])
def test_ranks_that_disagree_about_eager_slots_raise_call_mismatch(small):
    for error, elapsed, out, x in run_ranks(_near_a_slot_worker, 2, small, timeout=60):
        assert error and "topk: rank 0 has 0, rank 1 has 4" in error, error
        assert 1.9 < elapsed < 10, elapsed
        torch.testing.assert_close(out, x)
