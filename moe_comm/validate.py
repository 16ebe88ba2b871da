"""Argument checks of every Buffer call. Each raises ValueError/TypeError naming the argument
and what was expected, before anything is sent, so a bad call leaves the buffer usable.

Layout: primitives (one tensor, one number), then the checks of argument groups that several
calls share (x, expert ids, handles, rank masks, the low-latency layout), then one function
per call (``*_args``), which :class:`moe_comm.Buffer` runs first. Within a call, every
tensor's device is checked before any tensor's values are read: reading a CUDA tensor from a
CPU Buffer (or a meta tensor) would fail with an unrelated error, or synchronise the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import logfmt as logfmt_codec
from .errors import BufferTooSmallError
from .handle import DispatchHandle, LowLatencyHandle
from .signature import MAX_SCALE_COLS
from .transport.select import KINDS as TRANSPORTS
from .wire import LL_MAX_TOPK, LLLayout

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8 = torch.float8_e4m3fn
SCALE_DTYPES = (torch.float32, torch.int32)       # DeepEP's: float scales, or UE8M0 packed
MASK_DTYPES = (torch.int32, torch.int64, torch.bool)


@dataclass(frozen=True)
class BufferFacts:
    """What a call's arguments are checked against: the Buffer's group size, device,
    identity (``key``, carried by the handles it makes) and whether low-latency mode is on."""
    group_size: int
    device: torch.device
    key: tuple
    low_latency_mode: bool


# -- primitives -------------------------------------------------------------------------------
def tensor(name, t, *, ndim=None, dtypes=None):
    """Type, rank and dtype; the device is :func:`on_device`'s (all tensors of a call at once)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, "
                        f"got {t.dtype}")
    return t


