"""RDMA verbs engine of the host proxy (pyverbs): RC queue pairs, RDMA WRITE, and
write-with-immediate carrying signals.

Per remote rank one RC queue pair; one send CQ and one receive CQ for all of them. The
registered region is one memory region (remote write); its address and rkey go to the peers
in the connection exchange, so a put is a single RDMA WRITE to ``addr + offset``. The NIC
enforces the region's bounds: a write outside it fails the sender's QP (remote access error),
it never lands.

Signals cannot be plain RDMA writes: the spec does not order the placement of separate
writes, and a reader polling the word could see it before the payload. Instead a signal is
an RDMA WRITE WITH IMMEDIATE of the 8-byte value into a per-sender mailbox slot of the
receiver, the immediate carrying the target word index. The receiver's CQE for it is only
generated after every earlier write on that QP completed (RC ordering), so the receiver
thread, on that completion, bounds-checks the word and applies it with
:func:`moe_comm.shm.atomics.store_words` (release) -- the same visibility contract as TCP.

Flow control of mailboxes: each QP has ``SLOTS`` receives posted and ``SLOTS`` mailbox
slots; the k-th signal lands in slot ``k % SLOTS``. A write-with-immediate without a posted
receive is refused by the responder (RNR NAK) before any data is placed and retried
(``rnr_retry=7``: forever), and the receiver reposts a receive only after consuming its slot,
so a slot is never overwritten before it was read.

Sources are copied into registered staging memory (``staging.py``, shared with the NIXL
engine: puts are arbitrary host buffers, and a registration per put would cost more than the
copy), so a command's credit returns as soon as it is posted; staging space returns on its
send completion, in order. Every send is signaled.

Only exercised where an RDMA device exists (none on CI); the queue-pair setup it relies on is
unit-tested as plain data (``qp.py``).
"""
from __future__ import annotations

import collections
import logging
import os
import random
import socket
import threading
import time

import numpy as np

from ..shm.atomics import Backoff
from .commands import OP_PUT
from .qp import (ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, ERR, Endpoint, check_transitions,
                 import_pyverbs, rc_transitions, to_qp_attr)
from .receiver import Region
from .staging import Staging, aligned
from .tcp import PeerLost

log = logging.getLogger("moe_comm.transport")

SLOTS = 256                 # mailbox slots = posted receives per QP
SEND_DEPTH = 512            # outstanding sends per QP
STAGING = 32 << 20          # bytes of registered staging memory
CHUNK = 4 << 20             # largest single RDMA WRITE from staging


def probe():
    """``(True, device name)`` if a verbs device with an active port exists, else
    ``(False, reason)``."""
    try:
        pv = import_pyverbs()
    except ImportError as e:
        return False, str(e)
    try:
        devices = pv.device.get_device_list()
    except Exception as e:  # noqa: BLE001 - pyverbs raises PyverbsRDMAError without devices
        return False, f"no RDMA device ({e})"
    for dev in devices:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        try:
            with pv.device.Context(name=name) as ctx:
                if ctx.query_port(1).state == pv.enums.IBV_PORT_ACTIVE:
                    return True, name
        except Exception:  # noqa: BLE001 - a device we cannot open is no device
            continue
    return False, "no RDMA device with an active port"


