"""Every kernel launch of the CUDA backend passes exactly the arguments the kernel declares
(CPU, no GPU).

The backend's Python side (moe_comm/cuda/normal.py, ll.py, elastic.py) runs here against a
CudaComm on the CPU "device" with a recording ``launch``: each recorded launch must carry the
packed arguments of the kernel it launches, with exactly the names moe_comm/jit/kernel_args.py
declares for it (the list the kernel's C++ signature is generated from), pointers as tensors or
None and scalars as ints, at the block the kernel is compiled for; and every kernel it asks for
must be one its variant lists. Catches drift between the host code and the kernels without a
GPU.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_comm.cuda import elastic as cel
from moe_comm.cuda import ll as cll
from moe_comm.cuda import normal as cn
from moe_comm.cuda import relay as crelay
from moe_comm.cuda.comm import CudaComm
from moe_comm.jit import variants
from moe_comm.jit.kernel_args import KERNEL_ARGS, PackedArgs, pack
from moe_comm.jit.variants import THREADS
from moe_comm.wire import LLLayout


@pytest.fixture
def recorder(monkeypatch):
    calls = []

    def fake_load(variant, device):
        return {name: name for name in variant.kernels}

    def fake_launch(kernel, grid, block, args, shmem=0, device=None, stream=None):
        calls.append((kernel, grid, block, args))
        named = dict(zip(args.names, args.values))
        # what notify and layout would produce: a count matrix, per-rank counts
        if kernel == "moe_notify" and isinstance(named["matrix"], torch.Tensor):
            named["matrix"].fill_(2)
        if kernel == "moe_notify" and isinstance(named["host_matrix"], torch.Tensor):
            named["host_matrix"].fill_(2)        # hierarchical: 2 tokens per host
        if kernel == "moe_layout" and isinstance(named["per_rank"], torch.Tensor):
            named["per_rank"].fill_(1)

    monkeypatch.setattr(cn, "load_kernels", fake_load)            # the layout kernel
    monkeypatch.setattr(CudaComm, "kernels", lambda self, variant: fake_load(variant, None))
    for mod in (cn, cll, cel, crelay):
        monkeypatch.setattr(mod, "launch", fake_launch)
    return calls


def _check(calls):
    assert calls
    for kernel, grid, block, args in calls:
        assert isinstance(args, PackedArgs) and args.kernel == kernel, (kernel, args)
        sig = KERNEL_ARGS[kernel]
        assert args.names == sig.names, (kernel, args.names)
        for p, a in zip(sig.params, args.values):
            if p.is_pointer:
                assert a is None or isinstance(a, torch.Tensor), (kernel, p.name, type(a))
            else:
                assert isinstance(a, (int, np.int64)), (kernel, p.name, type(a))
        # every launch uses the block its kernel is compiled for (__launch_bounds__)
        assert block == THREADS[kernel], (kernel, block)
        dims = (grid,) if isinstance(grid, int) else grid
        assert all(isinstance(d, int) and d >= 1 for d in dims), (kernel, grid)


def test_pack_takes_exactly_the_declared_names_and_kinds():
    sig = KERNEL_ARGS["moe_ll_wait"]
    values = {p.name: (None if p.is_pointer else 1) for p in sig.params}
    packed = pack("moe_ll_wait", **values)
    assert packed.names == sig.names and len(packed.values) == len(sig.params)
    with pytest.raises(TypeError, match="missing"):
        pack("moe_ll_wait", **{k: v for k, v in values.items() if k != "epoch"})
    with pytest.raises(TypeError, match="unknown"):
        pack("moe_ll_wait", **values, seq=3)
    with pytest.raises(TypeError, match="bases"):
        pack("moe_ll_wait", **{**values, "bases": 5})            # a pointer given an int
    with pytest.raises(TypeError, match="epoch"):
        pack("moe_ll_wait", **{**values, "epoch": torch.zeros(1)})
    pack("moe_ll_wait", **{**values, "bases": np.uint64(64)})    # a raw device address


def _comm(num_ranks, ll_bytes=0, elastic=False, heap_bytes=64 << 20, host_of=None):
    return CudaComm(rank=0, num_ranks=num_ranks, device="cpu", pointers=[0] * num_ranks,
                    heap_bytes=heap_bytes, ll_bytes=ll_bytes, timeout_s=1.0,
                    own_allocation=False, opened=[], elastic=elastic, host_of=host_of)


def _relay_calls(R, H, K, E, dtypes):
    """A dispatch, combines in ``dtypes`` and a cached dispatch of a group on two hosts: the
    hierarchical path (cuda/relay.py) with its own kernels."""
    comm = _comm(R, host_of=[r * 2 // R for r in range(R)])
    idx = torch.randint(0, E, (3, K))
    w = torch.rand(3, K)
    x = torch.randn(3, H).bfloat16()
    rx, _, _, rw, handle = cn.dispatch(
        comm, x_bytes=x.view(torch.uint8), dtype=torch.bfloat16, hidden=H, scales=None,
        topk_idx=idx, topk_weights=w, layout=None, handle=None, num_experts=E,
        num_worst_tokens=0, buffer_key=("k",))
    assert handle.relay is not None
    for dtype in dtypes:
        cn.combine(comm, x=torch.randn(rx.shape[0], H).to(dtype), handle=handle,
                   topk_weights=rw, bias=())
    cn.dispatch(comm, x_bytes=x.view(torch.uint8), dtype=torch.bfloat16, hidden=H,
                scales=None, topk_idx=None, topk_weights=None, layout=None, handle=handle,
                num_experts=None, num_worst_tokens=0, buffer_key=("k",))


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8", "float32"])
@pytest.mark.parametrize("worst", [0, 64])
@pytest.mark.parametrize("elastic", [False, True])
def test_normal_launches_pass_the_declared_arguments(recorder, dtype, worst, elastic):
    R, T, H, K, E = 4, 10, 256, 4, 16
    comm = _comm(R, elastic=elastic)
    x = torch.randn(T, H)
    data, scales = (x.to(torch.float8_e4m3fn), torch.rand(T, H // 128)) if dtype == "fp8" else \
        (x.to(getattr(torch, dtype)), None)
    idx = torch.randint(-1, E, (T, K))
    w = torch.rand(T, K)
    layout = cn.get_dispatch_layout(idx, E, R)
    assert [t.shape for t in layout] == [(R,), (E,), (T, R)]
    rx, rs, ri, rw, handle = cn.dispatch(
        comm, x_bytes=data.view(torch.uint8), dtype=data.dtype, hidden=H, scales=scales,
        topk_idx=idx, topk_weights=w, layout=None,
        handle=None, num_experts=E, num_worst_tokens=worst, buffer_key=("k",))
    rows = worst or 2 * R
    assert rx.shape == (rows, H) and rx.dtype == data.dtype
    assert ri.shape == (rows, K) and rw.shape == (rows, K)
    assert (rs is None) == (scales is None)
    y = torch.randn(rows, H).bfloat16()
    out, w_out = cn.combine(comm, x=y, handle=handle, topk_weights=rw,
                            bias=(torch.randn(T, H), torch.randn(T, H)))
    assert out.shape == (T, H) and out.dtype == torch.bfloat16 and w_out.shape == (T, K)
    cached = cn.dispatch(comm, x_bytes=data.view(torch.uint8), dtype=data.dtype, hidden=H,
                         scales=scales, topk_idx=None, topk_weights=None, layout=None,
                         handle=handle, num_experts=None, num_worst_tokens=worst,
                         buffer_key=("k",))
    assert cached[2] is None and cached[4] is handle
    _check(recorder)
    names = [c[0] for c in recorder]
    assert names.count("moe_notify") == 3 and names.count("moe_wait_done") == 3
    # elastic: after the fresh dispatch's notify, and at the end of each of the three calls
    assert names.count("moe_agree") == (4 if elastic else 0)


def _windows(calls, kernel):
    """``(chunk, first)`` of every launch of ``kernel`` among ``calls``."""
    return [(named["chunk"], named["first"]) for name, _, _, args in calls if name == kernel
            for named in [dict(zip(args.names, args.values))]]


@pytest.mark.parametrize("worst", [0, 12])
@pytest.mark.parametrize("elastic", [False, True])
def test_streamed_calls_launch_one_window_per_round(recorder, worst, elastic):
    """A heap smaller than one copy: dispatch, combine and the cached dispatch run in rounds,
    each a barrier notify (after the first), a send of one window, a wait, (elastic) an
    agreement and a copy of the window; the windows tile the region."""
    R, T, H, K, E = 4, 10, 4096, 4, 16          # 8 rows of 8 KiB to each rank (fake notify)
    comm = _comm(R, elastic=elastic, heap_bytes=32 << 10)
    comm.check = lambda: None     # the fake notify's matrix is read as is (worst: for combine)
    x = torch.randn(T, H).bfloat16()
    idx = torch.randint(-1, E, (T, K))
    state = {}

    def dispatch():
        state["out"] = cn.dispatch(
            comm, x_bytes=x.view(torch.uint8), dtype=x.dtype, hidden=H, scales=None,
            topk_idx=idx, topk_weights=torch.rand(T, K), layout=None, handle=None,
            num_experts=E, num_worst_tokens=worst, buffer_key=("k",))

    def combine():
        rx, _, _, rw, handle = state["out"]
        cn.combine(comm, x=torch.randn(rx.shape[0], H).bfloat16(), handle=handle,
                   topk_weights=rw, bias=())

    def cached():
        cn.dispatch(comm, x_bytes=x.view(torch.uint8), dtype=x.dtype, hidden=H, scales=None,
                    topk_idx=None, topk_weights=None, layout=None, handle=state["out"][4],
                    num_experts=None, num_worst_tokens=worst, buffer_key=("k",))

    rounds = {}
    for call, kernel, region in ((dispatch, "moe_dispatch_send", worst or 2 * R),
                                 (combine, "moe_combine_send", 2 * R),
                                 (cached, "moe_dispatch_send", worst or 2 * R)):
        start = len(recorder)
        call()
        sends = _windows(recorder[start:], kernel)
        chunk = sends[0][0]
        assert chunk > 0 and sends == [(chunk, r * chunk) for r in range(len(sends))], sends
        assert len(sends) >= 2 and (len(sends) - 1) * chunk < region <= len(sends) * chunk
        rounds[call.__name__] = len(sends)
    rx, handle = state["out"][0], state["out"][4]
    assert handle.streamed and rx.shape == (worst or 2 * R, H)
    _check(recorder)
    names = [c[0] for c in recorder]
    total = sum(rounds.values())
    assert names.count("moe_notify") == total and names.count("moe_wait_done") == total
    assert len(_windows(recorder, "moe_dispatch_copy_out")) == rounds["dispatch"] + \
        rounds["cached"]
    assert names.count("moe_combine_stage") == rounds["combine"]
    # elastic: after the fresh dispatch's notify, and at the end of every round
    assert names.count("moe_agree") == ((1 + total) if elastic else 0)


@pytest.mark.parametrize("fp8,ue8m0", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("elastic", [False, True])
def test_low_latency_launches_pass_the_declared_arguments(recorder, fp8, ue8m0, elastic):
    R, M, H, K, E = 4, 8, 512, 4, 16
    lay = LLLayout(M, H, R, E)
    comm = _comm(R, lay.nbytes, elastic)
    x = torch.randn(6, H).bfloat16()
    idx = torch.randint(-1, E, (6, K))
    w = torch.rand(6, K)
    L = E // R
    for call in range(4):                       # calls 3 and 4 add the flow-control waits
        h = cll.dispatch_send(comm, x=x, topk_idx=idx, lay=lay, use_fp8=fp8, round_scale=ue8m0,
                              buffer_key=("k",))
        recv_x = torch.empty(L, R * M, H, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        scales = torch.empty(L, R * M, H // 512, dtype=torch.int32) if ue8m0 else \
            torch.empty(L, R * M, H // 128) if fp8 else None
        stats = torch.zeros(L, dtype=torch.int64)
        cll.dispatch_recv(comm, h, lay, recv_x=recv_x, recv_scales=scales,
                          recv_count=torch.zeros(L, dtype=torch.int32), use_fp8=fp8,
                          use_ue8m0=ue8m0, stats=stats)
        assert h.received and h.recv_ranges.shape == (L, R, 2) and h.return_base.shape == (R,)
        seq, buf = cll.combine_send(comm, x=torch.randn(L, R * M, H).bfloat16(), handle=h,
                                    lay=lay)
        out = torch.empty(6, H, dtype=torch.bfloat16)
        assert cll.combine_recv(comm, seq, buf, lay, handle=h, topk_idx=idx, topk_weights=w,
                                out=out) is out
    _check(recorder)
    names = [c[0] for c in recorder]
    # waits: recv and combine-recv every call, send-side flow control from call 3 on
    assert names.count("moe_ll_wait") == 4 * 2 + 2 * 2
    assert names.count("moe_agree") == (4 * 2 if elastic else 0)    # both receive halves


def test_every_kernel_of_the_mode_variants_is_launched(recorder):
    """The two tests above between them launch every kernel the intranode and LL variants
    list; here in one compact run, so none escapes the argument check."""
    R, H, K, E, M = 2, 512, 2, 4, 4
    lay = LLLayout(M, H, R, E)
    comm = _comm(R, lay.nbytes, elastic=True)
    idx = torch.randint(0, E, (3, K))
    w = torch.rand(3, K)
    x = torch.randn(3, H)
    rx, _, _, rw, handle = cn.dispatch(
        comm, x_bytes=x.bfloat16().view(torch.uint8), dtype=torch.bfloat16, hidden=H,
        scales=None, topk_idx=idx, topk_weights=w, layout=None, handle=None, num_experts=E,
        num_worst_tokens=0, buffer_key=("k",))
    for dtype in cn.REDUCE_KERNEL:
        cn.combine(comm, x=torch.randn(rx.shape[0], H).to(dtype), handle=handle, topk_weights=rw,
                   bias=())
    small = _comm(R, elastic=True, heap_bytes=32 << 10)    # streams: combine_stage too
    big = torch.randn(3, 4096).bfloat16()                  # 4 rows of 8 KiB to each rank
    _, _, _, srw, shandle = cn.dispatch(
        small, x_bytes=big.view(torch.uint8), dtype=torch.bfloat16, hidden=4096,
        scales=None, topk_idx=idx, topk_weights=w, layout=None, handle=None, num_experts=E,
        num_worst_tokens=0, buffer_key=("k",))
    cn.combine(small, x=torch.randn(2 * R, 4096).bfloat16(), handle=shandle, topk_weights=srw,
               bias=())
    for fp8 in (False, True):
        h = cll.dispatch_send(comm, x=x.bfloat16(), topk_idx=idx, lay=lay, use_fp8=fp8,
                              round_scale=False, buffer_key=("k",))
        L = E // R
        cll.dispatch_recv(comm, h, lay,
                          recv_x=torch.empty(L, R * M, H, dtype=torch.float8_e4m3fn if fp8
                                             else torch.bfloat16),
                          recv_scales=torch.empty(L, R * M, H // 128) if fp8 else None,
                          recv_count=torch.zeros(L, dtype=torch.int32), use_fp8=fp8,
                          use_ue8m0=False, stats=None)
        seq, buf = cll.combine_send(comm, x=torch.randn(L, R * M, H).bfloat16(), handle=h,
                                    lay=lay)
        cll.combine_recv(comm, seq, buf, lay, handle=h, topk_idx=idx, topk_weights=w,
                         out=torch.empty(3, H, dtype=torch.bfloat16))
    _relay_calls(4, H, K, 2 * E, list(cn.REDUCE_KERNEL))
    _check(recorder)
    listed = set(variants.INTRANODE_KERNELS)
    for v in (variants.ll_dispatch_send(H, False, False),
              variants.ll_dispatch_send(H, True, False),          # + the fp8 cast kernel
              variants.ll_dispatch_recv(H, False, False), variants.ll_combine(H)):
        listed |= set(v.kernels)
    assert {c[0] for c in recorder} == listed
