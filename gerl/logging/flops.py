"""FLOPs of a step, for MFU: each family's transformer forward as gerl/logging/transformer_ops.py writes it (its
matmuls with their data flow, the editing families' reference tokens included), priced here, and the VAE decode.

From the list (tests/logging/test_flops.py holds each against torch's FlopCounterMode on the tiny models):
- the forward: the sum, plus a LoRA's own two matmuls per adapted Linear (2·rows·r·(in + out)) when it runs unmerged;
- the backward as autograd runs it: a tensor needs a gradient when it depends on a trainable weight and the loss
  depends on it. A matmul whose output needs a gradient computes one matmul of its own size per operand that needs
  one (a Linear's input; both operands of an attention product), plus, trained, its weight's gradient. With LoRA
  the frozen weights get no weight gradient (the old count's "backward = 2 × forward" charged one), the embedders
  and the adaLN linears on the timestep embedding get no backward at all, and the first adapted block's
  projections no input gradient. The adapter's own backward per adapted Linear: dB and the gradient into A·x
  (4·rows·r·out), dA (2·rows·r·in), and its input's gradient through A (2·rows·r·in, where the input needs one).
  Fully fine-tuned, every Linear gets its weight gradient: ≈ 3 × forward, less the embedders' input gradients.
Model FLOPs, as MFU counts them: flash attention's backward recomputes QKᵀ (hardware work, 0.5 × the attention's
forward) and gradient checkpointing recomputes the forward; neither is counted.

The VAE decode is counted by FlopCounterMode itself, on the meta device, through the family's own `decode`
(`vae_decode_flops`): nothing allocated, exact for any VAE (Qwen-Image's causal 3-D convolutions included).
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from gerl.logging.transformer_ops import (  # noqa: F401 (family_of_config, image_tokens: part of this module's API)
    Op, family_of_config, image_tokens, transformer_ops,
)

CLIP_TOKENS = 77  # SD3 pads the CLIP-L/G hidden states to 77 tokens before concatenating T5's


def text_seq_len(max_sequence_length: int, clip_tokens: int = CLIP_TOKENS) -> int:
    """Joint-attention text tokens of SD3: CLIP (77, padded) + T5 (max_sequence_length, e.g. 256) = 333."""
    return clip_tokens + max_sequence_length


@dataclass(frozen=True)
class Lora:
    """A LoRA adapter as peft attaches it: target module names (peft matches a module whose dotted name is a target
    or ends with "." + target) and the rank."""

    targets: tuple[str, ...]
    rank: int

    def adapts(self, op: Op) -> bool:
        return op.linear is not None and any(op.name == t or op.name.endswith("." + t) for t in self.targets)


def _cached_ops(config: Mapping, resolution: int, text_len: int, vae_scale_factor: int,
                cond_tokens: int = 0) -> tuple[Op, ...]:
    return _ops_by_key(json.dumps(dict(config), sort_keys=True, default=str), resolution, text_len, vae_scale_factor,
                       cond_tokens)


@functools.lru_cache(maxsize=64)
def _ops_by_key(config_json: str, resolution: int, text_len: int, vae_scale_factor: int,
                cond_tokens: int) -> tuple[Op, ...]:
    return transformer_ops(json.loads(config_json), resolution, text_len, vae_scale_factor, cond_tokens)


def forward_flops(ops: tuple[Op, ...], lora: Lora | None = None) -> int:
    """One sample's forward FLOPs; with `lora`, its unmerged adapter's two matmuls per adapted Linear too."""
    total = sum(op.flops for op in ops)
    if lora is not None:
        total += sum(2 * r * lora.rank * (i + o) for op in ops if lora.adapts(op) for r, i, o in [op.linear])
    return total


def backward_flops(ops: tuple[Op, ...], lora: Lora | None = None) -> int:
    """One sample's backward FLOPs as autograd runs them (module docstring): training `lora` (the base frozen), or
    every weight (lora None: full fine-tuning)."""
    trained = (lambda op: op.linear is not None or op.weighted) if lora is None else lora.adapts
    grad = defaultdict(bool)  # tensor → depends on a trained weight
    for op in ops:
        grad[op.output] = trained(op) or any(grad[t] for t in op.inputs)
    needed = {ops[-1].output}  # tensors whose gradient the backward computes: on a path from a trained weight
    for op in reversed(ops):
        if op.output in needed:
            needed.update(t for t in op.inputs if grad[t])
    total = 0
    for op in ops:
        if op.output not in needed:
            continue
        total += op.flops * sum(grad[t] for t in op.inputs)  # each operand's gradient: one matmul of the same size
        if lora is None and op.linear is not None:
            total += op.flops  # the weight's gradient
        elif lora is not None and lora.adapts(op):
            rows, fin, fout = op.linear
            r = lora.rank
            total += 4 * rows * r * fout + 2 * rows * r * fin * (1 + grad[op.inputs[0]])
    return total


def transformer_flops_breakdown(config: Mapping, resolution: int, text_len: int, batch: int = 1,
                                vae_scale_factor: int = 8, cond_tokens: int = 0) -> dict[str, int]:
    """Matmul FLOPs (2·m·n·k per matmul) of one forward of `batch` samples, by part (embed, adaln, qkv, attention,
    attn_out, mlp, dual_attention, final)."""
    out: dict[str, int] = dict.fromkeys(["embed", "adaln", "qkv", "attention", "attn_out", "mlp", "dual_attention",
                                         "final"], 0)
    for op in _cached_ops(config, resolution, text_len, vae_scale_factor, cond_tokens):
        if op.flops:
            out[op.part] += op.flops * batch
    return out


def transformer_forward_flops(config: Mapping, resolution: int, text_len: int, batch: int = 1,
                              vae_scale_factor: int = 8, cond_tokens: int = 0) -> int:
    """Matmul FLOPs of one transformer forward on `batch` samples, any family. SD3.5-Medium at 512 px with 333 text
    tokens: ≈ 2.45 TFLOP per sample; FLUX.1-dev at 512 px with 128 T5 tokens: 15.8 TFLOP."""
    return forward_flops(_cached_ops(config, resolution, text_len, vae_scale_factor, cond_tokens)) * batch


def training_factor(config: Mapping, resolution: int, text_len: int, lora: Lora | None,
                    vae_scale_factor: int = 8, cond_tokens: int = 0) -> float:
    """(forward + backward) / base forward of one training pass: ≈ 3 fully fine-tuned; with LoRA ≈ 2.1–2.3 (the
    frozen weights' input gradients, both attention operands' gradients, the adapter's own terms)."""
    ops = _cached_ops(config, resolution, text_len, vae_scale_factor, cond_tokens)
    return (forward_flops(ops, lora) + backward_flops(ops, lora)) / forward_flops(ops)


def flow_grpo_step_flops(config: Mapping, *, resolution: int, text_len: int, images: int, num_steps: int,
                         guidance_scale: float, trained_steps: int, inner_epochs: int = 1, beta: float = 0.0,
                         recompute_old_log_probs: bool = False, trained_images: int | None = None,
                         vae_scale_factor: int = 8, lora: Lora | None = None, merged_rollout: bool = False,
                         decode_flops_per_image: int = 0, cond_tokens: int = 0) -> dict[str, int]:
    """Model FLOPs of one Flow-GRPO(-Fast) step.

    rollout  = images × num_steps forwards (× 2 with CFG: guidance_scale > 1), the unmerged adapter's matmuls
               included unless `merged_rollout` (model.merge_lora: one merged weight per Linear)
    decode   = images × decode_flops_per_image (the VAE: `vae_decode_flops`)
    training = trained_images × trained_steps × inner_epochs × (forward + backward) of the policy, as
               `backward_flops` counts it for `lora` (None: full fine-tuning)
               + the reference's forward (base, no adapter) per trained point and epoch when beta > 0
               + one no-grad policy forward per trained point when recompute_old_log_probs (before the epochs)
    Training replays run CFG too when guidance_scale > 1 (the same `predict_velocity` as the rollout). Text encoders
    are not counted (their embeddings are cached).

    Args:
        trained_steps: denoising steps trained per sample (Flow-GRPO-Fast: the window size).
        trained_images: samples that were trained on (default: images; fewer when failed rewards were dropped).
        cond_tokens: an editing model's reference-image tokens per sample (0: none).
    Returns:
        {"forward_per_image", "rollout", "decode", "train", "total"}; forward_per_image is the base forward with CFG.
    """
    ops = _cached_ops(config, resolution, text_len, vae_scale_factor, cond_tokens)
    cfg_mult = 2 if guidance_scale > 1.0 else 1
    base = forward_flops(ops) * cfg_mult
    policy = forward_flops(ops, lora) * cfg_mult
    trained = images if trained_images is None else trained_images
    rollout = images * num_steps * (base if merged_rollout else policy)
    points = trained * trained_steps
    train = points * inner_epochs * (policy + backward_flops(ops, lora) * cfg_mult)
    if beta > 0:
        train += points * inner_epochs * base
    if recompute_old_log_probs:
        train += points * policy
    decode = images * decode_flops_per_image
    return {"forward_per_image": base, "rollout": rollout, "decode": decode, "train": train,
            "total": rollout + decode + train}


def vae_decode_flops(vae_or_config, family, latent_shape: tuple[int, ...]) -> int:
    """FLOPs of decoding one image's canonical latent (C, h, w) through the model family's `decode`, counted by torch's
    FlopCounterMode on a meta-device copy of the VAE (a module, whose class and config are used, or a config dict with
    `_class_name`): convolutions, the mid-block attention, the up-sampling convolutions, as they run."""
    config = dict(vae_or_config.config) if hasattr(vae_or_config, "config") else dict(vae_or_config)
    cls = type(vae_or_config).__name__ if hasattr(vae_or_config, "config") else config.get("_class_name", "")
    config.pop("_class_name", None)
    return _vae_decode_flops(cls, json.dumps(config, sort_keys=True, default=str), family.name, tuple(latent_shape))


@functools.lru_cache(maxsize=16)
def _vae_decode_flops(cls: str, config_json: str, family_name: str, latent_shape: tuple[int, ...]) -> int:
    import diffusers
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from gerl.models.family import families

    with torch.device("meta"):
        vae = getattr(diffusers, cls).from_config(json.loads(config_json)).eval()
        latents = torch.empty(1, *latent_shape)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        families()[family_name].decode(vae, latents)
    return counter.get_total_flops()
