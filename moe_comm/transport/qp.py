"""Reliable-connected queue pair setup as plain data: RESET -> INIT -> RTR -> RTS.

A verbs QP only carries traffic after three ``modify`` calls, each with exactly the attribute
set the InfiniBand spec requires for that transition (``ibv_modify_qp`` rejects a missing or
extra bit with EINVAL, and nothing in CI has a device to find out). So the transitions are
built here as plain dicts plus their ``ibv_qp_attr_mask``, testable without a device, and
converted to pyverbs ``QPAttr`` objects only at the last moment (:func:`to_qp_attr`).

Bit and enum values are those of ``infiniband/verbs.h`` (rdma-core's ABI, stable since
2005); the tests compare them with ``pyverbs.enums`` where pyverbs imports.

:func:`import_pyverbs` finds pyverbs: a normal import, else Debian's ``python3-pyverbs``
(``/usr/lib/python3/dist-packages``, built for the system Python) when this interpreter has
the same version -- without leaving Debian's other packages on ``sys.path``.
"""
from __future__ import annotations

from dataclasses import dataclass
import importlib
import sys

# ibv_qp_state
RESET, INIT, RTR, RTS, SQD, SQE, ERR = range(7)
STATE_NAMES = {RESET: "RESET", INIT: "INIT", RTR: "RTR", RTS: "RTS", ERR: "ERR"}

# ibv_qp_attr_mask bits, by the QPAttr field each one covers
MASK_BITS = {
    "qp_state": 1 << 0, "cur_qp_state": 1 << 1, "en_sqd_async_notify": 1 << 2,
    "qp_access_flags": 1 << 3, "pkey_index": 1 << 4, "port_num": 1 << 5, "qkey": 1 << 6,
    "ah_attr": 1 << 7, "path_mtu": 1 << 8, "timeout": 1 << 9, "retry_cnt": 1 << 10,
    "rnr_retry": 1 << 11, "rq_psn": 1 << 12, "max_rd_atomic": 1 << 13,
    "alt_ah_attr": 1 << 14, "min_rnr_timer": 1 << 15, "sq_psn": 1 << 16,
    "max_dest_rd_atomic": 1 << 17, "path_mig_state": 1 << 18, "cap": 1 << 19,
    "dest_qp_num": 1 << 20,
}
ENUM_NAMES = {                 # our field -> pyverbs.enums name of its mask bit
    "qp_state": "IBV_QP_STATE", "qp_access_flags": "IBV_QP_ACCESS_FLAGS",
    "pkey_index": "IBV_QP_PKEY_INDEX", "port_num": "IBV_QP_PORT", "ah_attr": "IBV_QP_AV",
    "path_mtu": "IBV_QP_PATH_MTU", "timeout": "IBV_QP_TIMEOUT",
    "retry_cnt": "IBV_QP_RETRY_CNT", "rnr_retry": "IBV_QP_RNR_RETRY",
    "rq_psn": "IBV_QP_RQ_PSN", "max_rd_atomic": "IBV_QP_MAX_QP_RD_ATOMIC",
    "min_rnr_timer": "IBV_QP_MIN_RNR_TIMER", "sq_psn": "IBV_QP_SQ_PSN",
    "max_dest_rd_atomic": "IBV_QP_MAX_DEST_RD_ATOMIC", "dest_qp_num": "IBV_QP_DEST_QPN",
}

# Required attributes of each RC transition (IB spec 1.4, table 91 "QP State Transition
# Properties"; the same sets rdma-core's tests and perftest pass).
REQUIRED = {
    (RESET, INIT): {"qp_state", "pkey_index", "port_num", "qp_access_flags"},
    (INIT, RTR): {"qp_state", "ah_attr", "path_mtu", "dest_qp_num", "rq_psn",
                  "max_dest_rd_atomic", "min_rnr_timer"},
    (RTR, RTS): {"qp_state", "sq_psn", "timeout", "retry_cnt", "rnr_retry", "max_rd_atomic"},
}

ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE = 1, 2
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}       # ibv_mtu -> bytes


@dataclass(frozen=True)
class Endpoint:
    """What a peer publishes so the other side can connect its QP to it."""

    qpn: int
    psn: int            # 24-bit first packet sequence number
    lid: int            # InfiniBand local id (0 on RoCE)
    gid: str            # "xxxx:...:xxxx", used when routing is global (RoCE always)
    mtu: int            # the port's active ibv_mtu


def mask_of(attrs: dict) -> int:
    mask = 0
    for name in attrs:
        mask |= MASK_BITS[name]
    return mask


