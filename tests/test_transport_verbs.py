"""Verbs engine: the RC queue-pair state machine (RESET->INIT->RTR->RTS) as plain data, its
conversion to pyverbs objects where pyverbs imports, and puts + signals over a real RDMA
device where one exists (none on CI: those tests skip and say why)."""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from moe_comm.transport import qp
from moe_comm.transport.qp import (ERR, INIT, REQUIRED, RESET, RTR, RTS, Endpoint,
                                   check_transitions, rc_transitions)
from moe_comm.wire import tag
from ranks import run_ranks

LOCAL = Endpoint(qpn=0x11, psn=0x123456, lid=3, gid="fe80:0000:0000:0000:0202:c9ff:fe00:0001",
                 mtu=5)
REMOTE = Endpoint(qpn=0x22, psn=0xABCDEF, lid=7, gid="fe80:0000:0000:0000:0202:c9ff:fe00:0002",
                  mtu=3)


def _pyverbs():
    try:
        return qp.import_pyverbs()
    except ImportError as e:
        pytest.skip(f"pyverbs unavailable: {e}")


def _steps(**kw):
    return rc_transitions(1, LOCAL, REMOTE, gid_index=3, is_global=True, **kw)


def test_rc_transitions_walk_reset_init_rtr_rts_with_required_attributes():
    steps = _steps()
    check_transitions(steps)
    assert [(s.src, s.dst) for s in steps] == [(RESET, INIT), (INIT, RTR), (RTR, RTS)]
    for s in steps:
        assert set(s.attrs) == REQUIRED[(s.src, s.dst)]
        assert s.mask == sum(qp.MASK_BITS[n] for n in s.attrs)
    init, rtr, rts = (s.attrs for s in steps)
    assert init["qp_access_flags"] == qp.ACCESS_LOCAL_WRITE | qp.ACCESS_REMOTE_WRITE
    assert rtr["dest_qp_num"] == REMOTE.qpn and rtr["rq_psn"] == REMOTE.psn
    assert rtr["path_mtu"] == 3                      # the smaller of both ports
    assert rtr["ah_attr"]["dgid"] == REMOTE.gid and rtr["ah_attr"]["dlid"] == REMOTE.lid
    assert rts["sq_psn"] == LOCAL.psn
    assert rts["rnr_retry"] == 7                     # receiver-not-ready is flow control
    assert steps[0].mask == 0b111001                 # STATE|ACCESS_FLAGS|PKEY_INDEX|PORT


def test_check_transitions_rejects_wrong_order_and_attribute_sets():
    init, rtr, rts = _steps()
    with pytest.raises(ValueError, match="does not start"):
        check_transitions([rtr, rts])
    with pytest.raises(ValueError, match="not RTS"):
        check_transitions([init, rtr])
    missing = qp.Transition(INIT, RTR, {k: v for k, v in rtr.attrs.items() if k != "rq_psn"})
    with pytest.raises(ValueError, match="required"):
        check_transitions([init, missing, rts])
    extra = qp.Transition(RESET, INIT, dict(init.attrs, sq_psn=1))
    with pytest.raises(ValueError, match="required"):
        check_transitions([extra, rtr, rts])
    assert qp.STATE_NAMES[ERR] == "ERR"


def test_mask_bits_match_pyverbs_enums():
    pv = _pyverbs()
    for field, enum in qp.ENUM_NAMES.items():
        assert qp.MASK_BITS[field] == int(getattr(pv.enums, enum)), field
    for state, name in [(RESET, "RESET"), (INIT, "INIT"), (RTR, "RTR"), (RTS, "RTS"),
                        (ERR, "ERR")]:
        assert state == int(getattr(pv.enums, f"IBV_QPS_{name}"))
    assert qp.ACCESS_LOCAL_WRITE == int(pv.enums.IBV_ACCESS_LOCAL_WRITE)
    assert qp.ACCESS_REMOTE_WRITE == int(pv.enums.IBV_ACCESS_REMOTE_WRITE)
    assert qp.MTU_BYTES[int(pv.enums.IBV_MTU_4096)] == 4096


