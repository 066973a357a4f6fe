"""Tiny, seeded, randomly initialised Stable Diffusion 3 and FLUX.1 pipelines built entirely offline.

Every part of the real pipeline is present (MMDiT transformer, 16-channel VAE, two CLIP text encoders with
projections, T5, and their tokenizers) at a size that runs a training step on a laptop CPU in about a second.
The tokenizers are generated in code: CLIP gets a byte-level vocabulary with the `</w>` end-of-word variants its
BPE needs and no merges (one token per character); T5 gets a unigram vocabulary of single characters.
`save_tiny_sd3(dir)` writes a directory that `StableDiffusion3Pipeline.from_pretrained(dir)` loads.
The tiny FLUX.1 (`build_tiny_flux`, model.path=tiny-flux / tiny-flux-schnell) shares the CLIP and T5 and their
tokenizers; `save_tiny_flux(dir)` writes what `FluxPipeline.from_pretrained(dir)` loads.
"""

from __future__ import annotations

import string

import torch

# Sizes chosen so that: CLIP-L proj + CLIP-G proj = pooled_projection_dim, and the padded CLIP embedding fits in
# the T5 width (the SD3 pipeline pads the concatenated CLIP hidden states up to joint_attention_dim).
CLIP_HIDDEN = 32
CLIP_PROJ = 32
T5_WIDTH = 64
TOKEN_LENGTH = 32  # CLIP model_max_length and the T5 max_sequence_length used by the tiny recipes
RESOLUTION = 64  # pixels; the VAE below downsamples 4x → 16×16 latents → 64 image tokens after 2×2 patches

# The transformer's and the VAE's constructor arguments, as plain data: what they can generate is read from here
# without importing diffusers (gerl.plan.arch.check_resolution, ~4 s of imports saved per `gerl` process).
TRANSFORMER_KWARGS = dict(
    sample_size=RESOLUTION // 4,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=T5_WIDTH,
    caption_projection_dim=32,
    pooled_projection_dim=2 * CLIP_PROJ,
    pos_embed_max_size=32,
)
VAE_KWARGS = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(8, 16, 16),
    layers_per_block=1,
    latent_channels=16,
    norm_num_groups=4,
    sample_size=RESOLUTION,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=0.0609,
    scaling_factor=1.5305,
)


def _bytes_to_unicode() -> list[str]:
    # The GPT-2/CLIP byte→printable-unicode table: every byte gets a visible character.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def build_clip_tokenizer():
    from transformers import CLIPTokenizer

    chars = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:  # CLIP's BPE appends </w> to the last symbol of every word: those must be in the vocab
        vocab[c + "</w>"] = len(vocab)
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    tok = CLIPTokenizer(vocab=vocab, merges=[])
    tok.model_max_length = TOKEN_LENGTH
    return tok


def build_t5_tokenizer():
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(c, -2.0) for c in string.printable.strip() if c not in "▁"]
    pieces += [("▁" + c, -1.5) for c in string.ascii_letters + string.digits]
    tok = T5Tokenizer(vocab=pieces, extra_ids=0)
    tok.model_max_length = TOKEN_LENGTH
    return tok


def _clip_config():
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        hidden_size=CLIP_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=TOKEN_LENGTH,
        vocab_size=2 * 256 + 2,
        projection_dim=CLIP_PROJ,
        hidden_act="gelu",
        bos_token_id=512,
        eos_token_id=513,
        pad_token_id=513,
    )


def _t5_encoder(tokenizer):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=T5_WIDTH,
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
        )
    )


