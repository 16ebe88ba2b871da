"""The handle of a normal-mode dispatch: everything combine (and a cached dispatch) needs."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch


@dataclass(eq=False)
class DispatchHandle:
    """Opaque to users; pass it back to ``combine`` or to ``dispatch(handle=...)``.

    ``count_matrix[s, d]`` = tokens rank s sent to rank d (every rank holds the whole matrix);
    ``send_token_ids[d]`` = this rank's token indices sent to rank d, ascending;
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

    def rows_from(self, rank: int) -> int:
        return int(self.count_matrix[:, rank].sum())

    def without_inactive(self, active: np.ndarray, rank: int) -> "DispatchHandle":
        """This handle with the rows and columns of inactive ranks dropped: nothing is sent
        to or expected from them. ``self`` when every rank it involves is active."""
        gone = ~np.asarray(active, dtype=bool)
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
