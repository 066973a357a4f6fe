"""FLUX.1-Kontext: `FluxKontextPipeline`, FLUX.1-dev's transformer class (`FluxTransformer2DModel`, guidance embedding)
trained to edit an image: each prompt comes with a conditioning image.

What is Kontext's own, each as the stock FluxKontextPipeline does it; everything else (text, packing, guidance
embedding, σ schedule shifted by the *generated* image's token count, decode) is FLUX.1's (gerl/models/flux.py):
- the conditioning image is resized (`condition_size`), put through the pipeline's image processor (to [−1, 1]),
  encoded by the VAE's mode (`retrieve_latents(..., sample_mode="argmax")`), normalised as (z − shift)·scaling and
  packed into 2×2 tokens like the latents; gerl encodes it once per (prompt, image) in the text cache
  (`Embeds.cond`, (1, T_ref, 64), and its grid `Embeds.cond_hw`);
- the transformer reads the image's tokens followed by the reference tokens, the reference's position ids
  (1, row, column) after the image's (0, row, column), and its output is cut back to the image's tokens
  (`Flux.velocity`, which this family shares: the transformer is FLUX.1's class);
- size: the stock call picks, for an image of aspect a (its sides floored to the VAE factor × 2), the entry of
  PREFERRED_KONTEXT_RESOLUTIONS (about 1 MP, from 672 × 1568 to 1568 × 672) whose w/h is closest to a
  (`_auto_resize=True`, its default); `model.condition_resolution=N` instead keeps the image's aspect at an area of
  N² (w = round(√(N²·a)), h = round(√(N²/a)), as the stock call sizes its output from `max_area`), which the peers use
  to keep the reference at the training resolution (flow_grpo's train_flux_kontext.py resizes it to 512 × 512). Both
  are floored to a multiple of 16 (the VAE's 8 × the 2×2 patch). The generated image is model.resolution square
  (the stock call with height = width = max_area^½ = model.resolution).
"""

from __future__ import annotations

import torch

from gerl.models.family import register
from gerl.models.flux import Flux, pack
from gerl.sampling.loop import Embeds


def preferred_resolutions() -> list[tuple[int, int]]:
    """(width, height) pairs FLUX.1-Kontext was trained at (the stock pipeline's PREFERRED_KONTEXT_RESOLUTIONS)."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    return list(PREFERRED_KONTEXT_RESOLUTIONS)


def condition_size(width: int, height: int, multiple: int, condition_resolution: int) -> tuple[int, int]:
    """(width, height) the conditioning image is resized to, from its own size.

    Args:
        width, height: the image's pixels.
        multiple: the VAE's downsampling × 2 (16 for FLUX.1's VAE; the stock pipeline's vae_scale_factor · 2).
        condition_resolution: 0 = the stock call's `_auto_resize` (the preferred resolution of the closest aspect);
            N > 0 = the image's aspect at an area of N².
    """
    w, h = width - width % multiple, height - height % multiple  # VaeImageProcessor.get_default_height_width
    aspect = w / h
    if condition_resolution == 0:
        _, w, h = min((abs(aspect - pw / ph), pw, ph) for pw, ph in preferred_resolutions())
    else:
        area = condition_resolution ** 2
        w, h = round((area * aspect) ** 0.5), round((area / aspect) ** 0.5)
    return w // multiple * multiple, h // multiple * multiple


@register
class FluxKontext(Flux):
    name = "flux_kontext"
    title = "FLUX.1-Kontext"
    pipeline_classes = ("FluxKontextPipeline",)
    conditioned = True
    # flow_grpo's scripts/train_flux_kontext.py target_modules: FLUX.1's list and the single-stream blocks' proj_mlp
    lora_targets = Flux.lora_targets + ("proj_mlp",)

    def build_tiny(self, seed: int, variant: str):
        from gerl.models.tiny import build_tiny_flux_kontext

        return build_tiny_flux_kontext(seed)

    def encode_prompts(self, pipe, prompts: list[str], max_sequence_length: int, images=None,
                       condition_resolution: int = 0) -> Embeds:
        if images is None or len(images) != len(prompts):
            raise ValueError("FLUX.1-Kontext encodes each prompt with its conditioning image")
        text = super().encode_prompts(pipe, prompts, max_sequence_length)
        refs = [self.encode_image(pipe, im, condition_resolution) for im in images]  # (1, h, w) latents each
        tokens = [pack(z) for z in refs]
        longest = max(t.shape[1] for t in tokens)
        cond = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[1])) for t in tokens])
        hw = torch.tensor([list(z.shape[-2:]) for z in refs], dtype=torch.long)
        return Embeds(text.prompt, text.pooled, cond=cond, cond_hw=hw)

    @torch.no_grad()
    def encode_image(self, pipe, image, condition_resolution: int) -> torch.Tensor:
        """One PIL image → its normalised latents (1, 16, h, w) fp32, as FluxKontextPipeline prepares them."""
        vae = pipe.vae
        w, h = condition_size(image.width, image.height, pipe.vae_scale_factor * 2, condition_resolution)
        x = pipe.image_processor.preprocess(pipe.image_processor.resize(image, h, w), h, w)  # (1, 3, H, W) in [−1, 1]
        z = vae.encode(x.to(vae.device, vae.dtype)).latent_dist.mode()
        return ((z - vae.config.shift_factor) * vae.config.scaling_factor).float()