def test_transitions_convert_to_pyverbs_qp_attrs():
    _pyverbs()
    init, rtr, rts = (qp.to_qp_attr(s) for s in _steps())
    assert (init.qp_state, init.port_num, init.pkey_index) == (INIT, 1, 0)
    assert init.qp_access_flags == qp.ACCESS_LOCAL_WRITE | qp.ACCESS_REMOTE_WRITE
    assert (rtr.qp_state, rtr.dest_qp_num, rtr.rq_psn, rtr.path_mtu) == \
        (RTR, REMOTE.qpn, REMOTE.psn, 3)
    assert (rtr.max_dest_rd_atomic, rtr.min_rnr_timer) == (1, 12)
    assert rtr.ah_attr.dgid == REMOTE.gid and rtr.ah_attr.dlid == REMOTE.lid
    assert rtr.ah_attr.sgid_index == 3 and rtr.ah_attr.is_global == 1
    assert (rts.qp_state, rts.sq_psn, rts.timeout, rts.retry_cnt, rts.rnr_retry,
            rts.max_rd_atomic) == (RTS, LOCAL.psn, 14, 7, 7, 1)


def _device_or_skip():
    from moe_comm.transport.verbs import probe
    ok, why = probe()
    if not ok:
        pytest.skip(f"no RDMA device to run the verbs engine on: {why}")


def _verbs_exchange(rank, n):
    region = np.zeros(1 << 22, dtype=np.uint8)
    from moe_comm.shm import atomics
    from moe_comm.transport import open_transport
    t = open_transport(None, region, [1 - rank], kind="verbs", timeout_s=20)
    data = np.random.default_rng(rank).integers(0, 256, 3 << 20, dtype=np.uint8)
    for i in range(3):
        t.put(1 - rank, 4096 + i * (1 << 20) + 1, data[i << 20:(i + 1) << 20])
        t.signal(1 - rank, 8 * i, tag(1, i))
    t.flush()
    atomics.wait_words({1 - rank: region[:24].view(np.int64)}, 1, time.monotonic() + 20, "v", 20)
    other = np.random.default_rng(1 - rank).integers(0, 256, 3 << 20, dtype=np.uint8)
    ok = bool(np.array_equal(region[4097:4097 + (3 << 20)], other))
    import torch.distributed as dist
    dist.barrier()
    t.close()
    return t.kind, ok


def test_verbs_puts_and_signals_land_on_a_device():
    _device_or_skip()
    res = run_ranks(_verbs_exchange, 2, timeout=120)
    assert res == [("verbs", True), ("verbs", True)]


