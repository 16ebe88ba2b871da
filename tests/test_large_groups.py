"""Large groups on one host (#16): 32 ranks in normal mode, 64 in low-latency mode, and an
elastic run of 40 ranks that loses a rank whose bit lies in the second MASK word, all on the
host backend against the reference, with the group's memory measured.

Small hidden sizes and few tokens per rank (4-16, a rank with none, -1 slots, skewed
routing): the point is the group size - header slots, mask words, the agreement, the waits
over R slots - not bandwidth. Every process is a fork of the test process (nothing to
import), and each rank reports its proportional set size (shared pages split among the
processes that map them), so the sum is the group's real footprint, /dev/shm included.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

import moe_comm
from moe_comm.quant import quantize_fp8
from moe_comm.shm import atomics
from moe_comm.wire import (LINE_WORDS, MASK_BITS, VALUE_MASK, HeaderLayout, mask_bits,
                           mask_words, tag)
from checks import check_ll, check_normal
from ranks import run_ranks
from test_elastic import _check_survivors, _inputs, _ll_step, _normal_step, _route, _slots
from test_low_latency import _run as run_ll_cases
from test_normal_mode import _run_cases as run_normal_cases

GROUP_MEMORY_LIMIT = 8 << 30        # bytes: what the group adds, far below the machine's 24 GiB


def _added_bytes() -> int:
    """What this rank adds to the machine's memory: its private pages (copied on write or its
    own) plus its share of the shared memory it maps (the segments). Pages it still shares
    with the parent it was forked from are left out: they were in memory before the group
    (the whole proportional set size would charge the group for a parent that is large after
    earlier tests)."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("Private_Clean", "Private_Dirty", "Pss_Shmem"):
                fields[name] = int(rest.split()[0]) * 1024
    return sum(fields.values())


def _with_memory(run):
    """Wrap a rank function: its results, then this rank's PSS at the end (all its buffers
    destroyed, its results still alive)."""
    def measured(rank, n, *args):
        out = run(rank, n, *args)
        return out, _added_bytes()
    return measured


def _small_tokens(n, most=16):
    """Tokens per rank: rank 1 has none, rank 0 the most, the rest 4..most."""
    return [most if r == 0 else 0 if r == 1 else 4 + (5 * r) % (most - 3) for r in range(n)]


def _normal_cases(n):
    cases = []
    specs = [  # (routing, dtype, bias, alignment, num_worst_tokens)
        ("random", "bfloat16", False, 1, 0),
        ("skewed", "fp8", False, 4, 0),
        ("holes", "bfloat16", True, 1, 0),
        ("one_rank", "float32", False, 1, 0),
        ("holes", "float16", False, 1, 16 * n),
    ]
    for seed, (routing, dtype, bias, align, worst) in enumerate(specs):
        cases.append(dict(seed=1000 + seed, tokens=_small_tokens(n), hidden=128,
                          experts=2 * n, topk=4, routing=routing, dtype=dtype, bias=bias,
                          alignment=align, worst=worst))
    return cases


def _ll_cases(n):
    M = 16
    specs = [  # (hidden, fp8, round_scale, ue8m0, hook, zero_copy, routing)
        (128, False, False, False, False, False, "random"),
        (512, True, True, True, True, True, "skewed"),      # UE8M0: 4 scales per int32
        (128, True, False, False, True, False, "holes"),
    ]
    return [dict(seed=2000 + s, hidden=h, fp8=fp8, round_scale=rs, ue8m0=ue, hook=hook,
                 zero_copy=zc, routing=rt, max_tokens=M, tokens=_small_tokens(n, M),
                 experts=2 * n, topk=4)
            for s, (h, fp8, rs, ue, hook, zc, rt) in enumerate(specs)]


def _split(results):
    return [r[0] for r in results], sum(r[1] for r in results)


def test_normal_mode_32_ranks_match_reference():
    n = 32
    cases = _normal_cases(n)
    t0 = time.monotonic()
    results, added = _split(run_ranks(_with_memory(run_normal_cases), n, cases, timeout=240))
    check_normal(n, cases, results)
    print(f"\n32 ranks normal: {time.monotonic() - t0:.1f} s, group adds {added / 2**30:.2f} GiB")
    assert added < GROUP_MEMORY_LIMIT, added


def test_low_latency_64_ranks_match_reference():
    n = 64
    cases = _ll_cases(n)
    t0 = time.monotonic()
    results, added = _split(run_ranks(_with_memory(run_ll_cases), n, cases, timeout=240))
    check_ll(n, cases, results, quantize_fp8)
    print(f"\n64 ranks low-latency: {time.monotonic() - t0:.1f} s, group adds "
          f"{added / 2**30:.2f} GiB")
    assert added < GROUP_MEMORY_LIMIT, added


ELASTIC_RANKS, ELASTIC_VICTIM = 40, 35        # the victim's bit: word 1 of a MASK row
ELASTIC_TIMEOUT = 6.0                         # 40 ranks on 2 shared cores: no false alarms


