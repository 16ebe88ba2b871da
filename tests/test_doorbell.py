"""Doorbells of the Python waits (moe_comm/host/doorbell.py): a rank asleep on its doorbell
wakes when a writer rings it, long before its sleep's end, and a wait that sleeps on it
still ends when its words come."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from moe_comm.host import native
from moe_comm.host.doorbell import Doorbells
from moe_comm.shm import atomics
from moe_comm.wire import DOORBELL_WORD

LONG_SLEEP_S = 20.0      # a sleep a ring must cut short; the bound below is far under it

lib = native.library()
needs_c = pytest.mark.skipif(lib is None, reason="no C compiler: no doorbells")


def _two_ranks():
    words = [np.zeros(DOORBELL_WORD + 8, dtype=np.int64) for _ in range(2)]
    return words, Doorbells(words, 0, lib), Doorbells(words, 1, lib)


@needs_c
def test_a_ring_wakes_a_sleeper():
    words, mine, peer = _two_ranks()
    woke = []

    def sleeper():
        t0 = time.monotonic()
        mine.arm()
        mine.sleep(LONG_SLEEP_S)
        woke.append(time.monotonic() - t0)

    t = threading.Thread(target=sleeper)
    t.start()
    time.sleep(0.2)                   # (asleep by now; if not, the ring finds it armed)
    peer.ring(0)
    t.join(LONG_SLEEP_S + 5)
    assert woke and woke[0] < LONG_SLEEP_S / 4, woke
    assert words[0][DOORBELL_WORD] == 0         # cleared for the next sleep


@needs_c
def test_a_wait_on_the_doorbell_ends_when_its_words_come():
    words, mine, peer = _two_ranks()
    slot = words[0][DOORBELL_WORD + 1:DOORBELL_WORD + 3]     # two words rank 1 writes

    def writer():
        time.sleep(0.3)
        atomics.store_words(slot, np.array([7 << 32 | 1, 7 << 32 | 2], dtype=np.int64))
        peer.ring(0)

    t = threading.Thread(target=writer)
    t.start()
    t0 = time.monotonic()
    silent = atomics.wait_words({1: slot}, 7, time.monotonic() + LONG_SLEEP_S, "test",
                                LONG_SLEEP_S, crowded=True, bell=mine)
    took = time.monotonic() - t0
    t.join()
    assert silent == set() and took < LONG_SLEEP_S / 4, took
    assert words[0][DOORBELL_WORD] == 0


@needs_c
def test_a_wait_without_words_still_times_out():
    words, mine, _ = _two_ranks()
    slot = words[0][DOORBELL_WORD + 1:DOORBELL_WORD + 2]
    t0 = time.monotonic()
    silent = atomics.wait_words({1: slot}, 3, time.monotonic() + 0.5, "test", 0.5,
                                raise_on_timeout=False, crowded=True, bell=mine)
    assert silent == {1} and 0.5 <= time.monotonic() - t0 < LONG_SLEEP_S / 4
