"""The argument list of every kernel of csrc/, defined once.

Each kernel takes only 8-byte parameters: pointers (``const u64*``, ``i32*``, ...) and ``i64``
scalars. Their order and names are written here and nowhere else: the device side gets them
as ``#define MOE_ARGS_<kernel> const u64* bases, i64 rank, ...`` from the generated header
(moe_comm/jit/device_header.py), so a kernel is declared ``name(MOE_ARGS_name)``; the host side
passes them by name, ``pack("moe_ll_wait", bases=..., rank=..., ...)``, and :meth:`Signature.pack`
puts them in the declared order after checking that exactly the declared names came, each
with a value of its kind (a pointer: a tensor, None or a raw ``np.uint64`` address; a scalar:
an int). Adding, removing or reordering a parameter is therefore one edit here plus the
kernel's body.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..wire import CALL_WORDS


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str                       # C spelling: "i64" or a pointer such as "const u16*"

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")


@dataclass(frozen=True)
class PackedArgs:
    """A kernel's arguments in declared order (tensors, None, ints, numpy scalars, as given;
    moe_comm/jit/launch.py converts them to 64-bit words)."""

    kernel: str
    names: tuple
    values: tuple


@dataclass(frozen=True)
class Signature:
    kernel: str
    params: tuple

    @property
    def names(self) -> tuple:
        return tuple(p.name for p in self.params)

    def declaration(self) -> str:
        """``const u64* bases, i64 rank, ...``: the C++ parameter list."""
        return ", ".join(f"{p.ctype} {p.name}" for p in self.params)

    def pack(self, **values) -> PackedArgs:
        """The arguments by name -> in declared order. Raises TypeError for a missing or an
        unknown name, or a value of the wrong kind."""
        if values.keys() != set(self.names):
            missing = [n for n in self.names if n not in values]
            unknown = sorted(set(values) - set(self.names))
            raise TypeError(f"{self.kernel}: missing arguments {missing}, unknown {unknown}")
        for p in self.params:
            _check_kind(self.kernel, p, values[p.name])
        return PackedArgs(self.kernel, self.names, tuple(values[n] for n in self.names))


def _check_kind(kernel: str, p: Param, value) -> None:
    if p.is_pointer:
        ok = value is None or isinstance(value, (torch.Tensor, np.uint64))
    else:
        ok = isinstance(value, (int, np.int64)) and not isinstance(value, np.uint64)
    if not ok:
        want = "a tensor, None or np.uint64" if p.is_pointer else "an int"
        raise TypeError(f"{kernel}: argument {p.name} ({p.ctype}) takes {want}, got "
                        f"{type(value).__name__}")


def _params(text: str) -> tuple:
    """``"const u64* bases, i64 rank"`` -> Params (the type is all but the last word)."""
    out = []
    for item in text.split(","):
        ctype, name = item.strip().rsplit(" ", 1)
        out.append(Param(name, ctype))
    return tuple(out)


# Shared leading groups (the C++ builds its structs from these names: MOE_GROUP, MOE_ERRORS,
# MOE_CALL_ROW in csrc/kernels).
GROUP = ("const u64* bases, i64 rank, i64 num_ranks, i64 data_off, i64 capacity, "
         "i64 timeout_ns, i32* active, i64* floors")
LL_GROUP = "const u64* bases, i64 rank, i64 num_ranks, i64 timeout_ns"
ERRORS = "i32* err_host, i32* err_dev, i64 op"
CALL = ", ".join(f"i64 call{i}" for i in range(CALL_WORDS))
# The three reduce kernels differ only in the element type of `out` (Elem::Storage).
_REDUCE = (GROUP + ", i64 hidden, i64 topk, const i32* matrix, const i32* send_pos, "
           "i64 num_tokens, const float* bias0, const float* bias1, {out}* out, float* w_out, "
           "const u8* staged")

_RELAY_REDUCE = (GROUP + ", " + ERRORS + ", i64 hidden, i64 topk, i64 gather_off, "
                 "i64 gather_rows, const i64* jobs, const i64* ends, i64 num_jobs, "
                 "const i32* relay_pos, i64 num_here, const i32* done_to, i64 done_off, "
                 "i64 done_stride, i64 epoch, i32* counter")

_DECLARED = {
    # ---- intranode.cu: layout and normal mode (normal.py), elastic agreement (elastic.py)
    "moe_layout": "const i64* topk_idx, i64 num_tokens, i64 topk, i64 num_experts, "
                  "i64 num_ranks, i32* per_rank, i32* per_expert, u8* in_rank, i32* send_pos",
    "moe_notify": f"{GROUP}, {ERRORS}, i64 notify_off, i64 row_words, i64 epoch, "
                  f"const i32* counts, i32* matrix, i64 call_off, {CALL}, "
                  "const i32* host_counts, i64 num_hosts, i32* host_matrix",
    "moe_wait_done": f"{GROUP}, {ERRORS}, i64 done_off, i64 done_stride, i64 epoch",
    "moe_dispatch_send": f"{GROUP}, {ERRORS}, const u8* x, i64 num_tokens, i64 row_bytes, "
                         "const float* scales, i64 scale_cols, const i64* topk_idx, "
                         "const float* topk_w, i64 topk, i64 num_local, const i32* send_pos, "
                         "const i32* matrix, i64 worst, i64 chunk, i64 first, i64 done_off, "
                         "i64 done_stride, i64 epoch, i32* counter",
    "moe_dispatch_copy_out": f"{GROUP}, i64 row_bytes, i64 scale_cols, i64 topk, "
                             "const i32* matrix, i64 worst, i64 chunk, i64 first, "
                             "i64 rows_out, u8* recv_x, "
                             "float* recv_scales, i64* recv_idx, float* recv_w, "
                             "i32* expert_counts, i64 num_local",
    "moe_combine_send": f"{GROUP}, {ERRORS}, const u8* x, i64 row_bytes, const float* topk_w, "
                        "i64 topk, const i32* matrix, i64 chunk, i64 first, i64 done_off, "
                        "i64 done_stride, i64 epoch, i32* counter",
    "moe_combine_stage": f"{GROUP}, i64 row_bytes, i64 topk, i64 chunk, i64 first, i64 rows, "
                         "i64 total, u8* staged",
    "moe_combine_reduce_bf16": _REDUCE.format(out="u16"),
    "moe_combine_reduce_f16": _REDUCE.format(out="u16"),
    "moe_combine_reduce_f32": _REDUCE.format(out="float"),
    # hierarchical normal mode (relay.cuh, cuda/relay.py)
    "moe_relay_stage": f"{GROUP}, {ERRORS}, const u8* x, i64 num_tokens, i64 row_bytes, "
                       "const float* scales, i64 scale_cols, const i64* topk_idx, "
                       "const float* topk_w, i64 topk, const i32* send_pos, "
                       "const i32* host_pos, i64 num_hosts, const i32* relay_of, "
                       "const i32* ranks_on, i64 mask_cols, const i64* stage_off, "
                       "const i64* stage_rows, const i64* stage_row0, const i32* done_to, "
                       "i64 done_off, i64 done_stride, i64 epoch, i32* counter",
    "moe_relay_forward": f"{GROUP}, {ERRORS}, i64 row_bytes, i64 scale_cols, i64 topk, "
                         "i64 num_local, i64 mask_cols, i64 stage_off, i64 stage_rows, "
                         "const i64* jobs, i64 num_jobs, const i64* out_rows, i32* relay_pos, "
                         "i64 num_here, const i32* done_to, i64 done_off, i64 done_stride, "
                         "i64 epoch, i32* counter",
    "moe_relay_ranges": f"{GROUP}, {ERRORS}, const u8* x, i64 row_bytes, const float* topk_w, "
                        "i64 topk, const i64* jobs, const i64* ends, i64 num_jobs, "
                        "const i32* done_to, i64 done_off, i64 done_stride, i64 epoch, "
                        "i32* counter",
    "moe_relay_reduce_bf16": _RELAY_REDUCE,
    "moe_relay_reduce_f16": _RELAY_REDUCE,
    "moe_relay_reduce_f32": _RELAY_REDUCE,
    "moe_agree": f"{LL_GROUP}, {ERRORS}, i32* active, i32* told, i64 mask_off, "
                 "i64 decided_off, i64 fence_off, i64 row_stride, i64 mask_words, i64 seq, "
                 "i64 tag0, i64 max_rounds, i32* matrix, i64* floors",
    # ---- ll.cu: low-latency mode (ll.py)
    "moe_ll_wait": f"{LL_GROUP}, {ERRORS}, i64 offset, i64 src_stride, i64 words, i64 epoch, "
                   "i32* active, i64* wait_cost",
    "moe_ll_check_call": f"{LL_GROUP}, {ERRORS}, i64 call_off, i64 seq, i32* active, {CALL}, "
                         "i64* wait_cost",
    "moe_ll_quantize": "const u16* x, i64 num_tokens, i64 hidden, u8* staged, "
                       "i64 staged_stride",
    "moe_ll_dispatch_send": f"{LL_GROUP}, {ERRORS}, i64 payload_off, i64 meta_off, "
                            "i64 counts_off, i64 count_row_words, i64 stride, i64 max_tokens, "
                            "const u16* x, const u8* staged, i64 staged_stride, "
                            "i64 num_tokens, i64 hidden, const i64* topk_idx, "
                            "i64 topk, i64 num_experts, i32* send_index, i64 seq, i32* active, "
                            f"i64 call_off, {CALL}, i64* holds, i32* shift_used, i32* runs, "
                            "i64 rows_cap",
    "moe_ll_dispatch_recv": f"{LL_GROUP}, {ERRORS}, i64 payload_off, i64 meta_off, "
                            "i64 counts_off, i64 count_row_words, i64 stride, i64 max_tokens, "
                            "i64 hidden, i64 num_local, i64 free_off, i64 seq, u8* recv_x, "
                            "void* recv_scales, i32* recv_count, i32* stats, i64* recv_meta, "
                            "i64* recv_ranges, i64* return_base, i32* counter, i32* active",
    "moe_ll_combine_send": f"{LL_GROUP}, {ERRORS}, i64 combine_off, i64 max_tokens, "
                           "const u16* x, i64 hidden, i64 num_local, i64 rows_cap, "
                           "const i64* recv_ranges, const i64* return_base, i64 done_off, "
                           "i64 done_stride, i64 seq, i32* counter, i32* active, i64 logfmt",
    "moe_ll_combine_recv": f"{LL_GROUP}, {ERRORS}, i64 combine_off, i64 hidden, "
                           "i64 num_tokens, i64 topk, i64 rows_cap, const i64* topk_idx, "
                           "const float* topk_w, const i32* send_index, i64 free_off, i64 seq, "
                           "u16* out, i32* counter, i64 num_local, i32* active, i64* holds, "
                           "const i32* runs, i64 done_off, i64 logfmt, i32* logfmt_seen",
    # ---- csrc/ibgda/selftest.cu (moe_comm/testing/ibgda_selftest.py)
    "moe_ibgda_test_send": f"const u64* bases, {ERRORS}, i64 peer, i64 dst_off, const u8* src, "
                           "i64 bytes, i64 sig_off, i64 word",
    "moe_ibgda_test_wait": f"const u64* bases, {ERRORS}, i64 peer, const u64* word, i64 epoch, "
                           "i64 timeout_ns, i64* out",
    "moe_ibgda_test_wait_remote": f"const u64* bases, {ERRORS}, i64 peer, i64 off, i64 epoch, "
                                  "i64 timeout_ns, i64* out",
    "moe_ibgda_test_pingpong": f"const u64* bases, {ERRORS}, i64 rank, i64 peer, i64 first, "
                               "i64 iters, i64 dst_off, const u8* src, i64 bytes, i64 sig_off, "
                               "i64 epoch0, i64 timeout_ns, i64* out",
}

KERNEL_ARGS = {name: Signature(name, _params(text)) for name, text in _DECLARED.items()}


def pack(kernel: str, **values) -> PackedArgs:
    """``kernel``'s arguments by name, checked and in declared order (see the module doc)."""
    return KERNEL_ARGS[kernel].pack(**values)


def call_args(call_row) -> dict:
    """A call signature row (moe_comm/signature.py, eight values) as ``call0..call7``."""
    values = [int(v) for v in call_row]
    if len(values) != CALL_WORDS:
        raise ValueError(f"a call signature has {CALL_WORDS} words, got {len(values)}")
    return {f"call{i}": v for i, v in enumerate(values)}
