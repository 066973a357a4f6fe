"""Z-Image and Z-Image-Turbo: `ZImagePipeline` with a `ZImageTransformer2DModel` (6 B: 30 single-stream layers of
width 3840 after 2 noise and 2 caption refiner layers) and a Qwen3-4B text encoder.

What is Z-Image's own, each as the stock ZImagePipeline does it:
- text: each prompt in Qwen3's chat template (thinking on: no think block), padded to `max_sequence_length` and run
  through the encoder; the *penultimate* hidden state (`hidden_states[-2]`) at the prompt's real tokens, so each
  prompt keeps its own length (a (B, L) mask in `Embeds`; the transformer takes the list of per-prompt tensors and
  pads them itself);
- latents (B, 16, h, w) at 1/8 of the image side (FLUX.1's VAE and factors), always fp32; the transformer takes a
  list of (16, 1, h, w) frames in the model dtype and patchifies 2×2 itself;
- the transformer's time is 1 − σ ((1000 − timestep) / 1000) and its output is the *negative* velocity (the stock
  call steps with −output);
- guidance: the stock `guidance_scale` g runs a second pass on the negative prompt ("") when g > 0 and combines
  pos + g·(pos − neg); gerl's `sampling.guidance_scale` is the usual classifier-free scale s = 1 + g (1 = no second
  pass: Z-Image-Turbo's g = 0; the base model's g = 4 is s = 5). The stock call's optional `cfg_normalization` and
  `cfg_truncation` are off by default and not offered;
- σ schedule: torch.linspace(1, 1/N, N) (float32, unlike FLUX's float64 numpy) through the scheduler with mu from the
  token count (the shared line, `resolution_shift`); Z-Image-Turbo's scheduler has no dynamic shifting (a static
  shift of 3), so mu is ignored there — its few-step schedule (8–9 steps, guidance off) is this one at small N;
- decode: latents / scaling_factor + shift_factor through the VAE (FLUX.1's 0.3611 and 0.1159).
"""

from __future__ import annotations

import torch

from gerl.models.family import Family, compute_dtype, register, resolution_shift
from gerl.sampling.loop import Embeds, Schedule


def _rows(prompt: torch.Tensor, mask: torch.Tensor | None, dtype) -> list[torch.Tensor]:
    """A batch's text as the stock transformer takes it: one (L_i, D) tensor per prompt, its real tokens only."""
    if mask is None:
        return list(prompt.to(dtype).unbind(0))
    return [p[: int(n)].to(dtype) for p, n in zip(prompt, mask.sum(dim=1))]


@register
class ZImage(Family):
    name = "zimage"
    title = "Z-Image / Z-Image-Turbo"
    pipeline_classes = ("ZImagePipeline",)
    transformer_class = "ZImageTransformer2DModel"
    block_lists = ("noise_refiner", "context_refiner", "layers")
    # the transformer pads each prompt to a multiple of 32 itself and masks it: lengths still vary per batch
    compile_refusal = ("its text length is each batch's own (the transformer pads per prompt), so new lengths "
                       "would compile the blocks again")
    attention_mask = True
    components = ("transformer", "vae", "text_encoder")
    tokenizers = {"text_encoder": "tokenizer"}
    extra_classes = (("transformers", "Qwen3Model"), ("transformers", "Qwen2Tokenizer"))
    negative_prompt = ""  # ZImagePipeline.encode_prompt's default negative prompt
    # X-GenGroup/Flow-Factory src/flow_factory/models/z_image/z_image.py default_target_modules (commit a0b2bc5)
    lora_targets = ("attention.to_k", "attention.to_q", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                    "feed_forward.w2", "feed_forward.w3")

    def build_tiny(self, seed: int, variant: str):
        from gerl.models.tiny_qwen3 import build_tiny_zimage

        return build_tiny_zimage(seed)

    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], max_sequence_length: int) -> Embeds:
        rows = pipe._encode_prompt(prompt=list(prompts), device=pipe.transformer.device,
                                   max_sequence_length=max_sequence_length)  # [(L_i, D)], the stock helper
        longest = max(r.shape[0] for r in rows)
        prompt = torch.stack([torch.nn.functional.pad(r, (0, 0, 0, longest - r.shape[0])) for r in rows])
        mask = torch.zeros(len(rows), longest, dtype=torch.long, device=prompt.device)
        for i, r in enumerate(rows):
            mask[i, : r.shape[0]] = 1
        return Embeds(prompt, None, mask=mask)

    def uses_negative(self, guidance: float) -> bool:
        return guidance > 1.0  # s = 1 + g: the stock call's second pass runs for g > 0

    def latent_shape(self, pipe, resolution: int) -> tuple[int, int, int]:
        factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)  # 8 for FLUX.1's VAE
        side = 2 * (resolution // (factor * 2))
        return pipe.transformer.config.in_channels, side, side

    def schedule(self, scheduler_config, num_steps: int, latent_shape: tuple[int, ...]) -> Schedule:
        from diffusers import FlowMatchEulerDiscreteScheduler

        sigmas = torch.linspace(1.0, 1 / num_steps, num_steps).tolist()  # get_default_z_image_sigmas
        tokens = (latent_shape[-2] // 2) * (latent_shape[-1] // 2)
        sched = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
        sched.set_timesteps(None, device="cpu", sigmas=sigmas, mu=resolution_shift(tokens, scheduler_config, 1.15))
        return Schedule(sched.sigmas.float().clone(), sched.timesteps.float().clone())

    def velocity(self, transformer, x: torch.Tensor, timestep: torch.Tensor, embeds: Embeds,
                 guidance: float) -> torch.Tensor:
        """One call on the list of frames, on [cond; neg] (a doubled batch, as the stock call) when guided; the output
        negated into a velocity."""
        dtype = compute_dtype(transformer)
        B = x.shape[0]
        frames = x.to(dtype).unsqueeze(2)  # (B, 16, 1, h, w)
        t = (1000 - timestep.float()) / 1000  # the transformer's time runs from 0 (noise) to 1
        text = _rows(embeds.prompt, embeds.mask, dtype)
        guided = self.uses_negative(guidance)
        if guided:
            if embeds.neg_prompt is None:
                raise ValueError("guidance > 1 needs negative embeddings")
            frames, t = frames.repeat(2, 1, 1, 1, 1), t.repeat(2)
            text = text + _rows(embeds.neg_prompt, embeds.neg_mask, dtype)
        out = transformer(list(frames.unbind(0)), t, text, return_dict=False)[0]
        out = torch.stack([o.float() for o in out])
        if guided:
            pos, neg = out[:B], out[B:]
            out = pos + (guidance - 1) * (pos - neg)
        return -out.squeeze(2)  # (B, 16, h, w)

    # Copied from gerl.models.sd3.SD3.decode: FLUX.1's VAE with its scaling and shift
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        z = latents / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(z.to(vae.device, vae.dtype), return_dict=False)[0]
