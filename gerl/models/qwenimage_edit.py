"""Qwen-Image-Edit-Plus: `QwenImageEditPlusPipeline` (Qwen/Qwen-Image-Edit-2509, -2511), Qwen-Image's transformer
class (`QwenImageTransformer2DModel`) trained to edit an image: each prompt comes with a conditioning image.

What is the edit pipeline's own, each as the stock QwenImageEditPlusPipeline does it; everything else (packing,
true CFG with its norm rescale, the σ schedule shifted by the *generated* image's token count, the video VAE's
decode, the LoRA targets) is Qwen-Image's (gerl/models/qwenimage.py):
- the text encoder sees the image: the prompt becomes "Picture 1: <|vision_start|><|image_pad|><|vision_end|>" +
  prompt inside the edit template (`EDIT_TEMPLATE`, whose system turn is `EDIT_DROP_IDX` = 64 tokens, dropped), the
  image placeholder expanded to the vision tower's merged patches, and Qwen2.5-VL runs on the ids with the image's
  `pixel_values` and `image_grid_thw`; the image is first resized to an area of 384² at its aspect
  (`calculate_dimensions(CONDITION_IMAGE_SIZE, …)`, sides rounded to 32) by the pipeline's image processor. The
  stock call does the expansion and the pixel values through transformers' Qwen2VLProcessor, which insists on a video
  processor (torchvision); gerl runs its image processor alone (`Qwen2VLImageProcessorPil`, Qwen2.5-VL's patch 14,
  merge 2, CLIP mean and std) and expands the placeholder itself — the parity test holds it to the stock call. The
  negative prompt (" ", as for Qwen-Image) is encoded with the same image, as the stock call does. The edit
  pipeline does not cut prompts to `max_sequence_length`;
- the conditioning image is also resized to an area of 1024² at its aspect (`VAE_IMAGE_SIZE`; or
  `model.condition_resolution`² — flow_grpo's edit runs use 512²), encoded by the VAE's mode, normalised
  ((z − latents_mean) / latents_std) and packed into 2×2 tokens (`Embeds.cond`, its grid `Embeds.cond_hw`);
- the transformer reads the image's tokens followed by the reference's, `img_shapes` = [(1, h/2, w/2), (1, h_ref/2,
  w_ref/2)] per sample, and both the conditional and the negative pass keep only the image's tokens before the CFG
  combine (`QwenImage.velocity`, which this family shares). Qwen-Image-Edit-2511's `zero_cond_t` (the reference's
  timestep zeroed) is the transformer's own and follows from `img_shapes`.
The stock call takes one prompt at a time; gerl batches prompts (each row its own text length, masked, as
Qwen-Image's family does) and calls the transformer once per reference grid in a batch.
"""

from __future__ import annotations

import torch

from gerl.models import qwenimage_math as qm
from gerl.models.family import register
from gerl.models.qwenimage import QwenImage
from gerl.sampling.loop import Embeds

# QwenImageEditPlusPipeline.__init__: prompt_template_encode, prompt_template_encode_start_idx; _get_qwen_prompt_embeds'
# img_prompt_template.
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_DROP_IDX = 64
IMAGE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"


