"""The receiving side of the TCP transport: apply a peer's frames to the registered region.

Every frame is checked against the region before a byte of it is written: a put must lie
inside ``[0, size)``, a signal must be an 8-byte aligned word inside it, reserved fields must
be 0. A frame that fails is refused, logged with the peer's rank and address, and the
connection is dropped -- the rest of that stream can no longer be trusted to be in step.

Signals are applied with :func:`moe_comm.shm.atomics.store_words` (release fence, then an
aligned 8-byte store). Everything this connection wrote before was written by this thread
(payload copies and ``recv_into`` completed before), so a reader in any process that maps
the region and loads the word with an acquire fence sees the payload (see atomics.py).

Large payloads are received straight into the region (no copy), the next header in the same
scatter read; small frames are read in batches through a 64 KiB buffer, so a stream of small
puts and signals costs one ``recv`` per batch rather than per frame.
"""
from __future__ import annotations

import logging
import socket

import numpy as np

from ..shm import atomics
from .commands import FRAME, FRAME_BYTES, OP_PUT, OP_SIGNAL

log = logging.getLogger("moe_comm.transport")

BUF = 1 << 16


class Region:
    """This rank's registered region: the only memory a peer may write."""

    def __init__(self, region: np.ndarray):
        if not isinstance(region, np.ndarray) or region.dtype != np.uint8 or region.ndim != 1:
            raise TypeError("region must be a 1-D numpy uint8 array (the registered segment)")
        if not region.flags.c_contiguous or not region.flags.writeable:
            raise ValueError("region must be contiguous and writeable")
        if region.ctypes.data % 8:
            raise ValueError("region must start 8-byte aligned (signal words are int64)")
        self.bytes = region
        self.view = memoryview(region)
        self.size = region.nbytes
        self.words = region[:self.size // 8 * 8].view(np.int64)

    def check_put(self, offset: int, nbytes: int):
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            return (f"put of bytes [{offset}, {offset + nbytes}) outside the registered "
                    f"region of {self.size} bytes")
        return None

    def check_signal(self, offset: int):
        if offset % 8 or offset < 0 or offset + 8 > self.size:
            return (f"signal at byte {offset} is not an aligned word inside the registered "
                    f"region of {self.size} bytes")
        return None

    def signal(self, offset: int, value: int) -> None:
        w = offset >> 3
        atomics.store_words(self.words[w:w + 1], value)


class Refused(Exception):
    pass


def serve_connection(sock: socket.socket, region: Region) -> str:
    """Apply frames until the stream ends. Returns why it ended: ``"closed"`` (clean end at
    a frame boundary) or ``"closed mid-frame"``; raises :class:`Refused` on a bad frame and
    ``OSError`` on a socket error."""
    buf = bytearray(BUF)
    mv = memoryview(buf)
    lo = hi = 0
    while True:
        while hi - lo < FRAME_BYTES:                     # need a whole header
            if lo == hi:
                lo = hi = 0
            elif BUF - lo < FRAME_BYTES:                 # header straddles the end
                buf[:hi - lo] = buf[lo:hi]
                lo, hi = 0, hi - lo
            n = sock.recv_into(mv[hi:])
            if n == 0:
                return "closed" if lo == hi else "closed mid-frame"
            hi += n
        op, flags, offset, arg = FRAME.unpack_from(buf, lo)
        lo += FRAME_BYTES
        if flags:
            raise Refused(f"frame with reserved flags {flags:#x}")
        if op == OP_SIGNAL:
            err = region.check_signal(offset)
            if err:
                raise Refused(err)
            region.signal(offset, arg)
        elif op == OP_PUT:
            err = region.check_put(offset, arg)
            if err:
                raise Refused(err)
            dst = region.view[offset:offset + arg]
            got = min(hi - lo, arg)
            dst[:got] = mv[lo:lo + got]
            lo += got
            while got < arg:
                need = arg - got
                if need >= BUF // 2:
                    # Large: straight into the region, and the next header in the same
                    # call (scatter read) -- one syscall per frame, no copy.
                    n = sock.recvmsg_into([dst[got:], mv[:FRAME_BYTES]])[0]
                    if n == 0:
                        return "closed mid-frame"
                    if n > need:
                        lo, hi = 0, n - need
                    got += min(n, need)
                else:                                    # small tail: read ahead with it
                    n = sock.recv_into(mv)               # (buffer is empty here)
                    if n == 0:
                        return "closed mid-frame"
                    take = min(n, need)
                    dst[got:got + take] = mv[:take]
                    got += take
                    lo, hi = take, n
        else:
            raise Refused(f"unknown op {op}")
