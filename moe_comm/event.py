"""EventOverlap: DeepEP's handle for work that may finish asynchronously."""
from __future__ import annotations

import contextlib

import torch


class EventHandle:
    """DeepEP's ``EventHandle``: the work queued so far on the current CUDA stream, recorded at
    construction (nothing on a machine without CUDA, where calls complete when they return)."""

    def __init__(self):
        self.event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """Wraps a ``torch.cuda.Event`` (CUDA backend) or nothing (host backend, whose calls are
    complete when they return). ``current_stream_wait()`` makes the current stream wait for
    the event; ``with event:`` does the same at the end of the block."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors      # kept alive until the event completes

    def current_stream_wait(self) -> None:
        if isinstance(self.event, EventHandle):          # DeepEP's way of building one
            self.event.current_stream_wait()
        elif self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()
        return False


def capture_event() -> EventOverlap:
    """An EventOverlap for the work queued so far on the current stream."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return EventOverlap(ev)
    return EventOverlap()


class RecvHook:
    """The receive half of a low-latency call (``return_recv_hook=True``): calling it waits
    for the data and fills the tensors the call returned. It runs exactly once. ``enter``: a
    context manager factory the hook runs inside; what it refuses (a destroyed Buffer, another
    thread's call) is raised before the hook is used up."""

    def __init__(self, receive, on_done=None, enter=None):
        self._receive, self._on_done, self._enter, self.done = receive, on_done, enter, False

    def __call__(self):
        with self._enter() if self._enter is not None else contextlib.nullcontext():
            if self.done:
                raise RuntimeError("this receive hook already ran; each hook runs once")
            self.done = True
            try:
                self._receive()
            finally:
                if self._on_done is not None:
                    self._on_done()
