"""Small normal-mode calls in a few C calls: every pair's rows in an eager slot.

A call of a few tokens per rank (64 tokens of H=1024) moves a few KB per pair, and its cost
was the protocol's Python: per destination an index tensor, slab views, a signal, per source
a wait and the copies out (~0.6 ms of CPU a call, several times MPI's whole exchange). Here
each step runs over all peers in one C call (csrc/host/host_ops.c, "Small normal-mode
calls"): the eager sends, the signature and count words, the waits, the copies out or the
per-token sum.

The bytes and words are those of the Python protocol (eager.py, exchange.py), written in the
same order, with the same epochs and parities: whether a rank takes this path is its own
choice, and a rank on it pairs with a rank on the other. It is taken where it can be, and
the Python protocol does the rest:

- the Buffer: every peer on this host (no transport), not elastic, every rank active, flat
  (no relays), eager slots on, the C library loaded, ``MOE_COMM_SMALL`` not "0" (``usable``);
- sends: a dispatch whose every count of this rank fits a slot (direct.py: the counts that
  fit, of any dispatch), a combine of bf16 or float32 rows (the owners' rows that fit one;
  the rest stream through the slots, ring.py, or go to granted regions, granted.py);
- receives: a call whose every pair went eagerly (the count matrix says so on every rank):
  no grant anywhere, so nothing is left but to wait for the slots and read them. A dispatch
  with ``num_worst_tokens`` reads them in Python.

The rows a small dispatch receives come in new tensors, not in the heap: a small call needs
no heap, and results a caller holds do not fill it (only a call that is granted a region
receives into the heap, as the Buffer's docstring says).

A wait that does not end (a deadline, this rank fenced) hands over to ``HostComm.wait`` on
the same words, which raises as in any call.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import CommTimeoutError
from ..handle import TokenIds
from ..wire import CALL_WORDS, DOORBELL_WORD, PAGE, SLAB_ALIGN
from . import eager, native
from .exchange import DONE_WRITTEN, mismatch_behind
from .pool import outputs

# dtype codes of host_ops.c (native.DTYPES): the rows a combine's C sum reads and writes
SUM_DTYPES = native.DTYPES

ENV = "MOE_COMM_SMALL"       # "0": every call takes the Python protocol (tests, A/B timing)


def usable(comm) -> bool:
    """Whether this Buffer's calls may take this path now (see the module docstring)."""
    return (comm.eager_slot > 0 and comm.relays is None and not comm.elastic and
            comm.transport is None and bool(comm.active.all()) and
            addresses(comm).lib is not None)