def stock_sizes() -> tuple[int, int]:
    """The stock pipeline's pixel areas: (CONDITION_IMAGE_SIZE for the text encoder, VAE_IMAGE_SIZE for the VAE)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE

    return CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE


def calculate_dimensions(target_area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of an image of aspect `ratio` at about `target_area` pixels, each rounded to a multiple of 32
    (the stock pipeline's module function)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions as stock

    return stock(target_area, ratio)


def vision_processor(pipe):
    """The image processor the text encoder's vision tower reads with: the pipeline's processor's, or Qwen2.5-VL's
    defaults (a pipeline loaded without its processor: gerl's loader and the tiny model)."""
    proc = getattr(pipe, "processor", None)
    if proc is not None:
        return proc.image_processor
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil()


@register
class QwenImageEditPlus(QwenImage):
    name = "qwenimage_edit"
    title = "Qwen-Image-Edit-Plus"
    pipeline_classes = ("QwenImageEditPlusPipeline",)
    conditioned = True
    unloaded = ("processor",)  # see the module docstring: the image processor alone runs, from its defaults
    extra_classes = (("transformers", "Qwen2VLImageProcessorPil"),)

    def build_tiny(self, seed: int, variant: str):
        from gerl.models.tiny_qwenimage import build_tiny_qwenimage_edit_plus

        return build_tiny_qwenimage_edit_plus(seed)

    def encode_prompts(self, pipe, prompts: list[str], max_sequence_length: int, images=None,
                       condition_resolution: int = 0) -> Embeds:
        if images is None or len(images) != len(prompts):
            raise ValueError("Qwen-Image-Edit-Plus encodes each prompt with its conditioning image")
        texts = [self.encode_text(pipe, p, im) for p, im in zip(prompts, images)]  # (1, L_i, D) each
        refs = [self.encode_image(pipe, im, condition_resolution) for im in images]  # (1, 16, h, w) each
        longest = max(t.shape[1] for t in texts)
        prompt = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[1])) for t in texts])
        mask = torch.zeros(len(texts), longest, dtype=torch.long, device=prompt.device)
        for i, t in enumerate(texts):
            mask[i, :t.shape[1]] = 1
        tokens = [qm.pack_latents(z) for z in refs]
        most = max(t.shape[1] for t in tokens)
        cond = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, most - t.shape[1])) for t in tokens])
        hw = torch.tensor([list(z.shape[-2:]) for z in refs], dtype=torch.long)
        return Embeds(prompt, None, mask=mask, cond=cond, cond_hw=hw)

    @torch.no_grad()
    def encode_text(self, pipe, prompt: str, image) -> torch.Tensor:
        """One prompt with its image → the text encoder's last hidden states after the template, (1, L, D)."""
        area, _ = stock_sizes()
        w, h = calculate_dimensions(area, image.width / image.height)
        shown = pipe.image_processor.resize(image, h, w)
        vision = vision_processor(pipe)
        pixels = vision(images=[shown], return_tensors="pt")
        grid = pixels["image_grid_thw"]  # (1, 3): temporal, height, width patches
        placeholders = int(grid[0].prod()) // vision.merge_size ** 2
        text = EDIT_TEMPLATE.format(IMAGE_PROMPT.format(1) + prompt).replace(IMAGE_PAD, IMAGE_PAD * placeholders)
        enc = pipe.text_encoder
        ids = pipe.tokenizer([text], padding=True, return_tensors="pt").to(enc.device)
        # the inner model's last_hidden_state is the stock call's hidden_states[-1] (gerl/models/qwenimage_math.py)
        states = enc.model(input_ids=ids.input_ids, attention_mask=ids.attention_mask,
                           pixel_values=pixels["pixel_values"].to(enc.device, enc.dtype),
                           image_grid_thw=grid.to(enc.device)).last_hidden_state
        return states[:, EDIT_DROP_IDX:]

    @torch.no_grad()
    def encode_image(self, pipe, image, condition_resolution: int) -> torch.Tensor:
        """One PIL image → its normalised latents (1, 16, h, w) fp32, as QwenImageEditPlusPipeline prepares them."""
        _, area = stock_sizes()
        if condition_resolution:
            area = condition_resolution ** 2
        w, h = calculate_dimensions(area, image.width / image.height)
        x = pipe.image_processor.preprocess(image, h, w).unsqueeze(2)  # (1, 3, 1, H, W) in [−1, 1]
        vae = pipe.vae
        z = vae.encode(x.to(vae.device, vae.dtype)).latent_dist.mode()  # (1, 16, 1, h, w)
        c = z.shape[1]
        mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(z.device, z.dtype)
        return ((z - mean) / std)[:, :, 0].float()
