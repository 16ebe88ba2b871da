"""The handles of a dispatch: everything combine (and a cached dispatch) needs.

Both also read like DeepEP's handle tuples (index, ``len``, unpacking), so clients that index
them (``handle[0]`` is the rank prefix matrix) run unchanged; entries moe_comm has no
equivalent for (DeepEP's per-channel tables) are None."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch


class TokenIds(Sequence):
    """A handle's ``send_token_ids`` held as one int64 tensor ``ids``, grouped by rank, and
    the numpy offsets ``first`` [R + 1] of the groups: entry d is ``ids[first[d]:first[d +
    1]]``, a view made when read. A small call (host/small.py) makes the two arrays in C, and
    its combine reads them as they are: R views made at every dispatch would cost more than
    the rest of its handle."""

    def __init__(self, ids: torch.Tensor, first: np.ndarray):
        self.ids, self.first = ids, first

    def __len__(self) -> int:
        return len(self.first) - 1

    def __getitem__(self, d):
        if isinstance(d, slice):
            return [self[i] for i in range(*d.indices(len(self)))]
        if not -len(self) <= d < len(self):
            raise IndexError(f"rank {d} of {len(self)}")
        d %= len(self)
        return self.ids[int(self.first[d]):int(self.first[d + 1])]


@dataclass(eq=False)
class DispatchHandle:
    """Opaque to users; pass it back to ``combine`` or to ``dispatch(handle=...)``.

    ``count_matrix[s, d]`` = tokens rank s sent to rank d (every rank holds the whole matrix);
    ``send_token_ids[d]`` = this rank's token indices sent to rank d, ascending (a list of
    tensors, or a :class:`TokenIds` read alike);
    ``is_token_in_rank`` bool [T, R]; ``num_recv_tokens`` = rows this rank received;
    ``call_id`` = the epoch of the dispatch that made it (the same on every rank: the call
    signature of a cached dispatch or a combine carries it, moe_comm/signature.py).
    """

    buffer_key: tuple
    num_tokens: int
    hidden: int
    count_matrix: np.ndarray
    is_token_in_rank: torch.Tensor
    send_token_ids: list
    num_recv_tokens: int
    num_worst_tokens: int = 0
    call_id: int = 0
    relay: object = None       # host backend across hosts: relay.Routes of a hierarchical call
    rounds: list = None        # host backend: the token rounds of a relayed call too big for
                               # the heap in one copy (host/relay_rounds.py), else None

    # DeepEP's normal-mode handle is a 6-tuple; these are its entries, in its order
    DEEPEP_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix",
                     "recv_channel_prefix_matrix", "recv_src_idx", "is_token_in_rank",
                     "send_head")

    def rank_prefix_matrix(self) -> torch.Tensor:
        """int32 [R, R], DeepEP's ``handle[0]``: entry [s, d] = tokens ranks 0..s send to rank
        d (the count matrix summed over source ranks), so rank d's rows from source s are
        ``recv_x[m[s-1, d]:m[s, d]]``."""
        return torch.from_numpy(np.cumsum(self.count_matrix, axis=0).astype(np.int32))

    def _deepep_entries(self) -> tuple:
        # moe_comm moves rows without channels, and the receiver is not told the senders'
        # token indices: channel tables, recv_src_idx and send_head have no equivalent
        return (self.rank_prefix_matrix(), None, None, None, self.is_token_in_rank, None)

    def __getitem__(self, i):
        return self._deepep_entries()[i]

    def __len__(self) -> int:
        return len(self.DEEPEP_FIELDS)

    def __iter__(self):
        return iter(self._deepep_entries())

    def rows_from(self, rank: int) -> int:
        return int(self.count_matrix[:, rank].sum())

    def without_inactive(self, active: np.ndarray, rank: int) -> "DispatchHandle":
        """This handle with the rows and columns of inactive ranks dropped: nothing is sent
        to or expected from them. ``self`` when every rank it involves is active."""
        gone = ~np.asarray(active, dtype=bool)
        if not gone.any():
            return self
        m = self.count_matrix
        if not (m[gone].any() or m[:, gone].any() or
                any(len(self.send_token_ids[d]) for d in np.flatnonzero(gone))):
            return self
        m = m.copy()
        m[gone], m[:, gone] = 0, 0
        in_rank = self.is_token_in_rank.clone()
        in_rank[:, torch.from_numpy(gone)] = False
        ids = [t[:0] if gone[d] else t for d, t in enumerate(self.send_token_ids)]
        return replace(self, count_matrix=m, is_token_in_rank=in_rank, send_token_ids=ids,
                       num_recv_tokens=int(m[:, rank].sum()))


@dataclass(eq=False)
class LowLatencyHandle:
    """Opaque; pass to ``low_latency_combine``. Filled by the dispatch receive (the hook).

    ``recv_meta[le, i]`` = ``token << 8 | topk_slot`` of packed row i of local expert le;
    ``recv_ranges[le, src]`` = (first packed row, count) of the rows src sent to le;
    ``return_base[src]`` = where src's messages to this rank start in src's message order;
    ``send_tok``/``send_slot``: this rank's messages (token, top-k slot) in that order."""

    buffer_key: tuple
    seq: int
    buf: int
    max_tokens: int
    hidden: int
    num_experts: int
    num_tokens: int
    topk: int
    recv_meta: torch.Tensor = None
    recv_ranges: torch.Tensor = None
    return_base: torch.Tensor = None
    send_tok: torch.Tensor = None
    send_slot: torch.Tensor = None
    received: bool = False
    call_row: np.ndarray = None         # this call's signature (moe_comm/signature.py)
    # host backend: the row of this rank's combine region its messages' results come back
    # from (past rows a masked rank may still write), and the ranks its messages went to
    return_shift: int = 0
    sent_to: np.ndarray = None
    # host backend: (rank, messages, tok, slot, first) when this rank's messages to itself
    # were left in its own message rows for its receive to read (host/ll.py), until then
    own_rows: tuple = None

    # DeepEP's low-latency handle is a 5-tuple; these are its entries, in its order
    DEEPEP_FIELDS = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden",
                     "num_experts")

    def src_info(self) -> torch.Tensor:
        """int32 [E/R, R*M], DeepEP's ``handle[0]``: the source token index of each packed
        row (-1 past a local expert's received rows). Needs the receive (the hook) done."""
        self._require_received("src_info")
        return torch.where(self.recv_meta >= 0, self.recv_meta >> 8, -1).to(torch.int32)

    def layout_range(self) -> torch.Tensor:
        """int64 [E/R, R], DeepEP's ``handle[1]``: ``first packed row << 32 | row count`` of
        the rows each source sent to each local expert."""
        self._require_received("layout_range")
        return (self.recv_ranges[..., 0] << 32) | self.recv_ranges[..., 1]

    def _require_received(self, what: str) -> None:
        if not self.received:
            raise RuntimeError(f"the handle's {what} exists once the dispatch has received: "
                               "call its receive hook first")

    def _deepep_getters(self) -> tuple:
        # the numbers are there at once, the tables only after the receive
        return (self.src_info, self.layout_range, lambda: self.max_tokens,
                lambda: self.hidden, lambda: self.num_experts)

    def __getitem__(self, i):
        got = self._deepep_getters()[i]
        return tuple(g() for g in got) if isinstance(i, slice) else got()

    def __len__(self) -> int:
        return len(self.DEEPEP_FIELDS)

    def __iter__(self):
        return (g() for g in self._deepep_getters())