class Addresses:
    """Byte addresses one rank's small calls use, per parity: its slot and flag in every
    peer's heap (where it writes) and every source's in its own (where it reads); its call
    and count words in every peer's header, and every source's in its own. Built once per
    Buffer (HostComm.ll_cache["small"]): arrays of them, and ``context``, the address of each
    array in the order host_ops.c's CX_* words name them, which every C phase takes (a numpy
    array's address costs a microsecond to find, and a phase needs a dozen)."""

    def __init__(self, comm):
        me, R, lay = comm.rank, comm.num_ranks, comm.layout
        heaps = np.array([comm.peer_heap(r).data_ptr() for r in range(R)], dtype=np.int64)
        words = np.array([comm.words[r].ctypes.data for r in range(R)], dtype=np.int64)
        own, sources = heaps[me], range(R)

        def at_each(base, offsets):
            return base + np.array(list(offsets), dtype=np.int64)

        self.arrays = {}            # name -> [parity 0, parity 1]: the arrays, kept alive
        for name, per_parity in {
                "out_slot": lambda p: heaps + eager.rows_at(comm, p, me),
                "out_flag": lambda p: heaps + eager.flag_at(comm, p, me),
                "in_slot": lambda p: at_each(own, (eager.rows_at(comm, p, s) for s in sources)),
                "in_flag": lambda p: at_each(own, (eager.flag_at(comm, p, s) for s in sources)),
                "call_out": lambda p: words + 8 * lay.call(p, me),
                "call_in": lambda p: at_each(words[me], (8 * lay.call(p, s) for s in sources)),
                "count_out": lambda p: words + 8 * lay.notify(p, me),
                "count_in": lambda p: at_each(words[me], (8 * lay.notify(p, s)
                                                          for s in sources))}.items():
            self.arrays[name] = [per_parity(0), per_parity(1)]
        # read once a Buffer: the C library, or None (none, or MOE_COMM_SMALL=0)
        self.lib = native.library() if os.environ.get(ENV, "1") != "0" else None
        # this rank's header words, to read what came (int64, tags included), and the index
        # of every source's call and count words in it
        self.words = comm.words[me]
        base = self.words.ctypes.data
        self.call_words = [(c - base)[:, None] // 8 + np.arange(CALL_WORDS)
                           for c in self.arrays["call_in"]]
        self.count_words = [(c - base)[:, None] // 8 + np.arange(R)
                            for c in self.arrays["count_in"]]
        self.nwords = {n: np.full(R, n, dtype=np.int64) for n in (2, R, CALL_WORDS)}
        self.p_nwords = {n: a.ctypes.data for n, a in self.nwords.items()}
        self.rotation = np.array([(me + 1 + i) % R for i in range(R)], dtype=np.int64)
        self.p_rotation = self.rotation.ctypes.data
        self.ready = np.empty(R, dtype=np.uint8)
        self.p_ready = self.ready.ctypes.data
        self.fence = int(words[me] + 8 * lay.fence)
        # every rank's doorbell (wire.DOORBELL_WORD): rung after writing for it, and ours
        self.bells = words + 8 * DOORBELL_WORD
        self.p_bells = self.bells.ctypes.data
        self.bell = int(self.bells[me])
        # every address above in the order host_ops.c's CX_* words name them
        per_parity = [a.ctypes.data for name in ("out_slot", "out_flag", "in_slot", "in_flag",
                                                  "call_out", "call_in", "count_out",
                                                  "count_in")
                      for a in self.arrays[name]]
        self.differ = np.zeros(1, dtype=np.int64)     # set by a phase whose signatures differ
        self.context = np.array([R, int(comm.crowded), self.fence, self.bell, self.p_ready,
                                 self.p_rotation, self.p_bells, self.p_nwords[CALL_WORDS],
                                 self.p_nwords[R], self.p_nwords[2], SLAB_ALIGN, PAGE,
                                 DONE_WRITTEN, CALL_WORDS, self.differ.ctypes.data, me] +
                                per_parity, dtype=np.int64)
        self.p_context = self.context.ctypes.data
        if self.lib is not None and self.lib.moe_small_context_words() != len(self.context):
            raise RuntimeError("host/small.py and host_ops.c disagree on the context words")
        self.max_rows = {}


def addresses(comm) -> Addresses:
    found = comm.ll_cache.get("small")
    if found is None:
        found = comm.ll_cache["small"] = Addresses(comm)
    return found


def _max_rows(comm, row_bytes: int, scale_cols: int, topk: int, op: str):
    """The most rows of that shape of ``op`` ("dispatch" or "combine") an eager slot takes
    (eager.room), and a region of the whole heap."""
    key = (row_bytes, scale_cols, topk, op)
    cache = addresses(comm).max_rows
    if key not in cache:
        cache[key] = (eager.max_rows(eager.room(comm, op), row_bytes, scale_cols, topk),
                      eager.max_rows(comm.heap_bytes, row_bytes, scale_cols, topk))
    return cache[key]


def fits(comm, counts: np.ndarray, row_bytes: int, scale_cols: int, topk: int) -> bool:
    """Whether every count (of a row or a matrix) of a dispatch fits an eager slot
    (eager.pairs)."""
    return int(counts.max(initial=0)) <= _max_rows(comm, row_bytes, scale_cols, topk,
                                                   "dispatch")[0]


def _in_slots(comm, matrix: np.ndarray, received: np.ndarray, row_bytes: int,
              scale_cols: int, topk: int, op: str) -> bool:
    """Whether the Python protocol would grant nothing anywhere for this call: every pair
    of ``matrix`` fits a slot (eager.pairs), and every rank's ``received`` rows fit its heap
    in one region (normal.RoundPlan: one round, nothing refused, no more epochs taken).
    The same on every rank."""
    slot_rows, heap_rows = _max_rows(comm, row_bytes, scale_cols, topk, op)
    return int(matrix.max(initial=0)) <= slot_rows and \
        int(received.max(initial=0)) <= heap_rows


