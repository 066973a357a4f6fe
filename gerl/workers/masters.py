"""fp32 master weights for trained weights held in bf16 or fp16, on one unsharded process.

Why: AdamW's update of a weight is about lr per step; at |w| ≈ 0.02 one bf16 ulp is ≈ 8e-5, so a step of lr 1e-5
applied to a bf16 weight rounds away and full fine-tuning in bf16 learns nothing, without an error. The optimizer
therefore steps an fp32 copy of each trained weight (the master); the model's bf16/fp16 weight is re-cast from it
after every step, so each forward computes with the master's rounding. Each backward's low-precision gradient is
added into the master's fp32 gradient as soon as autograd has it (a post-accumulate hook), so the accumulation over
micro-batches and denoising steps is fp32 too, and the low-precision gradient is freed at once.

Under the data-parallel layer (gerl/engine/parallel.py) the parameters themselves are stored in fp32 and FSDP2 casts
them for each forward: the same masters, held by the engine. A LoRA's adapter is fp32 already and needs neither.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """fp32 masters of `params` (the model's low-precision trained weights): `params` of this object is what the
    optimizer steps, `to_model()` writes them back into the model after a step."""

    def __init__(self, model_params: list[torch.nn.Parameter]):
        self.model_params = model_params
        self.params = [torch.nn.Parameter(p.detach().float().clone()) for p in model_params]
        for p, m in zip(model_params, self.params):
            p.register_post_accumulate_grad_hook(self._accumulate_into(m))

    @staticmethod
    def _accumulate_into(master: torch.nn.Parameter):
        @torch.no_grad()
        def hook(p: torch.Tensor) -> None:
            if master.grad is None:
                master.grad = p.grad.float()
            else:
                master.grad.add_(p.grad)
            p.grad = None
        return hook

    @torch.no_grad()
    def to_model(self) -> None:
        """The model's weights re-cast from the masters (round to nearest)."""
        for p, m in zip(self.model_params, self.params):
            p.copy_(m)


def needs_masters(params: list[torch.Tensor]) -> bool:
    """Whether any trained weight is held in a precision AdamW's small steps would round away in."""
    return any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
