"""Qwen-Image for `gerl plan` (the PlanFamily interface of gerl/plan/family.py).

The model's own work runs through gerl/models/qwenimage.py on fake tensors: the latent shape, the velocity (2×2
packing, the RoPE's image grid, true CFG as a second transformer pass on the negative prompt with the per-token
norm rescale, the unpacking) and the 5-D VAE's one-frame decode.

Text lengths are the worst case a prompt may take: each prompt keeps its own length, at most
model.max_sequence_length tokens (gerl/models/qwenimage_math.py), so the plan counts every prompt at that length,
none padded (no mask: a padded batch adds a (b, L) mask and an attention mask over text and image tokens, a few MiB,
and leaves the attention's saved tensors as they are). The negative prompt " " keeps NEGATIVE_TOKENS. The text
encoder, Qwen2.5-VL, runs on the chat template's PROMPT_DROP_IDX tokens plus the prompt's and is held whole (its
vision tower and LM head too: the loader loads the class), though text-to-image reads only its language model's last
hidden state. The VAE is in model.vae_dtype (bf16 on a GPU, unless set).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gerl.models.qwenimage import QwenImage
from gerl.models.qwenimage_math import PROMPT_DROP_IDX
from gerl.plan.arch import _get
from gerl.plan.family import ModelFamilyPlan, rollout_decode
from gerl.sampling.loop import Embeds, predict_velocity

LABELS = {"transformer": "transformer", "vae": "VAE (5-D)", "text_encoder": "Qwen2.5-VL text encoder"}
FAMILY = QwenImage()
# The negative prompt " " after the template's system turn is dropped: " ", then the template's closing
# "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n" (QWEN's tokenizer: one token each).
NEGATIVE_TOKENS = 6


@dataclass
class QwenImagePlan(ModelFamilyPlan):
    labels = LABELS
    model_family = FAMILY
    text_tokens: int  # model.max_sequence_length: the longest prompt embedding

    def describe(self) -> str:
        return (f"text up to {self.text_tokens} Qwen2.5-VL tokens (the encoder reads {PROMPT_DROP_IDX} template + "
                f"{self.text_tokens}), negative prompt {NEGATIVE_TOKENS}")

    def uses_negative(self, guidance: float) -> bool:
        return FAMILY.uses_negative(guidance)

    def conditioning(self, b: int, guided: bool, dtype: torch.dtype) -> Embeds:
        """Cached text embeddings moved to the device: the prompts' (b, L, D) in model.dtype, the negative prompt's
        (b, NEGATIVE_TOKENS, D) when `guided`; no pooled vector, no mask (none padded: the module docstring)."""
        width = _get(self.arch.configs["transformer"], "joint_attention_dim")
        neg = torch.empty(b, NEGATIVE_TOKENS, width, dtype=dtype) if guided else None
        return Embeds(torch.empty(b, self.text_tokens, width, dtype=dtype), None, neg)

    def velocity(self, transformer, x, t, cond: Embeds, guidance: float) -> torch.Tensor:
        return predict_velocity(transformer, x, t, cond, guidance)

    def encode_text(self, encoders: dict, b: int) -> None:
        """gerl.models.qwenimage_math.encode_prompts on b prompts' token ids: the text encoder's inner model on the
        template and the prompt, then `select_prompt_states`' zero-padded output filled row by row from a copy of
        each sample's kept positions (its boolean indexing reads the mask's values, which fake tensors lack)."""
        te = encoders["text_encoder"]
        n = PROMPT_DROP_IDX + self.text_tokens
        with torch.no_grad():
            ids, mask = torch.zeros(b, n, dtype=torch.long), torch.ones(b, n, dtype=torch.long)
            states = te.model(input_ids=ids, attention_mask=mask).last_hidden_state
            embeds = states.new_zeros(b, self.text_tokens, states.shape[2])
            for i in range(b):
                embeds[i] = states[i].clone()[PROMPT_DROP_IDX:]

    def decode(self, vae, latents: torch.Tensor) -> None:
        rollout_decode(FAMILY, vae, latents)
