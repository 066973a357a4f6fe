"""FLUX.2-klein and Z-Image for `gerl plan` (the PlanFamily interface of gerl/plan/family.py): the two families whose
text encoder is Qwen3.

The model's own work runs through gerl/models/flux2.py and zimage.py on fake tensors: the latent shape, the velocity
(klein's token packing and position ids, its classifier-free second pass; Z-Image's list of frames, its doubled
batch when guided, the negated output) and the decode (klein's batch-norm de-normalisation and unpatchify). Text:
FLUX.2-klein pads every prompt to model.max_sequence_length and reads three hidden states of Qwen3 side by side, so a
micro-batch carries (b, L, 3·width); Z-Image keeps each prompt's own length, counted here at the worst case,
model.max_sequence_length, none padded (as Qwen-Image's plan does). The text encoder is held whole (klein's LM head
too: the loader loads the class) and runs on L tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gerl.models.flux2 import Flux2Klein
from gerl.models.zimage import ZImage
from gerl.plan.arch import _get
from gerl.plan.family import ModelFamilyPlan, rollout_decode
from gerl.sampling.loop import Embeds, predict_velocity


@dataclass
class _Qwen3Plan(ModelFamilyPlan):
    text_tokens: int  # model.max_sequence_length

    def uses_negative(self, guidance: float) -> bool:
        return self.model_family.uses_negative(guidance)

    def velocity(self, transformer, x, t, cond: Embeds, guidance: float) -> torch.Tensor:
        return predict_velocity(transformer, x, t, cond, guidance)

    def decode(self, vae, latents: torch.Tensor) -> None:
        rollout_decode(self.model_family, vae, latents)

    def _text(self, b: int, width: int, guided: bool, dtype: torch.dtype) -> Embeds:
        neg = torch.empty(b, self.text_tokens, width, dtype=dtype) if guided else None
        return Embeds(torch.empty(b, self.text_tokens, width, dtype=dtype), None, neg)


@dataclass
class Flux2KleinPlan(_Qwen3Plan):
    labels = {"transformer": "transformer", "vae": "VAE", "text_encoder": "Qwen3 text encoder"}
    model_family = Flux2Klein()

    def describe(self) -> str:
        return f"text {self.text_tokens} Qwen3 tokens (3 hidden states), classifier-free guidance above 1"

    def conditioning(self, b: int, guided: bool, dtype: torch.dtype) -> Embeds:
        return self._text(b, _get(self.arch.configs["transformer"], "joint_attention_dim"), guided, dtype)

    def encode_text(self, encoders: dict, b: int) -> None:
        """Qwen3's inner model on b prompts' ids with every hidden state kept, three of them stacked."""
        te = encoders["text_encoder"]
        with torch.no_grad():
            ids = torch.zeros(b, self.text_tokens, dtype=torch.long)
            out = te.model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True,
                           use_cache=False)
            torch.stack([out.hidden_states[k] for k in (9, 18, 27) if k < len(out.hidden_states)], dim=1)


@dataclass
class ZImagePlan(_Qwen3Plan):
    labels = {"transformer": "transformer", "vae": "VAE", "text_encoder": "Qwen3 text encoder"}
    model_family = ZImage()

    def describe(self) -> str:
        return f"text up to {self.text_tokens} Qwen3 tokens (the penultimate hidden state), none padded"

    def conditioning(self, b: int, guided: bool, dtype: torch.dtype) -> Embeds:
        return self._text(b, _get(self.arch.configs["transformer"], "cap_feat_dim"), guided, dtype)

    def encode_text(self, encoders: dict, b: int) -> None:
        te = encoders["text_encoder"]
        with torch.no_grad():
            ids = torch.zeros(b, self.text_tokens, dtype=torch.long)
            te(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states[-2]
