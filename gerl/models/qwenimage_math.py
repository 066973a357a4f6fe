"""Qwen-Image's sampling math, as the stock `QwenImagePipeline` (diffusers 0.42.1) computes it, in pure functions.

A Qwen-Image family module must reproduce each piece exactly; tests/models/test_qwenimage_math.py checks every
function against the stock pipeline's own helpers and runs an ODE loop built from them that equals the pipeline's
`__call__` (fp32, ≤ 1e-5). What the pipeline does, step by step:

**1. Prompt encoding.** Each prompt is put into a chat template (`PROMPT_TEMPLATE`: a fixed system turn, the
prompt as the user turn, then the opening of the assistant turn) and tokenized as one padded batch
(`padding=True`, truncation at 1024 + 34 tokens; Qwen2Tokenizer pads on the right unless configured otherwise,
and `select_prompt_states` handles either side). The text encoder (`Qwen2_5_VLForConditionalGeneration`, text
only: no image, no processor) runs on `input_ids` and `attention_mask` with `output_hidden_states=True`; the
pipeline takes `hidden_states[-1]`, the output of the last decoder layer after the final RMSNorm (the language
model's `last_hidden_state`, bit for bit: `encode_prompts` runs the inner `text_encoder.model` alone and so skips
the LM head's 152k-wide logits, which the stock call computes for every position and discards). Per sample
it keeps the positions where the mask is 1, drops the first `PROMPT_DROP_IDX` = 34 of them (the system turn and
"<|im_start|>user\\n": exactly 34 tokens with Qwen's tokenizer), and left-aligns what remains (the prompt's tokens
followed by "<|im_end|>\\n<|im_start|>assistant\\n", 5 tokens); the batch is zero-padded to its longest sample and
given a (B, L) int64 mask of ones then zeros. `encode_prompt` then cuts both to `max_sequence_length` (512 by
default in `__call__`, at most 1024) and replaces the mask by None when it is all ones (no padding anywhere).

**2. Latents.** The VAE downsamples 8× (`2 ** len(vae.temperal_downsample)`) and the transformer patchifies 2×2,
so the latent grid is h = 2·(H // 16), w = 2·(W // 16). Noise is drawn as `randn((B, 1, 16, h, w))` (a frame axis
of 1 *before* the channels) and packed into (B, h/2 · w/2, 64) tokens: token (i, j) in row-major order over the
(h/2, w/2) grid, its 64 features ordered channel-major then (dy, dx), i.e. feature = c·4 + dy·2 + dx. Because the
frame axis is 1 the packing views the 5-D noise as (B, 16, h, w). Unpacking inverts it into the VAE's 5-D layout
(B, 16, 1, h, w) (channels, then a frame axis of 1).

**3. The σ schedule.** `sigmas = linspace(1, 1/N, N)` (float64, then float32), the image sequence length
L_img = (h/2)·(w/2) gives `mu = calculate_shift(L_img, base_image_seq_len, max_image_seq_len, base_shift,
max_shift)` from the scheduler config (Qwen-Image: 256, 8192, 0.5, 0.9; the pipeline's fallbacks when a key is
missing are 256, 4096, 0.5, 1.15), a straight line in L_img. The scheduler (dynamic shifting, exponential type)
maps σ → e^mu / (e^mu + (1/σ − 1)), which is SD3's static shift with shift = e^mu (1024²: L_img = 4096,
mu = 0.6935, shift 2.00; 512²: mu = 0.5387, shift 1.71), then `shift_terminal` = 0.02 stretches the ladder so that
its last value is 0.02: σ ← 1 − (1 − σ)·(1 − 0.02)/(1 − σ_last). A 0 is appended: N + 1 values from exactly 1 down
to 0.02, then 0. The scheduler does this in float32 numpy; `sigma_schedule` repeats it operation for operation.
With N = 1 the stretch divides 0 by 0 and the stock pipeline's σ is NaN (a black image): `sigma_schedule` refuses.

**4. The transformer call.** `timesteps = sigmas[:-1] · 1000` (float32) and the transformer receives
`timestep / 1000`, which is σ up to float32 rounding (not bit-equal: `transformer_timestep`). It also receives
`encoder_hidden_states` (B, L_txt, D), `encoder_hidden_states_mask` (B, L_txt) or None, and
`img_shapes = [[(1, h/2, w/2)]] * B`. In diffusers 0.42.1 `img_shapes` only feeds the RoPE (and only its first
entry is read: all images in a batch must share one size) and there is no `txt_seq_lens` argument any more: the
text RoPE covers the padded length L_txt, the mask keeps padded text tokens out of the joint attention as keys.
(diffusers ≤ 0.35 took `txt_seq_lens = mask.sum(1).tolist()`; flow_grpo's Qwen-Image patch still passes it.) So a
padded prompt gives the same velocity as the unpadded one up to float rounding, which lets a family module batch
the conditional and negative prompts in one call (`join_prompt_embeds`). `guidance` is None (Qwen-Image is not
guidance-distilled: `guidance_embeds` is false).

**5. True CFG.** Only when `true_cfg_scale > 1` *and* a negative prompt (or its embeddings) is given; the pipeline's
default `true_cfg_scale` is 4.0, but without a negative prompt there is no CFG (a warning only). The two velocities
come from separate calls, each with its own prompt's embeddings, mask and length; they are combined as
comb = neg + s·(cond − neg) and rescaled per token to the conditional velocity's norm:
v = comb · (‖cond‖ / ‖comb‖), the norms over the last axis of the *packed* tokens (64 features each).

**6. The Euler step.** `scheduler.step` upcasts the sample to float32, computes x ← x + (σ_next − σ)·v with both σ
float32, and casts back to v's dtype.

**7. Decoding.** Unpack to (B, 16, 1, h, w); de-normalise with the VAE config's per-channel statistics as
x / (1 / latents_std) + latents_mean (that order: the reciprocal is taken first); `vae.decode(...)` returns
(B, 3, 1, H, W) clamped to [−1, 1]; frame 0 is taken; `output_type="pt"` maps it to [0, 1] by
(x · 0.5 + 0.5).clamp(0, 1). With `output_type="latent"` the pipeline returns the packed tokens as they are.

Noticed while checking: `encode_prompt` repeats the mask for `num_images_per_prompt` > 1 with a 2-D `repeat`
that tiles the prompts ([p0, p1, p0, p1]) while the embeddings are repeated per prompt ([p0, p0, p1, p1]): with
several prompts of different lengths and num_images_per_prompt > 1 the masks are attached to the wrong samples.
Repeat prompts before encoding (as gerl's group sampling does) rather than relying on num_images_per_prompt.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gerl.models.family import resolution_shift

# QwenImagePipeline.__init__: prompt_template_encode, prompt_template_encode_start_idx, tokenizer_max_length.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
PROMPT_DROP_IDX = 34  # tokens of the template before the prompt, dropped from the embeddings
TOKENIZER_MAX_LENGTH = 1024  # prompt tokens kept by the tokenizer beyond the dropped prefix
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s default; check_inputs refuses more than 1024
LATENT_CHANNELS = 16  # VAE z_dim; the transformer sees 4 × 16 = 64 features per packed token
VAE_SCALE_FACTOR = 8  # 2 ** len(vae.temperal_downsample) for Qwen-Image's VAE
NUM_TRAIN_TIMESTEPS = 1000  # scheduler.config.num_train_timesteps: timesteps = σ · 1000


# ------------------------------------------------------------------------------------------ 1. prompt encoding

def format_prompts(prompts: list[str]) -> list[str]:
    """The chat-template text the tokenizer sees, one string per prompt."""
    return [PROMPT_TEMPLATE.format(p) for p in prompts]


def select_prompt_states(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                         drop_idx: int = PROMPT_DROP_IDX) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's part of the text encoder's last hidden states, left-aligned and zero-padded.

    Args:
        hidden_states: (B, T, D) `hidden_states[-1]` of the text encoder over the templated, padded batch.
        attention_mask: (B, T) the tokenizer's mask (1 = token, 0 = padding; either padding side).
        drop_idx: template tokens to drop from the start of each sample's valid positions.
    Returns:
        embeds (B, L, D) in hidden_states' dtype, L the longest kept length; mask (B, L) int64, 1 where kept.
    """
    keep = attention_mask.bool()
    lengths = (keep.sum(dim=1) - drop_idx).tolist()
    longest = max(lengths)
    embeds = hidden_states.new_zeros(hidden_states.shape[0], longest, hidden_states.shape[2])
    mask = torch.zeros(hidden_states.shape[0], longest, dtype=torch.long, device=hidden_states.device)
    for b, n in enumerate(lengths):
        embeds[b, :n] = hidden_states[b][keep[b]][drop_idx:]
        mask[b, :n] = 1
    return embeds, mask


