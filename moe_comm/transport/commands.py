"""The proxy's command format and the TCP frame format, in one place.

Commands are fixed-size records so that any producer -- host code today, a GPU kernel
writing into pinned memory later -- can fill a ring slot without Python objects. A command
names its destination rank and what to do there:

- ``PUT``: write ``nbytes`` bytes at byte ``offset`` of the destination's registered region.
  Host producers keep the source object beside the record (see ``ring.py``); ``src_addr``
  holds its address for engines that read memory directly (verbs).
- ``SIGNAL``: store the int64 ``value`` at byte ``offset`` (8-byte aligned) of the
  destination's region, with a release fence, after every earlier command from this sender
  to that destination has been applied.

On TCP each command travels as one frame: a 24-byte header ``(op, flags, offset, arg)``,
where ``arg`` is ``nbytes`` for a put (followed by that many payload bytes) and ``value`` for
a signal (no payload). ``flags`` is reserved and must be 0, so a future extension is refused
by an old receiver instead of being misread.
"""
from __future__ import annotations

import struct

import numpy as np

OP_PUT = 1
OP_SIGNAL = 2

COMMAND_DTYPE = np.dtype([
    ("op", "<u4"),          # OP_PUT / OP_SIGNAL
    ("dst", "<u4"),         # destination rank (group rank)
    ("offset", "<u8"),      # byte offset in the destination's region
    ("nbytes", "<u8"),      # put: payload length; signal: 8
    ("value", "<i8"),       # signal: the word stored; put: 0
    ("src_addr", "<u8"),    # put: address of the source bytes (engines reading memory)
])

FRAME = struct.Struct("<IIQq")      # op, flags (0), offset, nbytes | value
FRAME_BYTES = FRAME.size            # 24

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
