"""Per-layer logical expert load, summed over a sliding window of steps."""

from __future__ import annotations

import torch

__all__ = ["ExpertLoadRecorder"]


class ExpertLoadRecorder:
    """Accumulate tokens per logical expert and report the load of the last steps.

    Typical use: for every MoE layer of a forward pass call :meth:`record_topk`
    (or :meth:`record`), then call :meth:`step` once per forward pass; feed
    :meth:`load` to :func:`moe_comm.eplb.rebalance_experts`.

    A ring of ``window`` completed steps is kept plus the step being recorded
    (the *open* step).  :meth:`load` sums the completed ring and, by default, the
    open step too, so a rebalance triggered mid-step does not ignore it.

    Args:
        num_layers: number of MoE layers.
        num_logical_experts: ``L``.
        window: completed steps kept (default 100).
        dtype: accumulator dtype (default int64; use a float dtype to record
            fractional counts).
        device: where the accumulators live (default CPU); inputs are moved there.
    """

    def __init__(self, num_layers, num_logical_experts, window=100, *, dtype=torch.int64, device="cpu"):
        for name, v in (("num_layers", num_layers), ("num_logical_experts", num_logical_experts),
                        ("window", window)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        self.num_layers, self.num_logical_experts, self.window = num_layers, num_logical_experts, window
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, num_logical_experts)
        self._ring = torch.zeros((window, *shape), dtype=dtype, device=self.device)
        self._open = torch.zeros(shape, dtype=dtype, device=self.device)
        self._sum = torch.zeros(shape, dtype=dtype, device=self.device)  # sum of the ring
        self._next = 0  # ring index the next completed step overwrites
        self.steps = 0  # completed steps since construction / reset

    def record(self, layer, counts, phy2log=None):
        """Add token counts for one layer to the open step.

        Args:
            layer: layer index in ``[0, num_layers)``.
            counts: ``[L]`` tokens per logical expert, or, with ``phy2log``,
                ``[P]`` tokens per physical slot.
            phy2log: optional ``[P]`` (or ``[num_layers, P]``, row ``layer`` is used)
                int placement mapping each slot to its logical expert; counts of
                slots holding ``-1`` are ignored (they own no expert).
        """
        self._check_layer(layer)
        if not isinstance(counts, torch.Tensor):
            raise TypeError(f"counts must be a torch.Tensor, got {type(counts).__name__}")
        if counts.dtype.is_floating_point and not self.dtype.is_floating_point:
            raise TypeError(f"counts are {counts.dtype} but the recorder accumulates {self.dtype}; "
                            f"construct it with a float dtype")
        c = counts.to(self.device, self.dtype)
        L = self.num_logical_experts
        if phy2log is None:
            if tuple(c.shape) != (L,):
                raise ValueError(f"counts must have shape [{L}] without phy2log, got {tuple(c.shape)}")
            self._open[layer] += c
            return
        if not isinstance(phy2log, torch.Tensor):
            raise TypeError(f"phy2log must be a torch.Tensor, got {type(phy2log).__name__}")
        p2l = phy2log[layer] if phy2log.dim() == 2 else phy2log
        if p2l.dim() != 1 or c.shape != p2l.shape:
            raise ValueError(f"counts {tuple(c.shape)} and phy2log row {tuple(p2l.shape)} must both be [P]")
        p2l = p2l.to(self.device).long()
        if bool((p2l >= L).any()) or bool((p2l < -1).any()):
            raise ValueError(f"phy2log entries must be in [-1, {L})")
        keep = p2l >= 0
        self._open[layer].index_add_(0, p2l[keep], c[keep])

    def record_topk(self, layer, topk_idx):
        """Add one token per (token, k) entry of ``topk_idx`` (int ``[T, K]`` logical ids, ``-1`` ignored)."""
        self._check_layer(layer)
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype.is_floating_point:
            raise TypeError("topk_idx must be an integer torch.Tensor")
        ids = topk_idx.reshape(-1).to(self.device).long()
        ids = ids[ids >= 0]
        if ids.numel() and int(ids.max()) >= self.num_logical_experts:
            raise ValueError(f"topk_idx entries must be < {self.num_logical_experts}")
        self._open[layer] += torch.bincount(ids, minlength=self.num_logical_experts).to(self.dtype)

    def step(self):
        """Close the open step: it enters the window and the oldest step leaves it."""
        slot = self._ring[self._next]
        self._sum += self._open - slot
        slot.copy_(self._open)
        self._open.zero_()
        self._next = (self._next + 1) % self.window
        self.steps += 1

    def load(self, include_open=True):
        """``[num_layers, L]`` load summed over the last ``window`` completed steps (plus the open step)."""
        # A float running sum would drift as steps enter and leave; re-add the ring instead.
        total = self._ring.sum(0) if self.dtype.is_floating_point else self._sum.clone()
        return total + self._open if include_open else total

    def reset(self):
        """Forget everything recorded."""
        self._ring.zero_()
        self._open.zero_()
        self._sum.zero_()
        self._next = 0
        self.steps = 0

    def _check_layer(self, layer):
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
