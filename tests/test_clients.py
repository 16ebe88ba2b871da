"""DeepEP's clients, replayed call by call on real rank processes (host backend).

Each replay issues the calls a client makes, with the arguments it passes, in its order
(read from the client's source, written here in our own words):

* vLLM's high-throughput prepare/finalize: a Buffer built as its all2all manager builds one,
  ``get_dispatch_layout`` -> ``dispatch`` of fp8 tokens with float32 block scales [T, H/128]
  (``expert_alignment=1``, the dispatch config for the group size, ``previous_event`` from
  ``Buffer.capture()``, ``async_finish``), the receiver's ``event.current_stream_wait()``,
  expert outputs weighted on the expert side, ``combine(topk_weights=None)``; one handle per
  micro-batch; and the fixed-shape variant (``num_worst_tokens``).
* vLLM's low-latency manager: a Buffer with ``enable_shrink``, ``explicitly_destroy``,
  ``num_qps_per_rank = E/R``; two micro-batches in flight on the two LL buffers
  (``return_recv_hook``, fp8 with ``round_scale`` and ``use_ue8m0``, ``out=``), then the
  fault-tolerance query ``low_latency_query_mask_buffer``; and DeepEP's shrink test where a
  rank dies when it reaches ``clean_low_latency_buffer``.
* SGLang's DeepEP token dispatcher in "auto" mode: one Buffer sized from
  ``Config.get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint`` at 4096 tokens x 7168
  hidden bf16 on 4 ranks plus the LL hint, normal (prefill) and LL (decode) steps in turns
  with ``clean_low_latency_buffer`` whenever LL follows normal, and an idle rank sending 0
  tokens.
* Megatron-Core's fused all-to-all: its ``FusedDispatch`` / ``FusedCombine`` autograd pattern
  (combine with ``topk_weights=grad_probs`` as dispatch's backward, cached dispatch as
  combine's) on its hint-sized Buffer, gradients against a pure-torch reference, and
  moe_comm.nn.autograd against the same reference.

The checks are DeepEP's own test checks: rank-valued rows (every channel holds the source
rank, the last 128 the token's index), per-rank and per-expert counts, the prefix matrix
``handle[0]``, combine of unchanged rows = x times the ranks visited, output hashes equal
across repeats, and the LL per-token values through ``src_info`` / ``layout_range``.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import cuda_cases
from inputs import per_block_fp8
from ranks import run_ranks

from moe_comm import Buffer
from moe_comm.jit import emulator
from moe_comm.nn import autograd as moe_autograd
from moe_comm.quant import dequantize_fp8, unpack_ue8m0
from moe_comm.wire import agree_rounds

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIM = ROOT / "moe_comm" / "deep_ep_shim"
TAIL = 128              # the last 128 channels carry the token's index


# -- DeepEP's test inputs and checks, shared by the replays -----------------------------------
def rank_valued_tokens(rank: int, num_tokens: int, hidden: int) -> torch.Tensor:
    """bf16 [T, H]: every channel holds ``rank``, the last 128 the token index modulo 256
    (bf16 holds integers up to 256 exactly), so every received row names its source."""
    x = torch.full((num_tokens, hidden), float(rank))
    x[:, -TAIL:] = (torch.arange(num_tokens) % 256).float()[:, None]
    return x.bfloat16()


def routing(rank: int, num_tokens: int, num_experts: int, topk: int, seed: int):
    """DeepEP's routing: top-k of random scores, about 10% of slots -1; float32 weights."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    idx = scores.topk(topk, dim=-1, sorted=False).indices
    idx[torch.rand(idx.shape, generator=gen) < 0.1] = -1
    weights = torch.rand(num_tokens, topk, generator=gen)
    return idx, weights