# -- the engine over an in-process stand-in for pyverbs -------------------------------------------
# No device on CI, but the engine's own logic (staging ring, mailbox slots and receive
# reposting, completions, failure handling, the order it drives the QP states in) is plain
# Python. This fake implements the pyverbs calls the engine makes; RC QPs "transmit" by
# memmove between memory regions of this process, in order, checking keys and bounds like a
# NIC, and hold a write-with-immediate back while the receiver has no receive posted (RNR).
def _make_fake_pyverbs():
    import collections
    import ctypes
    import threading
    from types import SimpleNamespace as NS

    enums = NS(IBV_PORT_ACTIVE=4, IBV_LINK_LAYER_ETHERNET=2, IBV_QPT_RC=2,
               IBV_WR_RDMA_WRITE=0, IBV_WR_RDMA_WRITE_WITH_IMM=1, IBV_SEND_SIGNALED=2,
               IBV_WC_SUCCESS=0, IBV_WC_REM_ACCESS_ERR=10, IBV_WC_WR_FLUSH_ERR=5,
               IBV_WC_RECV_RDMA_WITH_IMM=129)
    lock = threading.RLock()
    mrs, qps, rnr = {}, {}, [0]
    counter = iter(range(100, 1 << 30))

    class Attr:
        def __init__(self, **kw):
            self.__dict__["_set"] = set()
            for k, v in kw.items():
                setattr(self, k, v)

        def __setattr__(self, k, v):
            self._set.add(k)
            self.__dict__[k] = v

    class Context:
        def __init__(self, name):
            self.name = name

        def query_port(self, port):
            return NS(state=4, link_layer=2, lid=0, active_mtu=5)

        def query_gid(self, port, index):
            return NS(gid="fe80:0000:0000:0000:0000:0000:0000:0001")

        def close(self):
            pass

    class MR:
        def __init__(self, pd, length, access, address):
            self.lkey = self.rkey = next(counter)
            mrs[self.rkey] = (address, length, access)

    class CQ:
        def __init__(self, ctx, cqe, *args):
            self.q = collections.deque()

        def poll(self, n):
            with lock:
                out = [self.q.popleft() for _ in range(min(n, len(self.q)))]
            return len(out), out

    class QP:
        def __init__(self, pd, init):
            self.qp_num, self.init, self.state = next(counter), init, RESET
            self.recvs, self.pending, self.modifies = collections.deque(), [], []
            qps[self.qp_num] = self

        def modify(self, attr, mask):
            expect = sum(qp.MASK_BITS[k] for k in attr._set)
            assert mask == expect, (mask, expect)
            with lock:
                self.modifies.append((self.state, attr.qp_state))
                self.state = attr.qp_state
                if attr.qp_state == RTR:
                    self.dest = attr.dest_qp_num
                if attr.qp_state == ERR:            # outstanding receives are flushed
                    while self.recvs:
                        self.init.rcq.q.append(NS(wr_id=self.recvs.popleft(), status=5,
                                                  opcode=0, imm_data=0, qp_num=self.qp_num,
                                                  vendor_err=0))

        def post_recv(self, wr, bad):
            with lock:
                self.recvs.append(wr.wr_id)
                peer = qps.get(getattr(self, "dest", None))
                if peer is not None:
                    peer._drain()

        def post_send(self, wr, bad):
            with lock:
                if self.state != RTS:
                    raise RuntimeError(f"post_send in state {self.state}")
                self.pending.append(wr)
                self._drain()

        def _drain(self):                           # deliver in order; stop at RNR
            peer = qps[self.dest]
            while self.pending:
                wr = self.pending[0]
                imm = wr.opcode == enums.IBV_WR_RDMA_WRITE_WITH_IMM
                if imm and not peer.recvs:
                    rnr[0] += 1
                    return                          # RNR: retried at the next post_recv
                self.pending.pop(0)
                sge = wr.sg[0]
                base, length, access = mrs.get(wr.rkey, (0, 0, 0))
                if peer.state not in (RTR, RTS) or not access & 2 or \
                        not base <= wr.raddr <= wr.raddr + sge.length <= base + length:
                    self.init.scq.q.append(NS(wr_id=wr.wr_id, status=10, opcode=1,
                                              qp_num=self.qp_num, vendor_err=0))
                    self.state = ERR
                    continue
                ctypes.memmove(wr.raddr, sge.addr, sge.length)
                if imm:
                    peer.init.rcq.q.append(NS(wr_id=peer.recvs.popleft(), status=0,
                                              opcode=129, imm_data=wr.imm_data,
                                              qp_num=peer.qp_num, vendor_err=0))
                self.init.scq.q.append(NS(wr_id=wr.wr_id, status=0, opcode=1,
                                          qp_num=self.qp_num, vendor_err=0))

    class SendWR:
        def __init__(self, wr_id, opcode, num_sge, sg, send_flags, imm_data=0):
            self.wr_id, self.opcode, self.sg, self.imm_data = wr_id, opcode, sg, imm_data

        def set_wr_rdma(self, rkey, addr):
            self.rkey, self.raddr = rkey, addr

    return NS(
        enums=enums,
        device=NS(Context=Context),
        pd=NS(PD=lambda ctx: NS(ctx=ctx)),
        mr=NS(MR=MR),
        cq=NS(CQ=CQ),
        qp=NS(QP=QP, QPAttr=Attr, QPCap=Attr, QPInitAttr=Attr),
        addr=NS(GID=lambda s: s, GlobalRoute=Attr, AHAttr=Attr),
        wr=NS(SGE=lambda addr, length, lkey: NS(addr=addr, length=length, lkey=lkey),
              RecvWR=Attr, SendWR=SendWR),
        qps=qps, rnr=rnr,
    )


