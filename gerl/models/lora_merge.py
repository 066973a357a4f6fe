"""Generation on merged LoRA weights (`sampling.merge_lora`).

PEFT's LoRA forward is W0·x + s·B(A·x): two more matmuls per adapted linear in every denoising step, which cost
29–41 % of the rollout's images/s on an H100 (docs/benchmarks.md, gpu_day, rollout). Merged, each adapted linear
is one matmul with W = W0 + s·B·A. `merged(transformer)` merges for the length of a `with` block and puts every
base weight back exactly (a copy of W0 is kept, never W − s·B·A, which would drift in bf16) — the trainer's
forward, which needs the adapter unmerged for its gradients, never sees a merged weight, even on hybrid hosts
where rollout and actor share the transformer. `refresh()` re-merges after the adapter's tensors change inside
the block (staged weights loaded between micro-batches).

The numerics differ from the trainer's: W0 + s·B·A is rounded once to the model's dtype (the sum taken in fp32),
where the unmerged forward adds s·B(A·x) to W0·x. In fp32 the two agree to rounding; in bf16 a small s·B·A is
partly rounded away, so the rollout's policy is not bit-for-bit the trained one and the first update's ratio
departs from 1 by more than with the unmerged rollout — gpu_day's smoke phase measures both. Off by default.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def lora_layers(transformer) -> list:
    """The PEFT LoRA linears of `transformer` that hold an adapter."""
    from peft.tuners.lora.layer import LoraLayer

    return [m for m in transformer.modules() if isinstance(m, LoraLayer) and len(m.lora_A) > 0]


class MergedLora:
    """Merges a transformer's active LoRA adapters into the base weights and puts them back."""

    def __init__(self, transformer):
        self.layers = lora_layers(transformer)
        if not self.layers:
            raise ValueError("sampling.merge_lora: the transformer has no LoRA adapter to merge")
        self.saved: dict[int, torch.Tensor] = {}  # id(layer) → W0, kept between blocks (one copy, model dtype)
        self.active = False

    @torch.no_grad()
    def _merge_one(self, m) -> None:
        w = m.get_base_layer().weight
        w0 = self.saved.get(id(m))
        if w0 is None:
            w0 = self.saved[id(m)] = w.detach().clone()
        delta = sum(self._delta(m, a) for a in m.active_adapters if a in m.lora_A)
        w.copy_((w0.float() + delta).to(w.dtype))  # one rounding of the exact sum
        m.merged_adapters[:] = [a for a in m.active_adapters if a in m.lora_A]  # PEFT's forward: base layer only

    @staticmethod
    def _delta(m, adapter: str) -> torch.Tensor:
        a, b = m.lora_A[adapter].weight, m.lora_B[adapter].weight
        # replicated by the data-parallel layer (a DTensor whose local tensor is the whole adapter)
        a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
        a, b = a.float(), b.float()
        d = b @ a
        return (d.T if m.fan_in_fan_out else d) * m.scaling[adapter]

    @torch.no_grad()
    def _restore(self) -> None:
        for m in self.layers:
            if id(m) in self.saved:  # a merge that failed part-way saved only the layers it reached
                m.get_base_layer().weight.copy_(self.saved[id(m)])
            m.merged_adapters.clear()

    def refresh(self) -> None:
        """Re-merge from W0 with the adapter's current tensors (inside a `merged` block)."""
        if self.active:
            for m in self.layers:
                self._merge_one(m)

    @contextmanager
    def merged(self):
        for m in self.layers:
            if m.merged_adapters:
                raise RuntimeError("sampling.merge_lora: an adapter is already merged by someone else")
        self.active = True
        try:
            self.refresh()
            yield self
        finally:
            self.active = False
            self._restore()
