"""Input checks. Each raises ValueError/TypeError naming the argument and what was expected,
before anything is sent, so a bad call leaves the buffer usable."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8 = torch.float8_e4m3fn


def tensor(name, t, *, ndim=None, dtypes=None, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, "
                        f"got {t.dtype}")
    if device is not None and t.device.type != device:
        raise ValueError(f"{name} must be on the {device} device for this buffer, got {t.device}")
    return t


def num_experts(n, num_ranks):
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"num_experts must be a positive int, got {n!r}")
    if n % num_ranks:
        raise ValueError(f"num_experts={n} must be divisible by the group size {num_ranks} "
                         "(experts are owned contiguously, E/R per rank)")
    return n


def topk_idx(t, n_experts, num_tokens=None, device=None):
    tensor("topk_idx", t, ndim=2, dtypes=(torch.int64,), device=device)
    if num_tokens is not None and t.shape[0] != num_tokens:
        raise ValueError(f"topk_idx has {t.shape[0]} rows but x has {num_tokens} tokens")
    # The value check reads two numbers back: a host synchronisation on a GPU, which CUDA-graph
    # capture forbids; while capturing it is skipped (the ids were checked when warming up).
    if t.numel() and not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = int(t.min()), int(t.max())
        if lo < -1 or hi >= n_experts:
            bad = lo if lo < -1 else hi
            raise ValueError(f"topk_idx holds expert id {bad} outside [0, {n_experts}) "
                             "(use -1 for an unused slot)")
    return t


def topk_weights(t, idx, device=None):
    if t is None:
        return None
    tensor("topk_weights", t, ndim=2, dtypes=(torch.float32,), device=device)
    if idx is not None and t.shape != idx.shape:
        raise ValueError(f"topk_weights shape {tuple(t.shape)} must equal topk_idx shape "
                         f"{tuple(idx.shape)}")
    return t


def hidden_size(name, hidden):
    if hidden <= 0:
        raise ValueError(f"{name} has hidden size {hidden}: rows of 0 channels carry nothing")


def dispatch_x(x, device=None):
    """Returns ``(data [T, H], scales [T, H/128] or None)``, both contiguous."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError("x as a tuple must be (float8_e4m3fn data [T, H], float32 scales "
                             f"[T, H/128]), got {len(x)} items")
        data, scales = x
        tensor("x[0]", data, ndim=2, dtypes=(FP8,), device=device)
        tensor("x[1]", scales, ndim=2, dtypes=(torch.float32,), device=device)
        hidden_size("x[0]", data.shape[1])
        if data.shape[1] % 128:
            raise ValueError(f"hidden size {data.shape[1]} of fp8 x must be a multiple of 128 "
                             "(one scale per 128 channels)")
        if scales.shape != (data.shape[0], data.shape[1] // 128):
            raise ValueError(f"x[1] (scales) must have shape {(data.shape[0], data.shape[1] // 128)}"
                             f", got {tuple(scales.shape)}")
        return data.contiguous(), scales.contiguous()
    tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES + (FP8,), device=device)
    if x.dtype == FP8:
        raise TypeError("fp8 x must come with its scales: pass x=(data, scales)")
    hidden_size("x", x.shape[1])
    return x.contiguous(), None


def layout_matches(given: dict, computed: dict) -> None:
    """The caller's ``get_dispatch_layout`` outputs (``{name: tensor or None}``) must be what
    ``topk_idx`` gives (``computed``, same names): a rank that sent by one and sized by the
    other would disagree with its peers about how many rows move. Reads one flag per tensor
    back in one go (a host synchronisation on a GPU; skipped while a CUDA graph is being
    captured)."""
    names = [n for n, t in given.items() if t is not None]
    if not names or (given[names[0]].is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    for name in names:
        if tuple(given[name].shape) != tuple(computed[name].shape):
            raise ValueError(f"{name} has shape {tuple(given[name].shape)}, topk_idx gives "
                             f"{tuple(computed[name].shape)}")
    differ = torch.stack([(given[n].to(computed[n].dtype) != computed[n]).any()
                          for n in names]).tolist()
    for name, bad in zip(names, differ):
        if bad:
            raise ValueError(f"{name} does not match topk_idx (pass the outputs of "
                             "get_dispatch_layout for this topk_idx and num_experts)")


def alignment(n):
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"expert_alignment must be an int >= 1, got {n!r}")
    return n
