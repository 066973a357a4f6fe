"""SD3 / SD3.5 (Medium and Large): `StableDiffusion3Pipeline` with an `SD3Transformer2DModel` (MMDiT).

What is SD3's own: three text encoders (CLIP-L and CLIP-G, whose pooled outputs are concatenated, and T5, whose
tokens follow CLIP's in one sequence); latents (B, 16, h, w) fed to the transformer unpacked (it patchifies them
itself); classifier-free guidance as a second pass on a doubled batch with the empty prompt's embeddings; the
scheduler's own σ schedule (shift 3.0, no resolution dependence); decoding through the VAE's scaling and shift
factors. SD3.5-Large is the same classes at another size (38 blocks, no dual-attention blocks) — nothing here
depends on the sizes.
"""

from __future__ import annotations

import torch

from gerl.models.family import Family, compute_dtype, register, resolution_shift
from gerl.sampling.loop import Embeds, Schedule, make_schedule


@register
class SD3(Family):
    name = "sd3"
    title = "SD3 / SD3.5"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    transformer_class = "SD3Transformer2DModel"
    components = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    tokenizers = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}
    negative_prompt = ""  # StableDiffusion3Pipeline's negative_prompt=None is encoded as ""
    # Every attention projection of both streams, matched by suffix (so SD3.5-M's attn2 too). The SD3 recipes name
    # the peers' narrower choice explicitly: attn.* only (flow_grpo scripts/train_sd3.py, GeRL select_lora_modules).
    extra_classes = (("transformers", "T5TokenizerFast"),)  # the published model_index.json's T5 tokenizer
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

    def build_tiny(self, seed: int, variant: str):
        from gerl.models.tiny import build_tiny_sd3

        return build_tiny_sd3(seed)

    def encode_prompts(self, pipe, prompts: list[str], max_sequence_length: int) -> Embeds:
        prompt, _, pooled, _ = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=pipe.transformer.device,
            do_classifier_free_guidance=False, max_sequence_length=max_sequence_length,
        )
        return Embeds(prompt, pooled)  # (B, 77 + L, 4096) CLIP then T5 tokens; (B, 2048) CLIP-L ‖ CLIP-G pooled

    def uses_negative(self, guidance: float) -> bool:
        return guidance > 1.0

    def forward_rows(self, batch: int, guidance: float) -> int:
        return 2 * batch if self.uses_negative(guidance) else batch  # CFG: one pass on [uncond; cond]

    def use_attention_dispatch(self, transformer) -> None:
        # diffusers' SD3 processor calls F.scaled_dot_product_attention itself, which set_attention_backend skips
        from gerl.models.attention import JointAttnDispatchProcessor

        transformer.set_attn_processor(JointAttnDispatchProcessor())

    def latent_shape(self, pipe, resolution: int) -> tuple[int, int, int]:
        factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)  # 8 for SD3's VAE
        return pipe.transformer.config.in_channels, resolution // factor, resolution // factor

    def schedule(self, scheduler_config, num_steps: int, latent_shape: tuple[int, ...]) -> Schedule:
        if not scheduler_config.get("use_dynamic_shifting"):  # SD3 and SD3.5: a fixed shift (3.0)
            return make_schedule(scheduler_config, num_steps)
        # A scheduler with dynamic shifting: StableDiffusion3Pipeline shifts by the token count, patch size 2.
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
        tokens = (latent_shape[-2] // 2) * (latent_shape[-1] // 2)
        sched.set_timesteps(num_steps, device="cpu", mu=resolution_shift(tokens, scheduler_config, 1.16))
        return Schedule(sched.sigmas.float().clone(), sched.timesteps.float().clone())

    def velocity(self, transformer, x: torch.Tensor, timestep: torch.Tensor, embeds: Embeds,
                 guidance: float) -> torch.Tensor:
        """Classifier-free guidance when guidance > 1: one forward on [uncond; cond], as the stock pipeline does."""
        dtype = compute_dtype(transformer)
        if guidance > 1.0:
            if embeds.neg_prompt is None:
                raise ValueError("guidance > 1 needs negative embeddings")
            out = transformer(
                hidden_states=torch.cat([x, x]).to(dtype),
                timestep=torch.cat([timestep, timestep]),
                encoder_hidden_states=torch.cat([embeds.neg_prompt, embeds.prompt]).to(dtype),
                pooled_projections=torch.cat([embeds.neg_pooled, embeds.pooled]).to(dtype),
                return_dict=False,
            )[0]
            uncond, cond = out.float().chunk(2)
            return uncond + guidance * (cond - uncond)
        return transformer(
            hidden_states=x.to(dtype),
            timestep=timestep,
            encoder_hidden_states=embeds.prompt.to(dtype),
            pooled_projections=embeds.pooled.to(dtype),
            return_dict=False,
        )[0].float()

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        z = latents / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(z.to(vae.device, vae.dtype), return_dict=False)[0]