def on_device(device, **tensors) -> None:
    """Every tensor argument (``None`` and non-tensors are skipped) must live where the
    Buffer's backend works."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(f"{name} is on {t.device}, but this Buffer works on "
                             f"{device} (Buffer(device=...) picks the backend)")


def positive_int(name, n):
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    return n


def expert_count(n, num_ranks):
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"num_experts must be a positive int, got {n!r}")
    if n % num_ranks:
        raise ValueError(f"num_experts={n} must be divisible by the group size {num_ranks} "
                         "(experts are owned contiguously, E/R per rank)")
    return n


def hidden_size(name, hidden):
    if hidden <= 0:
        raise ValueError(f"{name} has hidden size {hidden}: rows of 0 channels carry nothing")


def alignment(n):
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"expert_alignment must be an int >= 1, got {n!r}")
    return n


def worst_tokens(n):
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"num_worst_tokens must be an int >= 0, got {n!r}")
    return n


def shape(name, t, expected) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


# -- argument groups --------------------------------------------------------------------------
def expert_ids(t, num_experts, num_tokens=None):
    tensor("topk_idx", t, ndim=2, dtypes=(torch.int64,))
    if num_tokens is not None and t.shape[0] != num_tokens:
        raise ValueError(f"topk_idx has {t.shape[0]} rows but x has {num_tokens} tokens")
    # The value check reads two numbers back: a host synchronisation on a GPU, which CUDA-graph
    # capture forbids; while capturing it is skipped (the ids were checked when warming up).
    if t.numel() and not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = (int(v) for v in torch.aminmax(t))      # one pass, one call
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            raise ValueError(f"topk_idx holds expert id {bad} outside [0, {num_experts}) "
                             "(use -1 for an unused slot)")
    return t


def expert_rows(t, num_experts: int, max_tokens: int) -> None:
    """Low-latency dispatch: no expert may get more than ``max_tokens`` rows from one rank
    (its block at the receiver holds that many), which only a token naming an expert twice
    can cause. One number read back, skipped while a CUDA graph is captured (expert_ids)."""
    if t.numel() <= max_tokens or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    # ids shifted by one: -1 slots count in column 0, which is dropped
    per_expert = torch.bincount((t + 1).flatten(), minlength=num_experts + 1)[1:]
    if int(per_expert.max()) > max_tokens:
        worst = int(per_expert.argmax())
        raise ValueError(f"topk_idx sends {int(per_expert[worst])} rows to expert {worst}, more "
                         f"than num_max_dispatch_tokens_per_rank={max_tokens}: a token names "
                         "that expert more than once")


def routing_weights(t, idx):
    if t is None:
        return None
    tensor("topk_weights", t, ndim=2, dtypes=(torch.float32,))
    if idx is not None and t.shape != idx.shape:
        raise ValueError(f"topk_weights shape {tuple(t.shape)} must equal topk_idx shape "
                         f"{tuple(idx.shape)}")
    return t


def dispatch_scales(scales, num_tokens) -> None:
    """The scales of fp8 x: float32 or int32 (UE8M0-packed), [T, S] with any S >= 1, either
    major-ness. They travel as S opaque 4-byte columns per row, as DeepEP carries them."""
    tensor("x[1]", scales, ndim=2, dtypes=SCALE_DTYPES)
    if scales.shape[0] != num_tokens:
        raise ValueError(f"x[1] (scales) has {scales.shape[0]} rows but x[0] has "
                         f"{num_tokens} tokens")
    if not 1 <= scales.shape[1] <= MAX_SCALE_COLS:
        raise ValueError(f"x[1] (scales) must have between 1 and {MAX_SCALE_COLS} columns, "
                         f"got {scales.shape[1]}")


def dispatch_x(x):
    """Returns ``(data [T, H], scales [T, S] or None)``, both row-major contiguous: the wire
    moves rows (column-major scales, SGLang's ``s.t().contiguous().t()``, are copied here, a
    few bytes per token; received scales are row-major, as DeepEP returns them)."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError("x as a tuple must be (float8_e4m3fn data [T, H], float32 or "
                             f"int32 scales [T, S]), got {len(x)} items")
        data, scales = x
        tensor("x[0]", data, ndim=2, dtypes=(FP8,))
        hidden_size("x[0]", data.shape[1])
        if data.shape[1] % 128:
            raise ValueError(f"hidden size {data.shape[1]} of fp8 x must be a multiple of 128 "
                             "(scales cover blocks of 128 channels)")
        dispatch_scales(scales, data.shape[0])
        return data.contiguous(), scales.contiguous()
    tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES + (FP8,))
    if x.dtype == FP8:
        raise TypeError("fp8 x must come with its scales: pass x=(data, scales)")
    hidden_size("x", x.shape[1])
    return x.contiguous(), None


def layout_matches(given: dict, computed: dict) -> None:
    """The caller's ``get_dispatch_layout`` outputs (``{name: tensor or None}``) must be what
    ``topk_idx`` gives (``computed``, same names): a rank that sent by one and sized by the
    other would disagree with its peers about how many rows move. Reads one flag per tensor
    back in one go (a host synchronisation on a GPU; skipped while a CUDA graph is being
    captured). Runs after the per-call check, once the backend has computed the layout."""
    names = [n for n, t in given.items() if t is not None]
    if not names or (given[names[0]].is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    for name in names:
        if tuple(given[name].shape) != tuple(computed[name].shape):
            raise ValueError(f"{name} has shape {tuple(given[name].shape)}, topk_idx gives "
                             f"{tuple(computed[name].shape)}")
    if not given[names[0]].is_cuda:      # no device: one comparison call per tensor
        differ = [not torch.equal(given[n].to(computed[n].dtype), computed[n]) for n in names]
    else:                                # one read back for all
        differ = torch.stack([(given[n].to(computed[n].dtype) != computed[n]).any()
                              for n in names]).tolist()
    for name, bad in zip(names, differ):
        if bad:
            raise ValueError(f"{name} does not match topk_idx (pass the outputs of "
                             "get_dispatch_layout for this topk_idx and num_experts)")


def dispatch_handle(handle, key, num_tokens, hidden=None) -> None:
    """A normal-mode handle made by this Buffer (``key``) for ``num_tokens`` tokens of
    ``hidden`` channels (either None: not checked)."""
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be a moe_comm dispatch handle, got "
                        f"{type(handle).__name__}")
    if handle.buffer_key != key:
        raise ValueError("handle comes from another Buffer; pass the handle returned by "
                         "this buffer's dispatch")
    if num_tokens is not None and num_tokens != handle.num_tokens:
        raise ValueError(f"x has {num_tokens} tokens but handle was made for "
                         f"{handle.num_tokens}")
    if hidden is not None and hidden != handle.hidden:
        raise ValueError(f"x has hidden size {hidden} but handle was made for "
                         f"{handle.hidden} (a cached dispatch repeats the handle's rows)")


