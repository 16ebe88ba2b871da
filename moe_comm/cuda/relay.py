"""Hierarchical (relay) normal mode of the CUDA backend: a token crosses to each other host once.

The host backend's protocol (moe_comm/host/relay.py; moe_comm/relay_map.py, the rule both
share: the relay of sender s on host H is H's rank with s's local index) with the CUDA backend's
kernels (csrc/kernels/relay.cuh has the device side and the order of every step). What this
module adds is the host's part: from the count matrices every rank holds after the notify
(ranks x ranks, and ranks x hosts: the notify carries each rank's token count per host),
where every slab lies and which rows each kernel moves, as small tables of jobs, the same on
every rank. Results, ordering and handles are the flat protocol's (normal.py): dispatch
outputs bit for bit, combine up to the float summation order (a relay sums its host's rows of
a token in float32 and sends one row in the payload dtype, as DeepEP does; the owner sums its
host's rows and one such row per other host).

When a call goes by relays (:func:`wanted`, then :func:`dispatch_fits` /
:func:`combine_fits`, all decided alike on every rank): the group spans hosts
(``comm.host_of``), ``MOE_COMM_RELAY`` is not ``0``, the dispatch has no num_worst_tokens
(its geometry must be known on the host), and every rank's output slab plus its staging slab
(dispatch), or its flat combine slab plus its gather slab (combine), fit its data region in
one copy. A dispatch that does not fit goes in token rounds of relayed calls that do
(rounds.py); one that does not fit even one token a round, MOE_COMM_RELAY=0 and
num_worst_tokens calls go flat (streamed where they must).

Masked ranks and elastic groups (the host backend's design, moe_comm/host/relay.py): a call's
relays are picked among the active ranks (``Relays.among``), from the mask the host reads
where it synchronises anyway (a fresh dispatch: with the count matrix, after the notify's
agreement; a cached dispatch or a combine on a group with a mask: before its notify, the mask
the last agreement left), so every rank derives the same choice. Elastic, the relays' waits
mask silent ranks in ``comm.active`` like every other wait, the waits behind a relay that may
itself have waited out a dead peer get ``PATIENT_TIMEOUTS`` more deadlines, and the call ends
with an agreement that the host reads (:func:`lost`): if a rank the relays were picked among
is gone, every survivor raises nothing and redoes the call flat over the survivors (normal.py;
the inputs are the caller's). Each relayed slab lies past the rank's floor and the call notes
where its slabs end (``comm.floors``), so a late writer lands in slabs no later call reads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from ..jit.kernel_args import pack
from ..jit.launch import launch
from ..jit.variants import THREADS
from ..relay_map import Relays
from ..wire import PAGE, SLAB_ALIGN, SlabLayout, round_up
from .comm import SIGNAL_STRIDE, CudaComm
from .kernel_inputs import errors, group

RELAY_REDUCE_KERNEL = {torch.bfloat16: "moe_relay_reduce_bf16",
                       torch.float16: "moe_relay_reduce_f16",
                       torch.float32: "moe_relay_reduce_f32"}


def enabled(comm: CudaComm) -> bool:
    """``MOE_COMM_RELAY`` (not ``0``: relays), read once per communicator (a Buffer), at its
    first normal call; it must be the same on every rank, as on the host backend."""
    on = getattr(comm, "_relay_enabled", None)
    if on is None:
        on = comm._relay_enabled = os.environ.get("MOE_COMM_RELAY", "1") != "0"
    return on


# More deadlines for a wait behind a relay, and for the closing agreement. A CUDA relay waits
# at most one deadline before it writes (dispatch: for the senders it relays for; combine: for
# its host's rows), each wait starting right after the call's notify, so one more deadline
# covers it (the host backend's relay may wait two in a row: PATIENT_TIMEOUTS = 2 there).
PATIENT_TIMEOUTS = 1


def wanted(comm: CudaComm, num_worst_tokens: int) -> bool:
    """Whether a call may go by relays, decided before its notify from what every rank
    knows alike."""
    return comm.host_of is not None and not num_worst_tokens and enabled(comm)


def current_mask(comm: CudaComm):
    """The rank mask as a numpy bool [R] (a synchronisation: asked only where one happens
    anyway, or on a group with a mask), None while no rank can be masked."""
    if comm.active is None:
        return None
    return comm.active.cpu().numpy() != 0


def lost(comm: CudaComm, routes: Routes) -> bool:
    """After a relayed call's closing agreement (elastic): whether a rank its relays were
    picked among is gone (a synchronisation; every survivor reads the same agreed mask).
    Raises first what this rank's kernels reported (RankMaskedError when it was dropped)."""
    mask = current_mask(comm)
    comm.check()
    return mask is not None and not routes.topo.relays.serve(mask)


