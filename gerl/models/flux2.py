"""FLUX.2-klein: `Flux2KleinPipeline` with a `Flux2Transformer2DModel` (klein-4B: 5 double- and 20 single-stream
blocks; klein-9B: 8 and 24) and a Qwen3 text encoder (4B / 8B).

What is klein's own, each as the stock Flux2KleinPipeline does it:
- text: each prompt in Qwen3's chat template without thinking, padded to `max_sequence_length` tokens (no mask: the
  padding's states are attended, as in the stock call), and the hidden states of layers 9, 18 and 27 side by side
  (`TEXT_LAYERS`, 3 × the encoder's width); the text position ids are (0, 0, 0, l). gerl runs the encoder without
  its LM head (`text_encoder.model`: the same hidden states, not the (B, L, 151k) logits the stock call discards);
- latents: the VAE's 32 channels are patchified 2×2 into 128 and normalised by the VAE's batch-norm statistics —
  the stock call draws its noise and steps in that space, (B, 128, h/2, w/2) packed into (h/2)·(w/2) tokens with
  position ids (0, row, column, 0). gerl's canonical latent is that normalised, patchified grid, (B, 128, h/2, w/2):
  the noise is the stock call's draw, the SDE steps and log-probs run on it, and `decode` de-normalises,
  unpatchifies and decodes;
- guidance: klein has no guidance embedding. The base models take classifier-free guidance: above 1 a second pass on
  the empty prompt, combined as neg + s·(cond − neg) (no rescale); the distilled models (`is_distilled` in their
  model_index.json) are sampled at guidance 1, where the stock call ignores any scale;
- the transformer reads the timestep as σ (the scheduler's timestep / 1000, in the model dtype);
- σ schedule: linspace(1, 1/N, N) shifted by FLUX.2's *empirical* mu, which depends on the token count and on N
  (`compute_empirical_mu`, the stock module's function): a different N is a different shift.
"""

from __future__ import annotations

import numpy as np
import torch

from gerl.models.family import Family, compute_dtype, register
from gerl.sampling.loop import Embeds, Schedule

TEXT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline.__call__'s text_encoder_out_layers default


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) → (B, h·w, C): each position one token, row by row (Flux2KleinPipeline._pack_latents)."""
    B, C, h, w = x.shape
    return x.reshape(B, C, h * w).permute(0, 2, 1)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack` (the stock call's scatter by position ids, whose ids run row by row)."""
    B, _, C = tokens.shape
    return tokens.permute(0, 2, 1).reshape(B, C, h, w)


def position_ids(h: int, w: int, device) -> torch.Tensor:
    """(h·w, 4) ids (0, row, column, 0) of the image tokens (Flux2KleinPipeline._prepare_latent_ids)."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1)).to(device)


def text_ids(length: int, device) -> torch.Tensor:
    """(length, 4) ids (0, 0, 0, l) of the text tokens (Flux2KleinPipeline._prepare_text_ids)."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(length)).to(device)


def bn_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's batch-norm mean and std (1, 4C, 1, 1) that normalise the patchified latents."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return mean, std


def unpatchify(x: torch.Tensor) -> torch.Tensor:
    """(B, 4C, h/2, w/2) → (B, C, h, w) (Flux2KleinPipeline._unpatchify_latents)."""
    B, C4, h, w = x.shape
    return x.reshape(B, C4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(B, C4 // 4, h * 2, w * 2)


def vae_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """gerl's canonical latents (B, 4C, h/2, w/2) → the VAE's (B, C, h, w): de-normalised, unpatchified, in the VAE's
    dtype (what the stock call hands `vae.decode`, and returns for output_type="latent")."""
    x = latents.to(vae.device, vae.dtype)
    mean, std = bn_stats(vae)
    return unpatchify(x * std.to(x.dtype) + mean.to(x.dtype))


@register
class Flux2Klein(Family):
    name = "flux2"
    title = "FLUX.2-klein"
    pipeline_classes = ("Flux2KleinPipeline",)
    transformer_class = "Flux2Transformer2DModel"
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    components = ("transformer", "vae", "text_encoder")
    tokenizers = {"text_encoder": "tokenizer"}
    extra_classes = (("transformers", "Qwen2TokenizerFast"),)
    negative_prompt = ""  # Flux2KleinPipeline encodes "" for classifier-free guidance
    # X-GenGroup/Flow-Factory src/flow_factory/models/flux/flux2_klein.py default_target_modules (commit a0b2bc5):
    # the double-stream blocks' attention projections and SwiGLU feed-forwards, the single-stream blocks' fused
    # qkv+mlp projection
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                    "ff_context.linear_out", "attn.to_qkv_mlp_proj")

    def build_tiny(self, seed: int, variant: str):
        from gerl.models.tiny_qwen3 import build_tiny_flux2_klein

        return build_tiny_flux2_klein(seed)

    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], max_sequence_length: int) -> Embeds:
        # the stock helper on the encoder's inner model: its hidden states without the LM head's logits
        prompt = pipe._get_qwen3_prompt_embeds(text_encoder=pipe.text_encoder.model, tokenizer=pipe.tokenizer,
                                               prompt=list(prompts), dtype=pipe.text_encoder.dtype,
                                               device=pipe.transformer.device,
                                               max_sequence_length=max_sequence_length,
                                               hidden_states_layers=TEXT_LAYERS)
        return Embeds(prompt, None)  # (B, max_sequence_length, 3 × width); every prompt padded to that length

    def uses_negative(self, guidance: float) -> bool:
        return guidance > 1.0

    def latent_shape(self, pipe, resolution: int) -> tuple[int, int, int]:
        factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)  # 8 for FLUX.2's VAE
        side = 2 * (resolution // (factor * 2))
        return pipe.transformer.config.in_channels, side // 2, side // 2  # patchified: 4 × 32 channels, half sides

    def schedule(self, scheduler_config, num_steps: int, latent_shape: tuple[int, ...]) -> Schedule:
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if scheduler_config.get("use_flow_sigmas"):
            sigmas = None
        sched = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
        mu = compute_empirical_mu(image_seq_len=latent_shape[-2] * latent_shape[-1], num_steps=num_steps)
        sched.set_timesteps(num_steps if sigmas is None else None, device="cpu", sigmas=sigmas, mu=mu)
        return Schedule(sched.sigmas.float().clone(), sched.timesteps.float().clone())

    def velocity(self, transformer, x: torch.Tensor, timestep: torch.Tensor, embeds: Embeds,
                 guidance: float) -> torch.Tensor:
        """One pass per branch, as the stock call: the conditional one, and above guidance 1 the empty prompt's."""
        dtype = compute_dtype(transformer)
        B, _, h, w = x.shape
        tokens = pack(x).to(dtype)
        img_ids = position_ids(h, w, x.device).expand(B, -1, -1)
        t = timestep.to(dtype) / 1000  # σ, rounded to the model dtype first as the stock call does

        def call(prompt):
            ids = text_ids(prompt.shape[1], x.device).expand(B, -1, -1)
            return transformer(hidden_states=tokens, timestep=t, guidance=None,
                               encoder_hidden_states=prompt.to(dtype), txt_ids=ids, img_ids=img_ids,
                               return_dict=False)[0].float()

        v = call(embeds.prompt)
        if self.uses_negative(guidance):
            if embeds.neg_prompt is None:
                raise ValueError("guidance > 1 needs negative embeddings")
            neg = call(embeds.neg_prompt)
            v = neg + guidance * (v - neg)
        return unpack(v, h, w)

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        return vae.decode(vae_latents(vae, latents), return_dict=False)[0]