def truncate_prompt_states(embeds: torch.Tensor, mask: torch.Tensor,
                           max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH):
    """`encode_prompt`'s cut to max_sequence_length; the mask becomes None when nothing is padded.

    Returns:
        (embeds (B, min(L, max_sequence_length), D), mask (B, same) int64 or None).
    """
    embeds, mask = embeds[:, :max_sequence_length], mask[:, :max_sequence_length]
    return embeds, (None if bool(mask.all()) else mask)


@torch.no_grad()
def encode_prompts(tokenizer, text_encoder, prompts: list[str],
                   max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH):
    """Steps 1 end to end: template, tokenize, run the text encoder, select, truncate.

    Returns:
        (embeds (B, L, D), mask (B, L) int64 or None), as `QwenImagePipeline.encode_prompt` returns them.
    """
    tokens = tokenizer(format_prompts(prompts), max_length=TOKENIZER_MAX_LENGTH + PROMPT_DROP_IDX, padding=True,
                       truncation=True, return_tensors="pt").to(text_encoder.device)
    # The stock call's hidden_states[-1] is the inner model's last_hidden_state, bit for bit (same multimodal RoPE
    # positions, same final norm); running the inner model skips the LM head's (B, T, 152k) logits, which the stock
    # call computes and discards (~2.9 GB in bf16 for 32 prompts of 300 tokens).
    states = text_encoder.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state
    embeds, mask = select_prompt_states(states, tokens.attention_mask)
    return truncate_prompt_states(embeds, mask, max_sequence_length)