@dataclass(frozen=True)
class Transition:
    src: int
    dst: int
    attrs: dict

    @property
    def mask(self) -> int:
        return mask_of(self.attrs)

    @property
    def name(self) -> str:
        return f"{STATE_NAMES[self.src]}->{STATE_NAMES[self.dst]}"


def rc_transitions(port: int, local: Endpoint, remote: Endpoint, *, gid_index: int,
                   is_global: bool, access: int = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE,
                   timeout: int = 14, retry_cnt: int = 7, rnr_retry: int = 7,
                   min_rnr_timer: int = 12) -> list:
    """The three modify steps connecting a local RC QP to ``remote``.

    ``timeout`` 14 = 4.096 us * 2**14 = 67 ms per retry, times ``retry_cnt`` 7: a dead peer
    turns into an error completion within about half a second. ``rnr_retry`` 7 = retry
    forever on "receiver not ready": the receiver's posted receives are the flow control of
    signals (see verbs.py), so RNR means "slow", never "dead"."""
    ah = {"port_num": port, "dlid": remote.lid, "sl": 0, "is_global": int(is_global),
          "dgid": remote.gid, "sgid_index": gid_index, "hop_limit": 64}
    return [
        Transition(RESET, INIT, {"qp_state": INIT, "pkey_index": 0, "port_num": port,
                                 "qp_access_flags": access}),
        Transition(INIT, RTR, {"qp_state": RTR, "ah_attr": ah,
                               "path_mtu": min(local.mtu, remote.mtu),
                               "dest_qp_num": remote.qpn, "rq_psn": remote.psn,
                               "max_dest_rd_atomic": 1, "min_rnr_timer": min_rnr_timer}),
        Transition(RTR, RTS, {"qp_state": RTS, "sq_psn": local.psn, "timeout": timeout,
                              "retry_cnt": retry_cnt, "rnr_retry": rnr_retry,
                              "max_rd_atomic": 1}),
    ]


def check_transitions(steps: list) -> None:
    """Raise ValueError unless ``steps`` walk RESET->INIT->RTR->RTS with exactly the
    required attributes each."""
    state = RESET
    for step in steps:
        if step.src != state or step.attrs.get("qp_state") != step.dst:
            raise ValueError(f"transition {step.name} does not start at "
                             f"{STATE_NAMES[state]} or does not set its target state")
        need = REQUIRED.get((step.src, step.dst))
        if need is None or set(step.attrs) != need:
            raise ValueError(f"{step.name}: attributes {sorted(step.attrs)} != required "
                             f"{sorted(need or ())}")
        state = step.dst
    if state != RTS:
        raise ValueError(f"transitions end in {STATE_NAMES[state]}, not RTS")


# -- pyverbs -----------------------------------------------------------------------------------
DEBIAN_DIST = "/usr/lib/python3/dist-packages"


def import_pyverbs():
    """The ``pyverbs`` package, or raise ImportError saying why it is unavailable."""
    try:
        importlib.import_module("pyverbs")
    except ImportError as first:
        if sys.version_info[:2] != (3, 11):          # Debian bookworm's python3 is 3.11
            raise ImportError(f"pyverbs is not installed ({first})") from None
        saved = list(sys.path)
        sys.path.append(DEBIAN_DIST)
        try:
            importlib.import_module("pyverbs")
        except ImportError as e:
            raise ImportError(f"pyverbs not importable ({first}; Debian's python3-pyverbs: "
                              f"{e}); apt-get install python3-pyverbs") from None
        finally:
            sys.path[:] = saved                      # subpackages resolve via __path__
    for sub in ("enums", "addr", "qp", "wr", "cq", "mr", "pd", "device"):
        importlib.import_module(f"pyverbs.{sub}")    # the pieces used, as attributes
    return sys.modules["pyverbs"]


def to_qp_attr(step: Transition):
    """A pyverbs ``QPAttr`` carrying ``step.attrs`` (pass it with ``step.mask``)."""
    pv = import_pyverbs()
    attr = pv.qp.QPAttr()
    for name, value in step.attrs.items():
        if name == "ah_attr":
            gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(value["dgid"]),
                                     sgid_index=value["sgid_index"],
                                     hop_limit=value["hop_limit"])
            value = pv.addr.AHAttr(port_num=value["port_num"], dlid=value["dlid"],
                                   sl=value["sl"], is_global=value["is_global"], gr=gr)
        setattr(attr, name, value)
    return attr
