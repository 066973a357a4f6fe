"""FLOPs of a step, for MFU: each family's transformer as a list of matmuls with their data flow, and the VAE decode.

A transformer forward is written out per family (SD3 / SD3.5's MMDiT, FLUX.1's double- and single-stream blocks,
Qwen-Image's double-stream blocks) as `Op`s: every matmul of one sample's forward — a Linear (its module's dotted
name, rows × in × out) or an activation × activation product (attention's QKᵀ and P·V) — with the tensors it reads
and the one it writes; norms, modulation, residuals, concatenations and splits are zero-FLOP `mix` ops that only carry
the data flow. A matmul costs 2·m·n·k. Not counted: norms, activations, softmax, RoPE, elementwise (< 1 %).

From that list (tests/logging/test_flops.py holds each against torch's FlopCounterMode on the tiny models):
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

CLIP_TOKENS = 77  # SD3 pads the CLIP-L/G hidden states to 77 tokens before concatenating T5's


def text_seq_len(max_sequence_length: int, clip_tokens: int = CLIP_TOKENS) -> int:
    """Joint-attention text tokens of SD3: CLIP (77, padded) + T5 (max_sequence_length, e.g. 256) = 333."""
    return clip_tokens + max_sequence_length


@dataclass(frozen=True)
class Op:
    """One matmul of a sample's forward (or, with flops 0, a mix of tensors that only carries the data flow)."""

    name: str  # a Linear's module path ("transformer_blocks.3.attn.to_q"); a label for the others
    part: str  # the breakdown group ("qkv", "attention", "mlp", ...)
    flops: int  # forward FLOPs for one sample
    inputs: tuple[str, ...]  # activation tensors read (weights are not listed)
    output: str
    linear: tuple[int, int, int] | None = None  # (rows, in, out) of a Linear (or a patch convolution); None otherwise
    weighted: bool = False  # a zero-FLOP op with a weight of its own (an affine norm): trained when fully fine-tuned


@dataclass(frozen=True)
class Lora:
    """A LoRA adapter as peft attaches it: target module names (peft matches a module whose dotted name is a target
    or ends with "." + target) and the rank."""

    targets: tuple[str, ...]
    rank: int

    def adapts(self, op: Op) -> bool:
        return op.linear is not None and any(op.name == t or op.name.endswith("." + t) for t in self.targets)


class _Graph:
    """Builds one sample's op list; `x` names are the activation tensors."""

    def __init__(self):
        self.ops: list[Op] = []

    def linear(self, name: str, part: str, x: str, rows: int, fin: int, fout: int, out: str | None = None) -> str:
        out = out or name
        self.ops.append(Op(name, part, 2 * rows * fin * fout, (x,), out, (rows, fin, fout)))
        return out

    def matmul(self, name: str, part: str, a: str, b: str, flops: int) -> str:
        self.ops.append(Op(name, part, flops, (a, b), name))
        return name

    def mix(self, out: str, *inputs: str) -> str:
        self.ops.append(Op(out, "mix", 0, tuple(inputs), out))
        return out

    def affine_norm(self, out: str, x: str) -> str:
        """A norm with a weight of its own, where it matters: fully fine-tuned, what follows it needs gradients."""
        self.ops.append(Op(out, "mix", 0, (x,), out, weighted=True))
        return out

    def attention(self, prefix: str, part: str, q: str, k: str, v: str, sq: int, sk: int, width: int) -> str:
        """QKᵀ and P·V over all heads (heads × head_dim = width): 2·2·sq·sk·width."""
        p = self.matmul(f"{prefix}.scores", part, q, k, 2 * sq * sk * width)
        return self.matmul(f"{prefix}.values", part, p, v, 2 * sq * sk * width)

    def timestep_mlp(self, prefix: str, leaf: str, fin: int, D: int) -> str:
        h = self.linear(f"{prefix}.linear_1", "embed", leaf, 1, fin, D)
        return self.linear(f"{prefix}.linear_2", "embed", h, 1, D, D)


