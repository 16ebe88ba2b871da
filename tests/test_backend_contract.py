"""Both backends implement moe_comm/backend.py's contract: the Backend methods, and mode
modules whose functions take the protocols' arguments (same names, same kinds; a backend may
add optional keyword arguments of its own)."""
from __future__ import annotations

import inspect

import pytest

from moe_comm import backend
from moe_comm.cuda import ll as cuda_ll
from moe_comm.cuda import normal as cuda_normal
from moe_comm.cuda.backend import CudaBackend
from moe_comm.host import ll as host_ll
from moe_comm.host import normal as host_normal
from moe_comm.host.backend import HostBackend


def _protocol_methods(proto):
    return {name: fn for name, fn in vars(proto).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


def _check(impl, proto_fn, skip_self: bool):
    want = list(inspect.signature(proto_fn).parameters.values())[1:]     # drop self
    got = list(inspect.signature(impl).parameters.values())[1 if skip_self else 0:]
    extra = got[len(want):]
    assert [(p.name, p.kind) for p in got[:len(want)]] == [(p.name, p.kind) for p in want], \
        f"{impl.__module__}.{impl.__qualname__}{inspect.signature(impl)} vs. the protocol's " \
        f"{inspect.signature(proto_fn)}"
    assert all(p.default is not inspect.Parameter.empty for p in extra), \
        f"{impl.__qualname__}: arguments beyond the contract must be optional: {extra}"


@pytest.mark.parametrize("module,proto", [(host_normal, backend.NormalMode),
                                          (cuda_normal, backend.NormalMode),
                                          (host_ll, backend.LowLatencyMode),
                                          (cuda_ll, backend.LowLatencyMode)],
                         ids=["host-normal", "cuda-normal", "host-ll", "cuda-ll"])
def test_mode_modules_follow_the_protocol(module, proto):
    for name, fn in _protocol_methods(proto).items():
        _check(getattr(module, name), fn, skip_self=False)


@pytest.mark.parametrize("cls", [HostBackend, CudaBackend])
def test_backends_follow_the_protocol(cls):
    for name, fn in _protocol_methods(backend.Backend).items():
        _check(getattr(cls, name), fn, skip_self=True)


def test_a_mismatch_is_seen():
    def dispatch(comm, *, x_bytes, dtype):        # the protocol's first arguments only
        pass
    with pytest.raises(AssertionError):
        _check(dispatch, backend.NormalMode.dispatch, skip_self=False)