def in_rank_of(idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """bool [T, R]: whether a token has an expert on each rank."""
    local = num_experts // num_ranks
    owner = torch.where(idx >= 0, idx // local, -1)
    return torch.stack([(owner == r).any(1) for r in range(num_ranks)], 1)


def output_hash(t: torch.Tensor) -> str:
    """A digest of a tensor's bytes (DeepEP compares hashes of outputs across repeated runs
    to catch nondeterminism); read in place, no copy of a large receive region."""
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy()).hexdigest()


def gather_counts(per_rank: torch.Tensor) -> torch.Tensor:
    """int32 [R, R] count matrix (row = source) from every rank's num_tokens_per_rank."""
    rows = [torch.empty_like(per_rank) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, per_rank.contiguous())
    return torch.stack(rows)


def check_normal_receive(rank, recv_x, recv_idx, counts, prefix, idx_of, num_experts,
                         num_tokens_of):
    """DeepEP's normal-mode checks on one receiver: the prefix matrix is the column sums of
    the count matrix; rows from source s sit at [prefix[s-1], prefix[s]) and hold s (the
    last 128 channels: the source's token indices, in order); top-k ids are local."""
    num_ranks = counts.shape[0]
    assert prefix.dtype == torch.int32 and torch.equal(prefix, counts.cumsum(0).int()), \
        "handle[0] is not the prefix sum of the count matrix over source ranks"
    local = num_experts // num_ranks
    for s in range(num_ranks):
        lo, hi = (int(prefix[s - 1, rank]) if s else 0), int(prefix[s, rank])
        rows = recv_x[lo:hi]
        assert (rows[:, :-TAIL] == s).all(), f"rows from rank {s} do not hold {s}"
        sent = in_rank_of(idx_of(s), num_experts, num_ranks)[:, rank].nonzero().flatten()
        assert hi - lo == sent.numel() <= num_tokens_of(s)
        assert torch.equal(rows[:, -1].float(), (sent % 256).float()), \
            f"token order from rank {s}"
        want = idx_of(s)[sent]
        want = torch.where(want // local == rank, want - rank * local, -1)
        assert torch.equal(recv_idx[lo:hi], want), f"top-k ids from rank {s}"


def weighted_sum(idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, 1] sum of each token's weights over its valid slots."""
    return torch.where(idx >= 0, weights, 0.0).sum(1, keepdim=True)


# -- 1. vLLM: high-throughput prepare/finalize ----------------------------------------------
VLLM_RANK_CONFIGS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)   # sizes with a tuned config
HT = dict(hidden=512, experts=12, topk=4, tokens=(40, 0, 33), seed=3)


def vllm_ht_buffer(group, buffer_mb: int) -> Buffer:
    """The intranode Buffer of vLLM's high-throughput manager (VLLM_DEEPEP_BUFFER_SIZE_MB)."""
    buf = Buffer(group=group, num_nvl_bytes=buffer_mb << 20, num_rdma_bytes=0,
                 low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)
    Buffer.set_num_sms(20)
    return buf


def vllm_config(num_ranks: int, which):
    return which(num_ranks) if num_ranks in VLLM_RANK_CONFIGS else None


def vllm_ht_prepare(buf, tokens, scales, topk_idx, topk_weights, num_experts,
                    num_worst_tokens=0):
    """vLLM's _do_dispatch + receiver: layout, fp8 dispatch (tuple of data and block
    scales), wait on the event where there is one, local ids moved to global ones."""
    previous = buf.capture()
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(
        topk_idx=topk_idx, num_experts=num_experts, previous_event=previous,
        async_finish=False, allocate_on_comm_stream=False)
    extra = dict(num_worst_tokens=num_worst_tokens) if num_worst_tokens else {}
    (recv, recv_ids, recv_weights, per_expert_list, handle, event) = buf.dispatch(
        x=(tokens, scales), handle=None, num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
        expert_alignment=1, config=vllm_config(buf.group_size, Buffer.get_dispatch_config),
        previous_event=previous, async_finish=True, allocate_on_comm_stream=False, **extra)
    if event.event is not None:
        event.current_stream_wait()
    offset = buf.rank * (num_experts // buf.group_size)
    # vLLM's kernels want every id valid: -1 goes to an expert of another rank
    global_ids = torch.where(recv_ids == -1, num_experts - 1 if offset == 0 else 0,
                             recv_ids + offset)
    return dict(recv=recv, recv_ids=recv_ids, global_ids=global_ids, weights=recv_weights,
                per_expert_list=per_expert_list, handle=handle, per_rank=per_rank,
                per_expert=per_expert, in_rank=in_rank)


def vllm_experts(prep, num_experts, num_ranks):
    """The experts (identity after dequantisation), weighted and summed per row on the
    expert side as vLLM's TopKWeightAndReduce does: HT combine gets no weights."""
    data, scales = prep["recv"]
    rows = dequantize_fp8(data, scales)
    local = num_experts // num_ranks
    mine = prep["global_ids"] // local == dist.get_rank()
    mine &= prep["recv_ids"] >= 0
    weight = torch.where(mine, prep["weights"], 0.0).sum(1, keepdim=True)
    return (rows * weight).bfloat16()


def vllm_ht_finalize(buf, output, expert_out, handle):
    combined, _, event = buf.combine(
        x=expert_out, handle=handle, topk_weights=None,
        config=vllm_config(buf.group_size, Buffer.get_combine_config),
        previous_event=buf.capture(), async_finish=True, allocate_on_comm_stream=False)
    if event.event is not None:
        event.current_stream_wait()
    output.copy_(combined, non_blocking=True)


def _vllm_ht_worker(rank, n, case):
    buf = vllm_ht_buffer(dist.group.WORLD, buffer_mb=32)
    t, h, e = case["tokens"][rank], case["hidden"], case["experts"]
    x = rank_valued_tokens(rank, t, h)
    tokens, scales = per_block_fp8(x)
    idx, w = routing(rank, t, e, case["topk"], case["seed"])
    out, hashes = {}, []
    handles = [None, None]                 # vLLM keeps one handle per micro-batch
    for ubatch in (0, 1):
        prep = vllm_ht_prepare(buf, tokens, scales, idx, w, e)
        handles[ubatch] = prep["handle"]
        hashes.append(output_hash(prep["recv"][0]) + output_hash(prep["recv"][1]))
        output = torch.empty(t, h, dtype=torch.bfloat16)
        vllm_ht_finalize(buf, output, vllm_experts(prep, e, n), handles[ubatch])
        out[f"combined{ubatch}"] = output
    counts = gather_counts(prep["per_rank"])
    # DeepEP's own check: combine of the unchanged rows = x times the ranks visited
    plain = dequantize_fp8(*prep["recv"]).bfloat16()
    unweighted, _, _ = buf.combine(plain, prep["handle"])
    out.update(hashes=hashes, counts=counts, prefix=prep["handle"][0].clone(),
               recv=dequantize_fp8(*prep["recv"]).round(),       # block scales: 1e-6 off
               recv_ids=prep["recv_ids"].clone(),
               per_expert_list=prep["per_expert_list"], per_rank=prep["per_rank"],
               per_expert=prep["per_expert"], in_rank=prep["in_rank"], unweighted=unweighted)
    # the fixed-shape variant (CUDA graphs): exactly num_worst_tokens rows, no count list
    worst = sum(case["tokens"])
    fixed = vllm_ht_prepare(buf, tokens, scales, idx, w, e, num_worst_tokens=worst)
    output = torch.empty(t, h, dtype=torch.bfloat16)
    vllm_ht_finalize(buf, output, vllm_experts(fixed, e, n), fixed["handle"])
    out.update(worst_rows=fixed["recv"][0].shape[0], worst_list=fixed["per_expert_list"],
               worst_pad_ids=fixed["recv_ids"][int(counts[:, rank].sum()):].clone(),
               worst_combined=output)
    buf.destroy()
    return out


def test_vllm_high_throughput_prepare_finalize():
    case, n = HT, len(HT["tokens"])
    results = run_ranks(_vllm_ht_worker, n, case, timeout=120)
    e, k = case["experts"], case["topk"]
    ins = [routing(r, case["tokens"][r], e, k, case["seed"]) for r in range(n)]
    counts = torch.stack([in_rank_of(ins[s][0], e, n).sum(0) for s in range(n)]).int()
    for rank, got in enumerate(results):
        idx, w = ins[rank]
        x = rank_valued_tokens(rank, case["tokens"][rank], case["hidden"]).float()
        in_rank = in_rank_of(idx, e, n)
        assert torch.equal(got["counts"], counts)
        assert torch.equal(got["in_rank"], in_rank)
        assert torch.equal(got["per_rank"], in_rank.sum(0).int())
        assert torch.equal(got["per_expert"],
                           torch.bincount(idx[idx >= 0], minlength=e).int())
        check_normal_receive(rank, got["recv"], got["recv_ids"], counts, got["prefix"],
                             lambda s: ins[s][0], e, lambda s: case["tokens"][s])
        ids = got["recv_ids"]
        want = torch.bincount(ids[ids >= 0], minlength=e // n).tolist()
        assert got["per_expert_list"] == want          # expert_alignment=1: exact counts
        assert got["hashes"][0] == got["hashes"][1], "dispatch output differs on a repeat"
        want_y = x * weighted_sum(idx, w)
        for key in ("combined0", "combined1", "worst_combined"):
            torch.testing.assert_close(got[key].float(), want_y, rtol=2e-2, atol=2e-2)
        assert torch.equal(got["unweighted"].float(),
                           (x * in_rank.sum(1, keepdim=True)).bfloat16().float())
        assert got["worst_rows"] == sum(case["tokens"]) and got["worst_list"] == []
        assert (got["worst_pad_ids"] == -1).all()


# -- 2. vLLM: the low-latency manager ----------------------------------------------------------
LL = dict(hidden=2048, experts=8, topk=4, max_tokens=64, tokens=(64, 23, 0, 50), seed=5)


def vllm_ll_buffer(group, case, num_ranks, timeout_s=30.0) -> Buffer:
    """vLLM's DeepEPLLAll2AllManager kwargs, with its fault-tolerance enable_shrink."""
    rdma = Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=case["max_tokens"], hidden=case["hidden"],
        num_ranks=num_ranks, num_experts=case["experts"])
    return Buffer(group=group, num_nvl_bytes=8 << 20, num_rdma_bytes=rdma,
                  low_latency_mode=True, num_qps_per_rank=case["experts"] // num_ranks,
                  allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                  explicitly_destroy=True, enable_shrink=True, timeout_s=timeout_s)


def vllm_ll_prepare(buf, x, topk_ids, case):
    """prepare_async: fp8 dispatch with UE8M0-packed scales (a DeepGEMM that takes them),
    the receive left to the returned hook."""
    recv, counts, handle, _, hook = buf.low_latency_dispatch(
        x, topk_ids, case["max_tokens"], case["experts"], use_fp8=True, round_scale=True,
        use_ue8m0=True, async_finish=False, return_recv_hook=True)
    return recv, counts, handle, hook


def ll_expert_rows(recv) -> torch.Tensor:
    """The experts: identity on the dequantised rows, bf16 out ([E/R, R*M, H])."""
    data, packed = recv
    return dequantize_fp8(data, unpack_ue8m0(packed)).bfloat16()


def ll_row_sources(handle, counts):
    """[(local expert, row, source rank, source token)] of every received row, from DeepEP's
    handle fields: layout_range packs (begin << 32 | rows) per source rank."""
    src_info, layout_range = handle[0], handle[1]
    rows = []
    for le in range(layout_range.shape[0]):
        for s in range(layout_range.shape[1]):
            begin, num = int(layout_range[le, s]) >> 32, int(layout_range[le, s]) & 0xFFFFFFFF
            rows += [(le, i, s, int(src_info[le, i])) for i in range(begin, begin + num)]
        assert len([r for r in rows if r[0] == le]) == int(counts[le])
    return rows


def check_ll_rows(rank, recv_rows, rows, idx_of, num_experts, num_ranks, exact):
    """DeepEP's LL per-token check: row i of local expert le from source s, token t holds s
    in every channel and t in the last 128, and t did pick that expert."""
    local = num_experts // num_ranks
    for le, i, s, t in rows:
        assert (idx_of(s)[t] == rank * local + le).any(), (le, i, s, t)
        row = recv_rows[le, i].float()
        want = torch.full_like(row, float(s))
        want[-TAIL:] = float(t % 256)
        if exact:
            assert torch.equal(row, want), (le, i, s, t)
        else:       # e4m3 with a power-of-two scale: within 1/16 of the value
            assert ((row - want).abs() <= want.abs() / 16 + 1e-6).all(), (le, i, s, t)


def _vllm_ll_worker(rank, n, case):
    buf = vllm_ll_buffer(dist.group.WORLD, case, n)
    t, e = case["tokens"][rank], case["experts"]
    x = rank_valued_tokens(rank, t, case["hidden"])
    ubatches = [routing(rank, t, e, case["topk"], case["seed"] + u) for u in (0, 1)]
    # DBO: both micro-batches' dispatches in flight at once, on the two LL buffers
    sent = [vllm_ll_prepare(buf, x, idx, case) for idx, _ in ubatches]
    out = {}
    for u, (recv, counts, handle, hook) in enumerate(sent):
        hook()
        out[f"rows{u}"] = ll_row_sources(handle, counts)
        out[f"recv{u}"] = ll_expert_rows(recv)
        out[f"counts{u}"] = counts.clone()
    outputs = [torch.empty(t, case["hidden"], dtype=torch.bfloat16) for _ in (0, 1)]
    hooks = []
    for u, (recv, _, handle, _) in enumerate(sent):
        idx, w = ubatches[u]
        _, _, hook = buf.low_latency_combine(out[f"recv{u}"], idx, w, handle,
                                             async_finish=False, zero_copy=False,
                                             return_recv_hook=True, out=outputs[u])
        hooks.append(hook)
    for hook in hooks:
        hook()
    out["combined"] = outputs
    mask_status = torch.full((n,), 9, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(mask_status)
    out["mask_status"] = mask_status
    buf.destroy()
    return out


def test_vllm_low_latency_micro_batches():
    case, n = LL, len(LL["tokens"])
    results = run_ranks(_vllm_ll_worker, n, case, timeout=120)
    e = case["experts"]
    for u in (0, 1):
        ins = [routing(r, case["tokens"][r], e, case["topk"], case["seed"] + u)
               for r in range(n)]
        for rank, got in enumerate(results):
            want = sum(torch.bincount(i[i >= 0], minlength=e) for i, _ in ins)
            assert got[f"counts{u}"].tolist() == want.view(n, -1)[rank].tolist(), (u, rank)
            check_ll_rows(rank, got[f"recv{u}"], got[f"rows{u}"], lambda s: ins[s][0], e, n,
                          exact=False)
            idx, w = ins[rank]
            x = rank_valued_tokens(rank, case["tokens"][rank], case["hidden"]).float()
            torch.testing.assert_close(got["combined"][u].float(), x * weighted_sum(idx, w),
                                       rtol=1 / 8, atol=1e-2)
    for got in results:
        assert got["mask_status"].tolist() == [0] * n


SHRINK = dict(LL, hidden=512, tokens=(30, 12, 0, 41))


def _shrink_clean_worker(rank, n, case, victim, timeout_s):
    buf = vllm_ll_buffer(dist.group.WORLD, case, n, timeout_s=timeout_s)
    t, e = case["tokens"][rank], case["experts"]
    x = rank_valued_tokens(rank, t, case["hidden"])
    idx, w = routing(rank, t, e, case["topk"], case["seed"])
    recv, counts, handle, _, _ = buf.low_latency_dispatch(x, idx, case["max_tokens"], e,
                                                          use_fp8=False)
    buf.low_latency_combine(recv, idx, w, handle)
    if rank == victim:
        os._exit(0)                     # DeepEP's shrink test: it fails when it reaches clean
    started = time.monotonic()
    buf.clean_low_latency_buffer(case["max_tokens"], case["hidden"], e)
    clean_s = time.monotonic() - started
    mask_status = torch.zeros(n, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(mask_status)
    recv, counts, handle, _, _ = buf.low_latency_dispatch(x, idx, case["max_tokens"], e,
                                                          use_fp8=False)
    combined, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    out = dict(clean_s=clean_s, mask_status=mask_status, counts=counts.clone(),
               combined=combined.float())
    buf.destroy()
    return out


@pytest.mark.parametrize("backend", ["host", "cuda_emulated"])
def test_shrink_clean_after_a_rank_died_is_bounded(backend, monkeypatch):
    """A rank dies when it reaches clean_low_latency_buffer: the survivors' clean masks it
    within its deadline (no barrier on the dead rank: on the CUDA backend a dist.barrier
    would wait out the process group's own timeout), the mask query says so, and the LL
    calls go on among the survivors. ``cuda_emulated``: the same Buffer calls on the CUDA
    backend in the kernel emulator, with the emulated elastic checks' 4 s deadline."""
    case, n, victim = SHRINK, len(SHRINK["tokens"]), 1
    timeout_s = 2.0
    if backend == "cuda_emulated":
        if not emulator.available():
            pytest.skip("the kernel emulator needs a C++ compiler (g++)")
        monkeypatch.setenv("MOE_COMM_CPU_BACKEND", "emulator")   # inherited by the ranks
        cuda_cases.preload("cpu", n, {case["hidden"]}, ll=True)
        timeout_s = 4.0
    results = run_ranks(_shrink_clean_worker, n, case, victim, timeout_s, timeout=120,
                        expect_exit=(victim,))
    # the first meet's agreement: a round waits the deadline plus a grace (at most 1 s) for
    # the dead rank, then at most every other round decides; the second meet is quick
    bound = agree_rounds(n) * (timeout_s + min(timeout_s, 1.0))
    e, local = case["experts"], case["experts"] // n
    ins = [routing(r, case["tokens"][r], e, case["topk"], case["seed"]) for r in range(n)]
    alive = [r for r in range(n) if r != victim]
    for rank in alive:
        got = results[rank]
        assert got["clean_s"] < bound, f"clean took {got['clean_s']:.1f} s"
        assert got["mask_status"].tolist() == [int(r == victim) for r in range(n)]
        want = sum(torch.bincount(ins[s][0][ins[s][0] >= 0], minlength=e) for s in alive)
        assert got["counts"].tolist() == want[rank * local:(rank + 1) * local].tolist()
        idx, w = ins[rank]
        kept = (idx >= 0) & (idx // local != victim)
        x = rank_valued_tokens(rank, case["tokens"][rank], case["hidden"]).float()
        torch.testing.assert_close(got["combined"], x * torch.where(kept, w, 0.0).sum(
            1, keepdim=True), rtol=2e-2, atol=1e-2)


# -- 3. SGLang: the DeepEP token dispatcher in auto mode ------------------------------------
SGLANG = dict(hidden=7168, experts=32, topk=8, max_tokens=128, seed=11,
              prefill=(4096, 4096, 0, 4096), decode=(128, 37, 0, 128))


def sglang_buffer(group, case, num_ranks, param_bytes=2) -> Buffer:
    """SGLang's DeepEPBuffer.get_deepep_buffer for auto mode: the larger of the dispatch and
    combine configs' NVL/RDMA hints for hidden_size * param_bytes, the LL hint, and
    num_qps_per_rank = max(num_sms, E/R)."""
    hidden_bytes = case["hidden"] * param_bytes
    nvl = rdma = 0
    for config in (Buffer.get_dispatch_config(num_ranks),
                   Buffer.get_combine_config(num_ranks)):
        nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks), nvl)
        rdma = max(config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks), rdma)
    rdma = max(Buffer.get_low_latency_rdma_size_hint(case["max_tokens"], case["hidden"],
                                                     num_ranks, case["experts"]), rdma)
    return Buffer(group, nvl, rdma, low_latency_mode=True,
                  num_qps_per_rank=max(Buffer.num_sms, case["experts"] // num_ranks),
                  allow_mnnvl=True, timeout_s=60)


class SGLangAutoDispatcher:
    """The mode switch of SGLang's DeepEPBuffer: the LL buffer is cleaned whenever a
    low-latency step follows a normal one."""

    def __init__(self, buf, case):
        self.buf, self.case, self.mode, self.cleans = buf, case, None, 0

    def enter(self, mode: str) -> None:
        if mode == "low_latency" and self.mode == "normal":
            self.buf.clean_low_latency_buffer(self.case["max_tokens"], self.case["hidden"],
                                              self.case["experts"])
            self.cleans += 1
        self.mode = mode

    def normal_step(self, x, topk_ids, topk_weights, async_finish):
        """dispatch_a/b + combine_a/b of _DeepEPDispatcherImplNormal (DeepGEMM on: expert
        alignment 128), the experts the identity."""
        self.enter("normal")
        buf = self.buf
        previous = Buffer.capture() if async_finish else None
        per_rank, per_rdma_rank, per_expert, in_rank, previous = buf.get_dispatch_layout(
            topk_ids, self.case["experts"], previous_event=previous,
            async_finish=async_finish, allocate_on_comm_stream=previous is not None)
        recv_x, recv_ids, _, per_expert_list, handle, event = buf.dispatch(
            x, topk_idx=topk_ids, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, previous_event=previous,
            async_finish=async_finish,
            allocate_on_comm_stream=(previous is not None) and async_finish,
            expert_alignment=128, config=None)
        if async_finish:
            event.current_stream_wait()
        step = dict(recv_x=recv_x, recv_ids=recv_ids, per_expert_list=per_expert_list,
                    handle=handle, per_rank=per_rank)
        previous = Buffer.capture() if async_finish else None
        combined, _, event = buf.combine(recv_x, handle, async_finish=async_finish,
                                         previous_event=previous,
                                         allocate_on_comm_stream=previous is not None,
                                         config=None)
        if async_finish:
            event.current_stream_wait()
        step["combined"] = combined
        return step

    def low_latency_step(self, x, topk_ids, topk_weights, return_recv_hook):
        """dispatch_a/b + combine_a/b of _DeepEPDispatcherImplLowLatency (bf16 output)."""
        self.enter("low_latency")
        buf, case = self.buf, self.case
        expected_m = (x.shape[0] * buf.group_size * topk_ids.shape[1] + case["experts"]) // \
            case["experts"]
        recv, masked_m, handle, event, hook = buf.low_latency_dispatch(
            x, topk_ids, case["max_tokens"], case["experts"], use_fp8=False,
            async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
        hook() if return_recv_hook else event.current_stream_wait()
        step = dict(recv=recv.clone(), masked_m=masked_m.clone(), expected_m=expected_m,
                    rows=ll_row_sources(handle, masked_m))
        combined, event, hook = buf.low_latency_combine(
            x=recv, topk_idx=topk_ids, topk_weights=topk_weights, handle=handle,
            async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
        hook() if return_recv_hook else event.current_stream_wait()
        step["combined"] = combined
        return step


def check_sglang_normal(rank, step, idx_of, case, num_tokens_of):
    counts = gather_counts(step["per_rank"])
    check_normal_receive(rank, step["recv_x"], step["recv_ids"], counts, step["handle"][0],
                         idx_of, case["experts"], num_tokens_of)
    ids = step["recv_ids"]
    exact = torch.bincount(ids[ids >= 0], minlength=case["experts"] // len(counts))
    assert step["per_expert_list"] == ((exact + 127) // 128 * 128).tolist()
    return counts


def _sglang_worker(rank, n, case):
    buf = sglang_buffer(dist.group.WORLD, case, n)
    dispatcher = SGLangAutoDispatcher(buf, case)
    e, k, h = case["experts"], case["topk"], case["hidden"]

    # every rank's routing, to check what arrives from each source
    routes = {phase: [routing(s, case[phase][s], e, k, case["seed"]) for s in range(n)]
              for phase in ("prefill", "decode")}
    out = dict(hashes=[])
    for turn in (0, 1):                           # normal, LL, normal, LL: auto mode
        x = rank_valued_tokens(rank, case["prefill"][rank], h)
        idx, w = routes["prefill"][rank]
        step = dispatcher.normal_step(x, idx, w, async_finish=bool(turn))
        check_sglang_normal(rank, step, lambda s: routes["prefill"][s][0], case,
                            lambda s: case["prefill"][s])
        visited = in_rank_of(idx, e, n).sum(1, keepdim=True)
        assert torch.equal(step["combined"], (x.float() * visited).bfloat16()), \
            "combine of unchanged rows is not x times the ranks visited"
        out["hashes"].append(output_hash(step["recv_x"]))
        del step
        x = rank_valued_tokens(rank, case["decode"][rank], h)
        idx, w = routes["decode"][rank]
        step = dispatcher.low_latency_step(x, idx, w, return_recv_hook=not turn)
        check_ll_rows(rank, step["recv"], step["rows"], lambda s: routes["decode"][s][0],
                      e, n, exact=True)
        torch.testing.assert_close(step["combined"].float(),
                                   x.float() * weighted_sum(idx, w), rtol=2e-2, atol=2e-2)
        out[f"masked_m{turn}"] = step["masked_m"]
    out["cleans"] = dispatcher.cleans
    out["nvl_bytes"], out["rdma_bytes"] = buf.num_nvl_bytes, buf.num_rdma_bytes
    buf.destroy()
    return out


def test_sglang_auto_mode_with_hint_sized_buffer():
    """4096 tokens x 7168 hidden bf16 on 4 ranks (one idle) through a Buffer sized by
    SGLang's Config hints: the largest receive region is larger than the heap, so it
    streams through it (moe_comm/host/normal.py); LL decode steps in between."""
    case, n = SGLANG, len(SGLANG["prefill"])
    results = run_ranks(_sglang_worker, n, case, timeout=240)
    e = case["experts"]
    ins = [routing(r, case["decode"][r], e, case["topk"], case["seed"]) for r in range(n)]
    want = sum(torch.bincount(i[i >= 0], minlength=e) for i, _ in ins).view(n, -1)
    for rank, got in enumerate(results):
        assert got["cleans"] == 2                    # normal -> LL, twice
        assert got["hashes"][0] == got["hashes"][1], "normal dispatch differs on a repeat"
        for turn in (0, 1):
            assert got[f"masked_m{turn}"].tolist() == want[rank].tolist()
    # the batch is larger than the hint-sized heap: rank 0's receive region streamed
    received = sum(int(in_rank_of(routing(s, case["prefill"][s], e, case["topk"],
                                          case["seed"])[0], e, n)[:, 0].sum())
                   for s in range(n))
    assert received * case["hidden"] * 2 > results[0]["nvl_bytes"]


# -- 4. Megatron-Core: fused dispatch/combine as autograd ----------------------------------
_megatron_buffer = None


def megatron_hidden_bytes(x: torch.Tensor) -> int:
    return x.size(1) * max(x.element_size(), 2)


def megatron_get_buffer(group, hidden_bytes: int) -> Buffer:
    """Megatron's get_buffer: one Buffer per process, rebuilt when the group changes or the
    configs' hints outgrow it."""
    global _megatron_buffer
    nvl = rdma = 0
    for config in (Buffer.get_dispatch_config(group.size()),
                   Buffer.get_combine_config(group.size())):
        nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), nvl)
        rdma = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), rdma)
    b = _megatron_buffer
    if b is None or b.group != group or b.num_nvl_bytes < nvl or b.num_rdma_bytes < rdma:
        _megatron_buffer = Buffer(group, nvl, rdma)
    return _megatron_buffer


class MegatronStyleDispatch(torch.autograd.Function):
    """Megatron's FusedDispatch call pattern: the layout's event feeds dispatch; backward is
    a combine of the received gradients with the probabilities' gradients as weights."""

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish):
        buf = megatron_get_buffer(group, megatron_hidden_bytes(x))
        previous = Buffer.capture() if async_finish else None
        per_rank, per_rdma_rank, per_expert, in_rank, event = buf.get_dispatch_layout(
            token_indices, num_experts, previous_event=previous, async_finish=async_finish,
            allocate_on_comm_stream=False)
        recv_x, recv_ids, recv_probs, per_expert_list, handle, after = buf.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs,
            num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            previous_event=event, async_finish=async_finish, allocate_on_comm_stream=False)
        if async_finish:
            after.current_stream_wait()
        ctx.group, ctx.handle, ctx.async_finish = group, handle, async_finish
        return recv_x, recv_ids, recv_probs, torch.tensor(per_expert_list), handle

    @staticmethod
    def backward(ctx, grad_x, _grad_ids, grad_probs, _grad_counts, _grad_handle):
        buf = megatron_get_buffer(ctx.group, megatron_hidden_bytes(grad_x))
        previous = Buffer.capture() if ctx.async_finish else None
        grad_in, grad_token_probs, after = buf.combine(
            grad_x.contiguous(), ctx.handle, topk_weights=grad_probs.float(),
            previous_event=previous, async_finish=ctx.async_finish,
            allocate_on_comm_stream=False)
        if ctx.async_finish:
            after.current_stream_wait()
        return grad_in, None, grad_token_probs, None, None, None


class MegatronStyleCombine(torch.autograd.Function):
    """Megatron's FusedCombine call pattern: backward is a dispatch with the cached handle."""

    @staticmethod
    def forward(ctx, x, group, handle, async_finish):
        buf = megatron_get_buffer(group, megatron_hidden_bytes(x))
        combined, _, after = buf.combine(x, handle=handle, async_finish=async_finish,
                                         previous_event=None, allocate_on_comm_stream=False)
        if async_finish:
            after.current_stream_wait()
        ctx.group, ctx.handle, ctx.async_finish = group, handle, async_finish
        return combined, None

    @staticmethod
    def backward(ctx, grad_out, _grad_none=None):
        buf = megatron_get_buffer(ctx.group, megatron_hidden_bytes(grad_out))
        grad_x, _, _, _, _, after = buf.dispatch(grad_out.contiguous(), handle=ctx.handle,
                                                 previous_event=None,
                                                 async_finish=ctx.async_finish,
                                                 allocate_on_comm_stream=False)
        if ctx.async_finish:
            after.current_stream_wait()
        return grad_x, None, None, None


MEGATRON = dict(hidden=256, experts=8, topk=3, tokens=(24, 0, 17, 31), seed=21)


def megatron_inputs(rank, case, dtype):
    t = case["tokens"][rank]
    gen = torch.Generator().manual_seed(case["seed"] * 31 + rank)
    x = torch.randn(t, case["hidden"], generator=gen).to(dtype)
    idx, probs = routing(rank, t, case["experts"], case["topk"], case["seed"])
    grad_out = torch.randn(t, case["hidden"], generator=gen).to(dtype)
    return x, idx, probs, grad_out


def expert_side(recv_x, recv_local_ids, recv_probs, rank, local):
    """Each local expert e scales its rows by (global e + 1), weighted by the routing
    probability; plus a term nonlinear in x once per rank visited."""
    mine = recv_local_ids >= 0
    scale = torch.where(mine, recv_probs * (recv_local_ids + rank * local + 1), 0.0)
    return (recv_x.float() * scale.sum(1, keepdim=True) + 0.1 * recv_x.float() ** 2
            ).to(recv_x.dtype)


def reference_layer(x, idx, probs, num_experts, num_ranks):
    """What the whole group computes for one rank's tokens, in one process."""
    valid = idx >= 0
    scale = torch.where(valid, probs * (idx + 1), 0.0).sum(1, keepdim=True)
    visited = in_rank_of(idx, num_experts, num_ranks).sum(1, keepdim=True)
    return x.float() * scale + 0.1 * x.float() ** 2 * visited


def _megatron_worker(rank, n, case):
    group, local = dist.group.WORLD, case["experts"] // n
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for style in ("megatron", "moe_comm.nn"):
            x, idx, probs, grad_out = megatron_inputs(rank, case, dtype)
            x.requires_grad_(True)
            probs.requires_grad_(True)
            if style == "megatron":
                recv_x, recv_ids, recv_probs, per_expert, handle = MegatronStyleDispatch.apply(
                    x, idx, probs, case["experts"], group, dtype == torch.bfloat16)
                y = expert_side(recv_x, recv_ids, recv_probs, rank, local)
                combined, _ = MegatronStyleCombine.apply(y, group, handle, False)
                out[(str(dtype), "per_expert")] = per_expert
            else:
                buf = megatron_get_buffer(group, megatron_hidden_bytes(x))
                recv_x, recv_ids, recv_probs, handle = moe_autograd.dispatch(
                    buf, x, idx, probs, case["experts"])
                y = expert_side(recv_x, recv_ids, recv_probs, rank, local)
                combined = moe_autograd.combine(buf, y, handle)
            (combined.float() * grad_out.float()).sum().backward()
            out[(str(dtype), style)] = dict(out=combined.detach().float(),
                                            grad_x=x.grad.float(), grad_probs=probs.grad)
    _megatron_buffer.destroy()
    return out


def test_megatron_fused_dispatch_combine_gradients():
    case, n = MEGATRON, len(MEGATRON["tokens"])
    results = run_ranks(_megatron_worker, n, case, timeout=120)
    for rank, got in enumerate(results):
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            x, idx, probs, grad_out = megatron_inputs(rank, case, dtype)
            x = x.float().requires_grad_(True)
            probs.requires_grad_(True)
            want = reference_layer(x, idx, probs, case["experts"], n)
            (want * grad_out.float()).sum().backward()
            recv_counts = got[(str(dtype), "per_expert")]
            assert recv_counts.dtype == torch.int64 and recv_counts.shape == (case["experts"]
                                                                              // n,)
            for style in ("megatron", "moe_comm.nn"):
                g = got[(str(dtype), style)]
                peak = float(want.detach().abs().max()) if want.numel() else 0.0
                close = dict(rtol=tol, atol=tol * max(1.0, peak))
                torch.testing.assert_close(g["out"], want.detach(), **close)
                torch.testing.assert_close(g["grad_x"], x.grad, **close)
                torch.testing.assert_close(g["grad_probs"],
                                           torch.where(idx >= 0, probs.grad, 0.0), **close)


def test_megatron_imports_deep_ep_utils_through_the_shim():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SHIM), str(ROOT)]))
    probe = ("from deep_ep import Buffer\n"
             "from deep_ep.utils import EventHandle, EventOverlap\n"
             "EventOverlap(EventHandle()).current_stream_wait()\n")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