def dispatch_in_slots(comm, matrix: np.ndarray, row_bytes: int, scale_cols: int,
                      topk: int) -> bool:
    """Whether a dispatch of count matrix ``matrix`` goes all in eager slots (_in_slots)."""
    return _in_slots(comm, matrix, matrix.sum(0), row_bytes, scale_cols, topk, "dispatch")


def combine_in_slots(comm, matrix: np.ndarray, dtype, row_bytes: int, topk: int,
                     biases) -> bool:
    """Whether a combine on a dispatch of ``matrix`` goes all in eager slots (_in_slots:
    owner o gets back the ``matrix[o].sum()`` rows it sent) and its sum runs in C (bf16 or
    float32 rows, contiguous float32 biases)."""
    return dtype in SUM_DTYPES and \
        _in_slots(comm, matrix, matrix.sum(1), row_bytes, 0, topk, "combine") and \
        all(b.dtype == torch.float32 and b.is_contiguous() for b in biases)


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _outputs(comm, key: str, shapes) -> list:
    """Output tensors of ``shapes`` from the Buffer's pool (host/pool.py outputs: no
    first-touch page faults), as a granted region holds all of a dispatch's."""
    return outputs(comm.outputs, key, shapes, comm.poison)


# what a C phase returns when it could not finish (host_ops.c SMALL_*); a negative value
# -(s + 1) names a source whose slot holds another size than this rank expects
LATE_CALLS, LATE_COUNTS, LATE_FLAGS, AGAIN = 1, 2, 3, 4


def _deadline_ns(comm) -> int:
    return int(comm.deadline * 1e9)


def _views(comm, index: np.ndarray) -> dict:
    """Views of this rank's header words ``index[s]`` (one row of word indices per source)
    for HostComm.wait / verify_call."""
    return {s: comm.slot(comm.rank, int(w[0]), len(w)) for s, w in enumerate(index)}


def call_views(comm, parity: int) -> dict:
    """What HostComm.post_call returns for the signatures posted at ``parity``: the views
    the Python protocol checks them on (HostComm.verify_call)."""
    return _views(comm, addresses(comm).call_words[parity])


def _drive(comm, phase, op: str, epoch: int, parity: int, call_parity: int,
           count_parity: int = 0, counts=None, rc=None) -> None:
    """Run a C phase (``phase(resume)`` -> its return code) to its end, raising what the
    Python protocol raises where it stops: signatures that differ (the phase flagged them):
    HostComm.verify_call, CallMismatchError; a slot that did not come: HostComm.wait on it
    (past its deadline: CommTimeoutError naming the ranks, or RankMaskedError if this rank was
    fenced; if the words came after all, the phase goes on); a slot of another size:
    exchange.settle's error. A wait's slice that ran out (AGAIN): the phase goes on waiting,
    Python's signal handlers having run. ``counts``: the rows each source sends this rank
    (whose slots a finish phase waits for). ``rc``: what the phase's first run returned, if
    the caller ran it."""
    a, checked = addresses(comm), False
    if rc is None:
        rc = phase(0)
    while True:
        if a.differ[0] and not checked:
            comm.verify_call(call_views(comm, call_parity), epoch, op)    # raises
            checked = True           # (a test turned the check off: go on past it)
            if rc == 0:
                rc = phase(2)
                continue
        if rc == 0:
            return
        resume = 2 if checked else 1
        if rc == LATE_CALLS:
            comm.verify_call(call_views(comm, call_parity), epoch, op)
        elif rc == LATE_COUNTS:
            comm.wait(_views(comm, a.count_words[count_parity]), epoch, op + "/notify")
        elif rc == LATE_FLAGS:
            try:
                comm.wait(eager.flags(comm, parity, np.flatnonzero(counts).tolist()), epoch,
                          op + "/payload")
            except CommTimeoutError as e:     # (ranks that disagree wait for each other)
                if call_parity is not None:
                    mismatch_behind(comm, epoch, op, call_views(comm, call_parity), e)
                raise
        elif rc != AGAIN:             # (AGAIN: a slice ran out, the phase goes on waiting)
            raise RuntimeError(f"{op}: rows larger than the granted region (sender and "
                               f"receiver computed other sizes): nothing written to rank(s) "
                               f"[], nothing received from rank(s) [{-rc - 1}]")
        rc = phase(resume)