def _c(config: Mapping, key: str, default=None):
    v = config.get(key, default)
    if v is None:
        raise KeyError(f"transformer config has no {key!r}")
    return v


def family_of_config(config: Mapping) -> str:
    """"sd3", "flux" or "qwenimage" from a transformer config (its `_class_name`, else its keys)."""
    name = str(config.get("_class_name") or "")
    for family, cls in (("sd3", "SD3Transformer2DModel"), ("flux", "FluxTransformer2DModel"),
                        ("qwenimage", "QwenImageTransformer2DModel")):
        if name == cls:
            return family
    if name:  # another class (FLUX.2-klein's, Z-Image's) that a key below would mistake for one of these
        raise ValueError(f"no FLOPs model for a transformer config of class {name}; gerl counts SD3, FLUX.1 and "
                         "Qwen-Image")
    if "caption_projection_dim" in config:
        return "sd3"
    if "num_single_layers" in config:
        return "flux"
    if "axes_dims_rope" in config:
        return "qwenimage"
    raise ValueError(f"no FLOPs model for a transformer config of class {name or 'unknown'}; gerl counts SD3, "
                     "FLUX.1 and Qwen-Image")


def image_tokens(config: Mapping, resolution: int, vae_scale_factor: int = 8) -> int:
    """Image tokens of one sample: SD3 patches its latent by patch_size (512 px → 64² latent → 32² = 1024); FLUX.1 and
    Qwen-Image pack 2 × 2 latent patches per token (the same 1024 at 512 px)."""
    patch = int(_c(config, "patch_size")) if family_of_config(config) == "sd3" else 2
    side = resolution // vae_scale_factor // patch
    return side * side


def _sd3(g: _Graph, c: Mapping, N: int, L: int) -> None:
    """SD3Transformer2DModel: patch embedding, context embedder, timestep + pooled-text MLPs; per JointTransformerBlock
    adaLN-Zero linears on the timestep embedding (9·D with SD3.5's dual attention), Q/K/V of both streams, joint
    attention over N + L, output projections, 4·D MLPs; SD3.5's image-only second attention; the last block is
    `context_pre_only` (its context adaLN is 2·D, no context output projection or MLP)."""
    D = int(_c(c, "num_attention_heads")) * int(_c(c, "attention_head_dim"))
    p, cin = int(_c(c, "patch_size")), int(_c(c, "in_channels"))
    cout = int(c.get("out_channels") or cin)
    layers, dual = int(_c(c, "num_layers")), set(c.get("dual_attention_layers") or ())
    x = g.linear("pos_embed.proj", "embed", "latents", N, cin * p * p, D)  # a stride-p convolution
    cx = g.linear("context_embedder", "embed", "text", L, int(_c(c, "joint_attention_dim")), D)
    temb = g.mix("temb", g.timestep_mlp("time_text_embed.timestep_embedder", "t_proj", 256, D),
                 g.timestep_mlp("time_text_embed.text_embedder", "pooled", int(_c(c, "pooled_projection_dim")), D))
    S = N + L
    for i in range(layers):
        b, last = f"transformer_blocks.{i}", i == layers - 1
        mx = g.linear(f"{b}.norm1.linear", "adaln", temb, 1, D, (9 if i in dual else 6) * D)
        mc = g.linear(f"{b}.norm1_context.linear", "adaln", temb, 1, D, (2 if last else 6) * D)
        xn, cn = g.mix(f"{b}.xn", x, mx), g.mix(f"{b}.cn", cx, mc)
        q, k, v = (g.mix(f"{b}.{t}", g.linear(f"{b}.attn.to_{t}", "qkv", xn, N, D, D),
                         g.linear(f"{b}.attn.add_{t}_proj", "qkv", cn, L, D, D)) for t in "qkv")
        o = g.attention(f"{b}.attn", "attention", q, k, v, S, S, D)
        ox = g.linear(f"{b}.attn.to_out.0", "attn_out", o, N, D, D)
        x = g.mix(f"{b}.x_attn", x, ox, mx)
        if i in dual:
            q2, k2, v2 = (g.linear(f"{b}.attn2.to_{t}", "dual_attention", xn, N, D, D) for t in "qkv")
            o2 = g.attention(f"{b}.attn2", "dual_attention", q2, k2, v2, N, N, D)
            x = g.mix(f"{b}.x_attn2", x, g.linear(f"{b}.attn2.to_out.0", "dual_attention", o2, N, D, D))
        h = g.linear(f"{b}.ff.net.0.proj", "mlp", g.mix(f"{b}.xm", x, mx), N, D, 4 * D)
        x = g.mix(f"{b}.x", x, g.linear(f"{b}.ff.net.2", "mlp", h, N, 4 * D, D), mx)
        if not last:
            cx = g.mix(f"{b}.c_attn", cx, g.linear(f"{b}.attn.to_add_out", "attn_out", o, L, D, D), mc)
            h = g.linear(f"{b}.ff_context.net.0.proj", "mlp", g.mix(f"{b}.cm", cx, mc), L, D, 4 * D)
            cx = g.mix(f"{b}.c", cx, g.linear(f"{b}.ff_context.net.2", "mlp", h, L, 4 * D, D), mc)
    mo = g.linear("norm_out.linear", "final", temb, 1, D, 2 * D)
    g.linear("proj_out", "final", g.mix("x_out", x, mo), N, D, p * p * cout, out="output")


