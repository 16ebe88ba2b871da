"""Token rounds on the CUDA backend (#16; moe_comm/cuda/rounds.py, moe_comm/token_rounds.py).

A relayed normal call whose regions do not fit the buffer runs as rounds of relayed calls over
token chunks, so a large batch still crosses to each other host once per token. Emulated CUDA
ranks (kernels on the CPU emulator) on network-namespace hosts, a buffer several times smaller
than the call's largest region: dispatch, combine and a cached dispatch exact against the
reference (receive regions poisoned before each call; bf16, and fp8 with scales), the call went
through several relayed rounds, and the bytes on the host links within WIRE_RATIO_MAX of the
ideal. A controller's mask between a dispatch in rounds and its combine: each round's combine
goes flat, the survivors' results are exact, and the next step goes by rounds of relays among
them. An elastic group whose relay is killed mid-round: that round is redone flat, the rest
re-planned by relays among the survivors, exact. And the pure arithmetic: the chunk, and the
rows no round placed.
"""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

import cuda_cases
import moe_comm
from moe_comm import token_rounds
from moe_comm.cuda import relay, rounds
from moe_comm.cuda.comm import CudaComm
from moe_comm.jit import emulator
from moe_comm.testing import netns
from moe_comm.wire import SlabLayout
from checks import check_normal
from inputs import expert_fn, make_inputs
from test_elastic import VICTIM, _check_survivors, _inputs, _normal_step, _route
from test_hierarchical import _controller_masks, _kill_self_in_cuda_relay

WHY_NOT = netns.available()
CUDA_ENV = {"MOE_COMM_TRANSPORT": "tcp", "MOE_COMM_CPU_BACKEND": "emulator"}
WIRE_RATIO_MAX = 1.10          # issue #16: bytes on the links over the ideal, normal mode
HOSTS, PER_HOST = 3, 2
N = HOSTS * PER_HOST
# rows of 14 KiB (bf16, H = 7168, DeepSeek-V3's) and rounds that fill a 1 MiB buffer keep the
# fixed cost of a round (its notifies and DONE signals: about 37 KiB per host over TCP) small
# beside the payload; the buffer is sized so the largest receive region is over 4x its data
# region (about 11 rounds)
CASE = dict(seed=16, tokens=[72 - 4 * r for r in range(N)], hidden=7168, experts=8 * N,
            topk=8, routing="random", dtype="bfloat16", bias=True, alignment=4, worst=0)
HEAP = 1 << 20
# fp8 rows with their scales, -1 routing slots, in a few rounds: exact only (its rows are too
# small for the wire check at this size)
FP8_CASE = dict(seed=17, tokens=[40 - 4 * r for r in range(N)], hidden=1024, experts=8 * N,
                topk=8, routing="holes", dtype="fp8", bias=False, alignment=1, worst=0)
FP8_HEAP = 192 << 10
MIN_OVERSIZE = 4.0


def _emulated(n):
    if WHY_NOT is not None:
        pytest.skip(f"no network namespaces: {WHY_NOT}")
    if not emulator.available():
        pytest.skip("the kernel emulator needs a C++ compiler (g++)")
    cuda_cases.preload("cpu", n)


def _oversize(handle, comm, row_bytes: int, topk: int) -> float:
    """The largest receive region of the whole call over the data region."""
    most = int(handle.count_matrix.sum(0).max())
    return SlabLayout(most, row_bytes, 0, topk).nbytes / comm.heap_bytes


def _warm_up(buf, hidden, topk, experts):
    """A small call to every rank first, so the transport's connections are up before the
    links' counters are read."""
    x = torch.zeros(2, hidden, dtype=torch.bfloat16)
    idx = torch.arange(topk).repeat(2, 1) * (experts // topk)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, experts)
    rx, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                          num_tokens_per_expert=nte, topk_idx=idx)
    buf.combine(rx, handle)


