"""Dynamic loss scaling for fp16 weights: torch.amp.GradScaler's rule, written out so that data-parallel ranks
agree on every skipped step. The gradients are reduced over the ranks in the backward (fp32, gerl/engine/parallel.py)
and unscaled after it: the same as unscaling first, since every rank holds the same scale.

Why fp16 needs it: a step's log-prob is a mean over the latent's elements (16 × 64 × 64 at 512 px), so the
gradient reaching the transformer's fp16 output is ~1e-9–1e-8 per element, below fp16's smallest subnormal
(6e-8): it rounds to zero and the LoRA learns nothing, without an error. Multiplying the loss by S (2¹⁶ to start)
lifts those gradients into fp16's range; the fp32 LoRA gradients are divided by S again before anything reads them.
An overflow (inf/NaN in any gradient, on any rank) skips that optimizer step everywhere and halves S; 2000 clean
steps in a row double it. bf16 has fp32's exponent range and needs none of this.
"""

from __future__ import annotations

import torch


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0  # consecutive steps without an overflow since the scale last changed
        self.overflows = 0  # steps skipped for an overflow, over the whole run

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, params: list[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale in place; True when all of them are finite (on this rank)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return True
        if any(g.dtype == torch.float16 for g in grads):
            raise ValueError("fp16 gradients cannot be unscaled without losing them again; train fp32 master "
                             "weights (LoRA adapters are kept in fp32)")
        torch._foreach_mul_(grads, 1.0 / self.scale)
        # this rank's part of each gradient: the data-parallel layer agrees over the ranks afterwards
        return bool(torch.stack([torch.isfinite(_local(g)).all() for g in grads]).all())

    def update(self, overflow: bool, clean: bool = True) -> None:
        """After each optimizer step (taken or skipped): back off on an overflow, grow after a clean stretch.
        `clean=False` marks a step skipped for another reason (a non-finite loss, which the forward pass produced
        before any scaling): it says nothing about the scale, so it neither backs off nor counts towards growth."""
        if overflow:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.overflows += 1
            return
        if not clean:
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        self.overflows = int(state.get("overflows", 0))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor the data-parallel layer shards or replicates (a DTensor); the tensor itself
    otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def grad_zero_counts(params: list[torch.nn.Parameter]) -> tuple[int, int]:
    """(exactly-zero trainable gradient entries, all entries) on this rank; a parameter without a gradient counts as
    all zeros. fp16 underflow flushes single entries to zero: a rising fraction shows partial underflow on a real
    run, long before the whole gradient (and grad_norm) is zero. The data-parallel layer sums both over the ranks."""
    total = sum(_local(p).numel() for p in params)
    nonzero = [torch.count_nonzero(_local(p.grad)) for p in params if p.grad is not None]
    return total - (int(torch.stack(nonzero).sum()) if nonzero else 0), total


def grad_zero_fraction(params: list[torch.nn.Parameter]) -> float:
    """The fraction of `grad_zero_counts` on one process."""
    zeros, total = grad_zero_counts(params)
    return zeros / total if total else 0.0