def _elastic_worker(rank, n, point):
    buf = moe_comm.Buffer(None, 8 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        24, 128, n, _slots(n)), low_latency_mode=True, timeout_s=ELASTIC_TIMEOUT,
        elastic=True)
    x, idx, w = _inputs(rank)
    phy, pw = _route(idx, w, n)
    victim = rank == ELASTIC_VICTIM
    if point == "before_dispatch" and victim:
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "ll_hook":
        _, out, _ = _ll_step(buf, x, phy, pw, kill_in_hook=victim)
    else:
        _, out, _ = _normal_step(buf, x, phy, pw)
    mask = buf.active_ranks
    phy2, w2 = _route(idx, w, n, active=mask)         # experts re-placed over the survivors
    step = _ll_step if point == "ll_hook" else _normal_step
    second = step(buf, x, phy2, w2)[1]
    buf.destroy()
    return {"mask": mask, "out": out, "phy": phy, "second_out": second}


@pytest.mark.parametrize("point", ["before_dispatch", "ll_hook"])
def test_elastic_40_ranks_mask_a_rank_in_the_second_mask_word(point):
    n, victim = ELASTIC_RANKS, ELASTIC_VICTIM
    results = run_ranks(_elastic_worker, n, point, timeout=240, expect_exit=(victim,))
    mask = torch.ones(n, dtype=torch.int32)
    mask[victim] = 0
    _check_survivors(results, n, mask, point)


@pytest.mark.parametrize("num_ranks", [1, 31, 32, 33, 64, 65, 256])
def test_mask_words_round_trip_past_one_word(num_ranks):
    rng = np.random.default_rng(num_ranks)
    for active in (np.ones(num_ranks, bool), np.zeros(num_ranks, bool),
                   rng.random(num_ranks) < 0.5):
        words = mask_words(active)
        assert words.shape == (HeaderLayout(num_ranks).mask_words,)
        assert ((words >= 0) & (words <= VALUE_MASK)).all()    # fits a tagged word's value
        assert np.array_equal(mask_bits(words, num_ranks), active)
        for r in np.flatnonzero(active):                       # bit r of word r // 32
            assert (int(words[r // MASK_BITS]) >> (r % MASK_BITS)) & 1


def _header_slots(lay: HeaderLayout):
    """``(name, first word, words)`` of every signal slot of a header."""
    R, mw = lay.num_ranks, lay.mask_words
    slots = [("fence", lay.fence, 1)]
    for p in range(2):
        for s in range(R):
            slots += [("notify", lay.notify(p, s), R), ("mask", lay.mask(p, s), mw),
                      ("decided", lay.decided(p, s), mw), ("call", lay.call(p, s), LINE_WORDS),
                      ("ll_dispatch_free", lay.ll_dispatch_free(p, s), 1),
                      ("ll_combine_free", lay.ll_combine_free(p, s), 1),
                      ("ll_combine_done", lay.ll_combine_done(p, s), 1),
                      ("ll_call", lay.ll_call(p, s), LINE_WORDS)]
    for r in range(R):
        slots += [("grant", lay.grant(r), 2), ("done", lay.done(r), 1)]
    return slots


@pytest.mark.parametrize("num_ranks", [1, 8, 33, 64, 65, 256])
def test_header_slots_own_their_lines_at_any_group_size(num_ranks):
    """No two slots share a cache line (each has one writer) and all lie in the header; the
    header grows as R^2 words only through the NOTIFY rows (R counts each)."""
    lay = HeaderLayout(num_ranks)
    owner = {}
    for name, at, words in _header_slots(lay):
        assert 4 < at and at + words <= lay.num_words or name == "fence", (name, at)
        for line in range(at // LINE_WORDS, (at + words - 1) // LINE_WORDS + 1):
            assert line not in owner or owner[line] == (name, at), (name, at, owner[line])
            owner[line] = (name, at)
    notify_words = 2 * num_ranks * lay.row_words
    assert lay.num_words - notify_words <= 64 * LINE_WORDS * num_ranks


@pytest.mark.parametrize("num_slots, width", [(2, 1), (64, 1), (64, 9), (256, 2)])
def test_slot_poll_takes_each_slot_once_when_all_its_words_arrive(num_slots, width):
    """One gather per poll (4 slots or more) or one read per slot: the same answers."""
    header = np.zeros((num_slots * 2 + 1) * LINE_WORDS * 8, dtype=np.uint8).view(np.int64)
    stride = 2 * LINE_WORDS
    views = {r: header[r * stride:r * stride + width] for r in range(num_slots)}
    poll = atomics.SlotPoll(views)
    assert poll.take(7) == []
    for r in range(0, num_slots, 3):
        views[r][:] = tag(7, r)                       # complete: every word carries epoch 7
    views[1][0] = tag(7, 1)                           # only part of slot 1 (or all of it)
    taken = poll.take(7)
    done = set(range(0, num_slots, 3)) | ({1} if width == 1 else set())
    assert sorted(r for r, _ in taken) == sorted(done)
    for r, words in taken:
        assert (words == tag(7, r)).all() and words is not views[r]      # the words as read
    assert poll.take(7) == [] and set(poll.ranks) == set(range(num_slots)) - done
    for r in poll.ranks:
        views[r][:] = tag(6, r)                       # an older epoch never matches
    assert poll.take(7) == []


def test_slot_poll_reads_views_of_mixed_widths_one_by_one():
    header = np.zeros(64 * LINE_WORDS, dtype=np.int64)
    views = {r: header[r * LINE_WORDS:r * LINE_WORDS + 1 + r % 2] for r in range(8)}
    poll = atomics.SlotPoll(views)
    for r in (2, 5):
        views[r][:] = tag(3, 0)
    assert sorted(r for r, _ in poll.take(3)) == [2, 5]
