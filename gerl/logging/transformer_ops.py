"""One sample's transformer forward per family, as a list of matmuls with their data flow (gerl/logging/flops.py
prices it: forward, LoRA, the backward as autograd runs it).

Written out per family (SD3 / SD3.5's MMDiT, FLUX.1's double- and single-stream blocks, Qwen-Image's double-stream
blocks, FLUX.2's double- and fused single-stream blocks, Z-Image's refiners and single stream) as `Op`s: every matmul
of one sample's forward — a Linear (its module's dotted name, rows × in × out) or an activation × activation product
(attention's QKᵀ and P·V) — with the tensors it reads and the one it writes; norms, modulation, residuals,
concatenations and splits are zero-FLOP `mix` ops that only carry the data flow. A matmul costs 2·m·n·k. Not
counted: norms, activations, softmax, RoPE, elementwise (< 1 %).

The editing families run their text-to-image family's transformer with the reference image's tokens after the
image's (FLUX.1-Kontext: FLUX.1's; Qwen-Image-Edit-Plus: Qwen-Image's): `cond_tokens` more rows in every image-stream
matmul and in the joint attention, the output projection included (the pipelines slice its output afterwards).
tests/logging/test_flops.py holds every family, at two shapes, to torch's FlopCounterMode on its tiny model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


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

    def timestep_mlp(self, prefix: str, leaf: str, fin: int, D: int, rows: int = 1, mid: int | None = None,
                     names: tuple[str, str] = ("linear_1", "linear_2")) -> str:
        h = self.linear(f"{prefix}.{names[0]}", "embed", leaf, rows, fin, mid or D)
        return self.linear(f"{prefix}.{names[1]}", "embed", h, rows, mid or D, D)


def _c(config: Mapping, key: str, default=None):
    v = config.get(key, default)
    if v is None:
        raise KeyError(f"transformer config has no {key!r}")
    return v


CLASSES = {"SD3Transformer2DModel": "sd3", "FluxTransformer2DModel": "flux", "QwenImageTransformer2DModel": "qwenimage",
           "Flux2Transformer2DModel": "flux2", "ZImageTransformer2DModel": "zimage"}


def family_of_config(config: Mapping) -> str:
    """"sd3", "flux", "qwenimage", "flux2" or "zimage" (the FLOPs model's builder) from a transformer config: its
    `_class_name`, else its keys (each family's own key before the ones families share)."""
    name = str(config.get("_class_name") or "")
    if name in CLASSES:
        return CLASSES[name]
    if name:  # another class, which a key below could mistake for one of these
        raise ValueError(f"no FLOPs model for a transformer config of class {name}; gerl counts "
                         f"{', '.join(CLASSES)}")
    for key, family in (("caption_projection_dim", "sd3"), ("cap_feat_dim", "zimage"),
                        ("timestep_guidance_channels", "flux2"), ("num_single_layers", "flux"),
                        ("axes_dims_rope", "qwenimage")):
        if key in config:
            return family
    raise ValueError(f"no FLOPs model for a transformer config of class unknown; gerl counts {', '.join(CLASSES)}")


def image_tokens(config: Mapping, resolution: int, vae_scale_factor: int = 8) -> int:
    """Image tokens of one sample: SD3 patches its latent by patch_size (512 px → 64² latent → 32² = 1024); the others
    pack 2 × 2 latent patches per token (the same 1024 at 512 px; FLUX.2's VAE patchifies them into 128 channels, and
    Z-Image's transformer pads the count to a multiple of 32 itself)."""
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
    parallel, and one output projection of the attention and MLP outputs together (5·D → D). N counts FLUX.1-Kontext's
    reference tokens too."""
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
    training runs no backward through it. N counts Qwen-Image-Edit-Plus's reference tokens too; with `zero_cond_t`
    (Qwen-Image-Edit-2511) the timestep MLP and the image stream's modulation also run on the reference's zero time
    (two rows per sample)."""
    D = int(_c(c, "num_attention_heads")) * int(_c(c, "attention_head_dim"))
    p, cin = int(_c(c, "patch_size")), int(_c(c, "in_channels"))
    cout = int(c.get("out_channels") or cin)
    times = 2 if c.get("zero_cond_t") else 1
    x = g.linear("img_in", "embed", "latents", N, cin, D)
    cx = g.linear("txt_in", "embed", g.affine_norm("txt_norm", "text"), L, int(_c(c, "joint_attention_dim")), D)
    temb = g.timestep_mlp("time_text_embed.timestep_embedder", "t_proj", 256, D, rows=times)
    S = N + L
    for i in range(int(_c(c, "num_layers"))):
        b = f"transformer_blocks.{i}"
        mx = g.linear(f"{b}.img_mod.1", "adaln", temb, times, D, 6 * D)
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


def _flux2(g: _Graph, c: Mapping, N: int, L: int) -> None:
    """Flux2Transformer2DModel (FLUX.2-klein): bias-free x and context embedders, a timestep MLP (klein runs no
    guidance embedding), and the modulations shared by all blocks, each once per sample — 6·D per stream for the
    double-stream blocks, 3·D for the single-stream ones; Flux2TransformerBlocks as FLUX.1's with SwiGLU feed-forwards
    (D → 2·M gated to M → D, M = mlp_ratio·D); Flux2SingleTransformerBlocks over the joined L + N tokens: one fused
    projection to Q, K, V and the SwiGLU input (D → 3·D + 2·M), attention, and one output projection of the attention
    and MLP outputs together (D + M → D); the output layers on the image tokens."""
    D = int(_c(c, "num_attention_heads")) * int(_c(c, "attention_head_dim"))
    M = int(D * float(c.get("mlp_ratio") or 3.0))
    p, cin = int(c.get("patch_size") or 1), int(_c(c, "in_channels"))
    cout = int(c.get("out_channels") or cin)
    x = g.linear("x_embedder", "embed", "latents", N, cin, D)
    cx = g.linear("context_embedder", "embed", "text", L, int(_c(c, "joint_attention_dim")), D)
    temb = g.timestep_mlp("time_guidance_embed.timestep_embedder", "t_proj", int(c.get("timestep_guidance_channels")
                                                                                 or 256), D)
    mx = g.linear("double_stream_modulation_img.linear", "adaln", temb, 1, D, 6 * D)
    mc = g.linear("double_stream_modulation_txt.linear", "adaln", temb, 1, D, 6 * D)
    ms = g.linear("single_stream_modulation.linear", "adaln", temb, 1, D, 3 * D)
    S = N + L
    for i in range(int(_c(c, "num_layers"))):
        b = f"transformer_blocks.{i}"
        xn, cn = g.mix(f"{b}.xn", x, mx), g.mix(f"{b}.cn", cx, mc)
        q, k, v = (g.mix(f"{b}.{t}", g.linear(f"{b}.attn.to_{t}", "qkv", xn, N, D, D),
                         g.linear(f"{b}.attn.add_{t}_proj", "qkv", cn, L, D, D)) for t in "qkv")
        o = g.attention(f"{b}.attn", "attention", q, k, v, S, S, D)
        x = g.mix(f"{b}.x_attn", x, g.linear(f"{b}.attn.to_out.0", "attn_out", o, N, D, D), mx)
        cx = g.mix(f"{b}.c_attn", cx, g.linear(f"{b}.attn.to_add_out", "attn_out", o, L, D, D), mc)
        h = g.linear(f"{b}.ff.linear_in", "mlp", g.mix(f"{b}.xm", x, mx), N, D, 2 * M)
        x = g.mix(f"{b}.x", x, g.linear(f"{b}.ff.linear_out", "mlp", h, N, M, D), mx)
        h = g.linear(f"{b}.ff_context.linear_in", "mlp", g.mix(f"{b}.cm", cx, mc), L, D, 2 * M)
        cx = g.mix(f"{b}.c", cx, g.linear(f"{b}.ff_context.linear_out", "mlp", h, L, M, D), mc)
    hs = g.mix("joined", cx, x)
    for i in range(int(_c(c, "num_single_layers"))):
        b = f"single_transformer_blocks.{i}"
        qkvm = g.linear(f"{b}.attn.to_qkv_mlp_proj", "qkv", g.mix(f"{b}.hn", hs, ms), S, D, 3 * D + 2 * M)
        o = g.attention(f"{b}.attn", "attention", qkvm, qkvm, qkvm, S, S, D)
        hs = g.mix(f"{b}.h", hs, g.linear(f"{b}.attn.to_out", "mlp", g.mix(f"{b}.cat", o, qkvm), S, D + M, D), ms)
    mo = g.linear("norm_out.linear", "final", temb, 1, D, 2 * D)
    g.linear("proj_out", "final", g.mix("x_out", hs, mo), N, D, p * p * cout, out="output")


SEQ_MULTI_OF = 32  # Z-Image's transformer pads the image's and the caption's tokens each to a multiple of this


def _zimage(g: _Graph, c: Mapping, N: int, L: int) -> None:
    """ZImageTransformer2DModel: the image's and the caption's tokens each padded to a multiple of 32 (Nx, Lc); a
    timestep MLP (256 → 1024 → A, A = min(D, 256)); the image embedder and `n_refiner_layers` noise-refiner blocks on
    the image tokens, the caption embedder (an RMSNorm with a weight, then a Linear) and as many context-refiner blocks
    (no modulation) on the caption's; then `n_layers` blocks over the joined Nx + Lc tokens. A block: its adaLN linear
    (A → 4·D) once per sample where it modulates, Q/K/V, attention, the output projection, a SwiGLU feed-forward
    (w1 and w3: D → H, w2: H → D, H = ⌊8·D/3⌋). The final layer's adaLN (A → D) once, its linear on all Nx + Lc
    tokens (the image's are kept afterwards)."""
    D = int(_c(c, "dim"))
    H, A = int(D / 3 * 8), min(D, 256)
    p, f = int((c.get("all_patch_size") or [2])[0]), int((c.get("all_f_patch_size") or [1])[0])
    cin = int(_c(c, "in_channels"))
    Nx, Lc = (n + (-n) % SEQ_MULTI_OF for n in (N, L))
    key = f"{p}-{f}"
    temb = g.timestep_mlp("t_embedder.mlp", "t_proj", 256, A, mid=1024, names=("0", "2"))

    def block(b: str, x: str, rows: int, modulated: bool) -> str:
        m = g.linear(f"{b}.adaLN_modulation.0", "adaln", temb, 1, A, 4 * D) if modulated else None
        mod = (m,) if m else ()
        xn = g.mix(f"{b}.xn", x, *mod)
        q, k, v = (g.linear(f"{b}.attention.to_{t}", "qkv", xn, rows, D, D) for t in "qkv")
        o = g.attention(f"{b}.attention", "attention", q, k, v, rows, rows, D)
        x = g.mix(f"{b}.x_attn", x, g.linear(f"{b}.attention.to_out.0", "attn_out", o, rows, D, D), *mod)
        xm = g.mix(f"{b}.xm", x, *mod)
        gated = g.mix(f"{b}.gated", g.linear(f"{b}.feed_forward.w1", "mlp", xm, rows, D, H),
                      g.linear(f"{b}.feed_forward.w3", "mlp", xm, rows, D, H))
        return g.mix(f"{b}.x", x, g.linear(f"{b}.feed_forward.w2", "mlp", gated, rows, H, D), *mod)

    x = g.linear(f"all_x_embedder.{key}", "embed", "latents", Nx, f * p * p * cin, D)
    for i in range(int(_c(c, "n_refiner_layers"))):
        x = block(f"noise_refiner.{i}", x, Nx, True)
    cx = g.linear("cap_embedder.1", "embed", g.affine_norm("cap_embedder.0", "text"), Lc, int(_c(c, "cap_feat_dim")), D)
    for i in range(int(_c(c, "n_refiner_layers"))):
        cx = block(f"context_refiner.{i}", cx, Lc, False)
    u = g.mix("unified", x, cx)
    for i in range(int(_c(c, "n_layers"))):
        u = block(f"layers.{i}", u, Nx + Lc, True)
    mo = g.linear(f"all_final_layer.{key}.adaLN_modulation.1", "final", temb, 1, A, D)
    g.linear(f"all_final_layer.{key}.linear", "final", g.mix("x_out", u, mo), Nx + Lc, D, p * p * f * cin,
             out="output")


_BUILDERS = {"sd3": _sd3, "flux": _flux, "qwenimage": _qwenimage, "flux2": _flux2, "zimage": _zimage}


def transformer_ops(config: Mapping, resolution: int, text_len: int, vae_scale_factor: int = 8,
                    cond_tokens: int = 0) -> tuple[Op, ...]:
    """One sample's forward of the transformer `config` (diffusers' `transformer.config` or a dict of its keys) at
    `resolution` px with `text_len` text tokens (SD3: 77 CLIP + T5's; FLUX.1: T5's; Qwen-Image: the prompt's; FLUX.2-
    klein: max_sequence_length, every prompt padded to it; Z-Image: the batch's longest prompt) and, for an editing
    model, `cond_tokens` reference-image tokens after the image's."""
    family = family_of_config(config)
    if cond_tokens and family not in ("flux", "qwenimage"):
        raise ValueError(f"a {family} transformer takes no reference image's tokens (cond_tokens={cond_tokens})")
    g = _Graph()
    _BUILDERS[family](g, config, image_tokens(config, resolution, vae_scale_factor) + cond_tokens, text_len)
    return tuple(g.ops)