def _live_now(comm: CudaComm, flags: torch.Tensor) -> torch.Tensor:
    """The kernels' Active words (transport.cuh) for a wait for, or a flat send to, the ranks
    on in ``flags`` that are active now: word -1 says whether a missed deadline masks
    (elastic) or is reported. Fresh per call: an elastic wait clears its words (see
    :func:`_fold`); while no rank can be masked they never change, and are kept."""
    static = comm.active is None
    if static:
        cache = comm.__dict__.setdefault("_relay_live", {})
        if id(flags) in cache:
            return cache[id(flags)][1]
    words = torch.empty(1 + comm.num_ranks, dtype=torch.int32, device=comm.device)
    words[0] = int(comm.elastic)
    words[1:] = flags if static else flags * comm.active
    if static:                  # keyed by the Topology's tensor, which the entry keeps alive
        cache[id(flags)] = (flags, words[1:])
    return words[1:]


def _fold(comm: CudaComm, flags: torch.Tensor, live: torch.Tensor) -> None:
    """Elastic: the ranks a wait on ``live`` masked are masked in the group's mask too (on
    the stream, no synchronisation), so the closing agreement hears of them."""
    if comm.elastic:
        comm.active.mul_(torch.where(flags != 0, live, torch.ones_like(live)))


def _note_ends(comm: CudaComm, nbytes) -> None:
    """Elastic: where this operation's slabs end at every rank (``nbytes`` [R] from each
    rank's floor), for a move past them if a rank that may still write there is dropped
    (normal.cuh Group.note_end, for slabs the flat send kernels do not know of)."""
    if comm.floors is not None:
        R = comm.num_ranks
        ends = torch.tensor([int(n) for n in nbytes], dtype=torch.int64, device=comm.device)
        comm.floors[R:2 * R] = comm.floors[:R] + ends


def _flags(num_ranks: int, ranks, device) -> torch.Tensor:
    out = torch.zeros(num_ranks, dtype=torch.int32)
    out[list(ranks)] = 1
    return out.to(device)


class Topology:
    """Who relays for whom in one CudaComm's group among the ranks ``active`` marks (None:
    all), with the device tables every call uses (built once per mask)."""

    def __init__(self, comm: CudaComm, active=None):
        R, me, dev = comm.num_ranks, comm.rank, comm.device
        host_of = [int(h) for h in comm.host_of.tolist()]
        self.relays = r = Relays(host_of, me, active)
        self.num_ranks, self.rank, self.device = R, me, dev
        self.here = host_of[me]
        self.num_hosts, self.mask_cols, self.local = r.num_hosts, r.mask_cols, r.local
        self.relay_of = [r.relay(me, h) if h != self.here else -1 for h in range(r.num_hosts)]
        ranks_on = np.full((r.num_hosts, r.mask_cols), -1, np.int32)
        for h, ranks in enumerate(r.ranks_on):
            ranks_on[h, :len(ranks)] = ranks
        self.ranks_on = torch.from_numpy(ranks_on).to(dev)
        self.host_cols = [torch.tensor(ranks, dtype=torch.long, device=dev)
                          for ranks in r.ranks_on]
        mine = [f for f in self.relay_of if f is not None and f >= 0]
        self.relay_of = [-1 if f is None else f for f in self.relay_of]
        self.local_active = [d for d in self.local if r.active[d]]
        # host h's ranks by local index, -1 where masked (first_per_host)
        self.host_cols_active = [torch.tensor([bool(r.active[d]) for d in ranks], device=dev)
                                 for ranks in r.ranks_on]
        self.to_local = _flags(R, self.local_active, dev)
        self.to_relays = _flags(R, mine, dev)
        self.to_relayed = _flags(R, r.relayed[me], dev)
        self.relay_of_dev = torch.tensor(self.relay_of, dtype=torch.int32, device=dev)