def _flux(g: _Graph, c: Mapping, N: int, L: int) -> None:
    """FluxTransformer2DModel: x and context embedders, timestep (+ guidance) + pooled-text MLPs; FluxTransformerBlocks
    as SD3's (6·D adaLN per stream, joint attention over N + L, both streams' output projections and 4·D MLPs);
    FluxSingleTransformerBlocks over the joined N + L tokens: a 3·D adaLN, Q/K/V, attention, a 4·D MLP input in
    parallel, and one output projection of the attention and MLP outputs together (5·D → D)."""
    D = int(_c(c, "num_attention_heads")) * int(_c(c, "attention_head_dim"))
    p, cin = int(c.get("patch_size") or 1), int(_c(c, "in_channels"))
    cout = int(c.get("out_channels") or cin)
    x = g.linear("x_embedder", "embed", "latents", N, cin, D)
    cx = g.linear("context_embedder", "embed", "text", L, int(_c(c, "joint_attention_dim")), D)
    parts = [g.timestep_mlp("time_text_embed.timestep_embedder", "t_proj", 256, D)]
    if c.get("guidance_embeds"):
        parts.append(g.timestep_mlp("time_text_embed.guidance_embedder", "g_proj", 256, D))
    parts.append(g.timestep_mlp("time_text_embed.text_embedder", "pooled", int(_c(c, "pooled_projection_dim")), D))
    temb = g.mix("temb", *parts)
    S = N + L
    for i in range(int(_c(c, "num_layers"))):
        b = f"transformer_blocks.{i}"
        mx = g.linear(f"{b}.norm1.linear", "adaln", temb, 1, D, 6 * D)
        mc = g.linear(f"{b}.norm1_context.linear", "adaln", temb, 1, D, 6 * D)
        xn, cn = g.mix(f"{b}.xn", x, mx), g.mix(f"{b}.cn", cx, mc)
        q, k, v = (g.mix(f"{b}.{t}", g.linear(f"{b}.attn.to_{t}", "qkv", xn, N, D, D),
                         g.linear(f"{b}.attn.add_{t}_proj", "qkv", cn, L, D, D)) for t in "qkv")
        o = g.attention(f"{b}.attn", "attention", q, k, v, S, S, D)
        x = g.mix(f"{b}.x_attn", x, g.linear(f"{b}.attn.to_out.0", "attn_out", o, N, D, D), mx)
        cx = g.mix(f"{b}.c_attn", cx, g.linear(f"{b}.attn.to_add_out", "attn_out", o, L, D, D), mc)
        h = g.linear(f"{b}.ff.net.0.proj", "mlp", g.mix(f"{b}.xm", x, mx), N, D, 4 * D)
        x = g.mix(f"{b}.x", x, g.linear(f"{b}.ff.net.2", "mlp", h, N, 4 * D, D), mx)
        h = g.linear(f"{b}.ff_context.net.0.proj", "mlp", g.mix(f"{b}.cm", cx, mc), L, D, 4 * D)
        cx = g.mix(f"{b}.c", cx, g.linear(f"{b}.ff_context.net.2", "mlp", h, L, 4 * D, D), mc)
    hs = g.mix("joined", cx, x)
    for i in range(int(_c(c, "num_single_layers"))):
        b = f"single_transformer_blocks.{i}"
        m = g.linear(f"{b}.norm.linear", "adaln", temb, 1, D, 3 * D)
        hn = g.mix(f"{b}.hn", hs, m)
        mlp = g.linear(f"{b}.proj_mlp", "mlp", hn, S, D, 4 * D)
        q, k, v = (g.linear(f"{b}.attn.to_{t}", "qkv", hn, S, D, D) for t in "qkv")
        o = g.attention(f"{b}.attn", "attention", q, k, v, S, S, D)
        hs = g.mix(f"{b}.h", hs, g.linear(f"{b}.proj_out", "mlp", g.mix(f"{b}.cat", o, mlp), S, 5 * D, D), m)
    mo = g.linear("norm_out.linear", "final", temb, 1, D, 2 * D)
    g.linear("proj_out", "final", g.mix("x_out", hs, mo), N, D, p * p * cout, out="output")


