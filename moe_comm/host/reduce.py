"""Per-token sum of the rows sent back in combine, in float32, cache-blocked.

The C loops of native.py do it where they can run (same bits, 5-8x faster); the torch code
below is their definition and the path everywhere else.

Summing by one big ``index_add_`` would first convert every staged row to float32 (a temporary
as large as all the rows: page faults dominate on the CPU). Instead tokens are taken in blocks
whose float32 accumulator stays in cache; each source's rows for the block are found by binary
search in its (ascending) token ids.
"""
from __future__ import annotations

import torch

from . import native

BLOCK_TOKENS = 64
WEIGHTED_CHUNK_ROWS = 64           # float32 copy of 64 returned rows stays in cache


def sum_rows_per_token(segments, ids_per_segment, num_tokens: int, out_dtype, biases=(),
                       out=None):
    """``segments[i]`` [n_i, H] rows for tokens ``ids_per_segment[i]`` (ascending int64).
    Returns ``[num_tokens, H]`` in ``out_dtype`` (into ``out``, contiguous, where given): for
    each token the float32 sum of its rows plus ``biases`` (float32 [num_tokens, H] each);
    tokens with no row get the bias (or 0)."""
    fast = native.sum_rows(segments, ids_per_segment, num_tokens, out_dtype, biases, out=out)
    if fast is not None:
        return fast
    hidden = segments[0].shape[1] if segments else (biases[0].shape[1] if biases else 0)
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=out_dtype)
    if num_tokens == 0:
        return out
    acc = torch.empty(BLOCK_TOKENS, hidden, dtype=torch.float32)
    starts = torch.arange(0, num_tokens + BLOCK_TOKENS, BLOCK_TOKENS)
    bounds = [torch.searchsorted(ids, starts).tolist() for ids in ids_per_segment]
    for b, t0 in enumerate(range(0, num_tokens, BLOCK_TOKENS)):
        t1 = min(t0 + BLOCK_TOKENS, num_tokens)
        a = acc[:t1 - t0]
        a.zero_()
        for seg, ids, bd in zip(segments, ids_per_segment, bounds):
            lo, hi = bd[b], bd[b + 1]
            if hi > lo:
                rows = seg[lo:hi]
                a.index_add_(0, ids[lo:hi] - t0,
                             rows if rows.dtype == torch.float32 else rows.float())
        for bias in biases:
            a += bias[t0:t1]
        out[t0:t1] = a
    return out



def weighted_sum_rows(rows, tokens, weights, out):
    """``out`` [T, H] = for each token, the float32 sum of ``weights[i] * rows[i]`` over the
    rows ``i`` with ``tokens[i]`` = that token, added in row order (the low-latency combine:
    ``rows`` [n, H] bf16 or float32, ``tokens`` int64 [n] in any order, ``weights`` float32
    [n]); tokens with no row get 0."""
    if native.sum_rows([rows], [tokens], out.shape[0], out.dtype, weights=[weights],
                       out=out) is not None:
        return out
    acc = torch.zeros(out.shape, dtype=torch.float32)
    w = weights.unsqueeze(1)
    for m0 in range(0, tokens.numel(), WEIGHTED_CHUNK_ROWS):
        m1 = min(m0 + WEIGHTED_CHUNK_ROWS, tokens.numel())
        # a product of its own: float() of float32 rows is the rows themselves
        acc.index_add_(0, tokens[m0:m1], rows[m0:m1].float() * w[m0:m1])
    out.copy_(acc)
    return out