def join_prompt_embeds(parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate prompt batches of different lengths along the batch (e.g. conditional and negative prompts,
    to run CFG's two velocities in one transformer call): zero-pad to the longest, always return a mask.

    Args:
        parts: [(embeds (B_i, L_i, D), mask (B_i, L_i) or None meaning all ones), ...].
    Returns:
        embeds (ΣB_i, max L_i, D); mask (ΣB_i, max L_i) int64.
    """
    longest = max(e.shape[1] for e, _ in parts)
    embeds, masks = [], []
    for e, m in parts:
        m = torch.ones(e.shape[:2], dtype=torch.long, device=e.device) if m is None else m.long()
        pad = longest - e.shape[1]
        embeds.append(torch.cat([e, e.new_zeros(e.shape[0], pad, e.shape[2])], dim=1))
        masks.append(torch.cat([m, m.new_zeros(m.shape[0], pad)], dim=1))
    return torch.cat(embeds), torch.cat(masks)


# ------------------------------------------------------------------------------------------ 2. latents

def latent_size(height: int, width: int, vae_scale_factor: int = VAE_SCALE_FACTOR) -> tuple[int, int]:
    """(h, w) of the unpacked latent grid: the VAE's 8× and the 2×2 patches, rounded down to even."""
    return 2 * (int(height) // (vae_scale_factor * 2)), 2 * (int(width) // (vae_scale_factor * 2))


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) or (B, 1, C, h, w) → (B, h/2 · w/2, 4C) tokens; feature index c·4 + dy·2 + dx."""
    if latents.dim() == 5:  # the pipeline's noise layout (B, 1, C, h, w): the frame axis is 1, drop it
        latents = latents[:, 0]
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h/2 · w/2, 4C) tokens → (B, C, 1, h, w), the VAE's video layout with one frame."""
    b, _, d = tokens.shape
    x = tokens.reshape(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, 1, h, w)


def initial_noise(batch: int, height: int, width: int, generator: torch.Generator | None = None,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                  channels: int = LATENT_CHANNELS) -> torch.Tensor:
    """The pipeline's starting latents for one generator: randn (B, 1, C, h, w), packed to (B, h/2 · w/2, 4C).
    (A list of per-sample generators, as `randn_tensor` accepts, is not handled here.)"""
    h, w = latent_size(height, width)
    noise = torch.randn((batch, 1, channels, h, w), generator=generator, dtype=dtype, device=device)
    return pack_latents(noise)


def img_shapes(batch: int, height: int, width: int, vae_scale_factor: int = VAE_SCALE_FACTOR) -> list:
    """The transformer's `img_shapes` argument: one [(frames, h/2, w/2)] per sample."""
    return [[(1, height // vae_scale_factor // 2, width // vae_scale_factor // 2)]] * batch


# ------------------------------------------------------------------------------------------ 3. σ schedule

def mu_for(image_seq_len: int, scheduler_config) -> float:
    """mu as `QwenImagePipeline.__call__` reads the scheduler config (with its fallbacks for missing keys: 256,
    4096, 0.5, 1.15). The line itself is gerl.models.family.calculate_shift, shared with the other families."""
    return resolution_shift(image_seq_len, scheduler_config, 1.15)


_UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                "stochastic_sampling")


def sigma_schedule(num_steps: int, image_seq_len: int, scheduler_config) -> torch.Tensor:
    """The σ ladder `retrieve_timesteps(scheduler, sigmas=linspace(1, 1/N, N), mu=...)` leaves in
    `scheduler.sigmas`: float32, N + 1 values, the last 0. Computed in float32 numpy in the scheduler's order so
    that it is bit-equal.

    Args:
        num_steps: N, the number of denoising steps.
        image_seq_len: packed image tokens, (h/2)·(w/2).
        scheduler_config: the FlowMatchEulerDiscreteScheduler config (a dict or its FrozenDict).
    """
    for key in _UNSUPPORTED:
        if scheduler_config.get(key):
            raise ValueError(f"scheduler config sets {key}=True, which Qwen-Image's schedule does not use; "
                             f"load the scheduler config published with the model")
    terminal = scheduler_config.get("shift_terminal")
    if terminal and num_steps < 2:  # the stretch divides by 1 − σ_last = 0: the stock scheduler's σ is NaN
        raise ValueError(f"num_steps={num_steps}: with shift_terminal={terminal} the schedule needs at least 2 "
                         f"steps (one step gives σ = NaN in the stock scheduler)")
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)
    if scheduler_config.get("use_dynamic_shifting"):
        mu = mu_for(image_seq_len, scheduler_config)
        if scheduler_config.get("time_shift_type", "exponential") == "exponential":
            sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
        else:  # "linear"
            sigmas = mu / (mu + (1 / sigmas - 1) ** 1.0)
    else:
        shift = scheduler_config.get("shift", 1.0)
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    if terminal:
        one_minus = 1 - sigmas
        sigmas = 1 - (one_minus / (one_minus[-1] / (1 - terminal)))
    sigmas = torch.from_numpy(np.asarray(sigmas)).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1)])


