"""The signature of a collective call: the parameters every rank must pass alike.

Each rank sends its signature - one line of small integers (wire.NORMAL_CALL_FIELDS or
wire.LL_CALL_FIELDS) - to every peer ahead of the call's payload and compares what it hears
with its own. Every rank hears every signature, so when any two ranks differ they all see it
and all raise :class:`moe_comm.CallMismatchError` naming the fields and the ranks, at the same
point of the call: the group stays in step and the buffer serves the next call on which the
ranks agree. (Without it, a rank passing another hidden size or dtype would compute other
row sizes and offsets than its peers, and write where they do not expect it.)

``handle`` identifies a cached dispatch's or a combine's handle by the epoch of the dispatch
that made it, which is the same on every rank: ranks that pass handles of different dispatches
disagree.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .errors import CallMismatchError, LayoutLockedError
from .wire import CALL_WORDS, NORMAL_CALL_FIELDS

# "dispatch round": one round of a dispatch in token rounds (host/relay_rounds.py), its handle
# word the round's index + 1, so a rank left behind in a round never pairs with its peers'
# next call; "round after a failed one": what a rank whose round failed signs for the next
# round, so that every rank raises there together (relay_rounds.RoundFailed)
CALLS = {1: "dispatch", 2: "cached dispatch", 3: "combine", 4: "low-latency dispatch",
         5: "dispatch round", 6: "round after a failed one"}
CALL_CODE = {name: code for code, name in CALLS.items()}
DTYPES = {1: torch.bfloat16, 2: torch.float16, 3: torch.float32, 4: torch.float8_e4m3fn}
DTYPE_CODE = {dtype: code for code, dtype in DTYPES.items()}
# The scales' word holds their column count and, above SCALE_COLS_BITS, their dtype: a float32
# and an int32 (UE8M0-packed) tensor of one width are different calls (wire.NORMAL_CALL_FIELDS
# has no word to spare, and a tagged word's value has 32 bits).
SCALE_DTYPES = {1: torch.float32, 2: torch.int32}
SCALE_DTYPE_CODE = {dtype: code for code, dtype in SCALE_DTYPES.items()}
SCALE_COLS_BITS = 24
MAX_SCALE_COLS = (1 << SCALE_COLS_BITS) - 1


def _row(values) -> np.ndarray:
    row = np.zeros(CALL_WORDS, dtype=np.int64)
    row[:len(values)] = [int(v) for v in values]
    return row


@functools.lru_cache(maxsize=4096)
def normal(call: str, *, hidden: int, dtype, scale_cols: int, topk: int, num_experts: int,
           num_worst_tokens: int, handle_id: int) -> np.ndarray:
    """The signature of a normal-mode ``call`` ("dispatch", "cached dispatch", "combine").
    Read-only and kept: a model's calls repeat a few signatures, and a small call's whole
    Python budget is a few dozen microseconds."""
    row = _row((CALL_CODE[call], hidden, DTYPE_CODE[dtype], scale_cols, topk, num_experts,
                num_worst_tokens, handle_id))
    row.flags.writeable = False
    return row


def scale_word(scales) -> int:
    """The scales' signature word: 0 without scales, else columns | dtype code << 24."""
    if scales is None:
        return 0
    return scales.shape[1] | SCALE_DTYPE_CODE[scales.dtype] << SCALE_COLS_BITS


def of_dispatch(*, hidden, dtype, scales, topk_idx, num_experts, num_worst_tokens,
                handle, round_index=None, aborted=False) -> np.ndarray:
    """A normal dispatch's signature from the arguments the backends' dispatch takes;
    ``round_index``: a fresh dispatch that is that round of a dispatch in token rounds;
    ``aborted``: this rank's previous round failed (see CALLS)."""
    call = "cached dispatch" if handle is not None else \
        "dispatch" if round_index is None else "dispatch round"
    handle_id = handle.call_id if handle is not None else \
        0 if round_index is None else round_index + 1
    return normal("round after a failed one" if aborted else call, hidden=hidden, dtype=dtype,
                  scale_cols=scale_word(scales),
                  topk=0 if handle is not None or topk_idx is None else topk_idx.shape[1],
                  num_experts=0 if handle is not None else num_experts,
                  num_worst_tokens=num_worst_tokens, handle_id=handle_id)


def of_combine(*, x, topk_weights, handle, aborted=False) -> np.ndarray:
    """A normal combine's signature from the arguments the backends' combine takes."""
    return normal("round after a failed one" if aborted else "combine", hidden=x.shape[1],
                  dtype=x.dtype, scale_cols=0,
                  topk=0 if topk_weights is None else topk_weights.shape[1], num_experts=0,
                  num_worst_tokens=handle.num_worst_tokens, handle_id=handle.call_id)


def low_latency(*, hidden: int, use_fp8: bool, round_scale: bool, topk: int,
                num_experts: int, max_tokens: int, refused_by: int | None = None) -> np.ndarray:
    """The signature of a low-latency dispatch; ``refused_by``: this rank, when it cannot take
    the call's layout (:class:`~moe_comm.errors.LayoutLockedError`)."""
    return _row((CALL_CODE["low-latency dispatch"], hidden, use_fp8, round_scale, topk,
                 num_experts, max_tokens, 0 if refused_by is None else refused_by + 1))


def low_latency_refusal(comm, layout: tuple) -> int | None:
    """This rank (to pass as ``refused_by``) when it must refuse a low-latency call whose
    ``layout`` - (max tokens, hidden, experts) - is not the last one's while a masked rank may
    still write into the last one's rows (``comm.masked_may_write()``: a stopped rank resumes
    into the offsets of the call it was in; :class:`~moe_comm.errors.LayoutLockedError`).
    Else None, and ``layout`` becomes the one in use (``comm.ll_layout``)."""
    if comm.ll_layout not in (None, layout) and comm.masked_may_write():
        return comm.rank
    comm.ll_layout = layout
    return None


def _shown(field: str, value: int):
    if field == "call":
        return CALLS.get(value, value)
    if field == "dtype":
        return str(DTYPES.get(value, value)).replace("torch.", "")
    if field in ("use_fp8", "round_scale", "use_logfmt"):
        return bool(value)
    if field == "scale_cols":
        return _shown_scales(value)
    return value


def _shown_scales(word: int):
    """A scales' word as "4 x int32" ("none" without scales)."""
    if not word:
        return "none"
    dtype = SCALE_DTYPES.get(word >> SCALE_COLS_BITS)
    if dtype is None:
        return word
    return f"{word & MAX_SCALE_COLS} x {str(dtype).replace('torch.', '')}"


def check(op: str, rows: dict, fields=NORMAL_CALL_FIELDS) -> None:
    """Raise :class:`CallMismatchError` if the signatures ``rows`` (rank -> int array of
    CALL_WORDS values) differ in any of ``fields``."""
    if not rows:
        return
    stacked = np.stack([np.asarray(r, dtype=np.int64)[:len(fields)] for r in rows.values()])
    if "layout_refused" in fields:       # a refusal, not a disagreement: its own error
        refused = stacked[:, fields.index("layout_refused")]
        if refused.any():
            raise LayoutLockedError(op, [r for r, v in zip(rows, refused) if v])
    differ = np.flatnonzero((stacked != stacked[0]).any(0))
    if differ.size:
        ranks = list(rows)
        raise CallMismatchError(op, {fields[i]: {r: _shown(fields[i], int(stacked[k, i]))
                                                 for k, r in enumerate(ranks)}
                                     for i in differ})