def _next_call_parity(comm) -> int:
    """The parity of the next CALL round, as HostComm.post_call takes it."""
    comm.call_seq += 1
    return (comm.call_seq - 1) % 2


def start_dispatch(comm, epoch: int, parity: int, call_row: np.ndarray, in_rank, ids, first,
                   *, x_bytes, scales, topk_idx, topk_weights, num_local):
    """A small dispatch up to its count matrix (exchange.exchange_counts' words, after the
    eager sends): with ``in_rank`` (fresh) each rank's tokens, the sends, the signature, this
    rank's counts, every signature checked and every rank's counts read; returns ``(matrix,
    ids, first)``. Without (cached: ``ids``, ``first`` the handle's), the sends and the
    signature; returns the signatures' parity (checked by :func:`receive_dispatch`)."""
    a, R = addresses(comm), comm.num_ranks
    comm.check_fence()                # a rank the survivors masked writes nothing
    call_parity = _next_call_parity(comm)
    count_parity = None                   # NOTIFY: the call's parity (exchange_counts)
    if in_rank is not None:
        count_parity = call_parity
        T = in_rank.shape[0]
        ids, first = torch.empty(T * R, dtype=torch.int64), np.empty(R + 1, np.int64)
    matrix = np.empty((R, R), dtype=np.int64)
    # the C code (moe_put_rows) reads rows of these at their natural strides (scales: any
    # row stride, DeepEP's column-major ones copied)
    x_bytes, scales, topk_idx, topk_weights = (None if t is None else t.contiguous()
                                               for t in (x_bytes, scales, topk_idx,
                                                         topk_weights))
    args = (-1 if count_parity is None else count_parity, epoch, _deadline_ns(comm),
            0 if in_rank is None else in_rank.data_ptr(), x_bytes.shape[0],
            0 if in_rank is None else in_rank.stride(0),
            0 if in_rank is None else in_rank.stride(1), ids.data_ptr(), first.ctypes.data,
            x_bytes.data_ptr(), x_bytes.stride(0), x_bytes.shape[1], _ptr(scales),
            0 if scales is None else 4 * scales.stride(0),
            0 if scales is None else scales.shape[1], _ptr(topk_idx), _ptr(topk_weights),
            0 if topk_idx is None else topk_idx.shape[1], num_local, call_row.ctypes.data,
            matrix.ctypes.data)
    _drive(comm, lambda resume: a.lib.moe_small_dispatch_start(
        a.p_context, parity, call_parity, args[0], resume, *args[1:]), "dispatch", epoch,
        parity, call_parity, count_parity or 0)
    if in_rank is None:
        return call_parity
    return matrix, ids[:int(first[R])], first


def receive_dispatch(comm, epoch: int, parity: int, matrix: np.ndarray, *, row_bytes,
                     scales, topk, num_local, call_parity=None, call_row=None):
    """The rest of a dispatch every pair of which went eagerly: wait for the slots of the
    ranks sending this rank rows, check the signatures (a cached dispatch, ``call_parity``),
    and read the rows into new tensors in source order. Returns ``(recv_x, recv_scales,
    recv_idx, recv_weights, local_counts)``: uint8 rows, and how many received ids name each
    local expert (a list; None without top-k)."""
    a = addresses(comm)
    counts = np.ascontiguousarray(matrix[:, comm.rank])
    n = int(counts.sum())
    scale_cols = 0 if scales is None else scales.shape[1]
    recv_x, recv_s, recv_i, recv_w = _outputs(comm, "dispatch", [
        (n, row_bytes, torch.uint8), None if scales is None else (n, scale_cols, scales.dtype),
        (n, topk, torch.int64) if topk else None, (n, topk, torch.float32) if topk else None])
    local = torch.empty(max(num_local, 1), dtype=torch.int64)
    args = (epoch, _deadline_ns(comm), counts.ctypes.data, row_bytes, scale_cols, topk,
            recv_x.data_ptr(), _ptr(recv_s), _ptr(recv_i), _ptr(recv_w), num_local,
            local.data_ptr() if topk else 0, 0 if call_parity is None else call_row.ctypes.data)
    _drive(comm, lambda resume: a.lib.moe_small_dispatch_finish(
        a.p_context, parity, call_parity or 0, *args), "dispatch", epoch, parity, call_parity,
        counts=counts)
    return recv_x, recv_s, recv_i, recv_w, local[:num_local].tolist() if topk else None