def build_tiny_sd3(seed: int = 0):
    """Build the tiny SD3 pipeline (fp32, CPU), deterministic for a given seed.

    Returns:
        diffusers.StableDiffusion3Pipeline
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(**TRANSFORMER_KWARGS)
    vae = AutoencoderKL(**VAE_KWARGS)
    text_encoder = CLIPTextModelWithProjection(_clip_config())
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config())
    t5_tok = build_t5_tokenizer()
    text_encoder_3 = _t5_encoder(t5_tok)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    clip_tok = build_clip_tokenizer()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=build_clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tok,
    )
    for module in (transformer, vae, text_encoder, text_encoder_2, text_encoder_3):
        module.eval()
    return pipe


def save_tiny_sd3(path, seed: int = 0) -> None:
    """Write the tiny SD3 to `path` as a diffusers directory (safetensors)."""
    build_tiny_sd3(seed).save_pretrained(str(path), safe_serialization=True)


# The tiny FLUX.1: FLUX's block layout (double-stream then single-stream blocks, RoPE over (0, row, column) ids,
# 2×2-packed 16-channel latents) at toy size, with the tiny CLIP (its pooled output) and T5 above.
FLUX_TRANSFORMER_KWARGS = dict(
    patch_size=1,
    in_channels=64,  # 16 latent channels × a 2×2 patch
    num_layers=2,  # double-stream blocks
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=T5_WIDTH,
    pooled_projection_dim=CLIP_HIDDEN,  # CLIPTextModel's pooler output
    axes_dims_rope=(4, 6, 6),  # RoPE split of a head over the (0, row, column) ids: sums to attention_head_dim
)
FLUX_VAE_KWARGS = dict(VAE_KWARGS, shift_factor=0.1159, scaling_factor=0.3611)  # FLUX.1's VAE factors
# The released schedulers' configs: dev shifts by the image's token count, schnell not at all.
FLUX_SCHEDULERS = {
    "dev": dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, shift=3.0,
                use_dynamic_shifting=True),
    "schnell": dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, shift=1.0,
                    use_dynamic_shifting=False),
}


def build_tiny_flux(seed: int = 0, schnell: bool = False):
    """Build the tiny FLUX.1 pipeline (fp32, CPU), deterministic for a given seed: dev (a guidance embedding,
    dynamic shift) or schnell (neither).

    Returns:
        diffusers.FluxPipeline
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(**FLUX_TRANSFORMER_KWARGS, guidance_embeds=not schnell)
    vae = AutoencoderKL(**FLUX_VAE_KWARGS)
    text_encoder = CLIPTextModel(_clip_config())
    t5_tok = build_t5_tokenizer()
    text_encoder_2 = _t5_encoder(t5_tok)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULERS["schnell" if schnell else "dev"])
    pipe = FluxPipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                        tokenizer=build_clip_tokenizer(), text_encoder_2=text_encoder_2, tokenizer_2=t5_tok)
    for module in (transformer, vae, text_encoder, text_encoder_2):
        module.eval()
    return pipe


def save_tiny_flux(path, seed: int = 0, schnell: bool = False) -> None:
    """Write the tiny FLUX.1 to `path` as a diffusers directory (safetensors)."""
    build_tiny_flux(seed, schnell).save_pretrained(str(path), safe_serialization=True)


def build_tiny_flux_kontext(seed: int = 0):
    """The tiny FLUX.1-Kontext (fp32, CPU): the tiny FLUX.1-dev's components (FLUX.1-Kontext-dev is FLUX.1-dev's
    architecture, guidance embedding and scheduler) in a FluxKontextPipeline, deterministic for a given seed.

    Returns:
        diffusers.FluxKontextPipeline
    """
    from diffusers import FluxKontextPipeline

    parts = build_tiny_flux(seed).components
    parts.update(image_encoder=None, feature_extractor=None)
    return FluxKontextPipeline(**{k: parts[k] for k in ("transformer", "scheduler", "vae", "text_encoder",
                                                         "tokenizer", "text_encoder_2", "tokenizer_2",
                                                         "image_encoder", "feature_extractor")})


def save_tiny_flux_kontext(path, seed: int = 0) -> None:
    """Write the tiny FLUX.1-Kontext to `path` as a diffusers directory (safetensors)."""
    build_tiny_flux_kontext(seed).save_pretrained(str(path), safe_serialization=True)
