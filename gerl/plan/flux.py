"""FLUX.1-dev / FLUX.1-schnell for `gerl plan` (the PlanFamily interface of gerl/plan/family.py).

The model's own work runs through gerl/models/flux.py on fake tensors: the latent shape, the velocity (2×2 packing
into tokens, the position ids, dev's guidance embedding, the unpacking) and the decode. Text: CLIP-L on 77 tokens
(its position table; FluxPipeline pads to it) gives the pooled vector only, T5 on model.max_sequence_length gives the
sequence: a micro-batch carries (b, Lt, 4096) and (b, 768) in model.dtype, and no negative branch whatever the
guidance (dev's guidance is an input of the one forward; schnell has none). The VAE is in model.vae_dtype (bf16 on the GPU a
plan sizes, unless set).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gerl.models.flux import Flux
from gerl.plan.arch import _get
from gerl.plan.family import ModelFamilyPlan, rollout_decode
from gerl.sampling.loop import Embeds, predict_velocity

LABELS = {"transformer": "transformer", "vae": "VAE", "text_encoder": "CLIP-L", "text_encoder_2": "T5 encoder"}
FAMILY = Flux()


@dataclass
class FluxPlan(ModelFamilyPlan):
    labels = LABELS
    model_family = FAMILY
    t5_tokens: int  # model.max_sequence_length

    def clip_tokens(self) -> int:
        return int(_get(self.arch.configs["text_encoder"], "max_position_embeddings"))

    def describe(self) -> str:
        guidance = "guidance embedding" if _get(self.arch.configs["transformer"], "guidance_embeds") else "no guidance"
        return f"text {self.clip_tokens()} CLIP (pooled) + {self.t5_tokens} T5 tokens, {guidance}"

    def uses_negative(self, guidance: float) -> bool:
        return FAMILY.uses_negative(guidance)

    def conditioning(self, b: int, guided: bool, dtype: torch.dtype) -> Embeds:
        """Cached text embeddings moved to the device: T5's tokens (b, Lt, D) and CLIP-L's pooled (b, P) in
        model.dtype (`guided` is always false: FLUX.1 has no negative branch)."""
        tf = self.arch.configs["transformer"]
        return Embeds(torch.empty(b, self.t5_tokens, _get(tf, "joint_attention_dim"), dtype=dtype),
                      torch.empty(b, _get(tf, "pooled_projection_dim"), dtype=dtype))

    def velocity(self, transformer, x, t, cond: Embeds, guidance: float) -> torch.Tensor:
        return predict_velocity(transformer, x, t, cond, guidance)

    def encode_text(self, encoders: dict, b: int) -> None:
        """FluxPipeline.encode_prompt on b prompts' token ids: CLIP-L's pooled output, T5's last hidden state."""
        clip, t5 = encoders["text_encoder"], encoders["text_encoder_2"]
        with torch.no_grad():
            clip(torch.zeros(b, self.clip_tokens(), dtype=torch.long), output_hidden_states=False).pooler_output
            t5(torch.zeros(b, self.t5_tokens, dtype=torch.long), output_hidden_states=False)[0]

    def decode(self, vae, latents: torch.Tensor) -> None:
        rollout_decode(FAMILY, vae, latents)