def transformer_timestep(sigma: torch.Tensor) -> torch.Tensor:
    """What the transformer receives for σ: the scheduler's timestep σ·1000, divided by 1000 in the pipeline.
    float32 rounding makes it differ from σ in the last bit for some σ; the stock path is reproduced."""
    return (sigma.to(torch.float32) * NUM_TRAIN_TIMESTEPS) / NUM_TRAIN_TIMESTEPS


# ------------------------------------------------------------------------------------------ 5. CFG, 6. Euler

def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's CFG with its norm rescale: (B, L, 64) velocities → (B, L, 64).

    comb = uncond + scale·(cond − uncond), then each token rescaled to the conditional token's norm."""
    comb = uncond + scale * (cond - uncond)
    return comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


def euler_step(latents: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor,
               sigma_next: torch.Tensor) -> torch.Tensor:
    """The ODE step of FlowMatchEulerDiscreteScheduler.step: in float32, cast back to the velocity's dtype."""
    return (latents.to(torch.float32) + (sigma_next - sigma) * velocity).to(velocity.dtype)


# ------------------------------------------------------------------------------------------ 7. decoding

def denormalize_latents(latents: torch.Tensor, latents_mean, latents_std) -> torch.Tensor:
    """(B, C, 1, h, w) normalised latents → the VAE's latent space, exactly as the pipeline does it."""
    c = latents.shape[1]
    mean = torch.tensor(latents_mean).view(1, c, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(latents_std).view(1, c, 1, 1, 1).to(latents.device, latents.dtype)
    return latents / inv_std + mean


def decode_frames(vae, latents: torch.Tensor) -> torch.Tensor:
    """Unpacked normalised latents (B, C, 1, h, w) → images (B, 3, H, W) in [-1, 1] (the VAE clamps): de-normalise,
    decode in the VAE's dtype, take frame 0."""
    latents = denormalize_latents(latents.to(vae.device, vae.dtype), vae.config.latents_mean, vae.config.latents_std)
    return vae.decode(latents, return_dict=False)[0][:, :, 0]


@torch.no_grad()
def decode_latents(vae, tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed (B, L, 64) latents → images (B, 3, H, W) in [-1, 1], as the pipeline decodes its output."""
    h, w = latent_size(height, width)
    return decode_frames(vae, unpack_latents(tokens, h, w))


def to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] → [0, 1], as the pipeline's image processor returns `output_type="pt"`."""
    return (images * 0.5 + 0.5).clamp(0, 1)
