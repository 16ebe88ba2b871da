"""Config: DeepEP's tuning knobs for normal-mode kernels, and buffer size hints."""
from __future__ import annotations

from dataclasses import dataclass

from .wire import PAGE, SlabLayout, round_up


@dataclass(frozen=True)
class Config:
    """``num_sms``: SMs the CUDA kernels may use; chunk sizes: tokens per pipelined chunk of
    the CUDA kernels' NVLink / RDMA rings. The host backend accepts and ignores them."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self):
        for name in ("num_sms", "num_max_nvl_chunked_send_tokens",
                     "num_max_nvl_chunked_recv_tokens", "num_max_rdma_chunked_send_tokens",
                     "num_max_rdma_chunked_recv_tokens"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"Config.{name} must be positive, got {getattr(self, name)}")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink ring buffer the CUDA normal kernels need for this config."""
        channels = max(1, self.num_sms // 2)
        per_token = hidden_bytes + 512        # payload + scales/top-k/metadata
        return round_up(channels * num_ranks * self.num_max_nvl_chunked_recv_tokens *
                        per_token + 4 * num_ranks * num_ranks * 4, PAGE)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        channels = max(1, self.num_sms // 2)
        per_token = hidden_bytes + 512
        return round_up(2 * channels * num_ranks * self.num_max_rdma_chunked_recv_tokens *
                        per_token, PAGE)


def normal_buffer_size_hint(num_max_tokens_per_rank: int, hidden_bytes: int, num_ranks: int,
                            topk: int = 8, scale_bytes: int = 0, keep_alive: int = 1) -> int:
    """Host backend heap bytes for the single-copy path in the worst case (every token of
    every rank comes to one rank), for ``keep_alive`` received results held at once plus the
    combine staging region. A smaller heap still runs any batch: what does not fit streams
    through half the heap in rounds (moe_comm/host/normal.py RoundPlan), at the cost of one
    more copy; it needs at least two rows' worth (``2 * SlabLayout(1, ...).nbytes``). Across
    hosts the relayed one copy also holds the staging rows of the senders a rank relays for
    (at most their tokens); a call that does not fit runs as token rounds of relayed calls
    (moe_comm/host/relay_rounds.py), each a slice of every rank's tokens."""
    rows = num_max_tokens_per_rank * num_ranks
    recv = SlabLayout(rows, hidden_bytes, scale_bytes // 4, topk).nbytes
    staging = SlabLayout(num_max_tokens_per_rank * num_ranks, hidden_bytes, 0, topk).nbytes
    return keep_alive * recv + staging