def _qwenimage(g: _Graph, c: Mapping, N: int, L: int) -> None:
    """QwenImageTransformer2DModel: image and text input projections (the text from Qwen2.5-VL's 3584 wide states,
    after an RMSNorm with a weight, which full fine-tuning trains: the text projection then needs its input gradient),
    a timestep MLP; per block both streams' 6·D modulation linears, Q/K/V, joint attention over L + N, output
    projections and 4·D MLPs. Its last block's text stream reaches nothing (the output is the image stream), so
    training runs no backward through it."""
    D = int(_c(c, "num_attention_heads")) * int(_c(c, "attention_head_dim"))
    p, cin = int(_c(c, "patch_size")), int(_c(c, "in_channels"))
    cout = int(c.get("out_channels") or cin)
    x = g.linear("img_in", "embed", "latents", N, cin, D)
    cx = g.linear("txt_in", "embed", g.affine_norm("txt_norm", "text"), L, int(_c(c, "joint_attention_dim")), D)
    temb = g.timestep_mlp("time_text_embed.timestep_embedder", "t_proj", 256, D)
    S = N + L
    for i in range(int(_c(c, "num_layers"))):
        b = f"transformer_blocks.{i}"
        mx = g.linear(f"{b}.img_mod.1", "adaln", temb, 1, D, 6 * D)
        mc = g.linear(f"{b}.txt_mod.1", "adaln", temb, 1, D, 6 * D)
        xn, cn = g.mix(f"{b}.xn", x, mx), g.mix(f"{b}.cn", cx, mc)
        q, k, v = (g.mix(f"{b}.{t}", g.linear(f"{b}.attn.to_{t}", "qkv", xn, N, D, D),
                         g.linear(f"{b}.attn.add_{t}_proj", "qkv", cn, L, D, D)) for t in "qkv")
        o = g.attention(f"{b}.attn", "attention", q, k, v, S, S, D)
        x = g.mix(f"{b}.x_attn", x, g.linear(f"{b}.attn.to_out.0", "attn_out", o, N, D, D), mx)
        cx = g.mix(f"{b}.c_attn", cx, g.linear(f"{b}.attn.to_add_out", "attn_out", o, L, D, D), mc)
        h = g.linear(f"{b}.img_mlp.net.0.proj", "mlp", g.mix(f"{b}.xm", x, mx), N, D, 4 * D)
        x = g.mix(f"{b}.x", x, g.linear(f"{b}.img_mlp.net.2", "mlp", h, N, 4 * D, D), mx)
        h = g.linear(f"{b}.txt_mlp.net.0.proj", "mlp", g.mix(f"{b}.cm", cx, mc), L, D, 4 * D)
        cx = g.mix(f"{b}.c", cx, g.linear(f"{b}.txt_mlp.net.2", "mlp", h, L, 4 * D, D), mc)
    mo = g.linear("norm_out.linear", "final", temb, 1, D, 2 * D)
    g.linear("proj_out", "final", g.mix("x_out", x, mo), N, D, p * p * cout, out="output")


