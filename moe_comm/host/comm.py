"""The host backend's communicator: every rank's segment mapped, signal slots, deadlines,
and the set of active ranks.

It knows nothing about dispatch or combine; the mode modules (``normal.py``, ``ll.py``) build
their protocols from three primitives: :meth:`HostComm.signal` (release-store a tagged word
into a peer's header), :meth:`HostComm.wait` (deadline-bounded wait for tagged words in this
rank's own header: peers push, nobody polls remote memory) and :meth:`HostComm.peer_heap` (a
byte tensor over a peer's heap, written directly: the CPU analog of a CUDA IPC pointer).

Ranks on other hosts (another machine, or another network namespace) cannot be mapped: their
``peer_heap``/``peer_ll`` is a local staging mirror of their segment, and the mode modules
call :meth:`HostComm.commit` for each range they wrote, which a transport
(``moe_comm.transport``: host proxy over TCP or verbs) puts into the peer's segment; signals
to them travel on the same ordered channel, after the data. For ranks on this host
``commit`` does nothing: the writes already landed.

Rank health: ``active`` (bool [R]) holds the ranks still taking part. Waits skip inactive
ranks and the modes send nothing to them. In elastic mode a rank that misses a deadline is
marked inactive instead of raising, and :meth:`HostComm.agree` makes the survivors leave each
call with the same mask (flooding rounds of mask words with an early decision), and fences the
ranks it drops (their FENCE word: they raise RankMaskedError before they wait or write again).
"""
from __future__ import annotations

import logging
import os
import secrets
import time

import numpy as np
import torch
import torch.distributed as dist

from .. import signature
from ..errors import RankMaskedError
from ..shm import atomics
from ..shm.identity import host_identity, ranks_by_host
from ..shm.segment import Segment, pid_alive, reclaim_stale_segments, segment_name, segment_pid
from ..transport import open_transport
from ..wire import (CALL_WORDS, LL_RECV_AREAS, MAGIC, MAX_EPOCH, PAGE, VERSION, HeaderLayout,
                    agree_round_tag, agree_rounds, eager_slot_bytes, ll_stride, mask_bits,
                    mask_words, round_up, tag_value)
from . import native, ring
from .doorbell import Doorbells
from .heap import PageHeap
from .late_rows import LateRows
from .pool import OutputPool
from ..relay_map import Relays
from .relay import PATIENT_TIMEOUTS

log = logging.getLogger("moe_comm")

AGREE_GRACE_S = 1.0   # how long past its deadline a call waits for survivors' masks


AREAS_ENV = "MOE_COMM_LL_AREAS"      # "0": no receive areas (every LL row through the blocks)

