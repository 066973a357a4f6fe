"""Qwen-Image: `QwenImagePipeline` with a `QwenImageTransformer2DModel` (60 double-stream blocks, 20.4B parameters in
the released model) and a Qwen2.5-VL-7B text encoder.

What is Qwen-Image's own, each as the stock pipeline does it; the math lives in gerl/models/qwenimage_math.py (pure
functions, each checked against the stock pipeline by tests/models/test_qwenimage_math.py, its docstring the
written account), and this file only fits it to the `Family` interface:
- text: one encoder; each prompt goes through a chat template, the template's 34-token system turn is dropped, and
  prompts keep their own lengths (a (B, L) mask, no pooled vector). Every row carries its mask, so the text cache
  pads rows of different lengths with mask 0; `velocity` trims a batch to its longest real prompt and passes no mask
  when nothing is padded, as the stock pipeline encodes a batch;
- latents (B, 16, h, w) at 1/8 of the image side (the VAE is a video VAE: one frame), packed for the transformer
  into (h/2)·(w/2) tokens of 2×2×16 values; gerl keeps the canonical latent unpacked and packs inside `velocity`;
- guidance: `true_cfg_scale` (sampling.guidance_scale here): above 1 a second pass on the negative prompt, the two
  velocities combined as neg + s·(cond − neg) and each packed token rescaled to the conditional velocity's norm;
  the negative prompt is " ", the peers' (verl-omni's data_process/qwenimage_ocr.py; the stock pipeline has no
  default negative prompt and then runs no CFG at all, so a stock comparison passes negative_prompt=" ");
- the transformer reads the timestep as σ (the scheduler's timestep / 1000) and `img_shapes` for its RoPE;
- σ schedule: linspace(1, 1/N) shifted by `mu`, linear in the token count from 0.5 at 256 to 0.9 at 8192 tokens
  (512² → 1024 tokens → mu = 0.539, e^mu = 1.71), then stretched so that the last σ before 0 is `shift_terminal`
  = 0.02; N ≥ 2 (one step gives the stock scheduler σ = NaN);
- decode: latents × latents_std + latents_mean per channel through the VAE, frame 0.
"""

from __future__ import annotations

import torch

from gerl.errors import UserError
from gerl.models import qwenimage_math as qm
from gerl.models.family import Family, compute_dtype, condition_groups, register
from gerl.sampling.loop import Embeds, Schedule