_BUILDERS = {"sd3": _sd3, "flux": _flux, "qwenimage": _qwenimage}


def transformer_ops(config: Mapping, resolution: int, text_len: int, vae_scale_factor: int = 8) -> tuple[Op, ...]:
    """One sample's forward of the transformer `config` (diffusers' `transformer.config` or a dict of its keys) at
    `resolution` px with `text_len` text tokens (SD3: 77 CLIP + T5's; FLUX.1: T5's; Qwen-Image: the prompt's)."""
    g = _Graph()
    _BUILDERS[family_of_config(config)](g, config, image_tokens(config, resolution, vae_scale_factor), text_len)
    return tuple(g.ops)


def _cached_ops(config: Mapping, resolution: int, text_len: int, vae_scale_factor: int) -> tuple[Op, ...]:
    return _ops_by_key(json.dumps(dict(config), sort_keys=True, default=str), resolution, text_len, vae_scale_factor)


@functools.lru_cache(maxsize=64)
def _ops_by_key(config_json: str, resolution: int, text_len: int, vae_scale_factor: int) -> tuple[Op, ...]:
    return transformer_ops(json.loads(config_json), resolution, text_len, vae_scale_factor)


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
                                vae_scale_factor: int = 8) -> dict[str, int]:
    """Matmul FLOPs (2·m·n·k per matmul) of one forward of `batch` samples, by part (embed, adaln, qkv, attention,
    attn_out, mlp, dual_attention, final)."""
    out: dict[str, int] = dict.fromkeys(["embed", "adaln", "qkv", "attention", "attn_out", "mlp", "dual_attention",
                                         "final"], 0)
    for op in _cached_ops(config, resolution, text_len, vae_scale_factor):
        if op.flops:
            out[op.part] += op.flops * batch
    return out


def transformer_forward_flops(config: Mapping, resolution: int, text_len: int, batch: int = 1,
                              vae_scale_factor: int = 8) -> int:
    """Matmul FLOPs of one transformer forward on `batch` samples, any family. SD3.5-Medium at 512 px with 333 text
    tokens: ≈ 2.45 TFLOP per sample; FLUX.1-dev at 512 px with 128 T5 tokens: 15.8 TFLOP."""
    return forward_flops(_cached_ops(config, resolution, text_len, vae_scale_factor)) * batch


def training_factor(config: Mapping, resolution: int, text_len: int, lora: Lora | None,
                    vae_scale_factor: int = 8) -> float:
    """(forward + backward) / base forward of one training pass: ≈ 3 fully fine-tuned; with LoRA ≈ 2.1–2.3 (the
    frozen weights' input gradients, both attention operands' gradients, the adapter's own terms)."""
    ops = _cached_ops(config, resolution, text_len, vae_scale_factor)
    return (forward_flops(ops, lora) + backward_flops(ops, lora)) / forward_flops(ops)


def flow_grpo_step_flops(config: Mapping, *, resolution: int, text_len: int, images: int, num_steps: int,
                         guidance_scale: float, trained_steps: int, inner_epochs: int = 1, beta: float = 0.0,
                         recompute_old_log_probs: bool = False, trained_images: int | None = None,
                         vae_scale_factor: int = 8, lora: Lora | None = None, merged_rollout: bool = False,
                         decode_flops_per_image: int = 0) -> dict[str, int]:
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
    Returns:
        {"forward_per_image", "rollout", "decode", "train", "total"}; forward_per_image is the base forward with CFG.
    """
    ops = _cached_ops(config, resolution, text_len, vae_scale_factor)
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