def topology(comm: CudaComm, active=None) -> Topology:
    """The Topology among the ranks ``active`` (numpy bool [R] or None: all) marks, kept per
    mask."""
    cache = getattr(comm, "_relay_topologies", None)
    if cache is None:
        cache = comm._relay_topologies = {}
    key = None if active is None or np.asarray(active, bool).all() else \
        np.asarray(active, bool).tobytes()
    topo = cache.get(key)
    if topo is None:
        topo = cache[key] = Topology(comm, None if key is None else active)
    return topo


def host_positions(topo: Topology, in_rank: torch.Tensor):
    """``(counts int32 [H], pos int32 [T, H])`` on the device (no synchronisation): tokens of
    this rank per other host (0 for its own), and each token's place among them (-1: not)."""
    in_host = torch.stack([in_rank[:, cols].any(1) for cols in topo.host_cols], 1)
    in_host[:, topo.here] = False
    pos = torch.where(in_host, in_host.int().cumsum(0) - 1, -1).to(torch.int32)
    return in_host.sum(0, dtype=torch.int32), pos.contiguous()


def first_per_host(topo: Topology, send_pos: torch.Tensor) -> torch.Tensor:
    """send_pos [T, R] keeping, per other host, only the first rank there a token went to: the
    row where that host's relay puts the token's partial sum (the combine's reduce reads
    exactly those rows and those of this rank's own host)."""
    out = send_pos.clone()
    for h, cols in enumerate(topo.host_cols):
        if h == topo.here:
            continue
        # among the active ranks only: masked ones get nothing from the relay
        sp = torch.where(topo.host_cols_active[h][None, :], send_pos[:, cols],
                         torch.full_like(send_pos[:, cols], -1))
        first = (sp >= 0).int().argmax(1, keepdim=True)
        keep = torch.arange(len(cols), device=sp.device)[None, :] == first
        out[:, cols] = torch.where(keep, sp, torch.full_like(sp, -1))
    return out.contiguous()


@dataclass(eq=False)
class Routes:
    """One relayed dispatch's geometry, on its handle (``handle.relay``) for the combine and
    cached dispatches: the count matrices (numpy, the same on every rank) and the device
    tables of this rank."""

    topo: Topology
    matrix: np.ndarray               # [R, R] rows of s for d
    host_matrix: np.ndarray          # [R, H] tokens of s for the ranks of host h
    host_pos: torch.Tensor           # int32 [T, H] (host_positions)
    send_pos_first: torch.Tensor     # int32 [T, R] (first_per_host)
    relay_pos: torch.Tensor = field(default=None)   # int32 [staged rows here, L] (forward)
    _gather0: dict = field(default_factory=dict, repr=False)

    def relayed(self, f: int) -> list:
        return self.topo.relays.relayed[f]

    def host(self, r: int) -> int:
        return self.topo.relays.host_of[r]

    def ranks_here(self, f: int) -> list:
        return self.topo.relays.ranks_on[self.host(f)]

    # -- dispatch ------------------------------------------------------------------------
    def stage_rows(self, f: int) -> int:
        h = self.host(f)
        return int(sum(self.host_matrix[s, h] for s in self.relayed(f)))

    def stage_row0(self, s: int, f: int) -> int:
        h = self.host(f)
        return int(sum(self.host_matrix[p, h] for p in self.relayed(f) if p < s))

    # -- combine -------------------------------------------------------------------------
    def gather_parts(self, f: int) -> list:
        """((s, d, rows), ...) of f's gather slab in order: per relayed s, per rank d of f's
        host, the rows d returns for s."""
        return [(s, d, int(self.matrix[s, d])) for s in self.relayed(f)
                for d in self.ranks_here(f)]

    def gather_rows(self, f: int) -> int:
        return sum(n for _, _, n in self.gather_parts(f))

    def gather_row0(self, f: int, s: int, d: int) -> int:
        """Where d's rows for s start in f's gather slab (one table per f, kept: a combine
        asks once per source)."""
        table = self._gather0.get(f)
        if table is None:
            table, at = {}, 0
            for p, q, n in self.gather_parts(f):
                table[p, q] = at
                at += n
            self._gather0[f] = table
        return table[s, d]


