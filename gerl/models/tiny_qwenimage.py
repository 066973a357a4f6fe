"""A tiny, seeded, randomly initialised Qwen-Image built entirely offline.

Every part of the stock `QwenImagePipeline` is present at a size that generates an image on a CPU in well under a
second: the double-stream `QwenImageTransformer2DModel` (64 input features = 16 latent channels × 2×2 patches, as
the real one), the 8× causal-3D `AutoencoderKLQwenImage` (16 latent channels, with Qwen-Image's published
`latents_mean` / `latents_std`, which are the class defaults), the `FlowMatchEulerDiscreteScheduler` with
Qwen-Image's published config (`SCHEDULER_CONFIG`: dynamic exponential shifting, shift_terminal 0.02), and a
`Qwen2_5_VLForConditionalGeneration` text encoder with a tiny vision tower that text-to-image never runs.

The tokenizer is a byte-level BPE trained here with the `tokenizers` library, wrapped in transformers'
`Qwen2Tokenizer` (Qwen's pre-tokenizer regex and byte-level alphabet). It carries Qwen's special tokens and is
trained on the pipeline's chat template, so that the template's system turn is exactly `PROMPT_DROP_IDX` = 34
tokens as with the real tokenizer: the pipeline's hard-coded `drop_idx` then drops exactly that turn.
`save_tiny_qwenimage(dir)` writes a directory that `QwenImagePipeline.from_pretrained(dir)` loads.
"""

from __future__ import annotations

import json

import torch

from gerl.models.qwenimage_math import PROMPT_DROP_IDX, PROMPT_TEMPLATE

TEXT_WIDTH = 32  # the text encoder's hidden size = the transformer's joint_attention_dim
RESOLUTION = 128  # pixels; the VAE downsamples 8× → 16×16 latents → 64 image tokens after 2×2 packing

# Qwen-Image's scheduler/scheduler_config.json as published with Qwen/Qwen-Image (the copy under
# assets/configs/qwen-image/scheduler/ names its sources), minus the bookkeeping keys.
SCHEDULER_CONFIG = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    invert_sigmas=False,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    stochastic_sampling=False,
    time_shift_type="exponential",
    use_beta_sigmas=False,
    use_dynamic_shifting=True,
    use_exponential_sigmas=False,
    use_karras_sigmas=False,
)
# Constructor arguments as plain data (readable without importing diffusers). The RoPE axes must sum to the head
# dimension (the real model: 16 + 56 + 56 = 128).
TRANSFORMER_KWARGS = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=TEXT_WIDTH,
    axes_dims_rope=(4, 6, 6),
)
# len(dim_mult) − 1 = 3 spatial halvings, matching len(temperal_downsample) = 3 from which the pipeline derives its
# vae_scale_factor (8).
VAE_KWARGS = dict(
    base_dim=8,
    z_dim=16,
    dim_mult=[1, 2, 2, 2],  # lists: the VAE's constructor concatenates them with lists
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
)
# Qwen's special tokens (Qwen2.5-VL's ids 151643–151656 in the real vocabulary; here they follow the BPE vocab).
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                  "<|image_pad|>", "<|video_pad|>")
ENDOFTEXT = "<|endoftext|>"  # Qwen's bos / pad / unk token
VOCAB_SIZE = 512  # BPE target size before the special tokens; the corpus below fills ~400 of it


def _corpus(edit: bool = False) -> list[str]:
    """What the BPE learns from: the template (weighted so that each of its words becomes one token, as in Qwen's
    real vocabulary) and a few prompts in the styles gerl's data uses; with `edit`, Qwen-Image-Edit-Plus's template
    and its image placeholder too."""
    prompts = [
        'A sign that says "OPEN" hanging on a wooden door',
        "a photo of a cat holding a sign that reads hello world",
        "A red apple and a green pear on a white table",
        'A neon sign with the text "gerl 2026" at night',
        "two dogs playing in the snow, bad quality, blurry, low resolution",
        "a poster with the words STOP and GO, numbers 0 1 2 3 4 5 6 7 8 9",
    ]
    corpus = [PROMPT_TEMPLATE.format(p) for p in prompts] * 20 + prompts
    if edit:
        from gerl.models.qwenimage_edit import EDIT_TEMPLATE, IMAGE_PROMPT

        edits = ['make the sign say "OPEN"', "change the red apple to a green pear", "write 42 on the poster"]
        corpus += [EDIT_TEMPLATE.format(IMAGE_PROMPT.format(1) + p) for p in edits] * 20
    return corpus