def ll_handle(handle, key) -> None:
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(f"handle must be the handle returned by low_latency_dispatch, got "
                        f"{type(handle).__name__}")
    if handle.buffer_key != key:
        raise ValueError("handle comes from another Buffer")


def rank_mask(name, mask, group_size) -> None:
    if mask.dim() != 1 or mask.shape[0] != group_size or mask.is_floating_point():
        raise ValueError(f"{name} must be an integer or bool tensor of shape "
                         f"[{group_size}] (1 = active), got {mask.dtype} "
                         f"{tuple(mask.shape)}")


def active_mask(t, group_size) -> None:
    """The ``active_ranks=`` every call takes: None, or an int32/int64/bool [R] tensor."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype not in MASK_DTYPES:
        raise ValueError(f"active_ranks must be an int32/int64/bool tensor, got "
                         f"{getattr(t, 'dtype', type(t))}")
    rank_mask("active_ranks", t, group_size)


def ll_layout(facts: BufferFacts, ll_bytes, max_tokens, hidden, num_experts) -> LLLayout:
    """The low-latency region's layout for these shapes; it must fit the ``ll_bytes`` the
    Buffer has (``num_rdma_bytes``)."""
    if not facts.low_latency_mode:
        raise ValueError("low-latency calls need Buffer(..., low_latency_mode=True)")
    positive_int("num_max_dispatch_tokens_per_rank", max_tokens)
    expert_count(num_experts, facts.group_size)
    hidden_size("x", hidden)
    if hidden % 128:
        raise ValueError(f"hidden size {hidden} must be a multiple of 128 in low-latency "
                         "mode (one fp8 scale per 128 channels)")
    lay = LLLayout(max_tokens, hidden, facts.group_size, num_experts)
    if lay.nbytes > ll_bytes:
        raise BufferTooSmallError("low-latency mode", lay.nbytes, ll_bytes,
                                  argument="num_rdma_bytes")
    return lay


# -- one function per call --------------------------------------------------------------------
def buffer_args(num_nvl_bytes, num_rdma_bytes, timeout_s, transport) -> None:
    """``Buffer(...)``'s own arguments (the device and backend are picked after these)."""
    for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    if transport not in TRANSPORTS:   # moe_comm/transport/select.py KINDS
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


def flag(name, v) -> None:
    """A DeepEP switch: a bool (numpy bools and 0/1 ints pass too: they compare alike)."""
    if not (isinstance(v, (bool, np.bool_)) or (isinstance(v, int) and v in (0, 1))):
        raise TypeError(f"{name} must be a bool, got {v!r}")


def deepep_buffer_args(group, comm, *, num_qps_per_rank, **flags) -> None:
    """The constructor keywords ``Buffer`` takes from DeepEP (``flags``: name -> value)."""
    for name, v in flags.items():
        flag(name, v)
    positive_int("num_qps_per_rank", num_qps_per_rank)
    if group is None and comm is not None:
        raise TypeError("moe_comm needs a torch.distributed group (an mpi4py communicator "
                        "cannot carry it): pass group=..., or None for the default group")


def rank_index(name, r, group_size) -> int:
    if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < group_size:
        raise ValueError(f"{name} must be a rank in [0, {group_size}), got {r!r}")
    return r