def stage_nbytes(rows: int, row_bytes: int, scale_cols: int, topk: int, mask_cols: int) -> int:
    """Bytes of a relay's staging slab (relay.cuh StageSlab): ``rows`` payload rows, then one
    metadata row per token (ids, scales, weights, mask; 8-byte multiple), so a staged token
    crosses as two puts; SLAB_ALIGN between the two, a page multiple in all."""
    meta = round_up(topk * 8 + scale_cols * 4 + topk * 4 + mask_cols, 8)
    return round_up(round_up(rows * row_bytes, SLAB_ALIGN) + rows * meta, PAGE)


def capacity(comm: CudaComm):
    """Bytes of each rank's data region a call may use: the whole region (an int), or, in an
    elastic group, numpy int64 [R] of what lies past each rank's floor once the next notify
    has settled it (normal.cuh Group: a rank dropped mid-call costs the slabs it may still
    write, until the Buffer is rebuilt). The same on every survivor; a synchronisation
    (elastic groups only, where the calls that ask have one anyway)."""
    if comm.floors is None:
        return comm.heap_bytes
    R = comm.num_ranks
    f = comm.floors.cpu().numpy()
    floors = f[:R]
    if f[2 * R]:         # the last agreement dropped a rank: the next notify moves the floors
        floors = (f[R:2 * R] + PAGE - 1) // PAGE * PAGE
    return comm.heap_bytes - floors


def _per_rank(heap_bytes, num_ranks: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(heap_bytes, np.int64), (num_ranks,))


def dispatch_fits(routes: Routes, heap_bytes, row_bytes: int, scale_cols: int,
                  topk: int) -> bool:
    """Every rank's output slab and staging slab fit its data region (one copy; ``heap_bytes``
    the same for every rank, or per rank: :func:`capacity`)."""
    m, mc = routes.matrix, routes.topo.mask_cols
    cols, room = m.sum(0), _per_rank(heap_bytes, m.shape[0])
    return all(SlabLayout(int(cols[f]), row_bytes, scale_cols, topk).nbytes +
               stage_nbytes(routes.stage_rows(f), row_bytes, scale_cols, topk, mc)
               <= room[f] for f in range(m.shape[0]))


def combine_fits(routes: Routes, heap_bytes, row_bytes: int, topk: int) -> bool:
    """Every rank's flat combine slab and gather slab fit its data region (one copy;
    ``heap_bytes`` as for :func:`dispatch_fits`)."""
    back = routes.matrix.sum(1)
    room = _per_rank(heap_bytes, back.shape[0])
    return all(SlabLayout(int(back[f]), row_bytes, 0, topk).nbytes +
               SlabLayout(routes.gather_rows(f), row_bytes, 0, topk).nbytes <= room[f]
               for f in range(back.shape[0]))