def _rounds_rank(rank, n, per_host, cases):
    """Each (case, heap) on a Buffer of its own: one dispatch + combine between two barriers
    (local rank 0 of each host reads its link's counter around them), then a cached dispatch;
    every call on a poisoned buffer. Then the first case again without relays
    (MOE_COMM_RELAY=0, read per Buffer: flat, streamed). Returns (results by case, facts by
    case, the flat call's facts), saved by torch.save (fp8 tensors do not pickle)."""
    outs, infos = [], []
    for case, heap in cases:
        out, info = _rounds_case(rank, per_host, case, heap)
        outs.append(out)
        infos.append(info)
    os.environ["MOE_COMM_RELAY"] = "0"
    try:
        flat = _rounds_case(rank, per_host, *cases[0], cached=False)[1]
    finally:
        del os.environ["MOE_COMM_RELAY"]
    blob = io.BytesIO()
    torch.save((outs, infos, flat), blob)
    return blob.getvalue()


def _rounds_case(rank, per_host, case, heap, cached=True):
    buf = moe_comm.Buffer(None, heap, timeout_s=30)
    comm = buf._comm
    x, idx, w, bias = make_inputs(case, rank)
    ntr, tokens_per_host, nte, itr, _ = buf.get_dispatch_layout(idx, case["experts"])
    _warm_up(buf, case["hidden"], case["topk"], case["experts"])
    first = rank % per_host == 0
    dist.barrier()
    before = netns.link_tx_bytes() if first else None
    comm.poison_free_heap()
    rx, ri, rw, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte,
        topk_idx=idx, topk_weights=w, expert_alignment=case["alignment"])
    y = expert_fn(rx, rank)
    comm.poison_free_heap()
    comb, comb_w, _ = buf.combine(y, handle, topk_weights=rw, bias=bias)
    dist.barrier()
    sent = netns.link_tx_bytes() - before if first else None
    comm.poison_free_heap()
    rx2, ri2, _, counts2, handle2, _ = buf.dispatch(x, handle=handle) if cached else \
        (None,) * 6
    my_host = rank // per_host
    row = case["hidden"] * (1 if case["dtype"] == "fp8" else 2)
    ideal = row * 2 * sum(int(c) for h, c in enumerate(tokens_per_host) if h != my_host)
    plan = handle.rounds
    out = dict(rx=rx, ri=ri, rw=rw, counts=counts, y=y, comb=comb, comb_w=comb_w, rx2=rx2,
               ri2=ri2, counts2=counts2, handle2=handle2)
    info = dict(wire=(sent, ideal), oversize=_oversize(handle, comm, row, case["topk"]),
                rounds=0 if plan is None else len(plan.rounds),
                relayed=plan is not None and all(rd.handle.relay is not None
                                                 for rd in plan.rounds),
                prefix=torch.equal(handle[0].cpu(), torch.from_numpy(
                    np.cumsum(handle.count_matrix, 0).astype(np.int32))))
    buf.destroy()
    return out, info


def test_emulated_cuda_call_larger_than_the_buffer_goes_in_relayed_rounds():
    """3 hosts x 2 emulated CUDA ranks, the largest region over 4x the data region (bf16
    rows, and fp8 rows with scales and -1 routing slots): each call runs as several rounds,
    each by relays; dispatch, combine and a cached dispatch match the reference; the handle
    reads as the one-copy call's (rank prefix matrix); and for the bf16 call the links carry
    within WIRE_RATIO_MAX of the ideal bytes (each token once per other host, out and back),
    far above it flat (MOE_COMM_RELAY=0: streamed, a token crosses once per rank)."""
    _emulated(N)
    cases = [(CASE, HEAP), (FP8_CASE, FP8_HEAP)]
    blobs = netns.run_on_hosts(_rounds_rank, HOSTS, PER_HOST, PER_HOST, cases,
                               timeout=300, env=CUDA_ENV)
    results = [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]
    infos = [info[0] for _, info, _ in results]
    assert all(i["oversize"] >= MIN_OVERSIZE for i in infos), [i["oversize"] for i in infos]
    for c, (case, _) in enumerate(cases):
        assert all(info[c]["rounds"] >= 2 and info[c]["relayed"] and info[c]["prefix"]
                   for _, info, _ in results), [info[c] for _, info, _ in results]
        check_normal(N, [case], [[out[c]] for out, _, _ in results])
    flats = [flat for _, _, flat in results]
    assert not any(f["rounds"] for f in flats)
    ratio, flat_ratio = _ratio(infos), _ratio(flats)
    print(f"CUDA wire ratio in {infos[0]['rounds']} token rounds: {ratio:.3f}, flat "
          f"(streamed): {flat_ratio:.3f} (fp8: {results[0][1][1]['rounds']} rounds)")
    assert ratio <= WIRE_RATIO_MAX, ratio
    assert flat_ratio > 1.5 * WIRE_RATIO_MAX, flat_ratio


