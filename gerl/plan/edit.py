"""The image-editing families for `gerl plan`: FLUX.1-Kontext and Qwen-Image-Edit-Plus (the PlanFamily interface of
gerl/plan/family.py), their text-to-image family's plan plus the reference image.

The reference is what changes the memory: its latent tokens follow the image's through every transformer block, in
the rollout and in training alike, so a micro-batch carries them (`Embeds.cond`) and the velocity — the model
family's own, on fake tensors — runs on both. The plan takes a square reference of model.condition_resolution pixels
(0 = the stock pipeline's 1024² for a square image: Kontext's preferred 1024 × 1024, Qwen-Image-Edit-Plus's
VAE_IMAGE_SIZE), i.e. (side / 16)² tokens; a reference of another aspect at that area has about as many. Not counted:
the VAE encode of a new reference (once per (prompt, image), in the text encoders' phase of the rollout) and, for
Qwen-Image-Edit-Plus, the vision tower's pass over the 384² condition image — its 196 merged tokens are counted in the
text the language model reads and carries (a 384 × 384 image: 28 × 28 patches of 14 px, merged 2 × 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gerl.models.flux_kontext import FluxKontext
from gerl.models.qwenimage_edit import EDIT_DROP_IDX, QwenImageEditPlus
from gerl.plan.arch import _get
from gerl.plan.flux import FluxPlan
from gerl.plan.qwenimage import NEGATIVE_TOKENS, QwenImagePlan
from gerl.sampling.loop import Embeds

STOCK_SIDE = 1024  # the stock pipelines' reference for a square image
VISION_TOKENS = 196  # a 384² condition image through Qwen2.5-VL's vision tower, merged
# "Picture 1: <|vision_start|>" before the image tokens and "<|vision_end|>" after them (Qwen's tokenizer)
PICTURE_TOKENS = 6


def reference(side: int, latent_channels: int, dtype: torch.dtype, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cond (b, T, 4C), cond_hw (b, 2)) of a square reference of `side` pixels: an 8× VAE, 2×2 packing."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    h = 2 * (side // 16)
    with unset_fake_temporarily():  # real values: the family reads the grid to group rows (condition_groups)
        hw = torch.tensor([[h, h]] * b, dtype=torch.long)
    return torch.empty(b, (h // 2) ** 2, 4 * latent_channels, dtype=dtype), hw


@dataclass
class FluxKontextPlan(FluxPlan):
    model_family = FluxKontext()
    reference_side: int = STOCK_SIDE

    def describe(self) -> str:
        return f"{super().describe()}, a {self.reference_side}² reference image ({(self.reference_side // 16) ** 2} tokens)"

    def conditioning(self, b: int, guided: bool, dtype: torch.dtype) -> Embeds:
        e = super().conditioning(b, guided, dtype)
        c = _get(self.arch.configs["transformer"], "in_channels") // 4
        e.cond, e.cond_hw = reference(self.reference_side, c, dtype, b)
        return e


@dataclass
class QwenImageEditPlan(QwenImagePlan):
    model_family = QwenImageEditPlus()
    reference_side: int = STOCK_SIDE

    def describe(self) -> str:
        return (f"text up to {self.text_tokens} Qwen2.5-VL tokens with the condition image's {VISION_TOKENS} (the "
                f"encoder reads {EDIT_DROP_IDX} template + {self.text_tokens}), negative prompt "
                f"{NEGATIVE_TOKENS + VISION_TOKENS + PICTURE_TOKENS}, a {self.reference_side}² reference image "
                f"({(self.reference_side // 16) ** 2} tokens)")

    def conditioning(self, b: int, guided: bool, dtype: torch.dtype) -> Embeds:
        """The prompts' (b, L, D) — the image's tokens among them — and, guided, the negative prompt's with the same
        image; the reference's tokens."""
        width = _get(self.arch.configs["transformer"], "joint_attention_dim")
        neg = torch.empty(b, NEGATIVE_TOKENS + VISION_TOKENS + PICTURE_TOKENS, width, dtype=dtype) if guided else None
        c = _get(self.arch.configs["transformer"], "in_channels") // 4
        cond, hw = reference(self.reference_side, c, dtype, b)
        return Embeds(torch.empty(b, self.text_tokens, width, dtype=dtype), None, neg, cond=cond, cond_hw=hw)

    def encode_text(self, encoders: dict, b: int) -> None:
        """The language model on the edit template and the prompt with its image tokens (the vision tower's pass is
        not counted: the module docstring)."""
        te = encoders["text_encoder"]
        n = EDIT_DROP_IDX + self.text_tokens
        with torch.no_grad():
            ids, mask = torch.zeros(b, n, dtype=torch.long), torch.ones(b, n, dtype=torch.long)
            states = te.model(input_ids=ids, attention_mask=mask).last_hidden_state
            states[:, EDIT_DROP_IDX:].clone()


def kontext(arch, model) -> FluxKontextPlan:
    return FluxKontextPlan(arch, model.max_sequence_length, model.condition_resolution or STOCK_SIDE)


def qwenimage_edit(arch, model) -> QwenImageEditPlan:
    # the prompt's tokens, the picture's markers and its merged patches: the longest text the cache holds
    text = model.max_sequence_length + VISION_TOKENS + PICTURE_TOKENS
    return QwenImageEditPlan(arch, text, model.condition_resolution or STOCK_SIDE)