class HostComm:
    def __init__(self, group, heap_bytes: int, ll_bytes: int, timeout_s: float,
                 elastic: bool = False, transport: str = "auto"):
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.timeout_s = float(timeout_s)
        self.elastic = bool(elastic)
        self.active = np.ones(self.num_ranks, dtype=bool)
        self.all_active = True           # active.all(), kept: a small call reads it (direct.py)
        self.agree_seq = 0
        self._deadline = 0.0
        self.layout = HeaderLayout(self.num_ranks)
        self.heap_offset = self.layout.nbytes
        self.heap_bytes = round_up(int(heap_bytes), PAGE)
        # eager slots right after the heap (host/eager.py): peer_heap views cover both, a
        # slot's pages counted on from the heap's
        self.eager_slot = eager_slot_bytes(self.num_ranks) if \
            os.environ.get("MOE_COMM_EAGER", "1") != "0" else 0
        self.ll_offset = self.heap_offset + self.heap_bytes + 2 * self.num_ranks * self.eager_slot
        self.ll_bytes = round_up(int(ll_bytes), PAGE)
        self.ll_stride = ll_stride(self.ll_bytes)      # bytes between the two LL buffers
        size = self.ll_offset + self.ll_bytes
        self.epoch = 0
        self.normal_seq = 0              # normal-mode calls: the eager slots' parity
        self.call_seq = 0                # signature rounds (CALL and NOTIFY parity)
        self.segments = []
        self._own = None
        self.transport = None

        reclaim_stale_segments()
        # Agree on a job id, find which ranks share this host, check segments are sized alike.
        hierarchical = os.environ.get("MOE_COMM_RELAY", "1") != "0"
        info = (host_identity(), size, secrets.token_hex(8), hierarchical,
                len(os.sched_getaffinity(0)), ring.able())
        infos = [None] * self.num_ranks
        dist.all_gather_object(infos, info, group=group)
        self.remote_ranks = [r for r in range(self.num_ranks) if infos[r][0] != info[0]]
        # more ranks than cores here: waits sleep rather than poll (atomics.Backoff)
        self.crowded = self.num_ranks - len(self.remote_ranks) > len(os.sched_getaffinity(0))
        # the same, decided alike on every rank of this host (the fewest cores any of them may
        # run on): eager.room sizes a dispatch's slots by it, which every rank must do alike
        self.shared_cores = self.num_ranks - len(self.remote_ranks) > \
            min(i[4] for i in infos if i[0] == info[0])
        # large combines streamed through the eager slots (ring.py): all ranks or none
        self.ring_combine = all(i[5] for i in infos)
        hosts = list(dict.fromkeys(i[0] for i in infos))      # host index: order of first rank
        # int64 [R] host index of every rank; None on one host (layout.tokens_per_host)
        self.host_of = torch.tensor([hosts.index(i[0]) for i in infos]) if len(hosts) > 1 \
            else None
        if len({i[1] for i in infos}) != 1:
            raise ValueError("num_nvl_bytes/num_rdma_bytes/num_experts (and MOE_COMM_EAGER) "
                             "must be equal on every rank; segment sizes differ: "
                             f"{[i[1] for i in infos]}")
        if len({i[3] for i in infos}) != 1:
            raise ValueError("MOE_COMM_RELAY must be the same on every rank: "
                             f"{[int(i[3]) for i in infos]}")
        # a token crosses to each other host once, through a relay there (relay.py)
        self.relays = Relays(self.host_of.tolist(), self.rank) if \
            self.host_of is not None and hierarchical else None
        job = infos[0][2]
        log.debug("moe_comm rank %d: job %s, %d rank(s) share this host's memory, ranks on "
                  "other hosts: %s", self.rank, job, self.num_ranks - len(self.remote_ranks),
                  self.remote_ranks or "none")
        self.job = job
        self._own = Segment.create(segment_name(job, self.rank), size)
        words = self._own.bytes[:self.layout.nbytes].view(np.int64)
        words[:4] = (MAGIC, VERSION, self.num_ranks, self.heap_offset)
        names = [None] * self.num_ranks
        dist.all_gather_object(names, self._own.name, group=group)
        remote = set(self.remote_ranks)
        # processes of the ranks on this host: a masked one that is gone writes nothing more
        self._pids = [None if r in remote else segment_pid(n) for r, n in enumerate(names)]
        try:
            for r, name in enumerate(names):
                self.segments.append(self._own if r == self.rank else None if r in remote
                                     else Segment.open(name))
            dist.barrier(group=group)
        finally:
            self._own.unlink()          # mapped by all: the name is no longer needed
        # a remote rank's memory here is a staging mirror: written, then committed (put)
        mem = [np.empty(size, np.uint8) if s is None else s.bytes for s in self.segments]
        self.words = [None if r in remote else m[:self.layout.nbytes].view(np.int64)
                      for r, m in enumerate(mem)]
        for r, w in enumerate(self.words):
            if w is not None and (w[0] != MAGIC or w[1] != VERSION or w[2] != self.num_ranks):
                raise RuntimeError(f"segment of rank {r} has a foreign header")
        self._heaps = [torch.from_numpy(m[self.heap_offset:self.ll_offset]) for m in mem]
        self._ll = [torch.from_numpy(m[self.ll_offset:size]) for m in mem]
        self._ll_words = [m[self.ll_offset:size].view(np.int64) for m in mem]
        self._mem = mem
        # every local rank's doorbell: the Python waits sleep on this rank's, the Python
        # writers ring the reader's (host/doorbell.py); None without the C library
        lib = native.library()
        self.bells = None if lib is None else Doorbells(self.words, self.rank, lib)
        if self.remote_ranks:
            self.transport = open_transport(
                group, self._own.bytes, self.remote_ranks, kind=transport,
                timeout_s=self.timeout_s,
                channel_groups=ranks_by_host([i[0] for i in infos], self.remote_ranks))
        self.ll_seq = {"dispatch": 0, "combine": 0}
        self.ll_layout = None            # the low-latency layout in use (signature.py)
        self.ll_base = {"dispatch": 0, "combine": 0}
        self.ll_cache = {}               # ll.py, small.py: views and addresses, built once
        self.poison = None               # tests: the byte fresh outputs start as (small.py)
        self.outputs = OutputPool()      # reused bases of large outputs (pool.outputs)
        self._told = self.active.copy()     # whom agreements tell: the last decision
        self.heap = PageHeap(self._own.bytes, self.heap_offset, self.heap_bytes)
        self.late_rows = LateRows(self.gone)     # LL combine rows a masked rank may write
        self._open_areas(job)

    def _open_areas(self, job: str) -> None:
        """Every rank's low-latency receive areas (host/ll_direct.py): LL_RECV_AREAS of
        ll_stride bytes a rank in a segment of their own, mapped by every rank, its pages
        reserved as the layouts in use need them (reserve_area). Only where every rank is on
        this host, has the C loops, and is not elastic (a masked rank's late rows could land
        in an area handed out again); else ``ll_areas`` is None and every row goes through
        the blocks of the region."""
        self.ll_areas = None             # [R] numpy uint8 over each rank's areas
        self.ll_area_next = [None, None]  # per buffer: (area, call) its FREE push gave
        self._area_segments = []
        wanted = (self.ll_stride > 0 and not self.remote_ranks and not self.elastic and
                  native.library() is not None and os.environ.get(AREAS_ENV, "1") != "0")
        own = Segment.create(segment_name(job + "a", self.rank),
                             LL_RECV_AREAS * self.ll_stride, reserve=False) if wanted else None
        names = [None] * self.num_ranks
        dist.all_gather_object(names, None if own is None else own.name, group=self.group)
        if any(n is None for n in names):
            if own is not None:
                own.close()
            return
        try:
            self._area_segments = [own if r == self.rank else Segment.open(n)
                                   for r, n in enumerate(names)]
            dist.barrier(group=self.group)
        finally:
            own.unlink()
        self.ll_areas = [seg.bytes for seg in self._area_segments]
        self._area_reserved = [0] * LL_RECV_AREAS

    def area_reserved(self, area: int) -> int:
        """Bytes reserved of this rank's receive area ``area`` (reserve_area)."""
        return self._area_reserved[area]

    def reserve_area(self, area: int, nbytes: int) -> bool:
        """Reserve the first ``nbytes`` of this rank's receive area ``area`` (once); False
        where /dev/shm cannot hold them (the rows then go through the region's blocks).
        Whole pages: the FREE push that gives the area says how many."""
        nbytes = round_up(nbytes, PAGE)
        if self._area_reserved[area] < nbytes:
            try:
                self._area_segments[self.rank].reserve(area * self.ll_stride, nbytes)
            except MemoryError:
                return False
            self._area_reserved[area] = nbytes
        return True

    # -- primitives -----------------------------------------------------------------------
    def next_epoch(self) -> int:
        self.epoch = self.epoch % MAX_EPOCH + 1
        return self.epoch

    def start_call(self) -> None:
        """Start the deadline of one call (or one half of a low-latency call)."""
        if not self.active[self.rank]:
            raise RankMaskedError(f"rank {self.rank} is masked out of this Buffer "
                                  "(active_ranks[rank] == 0); a new Buffer is needed to rejoin")
        self.check_fence()
        self._deadline = time.monotonic() + self.timeout_s
        if self.transport is not None:
            # staging mirrors are about to be rewritten: earlier puts must have left them
            # (not those to masked ranks: no call reads what they get, and a rank a
            # controller masked may have closed its end)
            live = [r for r in self.transport.remote_ranks if self.active[r]]
            lost = self.transport.flush(live, raise_on_timeout=not self.elastic)
            if lost:
                self.mask(lost, "transport flush")

    def next_normal_parity(self) -> int:
        """The eager slots' parity of the normal-mode call starting now (host/eager.py)."""
        self.normal_seq += 1
        return self.normal_seq % 2

    def eager_page(self, parity: int, src: int) -> int:
        """Where eager slot ``(parity, src)`` starts, in pages from the heap's start (so
        ``peer_heap`` and ``commit(..., "heap", ...)`` reach it like a granted region)."""
        return (self.heap_bytes + (parity * self.num_ranks + src) * self.eager_slot) // PAGE

    def slot(self, rank: int, word: int, n: int = 1) -> np.ndarray:
        """``n`` header words of ``rank``'s segment starting at ``word`` (a live view)."""
        return self.words[rank][word:word + n]

    def signal(self, rank: int, word: int, epoch: int, values) -> None:
        """Publish tagged ``values`` into ``rank``'s header after all earlier writes."""
        vals = np.asarray(values, dtype=np.int64)
        if self.words[rank] is None:
            self._remote_signal(rank, word * 8, (epoch << 32) | vals)
            return
        atomics.store_words(self.slot(rank, word, vals.size), (epoch << 32) | vals)
        if self.bells is not None:
            self.bells.ring(rank)

    def signal_each(self, ranks, word: int, epoch: int, values) -> None:
        """:meth:`signal` of the same ``values`` into the same slot of every rank in
        ``ranks`` (a rank telling all its peers): tagged once, one release fence for all."""
        tagged = (epoch << 32) | np.asarray(values, dtype=np.int64)
        ranks = [int(r) for r in ranks]
        n = tagged.size
        atomics.store_each([self.slot(r, word, n) for r in ranks
                            if self.words[r] is not None], tagged)
        if self.bells is not None:
            for r in ranks:
                self.bells.ring(r)
        for r in ranks:
            if self.words[r] is None:
                self._remote_signal(r, word * 8, tagged)

    def _remote_signal(self, rank: int, byte_offset: int, words: np.ndarray) -> None:
        for i, w in enumerate(np.atleast_1d(words).tolist()):
            self.transport.signal(rank, byte_offset + 8 * i, w)

    def is_remote(self, rank: int) -> bool:
        """Whether ``rank`` is on another host (its memory here a staging mirror)."""
        return self.words[rank] is None

    def commit(self, rank: int, region: str, start: int, nbytes: int) -> None:
        """Make ``nbytes`` written at ``start`` of ``rank``'s ``region`` ("heap" or "ll")
        travel to it (ranks on other hosts; a no-op for mapped peers)."""
        if self.words[rank] is None and nbytes > 0:
            at = (self.heap_offset if region == "heap" else self.ll_offset) + start
            self.transport.put(rank, at, self._mem[rank][at:at + nbytes])

    @property
    def deadline(self) -> float:
        """When the call in progress times out (``time.monotonic()`` seconds)."""
        return self._deadline

    def refresh_deadline(self) -> float:
        """A fresh deadline for the next round of a call that streams through the heap in
        rounds (each round is one exchange with its peers, bounded on its own). Returns it."""
        self._deadline = time.monotonic() + self.timeout_s
        return self._deadline

    def wait(self, waits: dict, epoch: int, op: str, on_ready=None, patient=(),
             on_batch=None) -> set:
        """Wait for the tagged words ``waits`` (rank -> view of *this* rank's header) of the
        active ranks until the call's deadline. Returns the ranks that missed it (elastic
        mode: now masked) or raises :class:`CommTimeoutError` naming them.

        ``patient``: ranks whose words may come late from a healthy rank, because it first
        waits out dead peers of its own (a relay, relay.py: up to PATIENT_TIMEOUTS of them one
        after the other, each a fresh deadline). In elastic mode those still silent at the
        deadline get PATIENT_TIMEOUTS more timeouts, unless their process is known to be gone
        (ranks on this host): a dead one there costs one deadline, as elsewhere.
        ``on_batch``: atomics.wait_words's, in place of on_ready."""
        waits = {r: w for r, w in waits.items() if self.active[r]}
        silent = atomics.wait_words(waits, epoch, self._deadline, op, self.timeout_s,
                                    on_ready, raise_on_timeout=not self.elastic,
                                    check=self.check_fence, crowded=self.crowded,
                                    bell=self.bells, on_batch=on_batch)
        slow = [r for r in silent if r in patient and not self.gone(r)]
        if slow:
            later = atomics.wait_words({r: waits[r] for r in slow}, epoch,
                                       time.monotonic() + PATIENT_TIMEOUTS * self.timeout_s,
                                       op, self.timeout_s,
                                       on_ready, raise_on_timeout=False,
                                       check=self.check_fence, crowded=self.crowded,
                                       bell=self.bells, on_batch=on_batch)
            silent = (silent - set(slow)) | later
        if silent:
            self.mask(silent, op)
            # Healthy peers may have been held up by the same silent rank: they get a fresh
            # deadline for the rest of this call instead of being masked behind it.
            self._deadline = time.monotonic() + self.timeout_s
        return silent

    def post_call(self, epoch: int, row) -> dict:
        """Send this normal call's signature (moe_comm/signature.py) to every active rank;
        returns the views :meth:`verify_call` waits on. Two parities, like NOTIFY: a rank
        finishes a round only once every peer has written its row of it."""
        lay, me = self.layout, self.rank
        parity = self.call_seq % 2
        self.call_seq += 1
        self.signal_each(np.flatnonzero(self.active), lay.call(parity, me), epoch, row)
        return {s: self.slot(me, lay.call(parity, s), CALL_WORDS)
                for s in range(self.num_ranks)}

    def gather(self, waits: dict, epoch: int, op: str, seconds: float) -> None:
        """Wait up to ``seconds`` (never past the call's deadline) for every active rank's
        tagged words of ``waits``, without taking them: a later :meth:`wait` then finds
        whatever came in one look. Silent ranks are not masked or raised on here."""
        waits = {r: w for r, w in waits.items() if self.active[r]}
        atomics.wait_words(waits, epoch, min(self._deadline, time.monotonic() + seconds), op,
                           self.timeout_s, raise_on_timeout=False, check=self.check_fence,
                           crowded=self.crowded, bell=self.bells)

    def verify_call(self, waits: dict, epoch: int, op: str) -> None:
        """Wait for every active rank's signature; CallMismatchError on every rank if any two
        differ (each rank hears every signature, so all decide alike)."""
        self.wait(waits, epoch, op + "/notify")
        signature.check(op, {s: tag_value(waits[s]) for s in np.flatnonzero(self.active)})

    def mask(self, ranks, why: str) -> None:
        ranks = sorted(r for r in ranks if self.active[r])
        if ranks:
            self.active[ranks] = False
            self.all_active = False
            log.warning("moe_comm rank %d: masking rank(s) %s (%s)", self.rank, ranks, why)

    def agree(self, op: str, late: float = 0.0) -> None:
        """Elastic mode: leave the call with the same ``active`` mask as every survivor.

        Flooding rounds with early decision (docs/ARCHITECTURE.md "Agreement" has why it
        converges). Round ``r``: push this rank's estimate (its view ANDed with every
        estimate heard so far) to every rank the previous agreement kept, wait for the
        estimate of every rank it still listens to, AND them in, and drop the ranks that were
        silent. A round in which nobody it listens to was silent decides: the rank writes its
        decision to everyone and leaves. A rank that reads a peer's decision while waiting
        takes it, writes it on, and leaves. Each round loses a rank or decides, so an
        agreement ends after at most ``agree_rounds(R)`` rounds.

        Each round waits one deadline plus ``AGREE_GRACE_S`` from its start (round 1: or
        until the call's deadline plus the grace, if later): a healthy peer may arrive a
        whole deadline late, having timed out on a rank whose signals reached this one, or
        having spent the previous round waiting for a rank that died in it. The rest of the
        call then gets a fresh deadline. ``late``: seconds more for round 1, when a healthy
        peer may arrive later still (one that waited patiently, :meth:`wait`). The survivors
        write FENCE into the header of every rank the decision drops; rows go to every rank
        the previous agreement kept."""
        lay, me, R = self.layout, self.rank, self.num_ranks
        self.agree_seq = self.agree_seq % MAX_EPOCH + 1
        seq = self.agree_seq
        # told: every rank the last agreement kept, so a rank masked since then (by a wait
        # of this call or of an earlier one that raised before agreeing) is told and fenced
        tell = [p for p in np.flatnonzero(self._told).tolist() if p != me]
        estimate = self.active.copy()
        listen = [p for p in np.flatnonzero(estimate).tolist() if p != me]
        grace = min(self.timeout_s, AGREE_GRACE_S)
        deadline = max(self._deadline, time.monotonic() + self.timeout_s) + grace + late
        decision = None
        for rnd in range(1, agree_rounds(R) + 1):
            row_tag, row = agree_round_tag(seq, rnd, R), mask_words(estimate)
            self.signal_each(tell, lay.mask(rnd % 2, me), row_tag, row)
            heard, decision = self._agree_round(listen, rnd, seq, row_tag, deadline,
                                                op + "/agree")
            if decision is not None:
                break
            for words in heard.values():
                estimate &= mask_bits(words, R)
            silent = [p for p in listen if p not in heard]
            estimate[silent] = False
            if not silent:
                decision = estimate
                break
            listen = sorted(heard)
            deadline = time.monotonic() + self.timeout_s + grace
        if decision is None:             # every rank it listened to went silent: alone
            decision = estimate
        row = mask_words(decision)
        self.signal_each(tell, lay.decided(seq % 2, me), seq, row)
        dropped = [p for p in tell if not decision[p]]
        # a late rank stops before it writes again
        self.signal_each(dropped, lay.fence, seq, me + 1)
        self.mask(np.flatnonzero(~decision & self.active).tolist(), op + ": agreed by survivors")
        self._told = self.active.copy()
        self._deadline = time.monotonic() + self.timeout_s
        if not self.active[me]:
            raise RankMaskedError(f"{op}: rank {me} was masked out by its peers (it missed "
                                  "their deadline); a new Buffer is needed to rejoin")

    def _agree_round(self, listen, rnd, seq, row_tag, deadline, op):
        """Wait for round ``rnd``'s estimate of every rank in ``listen``, or for a decision
        of agreement ``seq`` from any of them. Returns ({rank: estimate words} heard, the
        first decision read as bool [R] or None)."""
        lay, me, mw = self.layout, self.rank, self.layout.mask_words
        rows = atomics.SlotPoll({p: self.slot(me, lay.mask(rnd % 2, p), mw) for p in listen})
        decided = atomics.SlotPoll({p: self.slot(me, lay.decided(seq % 2, p), mw)
                                    for p in listen})
        heard = {}
        backoff = atomics.Backoff(self.crowded)
        while True:
            self.check_fence()
            # a decision first, from any peer (one already heard too): it has left. (Each
            # row's tags and values come from the same load.)
            decisions = decided.take(seq)
            if decisions:
                atomics.acquire()
                return heard, mask_bits(tag_value(decisions[0][1]), self.num_ranks)
            arrived = rows.take(row_tag)
            if arrived:
                atomics.acquire()
                heard.update((p, tag_value(words)) for p, words in arrived)
            if len(heard) == len(listen) or time.monotonic() > deadline:
                if len(heard) < len(listen):
                    log.warning("moe_comm rank %d: %s round %d: no word from rank(s) %s",
                                me, op, rnd, sorted(set(listen) - set(heard)))
                return heard, None
            backoff.pause()

    def check_fence(self) -> None:
        """RankMaskedError if the survivors masked this rank (they wrote its FENCE word)."""
        w = int(self.words[self.rank][self.layout.fence])
        if w:
            self.active[self.rank] = False
            self.all_active = False
            raise RankMaskedError(f"rank {self.rank} was masked out by rank "
                                  f"{int(tag_value(w)) - 1} (it missed the survivors' deadline);"
                                  " a new Buffer is needed to rejoin")

    def masked_may_write(self) -> bool:
        """Whether a masked rank's process may still be there to write late (on another host
        it is never known gone)."""
        return any(not self.active[r] and not self.gone(r) for r in range(self.num_ranks))

    def gone(self, rank: int) -> bool:
        """Whether ``rank``'s process is known to be gone (a rank on this host only)."""
        pid = self._pids[rank]
        return pid is not None and not pid_alive(pid)

    def peer_heap(self, rank: int) -> torch.Tensor:
        return self._heaps[rank]

    def heap_slot(self, rank: int, byte_offset: int, n: int) -> np.ndarray:
        """``n`` int64 words at ``byte_offset`` of ``rank``'s heap view (the eager slots'
        flags lie past the heap proper)."""
        at = self.heap_offset + byte_offset
        return self._mem[rank][at:at + 8 * n].view(np.int64)

    def heap_signal(self, rank: int, byte_offset: int, epoch: int, values) -> None:
        """:meth:`signal` into a word of ``rank``'s heap view."""
        tagged = (epoch << 32) | np.asarray(values, dtype=np.int64)
        if self.words[rank] is None:
            self._remote_signal(rank, self.heap_offset + byte_offset, tagged)
            return
        atomics.store_words(self.heap_slot(rank, byte_offset, tagged.size), tagged)
        if self.bells is not None:
            self.bells.ring(rank)

    def peer_ll(self, rank: int) -> torch.Tensor:
        """Byte tensor over ``rank``'s low-latency region."""
        return self._ll[rank]

    def ll_slot(self, rank: int, byte_offset: int, n: int) -> np.ndarray:
        """``n`` int64 words of ``rank``'s low-latency region at ``byte_offset``."""
        w = byte_offset // 8
        return self._ll_words[rank][w:w + n]

    def ll_signal(self, rank: int, byte_offset: int, epoch: int, values) -> None:
        vals = np.asarray(values, dtype=np.int64)
        if self.words[rank] is None:
            self._remote_signal(rank, self.ll_offset + byte_offset, (epoch << 32) | vals)
            return
        atomics.store_words(self.ll_slot(rank, byte_offset, vals.size), (epoch << 32) | vals)
        if self.bells is not None:
            self.bells.ring(rank)

    def reset_ll(self) -> None:
        """Zero this rank's low-latency region and LL header slots (callers barrier around)."""
        self._ll[self.rank].zero_()
        lay = self.layout
        self.words[self.rank][lay.ll_first:lay.num_words] = 0
        # Call numbers go on (a signal still in flight from before, e.g. on a transport,
        # carries an old number and can never match); the next two calls of each kind skip
        # the flow-control wait, as the first two ever do.
        self.ll_base = dict(self.ll_seq)
        self.ll_area_next = [None, None]

    def poison_free_heap(self, byte: int = 0xFF) -> None:
        """Fill every free heap page with ``byte``, and from now on the outputs small calls
        allocate outside the heap (small.py) too (tests: unwritten output rows show up)."""
        self.poison = byte
        self.heap._drain()
        for start, length in self.heap._free:
            self.heap.view(start, length * PAGE)[:] = byte

    def destroy(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self._heaps = self._ll = self._ll_words = self.words = self._mem = None
        self.bells = None                # (addresses in the segments, and a view of one)
        self.ll_cache = {}
        self.outputs.clear()
        self.heap = None
        for s in self.segments + self._area_segments:
            if s is not None:
                s.close()
        self.segments, self._area_segments, self.ll_areas = [], [], None
        if self._own is not None:
            self._own.close()