def start_combine(comm, epoch: int, parity: int, call_row: np.ndarray, matrix: np.ndarray,
                  x: torch.Tensor, topk_weights):
    """A combine's eager sends (eager.send: each owner's rows of ``x``, received order, back
    into its slot; to itself only the flag, its rows staying in x; none to an owner whose rows
    do not fit a slot: a granted region takes them) and its signature, for rows of bf16 or
    float32; returns the signatures' parity, or None (nothing sent: the caller sends). ``x``
    and ``topk_weights`` contiguous."""
    if x.dtype not in SUM_DTYPES:
        return None
    a = addresses(comm)
    K = 0 if topk_weights is None else topk_weights.shape[1]
    row_bytes = x.shape[1] * x.element_size()
    count = np.ascontiguousarray(matrix[:, comm.rank])     # rows each owner sent this rank
    call_parity = _next_call_parity(comm)
    comm.check_fence()
    a.lib.moe_small_combine_start(a.p_context, parity, call_parity, epoch, count.ctypes.data,
                                  x.data_ptr(), row_bytes, _ptr(topk_weights), K,
                                  call_row.ctypes.data,
                                  _max_rows(comm, row_bytes, 0, K, "combine")[0])
    return call_parity


def receive_combine(comm, epoch: int, parity: int, handle, x, topk_weights, *, dtype, hidden,
                    topk, biases, call_parity, call_row):
    """The rest of a combine every pair of which went eagerly: wait for the slots of the
    ranks returning rows to this rank and the signatures, then sum per token in C straight
    from the slots, and from ``x`` the rows this rank returned to itself (start_combine did
    not copy them; normal._reduce's sums, bit for bit). Returns ``(combined_x,
    combined_weights or None)``."""
    a, me = addresses(comm), comm.rank
    own = int(handle.count_matrix[:me, me].sum())    # my rows for myself start there in x
    counts = np.ascontiguousarray(handle.count_matrix[comm.rank])   # rows d returns to me
    T = handle.num_tokens
    ids, first = handle_ids(handle)
    # (two bases: the two results are separate tensors, as the Python protocol's)
    out, = _outputs(comm, "combine", [(T, hidden, dtype)])
    out_w, = _outputs(comm, "combine_w", [(T, topk, torch.float32) if topk else None])
    bias_addr = np.array([b.data_ptr() for b in biases] or [0], dtype=np.int64)
    index = torch.empty(T + 1 + int(counts.sum()), dtype=torch.int64)
    scratch = torch.empty(2 * max(hidden, 1), dtype=torch.float32)
    args = (epoch, _deadline_ns(comm), counts.ctypes.data, ids.data_ptr(), first.ctypes.data,
            SUM_DTYPES[dtype], hidden, topk, T, bias_addr.ctypes.data, len(biases),
            out.data_ptr(), SUM_DTYPES[dtype], _ptr(out_w), index.data_ptr(),
            scratch.data_ptr(), call_row.ctypes.data, x[own:].data_ptr(),
            0 if topk_weights is None else topk_weights[own:].data_ptr())
    _drive(comm, lambda resume: a.lib.moe_small_combine_finish(
        a.p_context, parity, call_parity, *args), "combine", epoch, parity, call_parity,
        counts=counts)
    return out, out_w


def handle_ids(handle):
    """A handle's send_token_ids as one int64 tensor and its ``first`` offsets (numpy): a
    small dispatch's handle holds them so (handle.TokenIds); another's are joined once and
    kept on the handle, since every combine of it reads them."""
    sent = handle.send_token_ids
    if isinstance(sent, TokenIds):
        return sent.ids, sent.first
    found = getattr(handle, "_small_ids", None)
    if found is None:
        first = np.zeros(len(sent) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in sent], out=first[1:])
        ids = torch.cat(list(sent)).to(torch.int64).contiguous() \
            if len(sent) else torch.zeros(0, dtype=torch.int64)
        found = handle._small_ids = (ids, first)
    return found