def _ratio(infos) -> float:
    """Bytes the host links carried over the ideal bytes, every host's."""
    sent = sum(s for s, _ in (i["wire"] for i in infos) if s is not None)
    return sent / sum(ideal for _, ideal in (i["wire"] for i in infos))


MASK_HEAP = 20 << 10
ELASTIC_HEAP = 48 << 10
REPEAT = 4                  # test_elastic's inputs, repeated: a batch several times the buffer


def _relayed(handle) -> list:
    """Per round of a handle in rounds, whether the round's handle (still) has relays."""
    return [rd.handle.relay is not None for rd in handle.rounds.rounds] if handle.rounds \
        else []


def _first_copy(result: dict) -> dict:
    """A result of repeated inputs as _check_survivors reads it: the rows of the first copy
    (a token's copies are routed and combined alike)."""
    cut = len(result["phy"]) // REPEAT
    return {**result, **{k: result[k][:cut] for k in ("phy", "out", "second_out")}}


def _controller_masks_rounds(rank, n, heap):
    """test_hierarchical's controller mask (VICTIM, a relay on host 1, masked between a
    dispatch and its combine) on repeated inputs and a small buffer: a dispatch in rounds,
    each round's combine flat (its relays were picked with the victim in), the next step in
    rounds by relays among the rest."""
    result = _controller_masks(rank, n, heap, REPEAT, _relayed)
    return None if result is None else _first_copy(result)


def test_emulated_cuda_controller_mask_between_rounds_dispatch_and_combine():
    """2 hosts x 2 emulated CUDA ranks, a batch in rounds; rank 2 masked between the
    dispatch and its combine: the survivors' combine (per round, flat) is exact over what the
    surviving experts served, and the next step, in rounds by relays among the survivors,
    serves everything."""
    n = 4
    _emulated(n)
    results = netns.run_on_hosts(_controller_masks_rounds, 2, 2, MASK_HEAP, timeout=180,
                                 env=CUDA_ENV)
    mask = torch.tensor([int(r != VICTIM) for r in range(n)], dtype=torch.int32)
    _check_survivors(results, n, mask, "controller mask, token rounds")
    for r in range(n):
        if mask[r]:
            first, second = results[r]["relayed"]
            assert len(first) >= 2 and not any(first), (r, first)    # lost their relays
            assert len(second) >= 2 and all(second), (r, second)


ELASTIC_TIMEOUT = 2.0       # 6 emulated ranks + proxies on 2 loaded cores


def _relay_dies_in_a_round(rank, n, heap):
    """An elastic group of 3 hosts x 2 emulated CUDA ranks, a batch in rounds: VICTIM (the
    relay of ranks 0 and 4 on host 1) is SIGKILLed in the second round's dispatch, after the
    rows it relays were staged at it, before it forwards any. The survivors redo that round
    flat, relay the later rounds among themselves and pad the victim's rows they never got;
    then a step over experts re-placed on the survivors."""
    buf = moe_comm.Buffer(None, heap, timeout_s=ELASTIC_TIMEOUT, elastic=True)
    x, idx, w = (t.repeat(REPEAT, 1) for t in _inputs(rank))
    phy, pw = _route(idx, w, n)
    dist.barrier()                      # every rank is up before one goes
    if rank == VICTIM:
        _kill_self_in_cuda_relay(3)     # a relay waits twice a round: round 1's first wait
    handles = []
    out = _normal_step(buf, x, phy, pw, handles=handles)[1]
    mask = buf.active_ranks
    second = _normal_step(buf, x, *_route(idx, w, n, active=mask), handles=handles)[1]
    buf.destroy()
    return _first_copy({"mask": mask, "out": out, "phy": phy, "second_out": second,
                        "relayed": [_relayed(h) for h in handles]})


