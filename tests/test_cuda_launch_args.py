"""Every kernel launch of the CUDA backend passes what the kernel declares (CPU, no GPU).

The backend's Python side (moe_comm/cuda/normal.py, ll.py) runs here against a CudaComm on the
CPU "device" with a recording ``launch``: each recorded call is checked against the kernel's
signature parsed from csrc/kernels (argument count, and pointer vs. int64 in every position),
and every kernel it asks for must be one its variant lists. Catches drift between the host
code and the kernels without a GPU.
"""
from __future__ import annotations

import re

import pytest
import torch

from moe_comm.cuda import elastic as cel
from moe_comm.cuda import ll as cll
from moe_comm.cuda import normal as cn
from moe_comm.cuda.comm import CudaComm
from moe_comm.jit.cache import kernel_dir
from moe_comm.jit.variants import THREADS
from moe_comm.wire import LLLayout


# `MOE_KERNEL void __launch_bounds__(MOE_THREADS_X, 1) name(` (the bound is optional here)
KERNEL_HEAD = r"MOE_KERNEL void (?:__launch_bounds__\([^)]*\)\s+)?"


def _signatures() -> dict:
    """{kernel: ["ptr" | "int", ...]} from the extern "C" kernels of every .cu/.cuh file."""
    sigs = {}
    files = [*kernel_dir().glob("*.cu"), *kernel_dir().glob("*.cuh")]
    texts = [f.read_text().replace("\\\n", " ") for f in files]
    defines = {}                      # argument macros, wherever they are defined
    for text in texts:
        defines.update(re.findall(r"#define (MOE_\w+_ARGS) ([^\n]*)", text))

    def kinds(params):
        for name, body in defines.items():
            params = params.replace(name, body)
        return ["ptr" if "*" in p else "int" for p in params.split(",") if p.strip()]

    for text in texts:
        for name, params in re.findall(KERNEL_HEAD + r"(\w+)\(([^)]*)\)", text):
            if name != "NAME":
                sigs[name] = kinds(params)
        macro = re.search(r"#define MOE_REDUCE_KERNEL\(NAME, ELEM, THREADS\)\s*" + KERNEL_HEAD +
                          r"NAME\(([^)]*)\)", text)
        for inst in re.findall(r"^MOE_REDUCE_KERNEL\((\w+), \w+, \w+\)", text, re.M):
            sigs[inst] = kinds(macro.group(1))
    return sigs


SIGS = _signatures()


@pytest.fixture
def recorder(monkeypatch):
    calls = []

    def fake_load(variant, device):
        return {name: name for name in variant.kernels}

    def fake_launch(kernel, grid, block, *args, shmem=0, device=None, stream=None):
        calls.append((kernel, grid, block, args))
        # the count matrix notify would produce (its last ten arguments: call_off, signature)
        if kernel == "moe_notify" and isinstance(args[-10], torch.Tensor):
            args[-10].fill_(2)
        if kernel == "moe_layout" and isinstance(args[4], torch.Tensor):
            args[4].fill_(1)

    monkeypatch.setattr(cn, "load_kernels", fake_load)            # the layout kernel
    monkeypatch.setattr(CudaComm, "kernels", lambda self, variant: fake_load(variant, None))
    for mod in (cn, cll, cel):
        monkeypatch.setattr(mod, "launch", fake_launch)
    return calls


def _check(calls):
    assert calls
    for kernel, grid, block, args in calls:
        sig = SIGS[kernel]
        assert len(args) == len(sig), (kernel, len(args), len(sig))
        for i, (a, kind) in enumerate(zip(args, sig)):
            if kind == "ptr":
                assert a is None or isinstance(a, torch.Tensor), (kernel, i, type(a))
            else:
                assert isinstance(a, (int, bool)) and not isinstance(a, torch.Tensor), \
                    (kernel, i, type(a))
        # every launch uses the block its kernel is compiled for (__launch_bounds__)
        assert block == THREADS[kernel], (kernel, block)
        dims = (grid,) if isinstance(grid, int) else grid
        assert all(isinstance(d, int) and d >= 1 for d in dims), (kernel, grid)


def _comm(num_ranks, ll_bytes=0, elastic=False):
    return CudaComm(rank=0, num_ranks=num_ranks, device="cpu", pointers=[0] * num_ranks,
                    heap_bytes=64 << 20, ll_bytes=ll_bytes, timeout_s=1.0,
                    own_allocation=False, opened=[], elastic=elastic)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8", "float32"])
@pytest.mark.parametrize("worst", [0, 64])
@pytest.mark.parametrize("elastic", [False, True])
def test_normal_launches_match_kernel_signatures(recorder, dtype, worst, elastic):
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
                         scales=scales, topk_idx=None, topk_weights=None, layout=None, handle=handle, num_experts=None,
                         num_worst_tokens=worst, buffer_key=("k",))
    assert cached[2] is None and cached[4] is handle
    _check(recorder)
    names = [c[0] for c in recorder]
    assert names.count("moe_notify") == 3 and names.count("moe_wait_done") == 3
    # elastic: after the fresh dispatch's notify, and at the end of each of the three calls
    assert names.count("moe_agree") == (4 if elastic else 0)


@pytest.mark.parametrize("fp8,ue8m0", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("elastic", [False, True])
def test_low_latency_launches_match_kernel_signatures(recorder, fp8, ue8m0, elastic):
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
