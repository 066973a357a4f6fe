"""FLUX.1-dev and FLUX.1-schnell: `FluxPipeline` with a `FluxTransformer2DModel` (19 double-stream + 38
single-stream blocks in the released 12B models).

What is FLUX's own, each as the stock FluxPipeline does it:
- text: CLIP-L's pooled output (the pooled vector) and T5's tokens (the sequence), with all-zero text position ids;
- latents (B, 16, h, w) at 1/8 of the image side, packed for the transformer into (h/2)·(w/2) tokens of 2×2×16
  values, with (0, row, column) position ids; gerl keeps the canonical latent unpacked and packs inside `velocity`;
- guidance: FLUX.1-dev is guidance-*distilled*: the guidance scale is an input (an embedding), one pass per step and
  no negative prompt; FLUX.1-schnell has no guidance input (`guidance_embeds` false in its config), so the scale is
  ignored, as the stock pipeline ignores it;
- the transformer reads the timestep as σ (the scheduler's timestep / 1000);
- σ schedule: N values linspace(1, 1/N) put through the scheduler with a resolution-dependent shift `mu`, linear in
  the image's token count (0.5 at 256 tokens, 1.15 at 4096: 512² → 1024 tokens → mu = 0.63; 1024² → 1.15). dev's
  scheduler shifts exponentially by mu; schnell's config has no dynamic shifting and shift 1.0, so its σ are the
  linspace itself.
- decode: latents / scaling_factor + shift_factor through the VAE (0.3611 and 0.1159 for FLUX.1's VAE).
"""

from __future__ import annotations

import numpy as np
import torch