class VerbsEngine:
    kind = "verbs"

    def __init__(self, rank: int, region: Region, remote_ranks, timeout_s: float,
                 device: str | None = None, port: int = 1, gid_index: int | None = None):
        if region.size // 8 >= 1 << 32:
            raise ValueError("the verbs engine addresses signal words with a 32-bit "
                             "immediate: the region must be < 32 GiB")
        pv = self.pv = import_pyverbs()
        e = pv.enums
        self.rank, self.region, self.timeout_s, self.port = rank, region, timeout_s, port
        self.remote = list(remote_ranks)
        if device is None:
            device = os.environ.get("MOE_COMM_IB_DEVICE") or probe()[1]
        self.ctx = pv.device.Context(name=device)
        self.pd = pv.pd.PD(self.ctx)
        pattr = self.ctx.query_port(port)
        self.is_global = pattr.link_layer == e.IBV_LINK_LAYER_ETHERNET   # RoCE: GRH always
        if gid_index is None:
            gid_index = int(os.environ.get("MOE_COMM_IB_GID_INDEX", 3 if self.is_global else 0))
        self.gid_index = gid_index
        self.gid = self.ctx.query_gid(port, gid_index).gid
        self.lid, self.mtu = pattr.lid, pattr.active_mtu
        remote_access = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE
        self.region_mr = pv.mr.MR(self.pd, region.size, remote_access,
                                  address=region.bytes.ctypes.data)
        self.mailbox = aligned(8 * SLOTS * max(1, len(self.remote))).view(np.int64)
        self.mailbox_mr = pv.mr.MR(self.pd, self.mailbox.nbytes, remote_access,
                                   address=self.mailbox.ctypes.data)
        self.staging = Staging(STAGING)
        self.staging_mr = pv.mr.MR(self.pd, STAGING, ACCESS_LOCAL_WRITE,
                                   address=self.staging.address)
        n = max(1, len(self.remote))
        self.scq = pv.cq.CQ(self.ctx, SEND_DEPTH * n, None, None, 0)
        self.rcq = pv.cq.CQ(self.ctx, SLOTS * n, None, None, 0)
        cap = pv.qp.QPCap(max_send_wr=SEND_DEPTH, max_recv_wr=SLOTS, max_send_sge=1,
                          max_recv_sge=1)
        self.qps, self.psn = {}, {}
        for dst in self.remote:
            init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.scq, rcq=self.rcq, cap=cap)
            self.qps[dst] = pv.qp.QP(self.pd, init)          # RESET: we walk the states
            self.psn[dst] = random.getrandbits(24)
        self.qp_rank = {qp.qp_num: r for r, qp in self.qps.items()}
        self.peer = {}                       # dst -> remote region/mailbox addresses, rkeys
        self.lock = threading.Lock()         # send CQ + staging bookkeeping
        self.send_lock = threading.Lock()
        self.outstanding = collections.Counter()
        self.inflight = {}                   # wr_id -> (dst, staging ticket)
        self.next_wr = 0
        self.sig_seq = collections.Counter()
        self.recv_seq = collections.Counter()
        self.failed = {}
        self.closing = False
        self.thread = None

    # -- connection ------------------------------------------------------------------------
    def local_info(self) -> dict:
        """What each remote rank needs from this one: ``{dst: info}``, picklable."""
        out = {}
        for i, dst in enumerate(self.remote):
            out[dst] = dict(
                endpoint=Endpoint(self.qps[dst].qp_num, self.psn[dst], self.lid, self.gid,
                                  self.mtu),
                addr=self.region.bytes.ctypes.data, rkey=self.region_mr.rkey,
                size=self.region.size,
                mailbox=self.mailbox.ctypes.data + 8 * SLOTS * i,
                mailbox_rkey=self.mailbox_mr.rkey)
        return out

    def connect(self, infos: dict) -> None:
        """``infos[r]`` = rank r's :meth:`local_info`. Posts receives, then RESET->RTS."""
        for i, dst in enumerate(self.remote):
            peer = infos[dst][self.rank]
            self.peer[dst] = peer
            local = Endpoint(self.qps[dst].qp_num, self.psn[dst], self.lid, self.gid, self.mtu)
            steps = rc_transitions(self.port, local, peer["endpoint"],
                                   gid_index=self.gid_index, is_global=self.is_global)
            check_transitions(steps)
            qp = self.qps[dst]
            qp.modify(to_qp_attr(steps[0]), steps[0].mask)
            for slot in range(SLOTS):                      # receives exist before RTR
                self._post_recv(dst, i, slot)
            for step in steps[1:]:
                qp.modify(to_qp_attr(step), step.mask)
        self.thread = threading.Thread(target=self._recv_loop, daemon=True,
                                       name="moe_comm-verbs-recv")
        self.thread.start()

    def _post_recv(self, src: int, index: int, slot: int) -> None:
        pv = self.pv
        # pyverbs wants one SGE; write-with-immediate consumes the WQE but writes nothing to it.
        sge = pv.wr.SGE(self.mailbox.ctypes.data + 8 * (SLOTS * index + slot), 8,
                        self.mailbox_mr.lkey)
        self.qps[src].post_recv(pv.wr.RecvWR(wr_id=slot, num_sge=1, sg=[sge]), None)

    # -- sending (proxy thread) --------------------------------------------------------------
    def send(self, dst: int, cmds: list) -> None:
        # One sender at a time (channels share the engine): staging is taken in one order,
        # which is the order it is returned in.
        with self.send_lock:
            self._send(dst, cmds)

    def _send(self, dst: int, cmds: list) -> None:
        if dst in self.failed:
            raise PeerLost(dst, self.failed[dst])
        peer = self.peer[dst]
        deadline = time.monotonic() + self.timeout_s
        for op, _dst, offset, nbytes, value, _addr, ref in cmds:
            if op == OP_PUT:
                src = np.frombuffer(ref, dtype=np.uint8)
                for pos in range(0, nbytes, CHUNK):
                    n = min(CHUNK, nbytes - pos)
                    at, ticket = self._stage(n, deadline, dst)
                    self.staging.bytes[at:at + n] = src[pos:pos + n]
                    self._post(dst, self.pv.enums.IBV_WR_RDMA_WRITE, at, ticket, n,
                               peer["addr"] + offset + pos, peer["rkey"], None, deadline)
            else:
                at, ticket = self._stage(8, deadline, dst)
                self.staging.bytes[at:at + 8].view(np.int64)[0] = value
                slot = self.sig_seq[dst] % SLOTS
                self.sig_seq[dst] += 1
                self._post(dst, self.pv.enums.IBV_WR_RDMA_WRITE_WITH_IMM, at, ticket, 8,
                           peer["mailbox"] + 8 * slot, peer["mailbox_rkey"],
                           socket.htonl(offset // 8), deadline)

    def _stage(self, n: int, deadline: float, dst: int):
        """Reserve ``n`` bytes of staging, waiting for completions. Returns (offset, ticket):
        the ticket is done when this send completes."""
        backoff = Backoff()
        while True:
            with self.lock:
                got = self.staging.take(n)
            if got is not None:
                return got
            self.progress()
            if time.monotonic() > deadline:
                raise PeerLost(dst, "no send completions within the deadline")
            backoff.pause()

    def _post(self, dst, opcode, at, ticket, n, raddr, rkey, imm, deadline) -> None:
        pv = self.pv
        backoff = Backoff()
        while self.outstanding[dst] >= SEND_DEPTH:
            self.progress()
            if dst in self.failed:
                raise PeerLost(dst, self.failed[dst])
            if time.monotonic() > deadline:
                raise PeerLost(dst, "send queue full past the deadline")
            backoff.pause()
        sge = pv.wr.SGE(self.staging.address + at, n, self.staging_mr.lkey)
        with self.lock:
            wr_id = self.next_wr
            self.next_wr += 1
            self.inflight[wr_id] = (dst, ticket)
            self.outstanding[dst] += 1
        kw = {} if imm is None else {"imm_data": imm}
        wr = pv.wr.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge],
                          send_flags=pv.enums.IBV_SEND_SIGNALED, **kw)
        wr.set_wr_rdma(rkey, raddr)
        try:
            self.qps[dst].post_send(wr, None)
        except Exception as e:  # noqa: BLE001 - a QP in error refuses posts
            with self.lock:
                del self.inflight[wr_id]
                self.staging.done(ticket)               # its staging is free again
                self.outstanding[dst] -= 1
            raise PeerLost(dst, f"post_send failed: {e}") from None

    def progress(self) -> None:
        """Reap send completions: return staging space, notice failed peers."""
        with self.lock:
            n, wcs = self.scq.poll(64)
            for wc in wcs[:n]:
                entry = self.inflight.pop(wc.wr_id, None)
                if entry is None:
                    continue
                dst, ticket = entry
                self.staging.done(ticket)
                self.outstanding[dst] -= 1
                if wc.status != self.pv.enums.IBV_WC_SUCCESS and dst not in self.failed:
                    self.failed[dst] = f"send completion status {wc.status}"
                    log.warning("rank %d: RDMA to rank %d failed (status %d, vendor %d)",
                                self.rank, dst, wc.status, wc.vendor_err)

    def quiet(self, dst: int, deadline: float) -> bool:
        backoff = Backoff()
        while self.outstanding[dst] and dst not in self.failed:
            self.progress()
            if time.monotonic() > deadline:
                return False
            backoff.pause()
        return dst not in self.failed

    def drop(self, dst: int) -> None:
        self._to_error(dst)

    def abort_sends(self) -> None:
        pass                                    # posting never blocks past its deadline

    def _to_error(self, rank: int) -> None:
        try:
            attr = self.pv.qp.QPAttr()
            attr.qp_state = ERR
            self.qps[rank].modify(attr, 1)              # IBV_QP_STATE
        except Exception:  # noqa: BLE001 - already broken is fine
            pass

    # -- receiving ---------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        e = self.pv.enums
        index = {r: i for i, r in enumerate(self.remote)}
        backoff = Backoff()
        while not self.closing:
            n, wcs = self.rcq.poll(32)
            if not n:
                backoff.pause()
                continue
            backoff = Backoff()
            for wc in wcs[:n]:
                src = self.qp_rank.get(wc.qp_num)
                if src is None:
                    continue
                if wc.status != e.IBV_WC_SUCCESS:
                    if not self.closing:
                        log.warning("rank %d: receive from rank %d failed (status %d)",
                                    self.rank, src, wc.status)
                    continue
                slot = self.recv_seq[src] % SLOTS
                self.recv_seq[src] += 1
                offset = socket.ntohl(wc.imm_data) * 8
                err = self.region.check_signal(offset) if \
                    wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM else "not a write-with-immediate"
                if err:
                    log.error("rank %d: refused signal from rank %d: %s; connection dropped",
                              self.rank, src, err)
                    self._to_error(src)
                    continue
                value = int(self.mailbox[SLOTS * index[src] + slot])
                self.region.signal(offset, value)
                self._post_recv(src, index[src], slot)

    def close(self, join_s: float = 2.0) -> None:
        self.closing = True
        if self.thread is not None:
            self.thread.join(join_s)
        try:
            self.ctx.close()        # pyverbs closes the QPs, CQs, MRs and PD it created
        except Exception as e:  # noqa: BLE001
            log.warning("rank %d: closing the verbs context: %s", self.rank, e)