def test_emulated_cuda_elastic_relay_lost_in_a_round():
    """The round that lost its relay is redone flat, the rounds after it go by relays among
    the survivors, and the survivors' results are exact (over the experts that survived for
    the first step, over all of them re-placed for the second)."""
    n = 6
    _emulated(n)
    with netns.Hosts(3) as hosts:
        results = hosts.run(_relay_dies_in_a_round, 2, ELASTIC_HEAP,
                            expect_exit_ranks={VICTIM}, timeout=180, env=CUDA_ENV)
    mask = torch.tensor([int(r != VICTIM) for r in range(n)], dtype=torch.int32)
    _check_survivors(results, n, mask, "relay lost in a token round")
    for r in range(n):
        if mask[r]:
            first, second = results[r]["relayed"]
            assert len(first) >= 3 and not first[1] and all(first[2:]), (r, first)
            assert len(second) >= 2 and all(second), (r, second)


def _topology(num_ranks: int, num_hosts: int):
    """The relay Topology of rank 0 of a group of ``num_ranks`` on ``num_hosts`` hosts (a
    CudaComm on the CPU with no memory behind it: only the host tables are read)."""
    comm = CudaComm(rank=0, num_ranks=num_ranks, device="cpu", pointers=[0] * num_ranks,
                    heap_bytes=1 << 20, ll_bytes=0, timeout_s=1.0, own_allocation=False,
                    opened=[], host_of=[r * num_hosts // num_ranks for r in range(num_ranks)])
    return relay.Topology(comm)


def test_chunk_is_the_largest_whose_capped_relayed_call_fits():
    """rounds.chunk_for: 0 when the whole call fits in one copy; else the largest chunk whose
    capped counts fit (dispatch and combine) the room of a round, below the most tokens."""
    R, H, row, topk = 6, 3, 4096, 8
    topo = _topology(R, H)
    gen = np.random.default_rng(0)
    tokens = np.array([72 - 4 * r for r in range(R)])
    matrix = (tokens[:, None] * gen.uniform(0.6, 0.9, (R, R))).astype(np.int64)
    host_matrix = (tokens[:, None] * gen.uniform(0.8, 1.0, (R, H))).astype(np.int64)
    sizes = (row, 0, topk, row)

    def fits(c, room):
        return rounds._fits(topo, matrix, host_matrix, room, *sizes, c)

    assert rounds.chunk_for(topo, matrix, host_matrix, tokens, 8 << 20, 8 << 20, *sizes) == 0
    for room in (1 << 20, 512 << 10):
        c = rounds.chunk_for(topo, matrix, host_matrix, tokens, room, room, *sizes)
        assert 0 < c < tokens.max() and fits(c, room) and not fits(c + 1, room), (room, c)
    # a round's room smaller than the whole call's (elastic: half of it), a smaller chunk
    half = rounds.chunk_for(topo, matrix, host_matrix, tokens, 1 << 20, 512 << 10, *sizes)
    assert half == rounds.chunk_for(topo, matrix, host_matrix, tokens, 512 << 10, 512 << 10,
                                    *sizes)
    assert rounds.chunk_for(topo, matrix, host_matrix, tokens, 1 << 20, 4096, *sizes) == 0


def test_unplaced_rows_are_those_of_sources_cut_short():
    """RowPlacer.unplaced: the rows of the sources whose rounds stopped short of the whole
    call's count, in the one-copy call's order (by source)."""
    placer = token_rounds.RowPlacer(np.array([3, 0, 2, 4]))
    assert placer.next_round(np.array([2, 0, 1, 2])).tolist() == [0, 1, 3, 5, 6]
    assert placer.next_round(np.array([1, 0, 0, 1])).tolist() == [2, 7]
    assert placer.unplaced().tolist() == [4, 8]
    assert not placer.complete()
    assert placer.complete(np.array([True, True, False, False]))
    placer.next_round(np.array([0, 0, 1, 1]))
    assert placer.unplaced().tolist() == [] and placer.complete()
