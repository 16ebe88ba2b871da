"""The handle of a normal-mode dispatch: everything combine (and a cached dispatch) needs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(eq=False)
class DispatchHandle:
    """Opaque to users; pass it back to ``combine`` or to ``dispatch(handle=...)``.

    ``count_matrix[s, d]`` = tokens rank s sent to rank d (every rank holds the whole matrix);
    ``send_token_ids[d]`` = this rank's token indices sent to rank d, ascending;
    ``is_token_in_rank`` bool [T, R]; ``num_recv_tokens`` = rows this rank received.
    """

    buffer_key: tuple
    num_tokens: int
    hidden: int
    count_matrix: np.ndarray
    is_token_in_rank: torch.Tensor
    send_token_ids: list
    num_recv_tokens: int
    num_worst_tokens: int = 0

    def rows_from(self, rank: int) -> int:
        return int(self.count_matrix[:, rank].sum())


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
