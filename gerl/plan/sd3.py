"""SD3 / SD3.5 for `gerl plan` (the PlanFamily interface of gerl/plan/family.py).

Text: CLIP-L and CLIP-G on 77 tokens (the CLIP position table; the pipeline pads to it) and T5 on
model.max_sequence_length, joined into (b, 77 + Lt, 4096) prompt embeddings and (b, 2048) pooled ones. Latent:
16 × (resolution / 8)², patched 2 × 2 by the transformer. The VAE is in model.vae_dtype whatever model.dtype (bf16 on
the GPU a plan sizes, unless set; never fp16, in which its decoder overflows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gerl.errors import UserError
from gerl.models.loader import ROLE_COMPONENTS
from gerl.models.sd3 import SD3
from gerl.plan.arch import _get
from gerl.plan.family import ArchPlan, rollout_decode
from gerl.sampling.loop import Embeds, predict_velocity

LABELS = {"transformer": "transformer", "vae": "VAE", "text_encoder": "CLIP-L", "text_encoder_2": "CLIP-G",
          "text_encoder_3": "T5 encoder"}


@dataclass
class SD3Plan(ArchPlan):
    labels = LABELS
    t5_tokens: int  # model.max_sequence_length

    def components(self, role: str) -> tuple[str, ...]:
        return ROLE_COMPONENTS[role]

    def latent(self, resolution: int, transformer) -> tuple[int, int, int]:
        factor, patch = self.arch.vae_factor(), transformer.config.patch_size
        if resolution % (factor * patch):
            raise UserError(f"model.resolution={resolution} must be a multiple of {factor * patch} (the VAE's "
                            f"{factor}× times the transformer's {patch}×{patch} patches)")
        side = resolution // factor
        if side // patch > transformer.config.pos_embed_max_size:
            raise UserError(f"model.resolution={resolution} gives {side // patch} patches a side; this transformer's "
                            f"positional table holds {transformer.config.pos_embed_max_size}: lower model.resolution")
        return self.arch.latent_channels(), side, side

    def describe(self) -> str:
        return f"text {self.arch.clip_tokens()} CLIP + {self.t5_tokens} T5 tokens"

    def uses_negative(self, guidance: float) -> bool:
        return SD3().uses_negative(guidance)

    def conditioning(self, b: int, guided: bool, dtype: torch.dtype) -> Embeds:
        """Cached text embeddings moved to the device: prompt (b, Lc + Lt, D) and pooled (b, P) in model.dtype."""
        tf = self.arch.configs["transformer"]
        joint, pooled = _get(tf, "joint_attention_dim"), _get(tf, "pooled_projection_dim")
        tokens = self.arch.clip_tokens() + self.t5_tokens

        def pair():
            return torch.empty(b, tokens, joint, dtype=dtype), torch.empty(b, pooled, dtype=dtype)
        return Embeds(*pair(), *(pair() if guided else (None, None)))

    def velocity(self, transformer, x, t, cond: Embeds, guidance: float) -> torch.Tensor:
        return predict_velocity(transformer, x, t, cond, guidance)

    def encode_text(self, encoders: dict, b: int) -> None:
        """The three text encoders on b prompts' token ids (CLIP-L and CLIP-G: Lc tokens, T5: Lt), joined as SD3
        does."""
        from gerl.models.sd35_arch import encode_token_ids

        lc = self.arch.clip_tokens()
        ids = (torch.zeros(b, lc, dtype=torch.long), torch.zeros(b, lc, dtype=torch.long),
               torch.zeros(b, self.t5_tokens, dtype=torch.long))
        with torch.no_grad():
            encode_token_ids([encoders[c] for c in ("text_encoder", "text_encoder_2", "text_encoder_3")], ids)

    def decode(self, vae, latents: torch.Tensor) -> None:
        rollout_decode(SD3(), vae, latents)