def build_qwen_tokenizer(edit: bool = False):
    """A byte-level BPE `Qwen2Tokenizer` trained in code (deterministic), with Qwen's special tokens. With `edit`
    it also learns Qwen-Image-Edit-Plus's template, whose system turn is then exactly `EDIT_DROP_IDX` = 64 tokens as
    with the real tokenizer (and the text-to-image template's still 34)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # The same normalizer and pre-tokenizer that Qwen2Tokenizer builds, so that the merges learnt here apply.
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=2 * VOCAB_SIZE if edit else VOCAB_SIZE, special_tokens=[ENDOFTEXT],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_corpus(edit), trainer=trainer)
    learnt = json.loads(bpe.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=learnt["vocab"], merges=[tuple(m) for m in learnt["merges"]])
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    prefix = tok(PROMPT_TEMPLATE.split("{}")[0]).input_ids
    if len(prefix) != PROMPT_DROP_IDX:  # the pipeline drops exactly PROMPT_DROP_IDX tokens: they must be the prefix
        raise RuntimeError(f"the tiny Qwen tokenizer splits the template's prefix into {len(prefix)} tokens, "
                           f"QwenImagePipeline drops {PROMPT_DROP_IDX}: the BPE corpus needs more weight")
    if edit:
        from gerl.models.qwenimage_edit import EDIT_DROP_IDX, EDIT_TEMPLATE

        n = len(tok(EDIT_TEMPLATE.split("{}")[0]).input_ids)
        if n != EDIT_DROP_IDX:
            raise RuntimeError(f"the tiny Qwen tokenizer splits the edit template's prefix into {n} tokens, "
                               f"QwenImageEditPlusPipeline drops {EDIT_DROP_IDX}")
    return tok


def build_tiny_qwenimage(seed: int = 0, edit: bool = False):
    """Build the tiny Qwen-Image pipeline (fp32, CPU, eval mode), deterministic for a given seed; with `edit`, the
    tiny Qwen-Image-Edit-Plus (`build_tiny_qwenimage_edit_plus`).

    Returns:
        diffusers.QwenImagePipeline (QwenImageEditPlusPipeline with `edit`)
    """
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = build_qwen_tokenizer(edit)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT,) + SPECIAL_TOKENS}
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**TRANSFORMER_KWARGS)
    vae = AutoencoderKLQwenImage(**VAE_KWARGS)
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        # multimodal RoPE: the three sections (time, height, width) sum to head_dim / 2 = 8
        rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids[ENDOFTEXT],
    )
    vision_config = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_WIDTH)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    ))
    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae, text_encoder=text_encoder,
                 tokenizer=tokenizer, transformer=transformer)
    if edit:
        from diffusers import QwenImageEditPlusPipeline

        # no processor: transformers' Qwen2VLProcessor insists on a video processor, which needs torchvision; gerl's
        # family runs the image processor alone (gerl/models/qwenimage_edit.py), tests build one for the stock call
        pipe = QwenImageEditPlusPipeline(**parts, processor=None)
    else:
        pipe = QwenImagePipeline(**parts)
    for module in (transformer, vae, text_encoder):
        module.eval()
    return pipe


def save_tiny_qwenimage(path, seed: int = 0) -> None:
    """Write the tiny Qwen-Image to `path` as a diffusers directory (safetensors)."""
    build_tiny_qwenimage(seed).save_pretrained(str(path), safe_serialization=True)


def build_tiny_qwenimage_edit_plus(seed: int = 0):
    """The tiny Qwen-Image-Edit-Plus (fp32, CPU): the tiny Qwen-Image's classes and sizes with a tokenizer that also
    knows the edit template, in a QwenImageEditPlusPipeline without a processor (see gerl/models/qwenimage_edit.py).
    Its Qwen2.5-VL vision tower (1 block, width 16, 14-pixel patches merged 2×2) reads the conditioning image."""
    return build_tiny_qwenimage(seed, edit=True)


def save_tiny_qwenimage_edit_plus(path, seed: int = 0) -> None:
    """Write the tiny Qwen-Image-Edit-Plus to `path` as a diffusers directory (safetensors)."""
    build_tiny_qwenimage_edit_plus(seed).save_pretrained(str(path), safe_serialization=True)