def all_active(active: torch.Tensor, what: str) -> None:
    """``what`` needs every rank of the group taking part (``active``: int [R], 1 = active)."""
    if not bool(active.all()):
        gone = (active == 0).nonzero().flatten().tolist()
        raise ValueError(f"{what} needs every rank active (it gathers over the whole group); "
                         f"rank(s) {gone} are masked")


def mask_status_args(facts: BufferFacts, mask_status) -> None:
    """``low_latency_query_mask_buffer``'s output: an int32/int64 [R] tensor."""
    tensor("mask_status", mask_status, ndim=1, dtypes=(torch.int32, torch.int64))
    shape("mask_status", mask_status, (facts.group_size,))


def local_buffer_args(dtype, size, offset, nbytes) -> int:
    """``get_local_buffer_tensor``: returns the elements the view holds (``size``'s, else
    all that fit after ``offset`` bytes)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if not isinstance(offset, int) or not 0 <= offset <= nbytes:
        raise ValueError(f"offset must be a byte offset in [0, {nbytes}], got {offset!r}")
    elem = torch.empty((), dtype=dtype).element_size()
    if offset % elem:
        raise ValueError(f"offset {offset} is not a multiple of {dtype}'s {elem} bytes")
    fits = (nbytes - offset) // elem
    if size is None:
        return fits
    want = torch.Size(size).numel()
    if want > fits:
        raise ValueError(f"size {tuple(size)} needs {want} elements of {dtype}; the buffer "
                         f"holds {fits} after offset {offset}")
    return want


def wait_cost_stats(name, t, facts: BufferFacts) -> None:
    """``*_wait_recv_cost_stats``: None or an int64 [R] tensor, added to in place."""
    if t is None:
        return
    tensor(name, t, ndim=1, dtypes=(torch.int64,))
    shape(name, t, (facts.group_size,))
    on_device(facts.device, **{name: t})
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def host_transport(transport, device) -> None:
    """The host backend (CPU tensors) cannot use GPU-initiated RDMA."""
    if transport == "ibgda":
        raise ValueError("transport='ibgda' needs CUDA tensors (GPU-initiated RDMA); "
                         f"this Buffer's device is {device}")


def num_sms(n) -> int:
    if not isinstance(n, int) or n <= 0 or n % 2:
        raise ValueError(f"num_sms must be a positive even int, got {n!r}")
    return n


def set_active_ranks_args(facts: BufferFacts, mask) -> torch.Tensor:
    """Returns ``mask`` as a tensor (a list is accepted)."""
    if not isinstance(mask, torch.Tensor):
        mask = torch.as_tensor(mask)
    rank_mask("mask", mask, facts.group_size)
    return mask


def layout_args(facts: BufferFacts, topk_idx, num_experts, active_ranks) -> None:
    """``get_dispatch_layout``."""
    expert_count(num_experts, facts.group_size)
    tensor("topk_idx", topk_idx, ndim=2, dtypes=(torch.int64,))
    on_device(facts.device, topk_idx=topk_idx)            # before its values are read
    expert_ids(topk_idx, num_experts)
    active_mask(active_ranks, facts.group_size)


@dataclass(frozen=True)
class DispatchArgs:
    """What :func:`dispatch_args` found: x split into contiguous data and fp8 scales (or
    None), and the expert count (None for a cached dispatch, which repeats its handle)."""
    data: torch.Tensor
    scales: torch.Tensor | None
    num_experts: int | None


def dispatch_args(facts: BufferFacts, x, handle, num_tokens_per_rank, is_token_in_rank,
                  num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                  num_worst_tokens, active_ranks) -> DispatchArgs:
    """``dispatch``. Whether the layout tensors agree with ``topk_idx`` is checked after this
    (:func:`layout_matches`), against the layout the backend computes."""
    data, scales = dispatch_x(x)
    n_tokens, hidden = data.shape
    alignment(expert_alignment)
    worst_tokens(num_worst_tokens)
    R = facts.group_size
    if handle is not None:
        dispatch_handle(handle, facts.key, n_tokens, hidden)
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("pass either handle or topk_idx/topk_weights, not both")
        on_device(facts.device, x=data, scales=scales)
        active_mask(active_ranks, R)
        return DispatchArgs(data, scales, None)
    if topk_idx is None:
        # DeepEP's dispatch without routing ids: the membership says where tokens go
        if is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("dispatch without handle and topk_idx needs is_token_in_rank and "
                             "num_tokens_per_expert (from get_dispatch_layout)")
        if topk_weights is not None:
            raise ValueError("topk_weights needs the topk_idx it belongs to")
    else:
        tensor("topk_idx", topk_idx, ndim=2, dtypes=(torch.int64,))
    if num_tokens_per_expert is None:
        raise ValueError("num_tokens_per_expert (from get_dispatch_layout) is required "
                         "with topk_idx: it fixes num_experts")
    tensor("num_tokens_per_expert", num_tokens_per_expert, ndim=1)
    num_experts = num_tokens_per_expert.shape[0]
    expert_count(num_experts, R)
    if num_tokens_per_rank is not None:
        tensor("num_tokens_per_rank", num_tokens_per_rank, ndim=1)
        if num_tokens_per_rank.shape[0] != R:
            raise ValueError(f"num_tokens_per_rank must have {R} entries, got "
                             f"{num_tokens_per_rank.shape[0]}")
    if is_token_in_rank is not None:
        tensor("is_token_in_rank", is_token_in_rank, ndim=2, dtypes=(torch.bool,))
        shape("is_token_in_rank", is_token_in_rank, (n_tokens, R))
    # every tensor where this Buffer works, before any of their values is read
    on_device(facts.device, x=data, scales=scales, topk_idx=topk_idx,
              topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
              is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert)
    if topk_idx is not None:
        expert_ids(topk_idx, num_experts, n_tokens)
        routing_weights(topk_weights, topk_idx)
    active_mask(active_ranks, R)
    return DispatchArgs(data, scales, num_experts)


def biases(bias, handle) -> tuple:
    """``combine``'s ``bias``: None, a [T, H] tensor or a tuple of up to two; returned as a
    tuple (empty for None)."""
    if bias is None:
        return ()
    items = bias if isinstance(bias, tuple) else (bias,)
    if len(items) > 2:
        raise ValueError(f"bias must be a tensor or a tuple of up to two, got {len(items)}")
    for i, b in enumerate(items):
        tensor(f"bias[{i}]", b, ndim=2, dtypes=FLOAT_DTYPES)
        shape(f"bias[{i}]", b, (handle.num_tokens, handle.hidden))
    return items


def combine_args(facts: BufferFacts, x, handle, topk_weights, bias, active_ranks) -> tuple:
    """``combine``; returns the biases as a tuple (see :func:`biases`)."""
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be the handle returned by dispatch, got "
                        f"{type(handle).__name__}")
    dispatch_handle(handle, facts.key, None)
    tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    n = handle.num_recv_tokens
    if x.shape[0] != n and not (handle.num_worst_tokens and
                                x.shape[0] == handle.num_worst_tokens):
        raise ValueError(f"x must have the {n} rows this rank received"
                         + (f" (or num_worst_tokens={handle.num_worst_tokens})"
                            if handle.num_worst_tokens else "") + f", got {x.shape[0]}")
    if x.shape[1] != handle.hidden:
        raise ValueError(f"x hidden size {x.shape[1]} differs from the dispatched "
                         f"{handle.hidden}")
    if topk_weights is not None:
        tensor("topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,))
        if topk_weights.shape[0] != x.shape[0]:
            raise ValueError(f"topk_weights must have {x.shape[0]} rows like x, got "
                             f"{topk_weights.shape[0]}")
    items = biases(bias, handle)
    on_device(facts.device, x=x, topk_weights=topk_weights,
              **{f"bias[{i}]": b for i, b in enumerate(items)})
    active_mask(active_ranks, facts.group_size)
    return items


def ll_dispatch_args(facts: BufferFacts, ll_bytes, x, topk_idx, max_tokens, num_experts,
                     stats, use_fp8, round_scale, use_ue8m0, active_ranks) -> LLLayout:
    """``low_latency_dispatch``; returns the low-latency layout."""
    tensor("x", x, ndim=2, dtypes=(torch.bfloat16,))
    n_tokens, hidden = x.shape
    lay = ll_layout(facts, ll_bytes, max_tokens, hidden, num_experts)
    if n_tokens > max_tokens:
        raise ValueError(f"x has {n_tokens} tokens, more than "
                         f"num_max_dispatch_tokens_per_rank={max_tokens}")
    tensor("topk_idx", topk_idx, ndim=2, dtypes=(torch.int64,))
    on_device(facts.device, x=x, topk_idx=topk_idx)      # before topk_idx's values are read
    expert_ids(topk_idx, num_experts, n_tokens)
    if topk_idx.shape[1] > LL_MAX_TOPK:
        raise ValueError(f"topk_idx has {topk_idx.shape[1]} columns; low-latency mode "
                         f"supports top-k <= {LL_MAX_TOPK}")
    expert_rows(topk_idx, num_experts, max_tokens)
    if use_ue8m0 and not (use_fp8 and round_scale):
        raise ValueError("use_ue8m0 needs use_fp8=True and round_scale=True (UE8M0 holds "
                         "powers of two)")
    if use_ue8m0 and hidden % 512:
        raise ValueError(f"use_ue8m0 packs 4 scales per int32: hidden {hidden} must be a "
                         "multiple of 512")
    if stats is not None:
        tensor("cumulative_local_expert_recv_stats", stats, ndim=1,
               dtypes=(torch.int32, torch.int64))
        if stats.shape[0] != lay.num_local:
            raise ValueError(f"cumulative_local_expert_recv_stats must have {lay.num_local} "
                             f"entries, got {stats.shape[0]}")
        on_device(facts.device, cumulative_local_expert_recv_stats=stats)
    active_mask(active_ranks, facts.group_size)
    return lay


def logfmt(use_logfmt, hidden: int) -> None:
    """``low_latency_combine(use_logfmt=...)``: a flag, and the encoding's blocks of 128
    channels must tile the hidden size (moe_comm/logfmt.py)."""
    flag("use_logfmt", use_logfmt)
    if use_logfmt:
        logfmt_codec.row_bytes(hidden)


def ll_combine_args(facts: BufferFacts, ll_bytes, x, topk_idx, topk_weights, handle,
                    use_logfmt, zero_copy, out, active_ranks) -> LLLayout:
    """``low_latency_combine``; returns the low-latency layout. With ``zero_copy`` x is
    ignored (the Buffer's own combine buffer is sent), so it is not checked."""
    ll_handle(handle, facts.key)
    logfmt(use_logfmt, handle.hidden)
    if not handle.received:
        raise RuntimeError("the dispatch of this handle has not received yet: call its "
                           "receive hook before low_latency_combine")
    lay = ll_layout(facts, ll_bytes, handle.max_tokens, handle.hidden, handle.num_experts)
    if not zero_copy:
        tensor("x", x, ndim=3, dtypes=(torch.bfloat16,))
        shape("x", x, (lay.num_local, facts.group_size * handle.max_tokens, handle.hidden))
    tensor("topk_idx", topk_idx, ndim=2, dtypes=(torch.int64,))
    if tuple(topk_idx.shape) != (handle.num_tokens, handle.topk):
        raise ValueError(f"topk_idx must be the dispatched ids, shape "
                         f"{(handle.num_tokens, handle.topk)}, got {tuple(topk_idx.shape)}")
    routing_weights(topk_weights, topk_idx)
    if out is not None:
        tensor("out", out, ndim=2, dtypes=(torch.bfloat16,))
        shape("out", out, (handle.num_tokens, handle.hidden))
    on_device(facts.device, x=None if zero_copy else x, topk_idx=topk_idx,
              topk_weights=topk_weights, out=out)
    active_mask(active_ranks, facts.group_size)
    return lay