def test_verbs_engine_logic_over_a_fake_device(monkeypatch, caplog):
    from moe_comm.shm import atomics
    from moe_comm.transport import verbs
    from moe_comm.transport.commands import OP_PUT, OP_SIGNAL
    from moe_comm.transport.proxy import ProxyTransport
    from moe_comm.transport.receiver import Region

    fake = _make_fake_pyverbs()
    monkeypatch.setattr(verbs, "import_pyverbs", lambda: fake)
    monkeypatch.setattr(qp, "import_pyverbs", lambda: fake)
    monkeypatch.setattr(verbs, "SLOTS", 4)          # signals wrap the mailbox, hit RNR
    monkeypatch.setattr(verbs, "STAGING", 256 << 10)  # puts wrap the staging ring
    monkeypatch.setattr(verbs, "CHUNK", 48 << 10)     # and are split into chunks
    size = 1 << 20

    def pair():
        regions = [np.zeros(size, dtype=np.uint8) for _ in range(2)]
        engines = [verbs.VerbsEngine(r, Region(regions[r]), [1 - r], 5.0, device="fake0")
                   for r in range(2)]
        infos = {r: e.local_info() for r, e in enumerate(engines)}
        for r, e in enumerate(engines):
            e.connect({1 - r: infos[1 - r]})
        return regions, engines

    regions, engines = pair()
    for q in fake.qps.values():
        assert q.modifies == [(RESET, INIT), (INIT, RTR), (RTR, RTS)]
    ts = [ProxyTransport(e, r, [1 - r], {1 - r: size}, 5.0) for r, e in enumerate(engines)]
    data = np.random.default_rng(0).integers(0, 256, 700_001, dtype=np.uint8)
    ts[0].put(1, 4099, data)
    for i in range(50):                               # 50 signals through 4 mailbox slots
        ts[0].signal(1, 8 * (i % 8), tag(1 + i // 8, i))
    ts[1].put(0, 64, data[:1000])
    ts[1].signal(0, 0, tag(1, 7))
    assert ts[0].flush() == set() and ts[1].flush() == set()
    words1 = regions[1][:64].view(np.int64)
    atomics.wait_words({0: words1[1:2]}, 7, time.monotonic() + 5, "fake", 5)   # signal 49
    assert np.array_equal(regions[1][4099:4099 + data.size], data)
    assert [int(w) for w in words1] == [tag(1 + i // 8, i) for i in range(48, 50)] + \
        [tag(6, i) for i in range(42, 48)]
    atomics.wait_words({1: regions[0][:8].view(np.int64)}, 1, time.monotonic() + 5, "f", 5)
    assert np.array_equal(regions[0][64:1064], data[:1000])
    staging = engines[0].staging
    assert staging.head == staging.tail and not staging.busy()  # every staging byte returned
    assert staging.head > verbs.STAGING                         # ... after wrapping
    assert fake.rnr[0] > 0, "signals never outran the receiver's posted receives"

    # A put outside the peer's region: the "NIC" refuses it, the peer is lost, flush says so.
    before = regions[1].copy()
    engines[0].send(1, [(OP_PUT, 1, size - 8, 16, 0, 0, memoryview(bytes(16)))])
    assert ts[0].flush(1, raise_on_timeout=False) == {1}
    assert np.array_equal(regions[1], before)
    for t in ts:
        t.close(flush_s=0.5)

    # A signal word outside the receiver's region: refused by the receiver, link dropped.
    regions, engines = pair()
    ts = [ProxyTransport(e, r, [1 - r], {1 - r: size}, 5.0) for r, e in enumerate(engines)]
    with caplog.at_level(logging.ERROR, logger="moe_comm.transport"):
        engines[1].send(0, [(OP_SIGNAL, 0, size, 8, 1, 0, None)])
        end = time.monotonic() + 5
        while not any("refused signal" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < end
            time.sleep(0.01)
    assert not regions[0].any()
    ts[0].put(1, 0, data[:10])                      # that link is down both ways now
    assert ts[0].flush(raise_on_timeout=False) == {1}
    for t in ts:
        t.close(flush_s=0.5)