from gerl.models.family import Family, compute_dtype, condition_groups, register, resolution_shift
from gerl.sampling.loop import Embeds, Schedule


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) → (B, (h/2)·(w/2), 4C): each 2×2 patch becomes one token, its values ordered (C, dy, dx);
    tokens run row by row over the patch grid."""
    B, C, h, w = x.shape
    patches = x.reshape(B, C, h // 2, 2, w // 2, 2)  # B, C, row, dy, col, dx
    return patches.permute(0, 2, 4, 1, 3, 5).reshape(B, (h // 2) * (w // 2), C * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack`: (B, (h/2)·(w/2), 4C) → (B, C, h, w)."""
    B, _, D = tokens.shape
    grid = tokens.reshape(B, h // 2, w // 2, D // 4, 2, 2)  # B, row, col, C, dy, dx
    return grid.permute(0, 3, 1, 4, 2, 5).reshape(B, D // 4, h, w)


def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """Position ids of the packed tokens, ((h/2)·(w/2), 3): (0, row, column) of each 2×2 patch."""
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return ids.to(device=device, dtype=dtype)


@register
class Flux(Family):
    name = "flux"
    title = "FLUX.1-dev / FLUX.1-schnell"
    pipeline_classes = ("FluxPipeline",)
    transformer_class = "FluxTransformer2DModel"
    block_lists = ("transformer_blocks", "single_transformer_blocks")  # double-stream (MMDiT), then single-stream
    components = ("transformer", "vae", "text_encoder", "text_encoder_2")
    tokenizers = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}
    negative_prompt = ""  # unused: FLUX.1 has no classifier-free guidance pass (uses_negative is always false)
    extra_classes = (("transformers", "T5TokenizerFast"),)  # the published model_index.json's T5 tokenizer
    # flow_grpo's scripts/train_flux.py target_modules: the double-stream blocks' attention projections and both
    # feed-forwards (the single-stream blocks' to_q/k/v match "attn.to_q" etc. too; their proj_mlp/proj_out do not).
    lora_targets = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                    "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                    "ff_context.net.2")
    block_lists = ("transformer_blocks", "single_transformer_blocks")  # 19 double-stream, then 38 single-stream (dev)

    def build_tiny(self, seed: int, variant: str):
        from gerl.models.tiny import build_tiny_flux

        return build_tiny_flux(seed, schnell=variant == "schnell")

    def encode_prompts(self, pipe, prompts: list[str], max_sequence_length: int) -> Embeds:
        prompt, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=pipe.transformer.device,
                                               max_sequence_length=max_sequence_length)
        return Embeds(prompt, pooled)  # (B, L, 4096) T5 tokens; (B, 768) CLIP-L pooled

    def uses_negative(self, guidance: float) -> bool:
        return False  # dev's guidance is an embedding; schnell has none

    def latent_shape(self, pipe, resolution: int) -> tuple[int, int, int]:
        factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)  # 8 for FLUX.1's VAE
        side = 2 * (resolution // (factor * 2))  # even, for 2×2 packing (FluxPipeline.prepare_latents)
        return pipe.transformer.config.in_channels // 4, side, side

    def schedule(self, scheduler_config, num_steps: int, latent_shape: tuple[int, ...]) -> Schedule:
        from diffusers import FlowMatchEulerDiscreteScheduler

        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if scheduler_config.get("use_flow_sigmas"):  # such a scheduler makes its own σ (FluxPipeline drops these)
            sigmas = None
        tokens = (latent_shape[-2] // 2) * (latent_shape[-1] // 2)
        sched = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
        sched.set_timesteps(num_steps if sigmas is None else None, device="cpu", sigmas=sigmas,
                            mu=resolution_shift(tokens, scheduler_config, 1.15))
        return Schedule(sched.sigmas.float().clone(), sched.timesteps.float().clone())

    def velocity(self, transformer, x: torch.Tensor, timestep: torch.Tensor, embeds: Embeds,
                 guidance: float) -> torch.Tensor:
        """One forward on the packed latents; dev reads `guidance` through its embedding, schnell ignores it. With a
        conditioning image (FLUX.1-Kontext, `embeds.cond`) its tokens follow the image's, with position ids
        (1, row, column), and the output keeps the image's tokens — FluxKontextPipeline's call, one per grid."""
        groups = condition_groups(embeds)
        if len(groups) == 1:
            return self._velocity(transformer, x, timestep, embeds, guidance, groups[0][1])
        out = torch.empty_like(x)
        for rows, grid in groups:
            out[rows] = self._velocity(transformer, x[rows], timestep[rows], embeds.index(rows), guidance, grid)
        return out

    def _velocity(self, transformer, x, timestep, embeds: Embeds, guidance: float, grid) -> torch.Tensor:
        dtype = compute_dtype(transformer)
        B, _, h, w = x.shape
        g = None
        if transformer.config.guidance_embeds:
            g = torch.full((B,), float(guidance), device=x.device, dtype=torch.float32)
        tokens, ids = pack(x).to(dtype), image_ids(h, w, x.device, dtype)
        if embeds.cond is not None:  # the reference image's tokens, its ids' first axis 1 (FluxKontextPipeline)
            hc, wc = grid
            ref_ids = image_ids(hc, wc, x.device, dtype)
            ref_ids[:, 0] = 1
            tokens = torch.cat([tokens, embeds.cond[:, :(hc // 2) * (wc // 2)].to(dtype)], dim=1)
            ids = torch.cat([ids, ref_ids])
        out = transformer(
            hidden_states=tokens,
            timestep=timestep.to(dtype) / 1000,  # σ, rounded to the model dtype first as the stock pipeline does
            guidance=g,
            pooled_projections=embeds.pooled.to(dtype),
            encoder_hidden_states=embeds.prompt.to(dtype),
            txt_ids=torch.zeros(embeds.prompt.shape[1], 3, device=x.device, dtype=dtype),
            img_ids=ids,
            return_dict=False,
        )[0]
        return unpack(out[:, :(h // 2) * (w // 2)].float(), h, w)

    # Copied from gerl.models.sd3.SD3.decode: FLUX.1's VAE takes the same scaling and shift
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        z = latents / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(z.to(vae.device, vae.dtype), return_dict=False)[0]
