"""The normal combine's sums, bit for bit against moe_comm.reference_combine.

A rank's own rows are summed straight from its x (never copied into its staging region), the
other ranks' from the region, a token's rows in rank order and then the biases: the float32
operations of the reference, in its order. The free heap is poisoned (0xFF) before every call,
so a row read from where nobody wrote shows up as NaN.
"""
from __future__ import annotations

import pytest
import torch

import moe_comm
from checks import check_combine_bits, combine_biases
from inputs import expert_fn, make_inputs
from ranks import run_ranks


def _cases(n):
    def case(seed, tokens, routing, dtype, hidden, biases):
        return dict(seed=seed, tokens=tokens, hidden=hidden, experts=4 * n, topk=4,
                    routing=routing, dtype=dtype, bias=biases > 0, biases=biases)

    return [case(1, [48 + 7 * r for r in range(n)], "random", "bfloat16", 7168, 2),
            case(2, [40] * n, "holes", "float32", 300, 1),           # -1 slots
            case(3, [0] + [33] * (n - 1), "skewed", "bfloat16", 256, 0),  # a rank without tokens
            case(4, [21] * n, "one_rank", "bfloat16", 130, 1),       # all to one rank
            # an output of 2 MiB and more: from the Buffer's reused bases (host/pool.py), the
            # C sum writing it with non-temporal stores; pairs beyond an eager slot (4 MiB on 2
            # ranks: 291 such rows), so the calls go through granted regions
            case(5, [340 + 5 * r for r in range(n)], "random", "bfloat16", 7168, 0)]


def _run(rank, n, cases):
    buf = moe_comm.Buffer(None, 32 << 20, timeout_s=30)
    out = []
    for case in cases:
        x, idx, w, bias = make_inputs(case, rank)
        ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, case["experts"])
        buf._comm.poison_free_heap()
        rx, _, rw, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntr,
                                               is_token_in_rank=itr,
                                               num_tokens_per_expert=nte, topk_idx=idx,
                                               topk_weights=w)
        y = expert_fn(rx, rank)
        buf._comm.poison_free_heap()
        comb, comb_w, _ = buf.combine(y, handle, topk_weights=rw,
                                      bias=combine_biases(case, bias))
        out.append(dict(y=y.clone(), comb=comb, comb_w=comb_w))
        del rx, rw, y, handle
    buf.destroy()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_combine_sums_are_the_references_bit_for_bit(n):
    cases = _cases(n)
    check_combine_bits(n, cases, run_ranks(_run, n, cases, timeout=240))


def _held_outputs(rank, n):
    """Three combines of 2 MiB outputs, the caller holding all three, then one more after
    dropping them: every held output keeps its sums (the scales are powers of two, so the
    sums scale exactly), and the last one reuses the memory of an earlier one."""
    buf = moe_comm.Buffer(None, 32 << 20, timeout_s=30)
    case = _cases(n)[-1]
    x, idx, w, _ = make_inputs(case, rank)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, case["experts"])
    rx, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                          num_tokens_per_expert=nte, topk_idx=idx,
                                          topk_weights=w)
    y = expert_fn(rx, rank)
    held = [buf.combine(y * s, handle)[0] for s in (1, 2, 4)]
    ok = all(torch.equal(h, held[0] * s) for h, s in zip(held, (1, 2, 4)))
    ptrs = {h.data_ptr() for h in held}
    first = held[0].clone()
    del held
    again = buf.combine(y, handle)[0]
    buf.destroy()
    # (not a view: autograd lets a custom Function's output be changed in place)
    return ok and not again._is_view(), len(ptrs), again.data_ptr() in ptrs, \
        torch.equal(again, first)


def test_held_combine_outputs_are_never_overwritten_and_dropped_ones_reused():
    for ok, distinct, reused, same in run_ranks(_held_outputs, 2, timeout=120):
        assert ok and distinct == 3 and reused and same