def _grid(rows: int, kernel: str, num_sms: int) -> int:
    """Blocks of a warp-per-row kernel: enough for one warp a row, at most ``num_sms``."""
    return max(1, min(-(-rows // (THREADS[kernel] // 32)), num_sms))


def _i64(rows, width: int, device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, width).to(device)


def _signal_args(comm: CudaComm, epoch: int, done_to, counter: str) -> dict:
    return dict(done_to=done_to, done_off=comm.done_offset(), done_stride=SIGNAL_STRIDE,
                epoch=epoch, counter=comm.counter(counter))


def _wait(comm: CudaComm, k, flags, epoch: int, op: str, patient: bool = False) -> None:
    """moe_wait_done for the active ranks on in ``flags`` only: the group deadline, or
    ``PATIENT_TIMEOUTS`` more on an elastic group when those ranks may first have waited out
    a dead peer (``patient``). Elastic, the ranks it masks are masked in ``comm.active``."""
    live = _live_now(comm, flags)
    timeout = comm.timeout_ns * (1 + PATIENT_TIMEOUTS if patient and comm.elastic else 1)
    launch(k["moe_wait_done"], 1, THREADS["moe_wait_done"],
           pack("moe_wait_done", **{**group(comm), "active": live, "timeout_ns": timeout},
                **errors(comm, op), done_off=comm.done_offset(), done_stride=SIGNAL_STRIDE,
                epoch=epoch),
           device=comm.device)
    _fold(comm, flags, live)


def dispatch(comm: CudaComm, k, routes: Routes, epochs: tuple, send: dict, num_sms: int,
             relay_pos: torch.Tensor) -> None:
    """The payload of a relayed dispatch (relay.cuh), up to every row of this rank's output
    slab being in place: stage, own rows to this host, forward. ``send``: normal.py's send
    arguments (x, scales, top-k, send_pos, matrix); ``epochs``: (the own rows' epoch, the
    call's relay epoch); ``relay_pos`` int32 [stage_rows(me), L] is filled for the combine."""
    topo, me, dev = routes.topo, comm.rank, comm.device
    own_epoch, epoch = epochs
    m = routes.matrix
    cols = m.sum(0)
    row_bytes, scale_cols, topk = send["row_bytes"], send["scale_cols"], send["topk"]
    H = topo.num_hosts
    stage_off, stage_rows, stage_row0 = [], [], []
    for f in topo.relay_of:
        if f < 0:
            stage_off.append(0), stage_rows.append(0), stage_row0.append(0)
            continue
        stage_off.append(SlabLayout(int(cols[f]), row_bytes, scale_cols, topk).nbytes)
        stage_rows.append(routes.stage_rows(f))
        stage_row0.append(routes.stage_row0(me, f))
    if any(f >= 0 for f in topo.relay_of):
        launch(k["moe_relay_stage"], _grid(send["num_tokens"], "moe_relay_stage", num_sms),
               THREADS["moe_relay_stage"],
               pack("moe_relay_stage", **group(comm), **errors(comm, "dispatch/send"),
                    x=send["x"], num_tokens=send["num_tokens"], row_bytes=row_bytes,
                    scales=send["scales"], scale_cols=scale_cols, topk_idx=send["topk_idx"],
                    topk_w=send["topk_w"], topk=topk, send_pos=send["send_pos"],
                    host_pos=routes.host_pos, num_hosts=H, relay_of=topo.relay_of_dev,
                    ranks_on=topo.ranks_on, mask_cols=topo.mask_cols,
                    stage_off=_i64(stage_off, 1, dev).flatten(),
                    stage_rows=_i64(stage_rows, 1, dev).flatten(),
                    stage_row0=_i64(stage_row0, 1, dev).flatten(),
                    **_signal_args(comm, epoch, topo.to_relays, "relay_stage")), device=dev)
    # this rank's own rows to the ranks of its host: the flat send with only them live (its
    # DONE, at the own epoch, is overwritten by the forward's before anyone awaits it)
    launch(k["moe_dispatch_send"], max(1, num_sms), THREADS["moe_dispatch_send"],
           pack("moe_dispatch_send", **{**group(comm), "active": _live_now(comm, topo.to_local)},
                **errors(comm, "dispatch/send"), **send, chunk=0, first=0,
                done_off=comm.done_offset(), done_stride=SIGNAL_STRIDE, epoch=own_epoch,
                counter=comm.counter("dispatch_send")), device=dev)
    relayed = routes.relayed(me)
    if relayed:
        _wait(comm, k, topo.to_relayed, epoch, "dispatch/payload")
    prefix = np.cumsum(m, 0) - m
    jobs, here, active = [], topo.local, topo.relays.active
    for s in relayed:
        n = int(routes.host_matrix[s, topo.here])
        for li, d in enumerate(here):
            if n and active[d]:     # a masked rank gets nothing (relay_pos stays -1 there)
                jobs += [routes.stage_row0(s, me), n, d, li, int(prefix[s, d])]
    launch(k["moe_relay_forward"], max(1, min(len(jobs) // 5, 4 * max(1, num_sms))),
           THREADS["moe_relay_forward"],
           pack("moe_relay_forward", **group(comm), **errors(comm, "dispatch/send"),
                row_bytes=row_bytes, scale_cols=scale_cols, topk=topk,
                num_local=send["num_local"], mask_cols=topo.mask_cols,
                stage_off=SlabLayout(int(cols[me]), row_bytes, scale_cols, topk).nbytes,
                stage_rows=routes.stage_rows(me), jobs=_i64(jobs, 5, dev),
                num_jobs=len(jobs) // 5, out_rows=_i64(cols.tolist(), 1, dev).flatten(),
                relay_pos=relay_pos, num_here=len(here),
                **_signal_args(comm, epoch, topo.to_local, "relay_forward")), device=dev)
    # a relay of this host may first have waited out a dead sender
    _wait(comm, k, topo.to_local, epoch, "dispatch/payload", patient=True)
    _note_ends(comm, [SlabLayout(int(cols[f]), row_bytes, scale_cols, topk).nbytes +
                      (stage_nbytes(routes.stage_rows(f), row_bytes, scale_cols, topk,
                                    topo.mask_cols) if routes.relayed(f) else 0)
                      for f in range(comm.num_ranks)])


def combine(comm: CudaComm, k, routes: Routes, epoch: int, *, x, topk_weights, num_sms: int
            ) -> None:
    """The payload of a relayed combine (relay.cuh), up to every row this rank's reduce reads
    being in its flat staging slab: ranges (rows to this host's owners and relays), the
    relays' sums across. The reduce is normal.py's, with ``routes.send_pos_first``."""
    topo, me, dev = routes.topo, comm.rank, comm.device
    m = routes.matrix
    row_bytes = x.shape[1] * x.element_size()
    topk = 0 if topk_weights is None else topk_weights.shape[1]
    back = m.sum(1)
    received0 = np.cumsum(m[:, me]) - m[:, me]

    def flat_nbytes(f):
        return SlabLayout(int(back[f]), row_bytes, 0, topk).nbytes

    jobs, ends, total = [], [], 0
    for s in range(comm.num_ranks):
        n = int(m[s, me])
        if not n:
            continue
        if routes.host(s) == topo.here:    # owner here: its flat slab, the flat row
            jobs += [int(received0[s]), n, s, int(m[s, :me].sum()), 0, int(back[s])]
        else:                               # the owner's relay here: its gather slab
            f = topo.relays.relay(s, topo.here)
            jobs += [int(received0[s]), n, f, routes.gather_row0(f, s, me), flat_nbytes(f),
                     routes.gather_rows(f)]
        total += n
        ends.append(total)
    launch(k["moe_relay_ranges"], _grid(total, "moe_relay_ranges", num_sms),
           THREADS["moe_relay_ranges"],
           pack("moe_relay_ranges", **group(comm), **errors(comm, "combine/send"), x=x,
                row_bytes=row_bytes, topk_w=topk_weights, topk=topk, jobs=_i64(jobs, 6, dev),
                ends=_i64(ends, 1, dev).flatten(), num_jobs=len(ends),
                **_signal_args(comm, epoch, topo.to_local, "relay_ranges")), device=dev)
    _wait(comm, k, topo.to_local, epoch, "combine/payload")

    relayed = routes.relayed(me)
    here = topo.local
    if relayed:
        jobs, ends, total = [], [], 0
        for s in relayed:
            n = int(routes.host_matrix[s, topo.here])
            if not n:
                continue
            row = [routes.stage_row0(s, me), n, s, int(back[s])]
            for d in here:
                row += [routes.gather_row0(me, s, d), int(m[s, :d].sum())]
            jobs += row
            total += n
            ends.append(total)
        reduce = RELAY_REDUCE_KERNEL[x.dtype]
        launch(k[reduce], _grid(total, reduce, num_sms), THREADS[reduce],
               pack(reduce, **group(comm), **errors(comm, "combine/send"),
                    hidden=x.shape[1], topk=topk, gather_off=flat_nbytes(me),
                    gather_rows=routes.gather_rows(me),
                    jobs=_i64(jobs, 4 + 2 * len(here), dev), ends=_i64(ends, 1, dev).flatten(),
                    num_jobs=len(ends), relay_pos=routes.relay_pos, num_here=len(here),
                    **_signal_args(comm, epoch, topo.to_relayed, "relay_reduce")), device=dev)
    if any(f >= 0 for f in topo.relay_of):   # a relay may first have waited out a dead rank
        _wait(comm, k, topo.to_relays, epoch, "combine/payload", patient=True)
    _note_ends(comm, [flat_nbytes(f) + (SlabLayout(routes.gather_rows(f), row_bytes, 0,
                                                   topk).nbytes if routes.relayed(f) else 0)
                      for f in range(comm.num_ranks)])