def _text(prompt: torch.Tensor, mask: torch.Tensor | None, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch's text as the stock pipeline passes it: cut to its longest real prompt, and no mask when nothing is
    padded (what `encode_prompt` returns for that batch of prompts)."""
    if mask is None:
        return prompt.to(dtype), None
    longest = int(mask.sum(dim=1).max())
    prompt, mask = prompt[:, :longest], mask[:, :longest]
    return prompt.to(dtype), (None if bool(mask.all()) else mask)


@register
class QwenImage(Family):
    name = "qwenimage"
    title = "Qwen-Image"
    pipeline_classes = ("QwenImagePipeline",)
    transformer_class = "QwenImageTransformer2DModel"
    # _text cuts each batch's prompts to its longest, as the stock pipeline does: a new length is a new shape
    compile_refusal = ("its text length is each batch's longest prompt (the stock pipeline's cut), so every new "
                       "length would compile the blocks again")
    attention_mask = True  # a batch whose prompts differ in length masks the padding
    components = ("transformer", "vae", "text_encoder")
    tokenizers = {"text_encoder": "tokenizer"}
    negative_prompt = " "  # verl-omni examples/flowgrpo_trainer/data_process/qwenimage_ocr.py negative_user_prompt
    # The peers' list, the same in both: verl-omni examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora.sh
    # (target_modules, commit a1139ba) and flow_grpo scripts/train_qwenimage.py: both streams' attention projections
    # and both feed-forwards. (Flow-Factory's default names img_mlp.net.2.proj / txt_mlp.net.2.proj, which match no
    # module: net.2 is a plain Linear.)
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")

    def build_tiny(self, seed: int, variant: str):
        from gerl.models.tiny_qwenimage import build_tiny_qwenimage

        return build_tiny_qwenimage(seed)

    def encode_prompts(self, pipe, prompts: list[str], max_sequence_length: int) -> Embeds:
        prompt, mask = qm.encode_prompts(pipe.tokenizer, pipe.text_encoder, prompts, max_sequence_length)
        if mask is None:  # nothing padded in this batch; every row still says its length
            mask = torch.ones(prompt.shape[:2], dtype=torch.long, device=prompt.device)
        return Embeds(prompt, None, mask=mask)  # (B, L, 3584) for Qwen2.5-VL-7B; no pooled vector

    def uses_negative(self, guidance: float) -> bool:
        return guidance > 1.0  # true_cfg_scale > 1 with a negative prompt (ours is always given)

    def latent_shape(self, pipe, resolution: int) -> tuple[int, int, int]:
        factor = 2 ** len(pipe.vae.config.temperal_downsample)  # 8, as QwenImagePipeline.vae_scale_factor
        h, w = qm.latent_size(resolution, resolution, factor)
        return pipe.transformer.config.in_channels // 4, h, w

    def schedule(self, scheduler_config, num_steps: int, latent_shape: tuple[int, ...]) -> Schedule:
        if num_steps < 2 and scheduler_config.get("shift_terminal"):
            raise UserError(f"{num_steps} denoising step: Qwen-Image's scheduler stretches σ to shift_terminal="
                            f"{scheduler_config.get('shift_terminal')} and needs at least 2 steps (the stock "
                            "pipeline gives σ = NaN with one); use 2 or more")
        sigmas = qm.sigma_schedule(num_steps, (latent_shape[-2] // 2) * (latent_shape[-1] // 2), scheduler_config)
        # the stock σ and timesteps, bit for bit (torch.equal in tests/models/test_qwenimage.py and test_qwenimage_math.py)
        return Schedule(sigmas, sigmas[:-1] * qm.NUM_TRAIN_TIMESTEPS)

    def velocity(self, transformer, x: torch.Tensor, timestep: torch.Tensor, embeds: Embeds,
                 guidance: float) -> torch.Tensor:
        """The conditional pass, and with true CFG the negative one, each with its own text length as the stock
        pipeline runs them; CFG and its per-token norm rescale on the packed tokens, in fp32. With a conditioning
        image (Qwen-Image-Edit-Plus, `embeds.cond`) its tokens follow the image's in both passes, `img_shapes`
        lists both grids, and the outputs keep the image's tokens — QwenImageEditPlusPipeline's call, one per grid."""
        if transformer.config.guidance_embeds:
            raise UserError("this Qwen-Image transformer has guidance_embeds=true (a guidance-distilled variant), "
                            "which gerl's Qwen-Image family does not drive; use Qwen-Image's published transformer")
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
        tokens = qm.pack_latents(x).to(dtype)
        n = tokens.shape[1]
        t = timestep.to(dtype) / qm.NUM_TRAIN_TIMESTEPS  # σ, rounded to the model dtype first as the stock call does
        shapes = qm.img_shapes(B, h, w, vae_scale_factor=1)  # [(1, h/2, w/2)] per sample: the RoPE's grid
        if embeds.cond is not None:  # the reference image's tokens after the image's, its grid after the image's
            hc, wc = grid
            tokens = torch.cat([tokens, embeds.cond[:, :(hc // 2) * (wc // 2)].to(dtype)], dim=1)
            shapes = [[(1, h // 2, w // 2), (1, hc // 2, wc // 2)]] * B

        def call(prompt, mask):
            text, text_mask = _text(prompt, mask, dtype)
            return transformer(hidden_states=tokens, timestep=t, encoder_hidden_states=text,
                               encoder_hidden_states_mask=text_mask, img_shapes=shapes,
                               return_dict=False)[0][:, :n].float()

        v = call(embeds.prompt, embeds.mask)
        if self.uses_negative(guidance):
            if embeds.neg_prompt is None:
                raise ValueError("true_cfg_scale > 1 needs negative embeddings")
            v = qm.true_cfg(v, call(embeds.neg_prompt, embeds.neg_mask), guidance)
        return qm.unpack_latents(v, h, w)[:, :, 0]  # (B, 16, h, w)

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        return qm.decode_frames(vae, latents.unsqueeze(2))  # the VAE's one-frame video layout (B, 16, 1, h, w)
