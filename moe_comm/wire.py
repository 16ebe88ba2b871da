"""The wire format: where things land in a rank's communication segment and how signals
are encoded. Every backend and transport reads it from here; nothing else hard-codes an
offset.

A rank's segment = ``[header | heap]``.

Header (int64 words). Every signal slot is written by exactly one peer and read only by the
owner of the header: waits are always on local memory and a peer *pushes* what it has to say
(what a one-sided transport such as RDMA can do cheaply; a remote read would be a round trip).
Each slot sits on its own 64-byte line so peers never false-share:

- ``NOTIFY[parity][src]``: one line-aligned row of ``R`` tagged counts per source rank: row
  ``src`` holds ``src``'s token count for every destination. Every rank writes its row into
  every peer, so after the notify phase each rank knows the whole ``R x R`` count matrix.
  Two parities (by notify sequence number): a rank can run at most one notify ahead of a peer.
- ``GRANT[dst]``: receiver ``dst`` tells this sender "your rows for op ``epoch`` go to my heap
  page ``v``", and in the next word how many pages it granted: a sender whose rows would not
  fit writes nothing there (``GRANT_FAILED`` = it could not allocate; senders skip it and
  raise too).
- ``DONE[src]``: source ``src`` finished writing its payload for op ``epoch``.
- ``MASK[parity][src]``: elastic mode's agreement: ``src``'s estimate of the active ranks in
  one round (bit r of word r // 32), two parities by round (:func:`agree_round_tag`).
- ``DECIDED[parity][src]``: the mask ``src`` decided in agreement ``seq`` (tag ``seq``), two
  parities by agreement: a rank still in a round takes it instead of ``src``'s estimate.
- ``FENCE``: written by the survivors into the header of a rank they masked: that rank reads
  its own word before every wait and write, and raises ``RankMaskedError`` (a late writer
  stops instead of writing into memory the survivors have reused).
- ``CALL[parity][src]``: ``src``'s signature of the normal-mode call ``epoch`` (one line of
  tagged words, :data:`NORMAL_CALL_FIELDS`): every rank writes it into every peer first and
  compares the peers' with its own, so ranks that disagree about a call all raise before any
  payload moves (moe_comm/signature.py). Two parities like NOTIFY.
- ``LL_DISPATCH_FREE[buf][src]`` / ``LL_COMBINE_FREE[buf][src]``: rank ``src`` finished
  reading its low-latency receive buffer ``buf`` for LL call number ``epoch`` (a sender of call
  s waits for s-2 from every destination before overwriting: flow control of the double
  buffers).
- ``LL_COMBINE_DONE[buf][src]``: src finished writing its LL combine rows (value = rows).
- ``LL_CALL[buf][src]``: ``src``'s signature of LL dispatch call ``epoch``
  (:data:`LL_CALL_FIELDS`), written before its messages; the receiver checks it before it
  trusts the count rows (which a rank with another layout writes elsewhere).

The low-latency region (after the heap) is laid out by :class:`LLLayout`; its dispatch count
words ``[src][local_expert]`` carry the number of tokens src sent to that expert, written
after the rows (one message per (token, expert), so 0 is a real count and "not yet" is a
stale epoch).

Signal encoding ("tagged word"): ``(epoch << 32) | value`` with ``epoch >= 1``, so a word of
0 means "nothing arrived yet", and a stale word from an older op never matches the epoch the
reader waits for, so slots never need resetting. ``value < 2**32``.

Ordering rule (every backend): a writer makes its payload visible before the signal word
(release), a reader reads payload only after seeing the signal (acquire).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

PAGE = 4096
LINE_WORDS = 8                       # 64-byte cache line / 8-byte words
MAGIC = 0x6D6F655F636F6D6D           # "moe_comm"
VERSION = 4
VALUE_BITS = 32
VALUE_MASK = (1 << VALUE_BITS) - 1
MAX_EPOCH = (1 << 31) - 1
GRANT_FAILED = VALUE_MASK            # grant value meaning "receiver could not allocate"
LL_NUM_BUFFERS = 2                   # low-latency double buffering
MASK_BITS = 32                       # rank bits per MASK word (the value field of a tag)
# A tagged word's value meaning "the sender's call failed" (CUDA kernels): nothing it would
# announce arrived; every other value the kernels signal is below 2^31.
FAILED_VALUE = VALUE_MASK
# The bit of a LL_COMBINE_DONE value (rows | this) that says the sender's rows are
# LogFMT-encoded (moe_comm/logfmt.py): the receiver compares it with its own use_logfmt.
LL_DONE_LOGFMT = 1 << 30
# a dispatch count row's base word: the source wrote its rows straight into the receiver's
# area (host/ll_direct.py), not into its blocks
LL_ROWS_DIRECT = 1 << 30

# The CUDA kernels' error word (int32, pinned host memory, read by moe_comm/cuda/comm.py):
# [0] code, [1] op id, [2] epoch, [3] detail, [ERROR_HEADER + r] = 1 if rank r is silent.
ERROR_HEADER = 4
MAX_ERROR_RANKS = 256    # a flag per rank of the largest CUDA group (jit/variants.py MAX_RANKS)
ERR_TIMEOUT = 1          # a peer's signal did not arrive before the deadline
ERR_OVERFLOW = 2         # more rows than the receive region / num_worst_tokens hold
ERR_NO_TRANSPORT = 3     # a rank is neither mapped nor served by a transport
ERR_MASKED = 4           # elastic: the survivors masked this rank out
ERR_PROXY = 5            # the host proxy took no command in time
ERR_PEER_FAILED = 6      # a peer's call failed: it signalled FAILED_VALUE
ERR_MISMATCH = 7         # the ranks' call signatures differ (moe_comm/signature.py)

# The host proxy's command ring (u64 words in host memory; csrc/kernels/proxy_ring.cuh has
# the protocol): header words, then slots {seq, op << 32 | rank, offset, bytes or value}.
PROXY_HEAD, PROXY_DEPTH, PROXY_TIMEOUT, PROXY_TAIL = 0, 1, 2, 8   # header word indices
PROXY_HEADER_WORDS, PROXY_SLOT_WORDS = 16, 4
PROXY_OP_PUT, PROXY_OP_SIGNAL = 1, 2
# What every rank must pass alike, one tagged word each (one line): the call's signature.
NORMAL_CALL_FIELDS = ("call", "hidden", "dtype", "scale_cols", "topk", "num_experts",
                      "num_worst_tokens", "handle")
# "layout_refused": not a parameter but a refusal (rank + 1, or 0): a rank that cannot take
# a new LL layout (errors.LayoutLockedError) makes every rank's check fail - values differ
# whenever any rank refuses, also when all do.
LL_CALL_FIELDS = ("call", "hidden", "use_fp8", "round_scale", "topk", "num_experts",
                  "num_max_dispatch_tokens_per_rank", "layout_refused")
CALL_WORDS = LINE_WORDS
FENCE_WORD = 4                       # header word a masked rank finds set (HeaderLayout.fence)
DOORBELL_WORD = 5    # header word set while its rank sleeps in a C wait (host_ops.c "Doorbells")
SLAB_ALIGN = 64                      # bytes: each sub-array of a SlabLayout starts on a line


def tag(epoch: int, value: int) -> int:
    """Encode ``value`` for op ``epoch`` into one signal word."""
    return (epoch << VALUE_BITS) | value


def tag_epoch(word):
    """Epoch field of a signal word (works on ints and int64 tensors/arrays)."""
    return word >> VALUE_BITS


def tag_value(word):
    """Value field of a signal word (works on ints and int64 tensors/arrays)."""
    return word & VALUE_MASK


def agree_rounds(num_ranks: int) -> int:
    """The most rounds one mask agreement of ``num_ranks`` ranks can take: a round that hears
    from everyone it listens to decides, and each other round loses at least one rank."""
    return num_ranks + 1


def agree_round_tag(seq: int, rnd: int, num_ranks: int) -> int:
    """Epoch field of a MASK row of round ``rnd`` (1-based) of agreement ``seq``: unique over
    the rounds of many agreements, so a row of another round never matches."""
    return ((seq - 1) * agree_rounds(num_ranks) + rnd - 1) % MAX_EPOCH + 1


def mask_words(active):
    """bool [R] -> the words of a MASK row (bit r of word r // 32), as int64."""
    bits = np.zeros(-(-len(active) // MASK_BITS) * MASK_BITS, dtype=np.int64)
    bits[:len(active)] = np.asarray(active, dtype=bool)
    return (bits.reshape(-1, MASK_BITS) << np.arange(MASK_BITS)).sum(1)


def mask_bits(words, num_ranks: int):
    """The words of a MASK row (values, not tagged) -> bool [num_ranks]."""
    w = np.asarray(words, dtype=np.int64)
    return (((w[:, None] >> np.arange(MASK_BITS)) & 1).reshape(-1)[:num_ranks]).astype(bool)


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True)
class HeaderLayout:
    """Word offsets of every signal slot in a segment of a group of ``num_ranks`` ranks."""

    num_ranks: int

    @property
    def row_words(self) -> int:
        # one NOTIFY row, line aligned: R per-rank counts, then (a hierarchical call of the
        # host backend, moe_comm/host/relay.py) up to R per-host counts, the free heap and
        # the rank's token count (the rounds of a call too big for it, relay_rounds.py)
        return round_up(2 * self.num_ranks + 2, LINE_WORDS)

    @property
    def mask_words(self) -> int:           # words of one MASK row (32 rank bits per word)
        return -(-self.num_ranks // MASK_BITS)

    # word 0: magic, word 1: version, word 2: num_ranks, word 3: heap offset (bytes),
    # word 4: FENCE (at a place that does not depend on R: every kernel reads it)
    def notify(self, parity: int, src: int) -> int:
        return LINE_WORDS + (parity * self.num_ranks + src) * self.row_words

    def grant(self, dst: int) -> int:
        return self.notify(2, 0) + LINE_WORDS * dst

    def done(self, src: int) -> int:
        return self.grant(self.num_ranks) + LINE_WORDS * src

    def mask(self, parity: int, src: int) -> int:
        row = round_up(self.mask_words, LINE_WORDS)
        return self.done(self.num_ranks) + row * (parity * self.num_ranks + src)

    def decided(self, parity: int, src: int) -> int:
        row = round_up(self.mask_words, LINE_WORDS)
        return self.mask(2, 0) + row * (parity * self.num_ranks + src)

    @property
    def fence(self) -> int:
        return FENCE_WORD

    def call(self, parity: int, src: int) -> int:
        return self.decided(2, 0) + CALL_WORDS * (parity * self.num_ranks + src)

    def ll_dispatch_free(self, buf: int, src: int) -> int:
        return self.call(2, 0) + LINE_WORDS * (buf * self.num_ranks + src)

    def ll_combine_free(self, buf: int, src: int) -> int:
        return self.ll_dispatch_free(LL_NUM_BUFFERS, 0) + LINE_WORDS * (buf * self.num_ranks
                                                                        + src)

    def ll_combine_done(self, buf: int, src: int) -> int:
        return self.ll_combine_free(LL_NUM_BUFFERS, 0) + LINE_WORDS * (buf * self.num_ranks + src)

    def ll_call(self, buf: int, src: int) -> int:
        return self.ll_combine_done(LL_NUM_BUFFERS, 0) + CALL_WORDS * (buf * self.num_ranks +
                                                                       src)

    @property
    def ll_first(self) -> int:
        """First word of the low-latency slots (zeroed by a low-latency reset)."""
        return self.ll_dispatch_free(0, 0)

    @property
    def num_words(self) -> int:
        return self.ll_call(LL_NUM_BUFFERS, 0)

    @property
    def nbytes(self) -> int:
        """Header size in bytes; the heap starts right after, page aligned."""
        return round_up(self.num_words * 8, PAGE)


@dataclass(frozen=True)
class SlabLayout:
    """Layout of one normal-mode receive region ("slab") holding ``rows`` received tokens.

    Sub-arrays, each row-major, :data:`SLAB_ALIGN`-byte aligned, in this order: payload
    ``[rows, row_bytes]``,
    fp8 scales ``[rows, scale_cols]`` float32 (0 columns if not fp8), top-k ids
    ``[rows, topk]`` int64, top-k weights ``[rows, topk]`` float32, and (a relay's staging
    region, moe_comm/host/relay.py) a destination mask ``[rows, mask_cols]`` uint8: which
    ranks of the relay's host get the row. Rows are ordered by source
    rank, then by the token's index on the source: source ``s`` owns rows
    ``[prefix[s], prefix[s] + count[s])``, so every sender computes its rows from the count
    matrix alone.
    """

    rows: int
    row_bytes: int
    scale_cols: int = 0
    topk: int = 0
    mask_cols: int = 0

    def _sizes(self):
        return (self.rows * self.row_bytes, self.rows * self.scale_cols * 4,
                self.rows * self.topk * 8, self.rows * self.topk * 4,
                self.rows * self.mask_cols)

    # cached: a call asks for them per peer and per sub-array (frozen: computed once)
    @functools.cached_property
    def offsets(self):
        offs, at = [], 0
        for size in self._sizes():
            offs.append(at)
            at = round_up(at + size, SLAB_ALIGN)
        return offs

    @functools.cached_property
    def nbytes(self) -> int:
        sizes, offs = self._sizes(), self.offsets
        return round_up(offs[-1] + sizes[-1], PAGE)

    @property
    def num_pages(self) -> int:
        return max(1, self.nbytes // PAGE)


def eager_slot_bytes(num_ranks: int) -> int:
    """Bytes of one eager slot of a host-backend segment (moe_comm/host/eager.py): one per
    (parity, source rank), so a sender's small rows need no grant. 8 MiB / ranks, at most
    4 MiB and its flag's page: 4 MiB on 2 ranks (a 1024-token call of H=1024 bf16 rows with
    top-8 ids per pair, or 256 tokens of H=7168), 2 MiB on 4, 128 KiB on 64: the two
    parities of all sources stay within 16 MiB a rank (and a page or two of rounding).
    (Calls that fit go as small calls, host/small.py: at 64 x 7168 on 2 ranks about 2x
    faster than granted regions. With 1 MiB slots a 2-rank 512 x 1024 call just missed them,
    and its dispatch took 774 us, against MPICH's 704; with 2 MiB a 2-rank 1024 x 1024
    dispatch did, 505-533 us against 224-476 with 4 MiB, calls of each alternating. Since
    granted calls run in C, a large dispatch on one host fills less of a slot: eager.room.)"""
    return round_up(max(16 << 10, min((4 << 20) + PAGE, (8 << 20) // max(1, num_ranks))),
                    PAGE)


def stream_chunk_rows(rows: int, row_bytes: int, scale_cols: int, topk: int,
                      heap_bytes: int) -> int:
    """Rows per round of a normal-mode receive region of ``rows`` rows in a heap of
    ``heap_bytes``: all of them when their slab fits the heap (one round, the single-copy
    path), else as many as fit half the heap (the region streams through it in rounds; the
    other half stays for results the caller still holds). 0 when not even one row fits. Every
    rank computes it from the count matrix and the (equal) heap size: the same geometry
    everywhere."""
    if SlabLayout(rows, row_bytes, scale_cols, topk).nbytes <= heap_bytes:
        return rows
    budget = heap_bytes // 2
    per_row = row_bytes + scale_cols * 4 + topk * 12
    n = min(rows, budget // per_row)
    while n > 0 and SlabLayout(n, row_bytes, scale_cols, topk).nbytes > budget:
        n -= max(1, (SlabLayout(n, row_bytes, scale_cols, topk).nbytes - budget) // per_row)
    return max(n, 0)


LL_MAX_TOPK = 16                     # combine slots per token in the LL receive region
# receive areas a rank gives its low-latency senders to write recv_x into (host/ll_direct.py):
# the call it receives, the next one's, and two its caller may still hold
LL_RECV_AREAS = 4
# a dispatch FREE push's value: 0, or the area it gives the call two on (index + 1) in the low
# LL_AREA_BITS, the pages of it reserved above them (ll_direct.c AREA_BITS, AREA_PAGE = PAGE)
LL_AREA_BITS = 4


@dataclass(frozen=True)
class LLLayout:
    """Byte layout of one rank's low-latency region for ``max_tokens`` tokens per rank.

    Per buffer ``buf`` (two, alternating):

    - dispatch payload ``[local_expert][src][max_tokens]`` messages of ``msg_bytes``: the
      token (fp8 bytes then float32 scales, or bf16), written by src at row = the token's
      rank among src's tokens routed to that expert;
    - dispatch meta ``[local_expert][src][max_tokens]`` int64: ``token_index << 8 | topk_slot``
      so combine can send the expert output back to the right (token, slot);
    - dispatch counts ``[src]``: a line-aligned row of tagged words, one count per local
      expert, then ``base``: where src's messages to this rank start in src's own message
      order (src sorts its (token, slot) messages by expert, then token);
    - combine rows ``[max_tokens * LL_MAX_TOPK]`` of ``hidden`` bf16 in this rank's message
      order: an expert rank returns the rows of its block at ``base`` + packed position, so
      every return is a contiguous copy and the owner finds (token, slot) from its own sort;
    - announce rows ``[src]`` (as the count rows): src's counts, written before its rows by a
      sender that writes them straight into this rank's receive area (host/ll_direct.py):
      the senders after it place their rows after src's from them.
    """

    max_tokens: int
    hidden: int
    num_ranks: int
    num_experts: int

    @property
    def num_local(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def msg_bytes(self) -> int:
        return round_up(max(2 * self.hidden, self.hidden + self.hidden // 128 * 4), 64)

    @property
    def count_row_words(self) -> int:        # counts per local expert + the base word
        return round_up(self.num_local + 1, LINE_WORDS)

    def _sizes(self):
        slots = self.num_local * self.num_ranks * self.max_tokens
        return (slots * self.msg_bytes, slots * 8, self.num_ranks * self.count_row_words * 8,
                self.max_tokens * LL_MAX_TOPK * self.hidden * 2,
                self.num_ranks * self.count_row_words * 8)

    @property
    def buffer_bytes(self) -> int:
        return round_up(sum(round_up(s, PAGE) for s in self._sizes()), PAGE)

    def offset(self, buf: int, part: str, stride: int) -> int:
        """Byte offset of ``part`` in {"payload", "meta", "counts", "combine", "announce"} of
        ``buf``.

        ``stride``: bytes between the two buffers, the region's own (:func:`ll_stride`), not
        this layout's size: buffer ``buf`` of any layout that fits lies in the same half of
        the region, so a rank calling with another shape (caught by the call signature) can
        never write into the other buffer, which may hold a call still being received."""
        if self.buffer_bytes > stride:
            raise ValueError(f"a low-latency buffer of {self.buffer_bytes} bytes does not fit "
                             f"the region's {stride}")
        at = buf * stride
        for name, size in zip(("payload", "meta", "counts", "combine", "announce"),
                              self._sizes()):
            if name == part:
                return at
            at += round_up(size, PAGE)
        raise KeyError(part)

    @property
    def nbytes(self) -> int:
        return LL_NUM_BUFFERS * self.buffer_bytes


def ll_stride(ll_bytes: int) -> int:
    """Bytes between the two buffers of a low-latency region of ``ll_bytes``: half of it, in
    whole pages (a layout fits when its ``nbytes <= ll_bytes``)."""
    return ll_bytes // LL_NUM_BUFFERS // PAGE * PAGE


def ll_msg_stride(hidden: int, fp8: bool) -> int:
    """Bytes of one low-latency message: the token, and its scales with fp8; a multiple of 16
    so rows move as int64 words (torch's CPU row scatter is ~7x faster on int64 than bytes)."""
    return round_up(hidden + hidden // 128 * 4, 16) if fp8 else 2 * hidden
