"""Tiny, seeded, randomly initialised FLUX.2-klein and Z-Image built offline: the families whose text encoder is Qwen3.

Both take the stock pipelines' classes at toy size. The tokenizer is the tiny Qwen-Image's byte-level BPE
(gerl/models/tiny_qwenimage.py) with a chat template that writes Qwen3's single-turn format — "<|im_start|>user\\n…
<|im_end|>\\n<|im_start|>assistant\\n", then "<think>\\n\\n</think>\\n\\n" when `enable_thinking` is false, as Qwen3's own
template does (FLUX.2-klein asks for that; Z-Image asks for thinking, i.e. no think block).

- FLUX.2-klein (`build_tiny_flux2_klein`): `Flux2Transformer2DModel` (1 double- and 2 single-stream blocks, 128 input
  features = 32 latent channels × 2×2, no guidance embedding as klein's), `AutoencoderKLFlux2` (32 latent channels, 4×
  here, its batch-norm statistics set to seeded values so that de-normalising matters), `Qwen3ForCausalLM` with 27
  layers — the pipeline reads hidden states 9, 18 and 27 — of width 16, so the text is 3 × 16 = 48 wide.
- Z-Image (`build_tiny_zimage`): `ZImageTransformer2DModel` (2 layers and 1 refiner layer of width 32), FLUX.1's
  tiny `AutoencoderKL` (Z-Image uses FLUX.1's VAE and factors), a 3-layer `Qwen3Model` (the pipeline reads the
  penultimate hidden state) and Z-Image-Turbo's scheduler (shift 3, no dynamic shifting: `ZIMAGE_SCHEDULER`).
"""

from __future__ import annotations

import torch

QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- if "
    "enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
KLEIN_TEXT_WIDTH = 16  # Qwen3's hidden size: the transformer reads 3 of its layers side by side (48)
KLEIN_TEXT_LAYERS = 27  # hidden_states[27] is the deepest layer FLUX.2-klein reads (9, 18, 27)
ZIMAGE_TEXT_WIDTH = 32
# Z-Image-Turbo's scheduler/scheduler_config.json values (assets/configs/z-image-turbo names the source)
ZIMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
# FLUX.2-klein's scheduler: FLUX.2's dynamic shifting (the pipeline computes mu from the token and step counts)
KLEIN_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)


def build_qwen3_tokenizer():
    """The tiny Qwen BPE with Qwen3's chat template and its think tokens."""
    from gerl.models.tiny_qwenimage import build_qwen_tokenizer

    tok = build_qwen_tokenizer()
    tok.add_tokens(["<think>", "</think>"], special_tokens=True)
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


def _qwen3_config(tok, hidden: int, layers: int):
    from transformers import Qwen3Config

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    return Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=1024,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=pad, eos_token_id=eos,
                       pad_token_id=pad)


def build_tiny_flux2_klein(seed: int = 0):
    """The tiny FLUX.2-klein (fp32, CPU, eval mode), deterministic for a given seed.

    Returns:
        diffusers.Flux2KleinPipeline
    """
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    tok = build_qwen3_tokenizer()
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=128, num_layers=1, num_single_layers=2,
                                          attention_head_dim=16, num_attention_heads=2,
                                          joint_attention_dim=3 * KLEIN_TEXT_WIDTH, timestep_guidance_channels=32,
                                          axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
    vae = AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                             block_out_channels=(8, 16, 16), layers_per_block=1, latent_channels=32,
                             norm_num_groups=4, sample_size=64)
    with torch.no_grad():  # batch-norm statistics as a trained VAE's would be: not 0 and 1
        vae.bn.running_mean.normal_(0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    text_encoder = Qwen3ForCausalLM(_qwen3_config(tok, KLEIN_TEXT_WIDTH, KLEIN_TEXT_LAYERS))
    pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**KLEIN_SCHEDULER), vae=vae,
                              text_encoder=text_encoder, tokenizer=tok, transformer=transformer, is_distilled=False)
    for module in (transformer, vae, text_encoder):
        module.eval()
    return pipe


def build_tiny_zimage(seed: int = 0):
    """The tiny Z-Image (fp32, CPU, eval mode), deterministic for a given seed.

    Returns:
        diffusers.ZImagePipeline
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    from gerl.models.tiny import FLUX_VAE_KWARGS

    tok = build_qwen3_tokenizer()
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(in_channels=16, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
                                           n_kv_heads=2, cap_feat_dim=ZIMAGE_TEXT_WIDTH, axes_dims=[4, 6, 6],
                                           axes_lens=[256, 64, 64])
    vae = AutoencoderKL(**FLUX_VAE_KWARGS)
    text_encoder = Qwen3Model(_qwen3_config(tok, ZIMAGE_TEXT_WIDTH, 3))
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER), vae=vae,
                          text_encoder=text_encoder, tokenizer=tok, transformer=transformer)
    for module in (transformer, vae, text_encoder):
        module.eval()
    return pipe


def save_tiny_flux2_klein(path, seed: int = 0) -> None:
    build_tiny_flux2_klein(seed).save_pretrained(str(path), safe_serialization=True)


def save_tiny_zimage(path, seed: int = 0) -> None:
    build_tiny_zimage(seed).save_pretrained(str(path), safe_serialization=True)
