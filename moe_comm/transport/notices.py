"""Signals as authenticated, numbered notices, for engines whose wire does not order them.

An engine built on a transfer library (NIXL) carries a signal as a short message to the
receiving process rather than as a write: the receiver bounds-checks the word and stores it
itself (release fence), like the TCP receiver does. The library's notification channel
trusts whoever can reach it, so every notice carries

- the sender's sequence number: the receiver applies notices of one sender strictly in
  order (a bounded reorder window absorbs a transport that delivers out of order), and
  refuses a replayed or stale one;
- a MAC (HMAC-SHA256, 16 bytes) under a key derived from the job secret for this ordered
  pair of ranks: a process outside the job, or a notice meant for another pair, is refused.

Format: ``MAGIC | seq u64 | flags u32 | count u32 | count x (offset u64, value i64) | mac[16]``.
Sequence 0 is the hello each side sends when the engine connects (no signals); the last one
may carry ``BYE``: the sender is closing its transport, so a failure to reach it from then on
is the end of the job's use of it, not a fault.
"""
from __future__ import annotations

import hashlib
import hmac
import struct

MAGIC = b"MCN1"
HEAD = struct.Struct("<4sQII")
BYE = 1
ENTRY = struct.Struct("<Qq")
MAC = 16
WINDOW = 4096                # notices held for a gap in one sender's sequence at most


class Refused(Exception):
    pass


def pair_key(secret: bytes, src: int, dst: int) -> bytes:
    return hmac.new(secret, b"moe_comm notices" + struct.pack("<ii", src, dst),
                    hashlib.sha256).digest()


def encode(key: bytes, seq: int, signals, flags: int = 0) -> bytes:
    """One notice: ``signals`` is a list of ``(offset, value)`` stored in this order."""
    body = bytearray(HEAD.pack(MAGIC, seq, flags, len(signals)))
    for off, value in signals:
        body += ENTRY.pack(off, value)
    return bytes(body) + hmac.new(key, body, hashlib.sha256).digest()[:MAC]


def decode(key: bytes, msg: bytes):
    """``(seq, flags, [(offset, value), ...])`` of a genuine notice, else :class:`Refused`."""
    if len(msg) < HEAD.size + MAC:
        raise Refused(f"notice of {len(msg)} bytes is too short")
    body, mac = msg[:-MAC], msg[-MAC:]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()[:MAC]):
        raise Refused("bad MAC: not from a peer of this job")
    magic, seq, flags, count = HEAD.unpack_from(body)
    if magic != MAGIC or flags & ~BYE or len(body) != HEAD.size + count * ENTRY.size:
        raise Refused("malformed notice")
    return seq, flags, [ENTRY.unpack_from(body, HEAD.size + i * ENTRY.size)
                        for i in range(count)]


class Inbox:
    """One sender's notices, released in sequence order."""

    def __init__(self, key: bytes):
        self.key = key
        self.next = 0
        self.held = {}

    def accept(self, msg: bytes) -> list:
        """The notices now due, in order, as ``(flags, signals)`` (possibly none); raises
        :class:`Refused` for a forged, replayed or runaway notice."""
        seq, flags, signals = decode(self.key, msg)
        if seq < self.next or seq in self.held:
            raise Refused(f"notice {seq} replayed (next expected {self.next})")
        if seq >= self.next + WINDOW:
            raise Refused(f"notice {seq} is {seq - self.next} ahead of the sequence")
        self.held[seq] = flags, signals
        due = []
        while self.next in self.held:
            due.append(self.held.pop(self.next))
            self.next += 1
        return due
