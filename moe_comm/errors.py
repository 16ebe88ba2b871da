"""Every error moe_comm raises on purpose, in one place.

Bad input is a plain ``ValueError``/``TypeError`` naming the argument (raised before any byte
moves). Communication failures have their own types so callers can tell them apart.
"""
from __future__ import annotations


class CommTimeoutError(RuntimeError):
    """A wait on peers passed its deadline.

    ``silent_ranks`` lists the group ranks whose signal never arrived; ``op`` names the phase
    (for example ``"dispatch/notify"``). After this error the buffer's peers are out of step:
    destroy the buffer (or, in elastic mode, the silent ranks are masked instead of raising).
    """

    def __init__(self, op: str, silent_ranks, timeout_s: float):
        self.op = op
        self.silent_ranks = sorted(int(r) for r in silent_ranks)
        self.timeout_s = timeout_s
        super().__init__(
            f"{op}: no signal from rank(s) {self.silent_ranks} within {timeout_s:g} s "
            f"(peer dead, hung, or not calling the same operation)")


class BufferTooSmallError(ValueError):
    """The communication buffer cannot hold what this call must receive.

    ``needed`` is the number of bytes of buffer this call needs; the message says which
    constructor argument to raise.
    """

    def __init__(self, what: str, needed: int, available: int, argument: str = "num_nvl_bytes"):
        self.needed = int(needed)
        self.available = int(available)
        super().__init__(
            f"{argument} too small: {what} needs {self.needed} bytes of buffer, "
            f"{self.available} are available; create the Buffer with "
            f"{argument} >= {self.needed} (plus room for received tensors you keep alive)")


class CallMismatchError(ValueError):
    """The ranks disagree about a call: each passed other shape parameters (hidden size,
    dtype, top-k, number of experts, num_worst_tokens, ...) or another cached handle. Raised on
    every rank, naming the fields and the ranks, before any payload moves; the buffer serves
    the next call on which they agree. ``fields`` maps each field that differs to
    ``{rank: value}``."""

    def __init__(self, op: str, fields: dict):
        self.op = op
        self.fields = fields
        parts = [f"{name}: " + ", ".join(f"rank {r} has {v}" for r, v in sorted(vals.items()))
                 for name, vals in fields.items()]
        super().__init__(f"{op}: the ranks disagree about this call; " + "; ".join(parts))


class LayoutLockedError(CallMismatchError):
    """A low-latency call with another layout (``num_max_dispatch_tokens_per_rank``, hidden
    size or number of experts) than the last one, refused by the ranks in ``ranks``: a rank
    was masked while it may have been in the middle of writing into their low-latency region
    (stopped, not known to be dead), and its late rows land where the old layout put them -
    which the new layout would hand to other rows. Raised on every rank before any result is
    read; calls with the previous layout go on. A new Buffer (over the survivors) takes any
    layout."""

    def __init__(self, op: str, ranks):
        self.ranks = sorted(int(r) for r in ranks)
        super().__init__(op, {"layout_refused": {r: True for r in self.ranks}})
        self.args = (f"{op}: rank(s) {self.ranks} keep the previous low-latency layout: a rank "
                     "masked mid-call may still write where that layout put its rows (its "
                     "process is not known to be gone); call with the previous "
                     "num_max_dispatch_tokens_per_rank, hidden size and num_experts, or build "
                     "a new Buffer",)


class RoundFailed(RuntimeError):
    """A call that ran in token rounds (a relayed call bigger than the buffer) stopped because
    a round failed on some rank (its own error, e.g. BufferTooSmallError, is raised there):
    every rank raises in the next round, before anything of it moves, and the buffer serves
    the next call."""


class RankMaskedError(RuntimeError):
    """This rank was masked out of an elastic Buffer (by ``set_active_ranks``, or by its peers
    when it missed their deadline); it takes no further part: a new Buffer is needed to
    rejoin."""


def refuse_if_masked(active_ranks, why: str) -> None:
    """RuntimeError when a rank of ``active_ranks`` (int [R], 0 = masked) is masked: ``why``
    (a meeting of every rank) cannot take place without it."""
    masked = (active_ranks == 0).nonzero().flatten().tolist()
    if masked:
        raise RuntimeError(f"{why}: rank(s) {masked} are masked and this backend can only do it "
                           "with every rank of the group taking part; build a new Buffer over "
                           "the survivors")
