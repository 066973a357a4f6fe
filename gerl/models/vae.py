"""The VAE's precision and memory format for decoding (model.vae_dtype), and how far a bf16 decode is from fp32's.

Decoded images feed the reward alone: the rollout's log-probs, the ratio and the training replay are all computed on
latents, so the VAE's precision changes what the reward sees by a rounding and never the algorithm's exactness. A
bf16 decode is therefore a free speed-up wherever the device has fast bf16 convolutions; `decode_psnr` says how much
it changes the images (≈ 50 dB on uint8 images for the tiny VAEs: tests/models/test_vae.py).

fp16 is not offered: SD3's and FLUX.1's VAE decoders overflow fp16's range (their configs ask for `force_upcast`) and
decode NaN, which the rollout reports (gerl.workers.rollout.decode) — bf16 has fp32's range.
"""

from __future__ import annotations

import math

import torch

VAE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def vae_dtype_for(name: str, device: torch.device | str) -> torch.dtype:
    """model.vae_dtype on `device`: "fp32" or "bf16" as named; "auto" = bf16 on CUDA, fp32 on any other device.

    Why not bf16 on a CPU: its speed there depends on the CPU's instruction set. Measured with SD3.5-M's VAE
    decoding one 128² image on one thread of this project's CI machine (an AMD EPYC with avx512_bf16): fp32 1.59–1.74 s,
    bf16 0.92–1.16 s (0.75–0.81 s in channels_last); the same run with oneDNN held to AVX-512 without its bf16
    instructions (ONEDNN_MAX_CPU_ISA=AVX512_CORE, as a CPU without them runs it): fp32 2.2 s, bf16 6.4 s — 3× slower.
    A CPU run is also the reproducible one (the tests, the quickstart, parity with the stock pipelines), whose images
    should not change with the machine's instruction set. So auto keeps fp32 on a CPU; vae_dtype=bf16 asks for it.
    """
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return VAE_DTYPES[name]


def to_channels_last(module: torch.nn.Module) -> torch.nn.Module:
    """Every 4-D weight (Conv2d) in channels_last and every 5-D one (Conv3d: Qwen-Image's causal video VAE) in
    channels_last_3d, in place. `module.to(memory_format=channels_last)` cannot do the second: it fails on a 5-D
    tensor, and channels_last_3d fails on a 4-D one. A convolution whose weight is channels-last returns a
    channels-last output, so the activations follow without converting the input."""
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(p.dim())
            if fmt is not None:
                p.data = p.data.contiguous(memory_format=fmt)
    return module


def uses_channels_last(vae: torch.nn.Module, device: torch.device | str) -> bool:
    """Whether a bf16 VAE decodes faster with channels-last weights, as measured (benchmarks/bench_vae.py's
    variants; docs/benchmarks.md, "The VAE decode"): yes for Qwen-Image's causal 3-D VAE anywhere (H200, 512², 8
    images: 0.122–0.126 s vs 0.132–0.136 s contiguous; the CPU above: 2.57 vs 2.70 s at 128²); for a 2-D
    AutoencoderKL (SD3's, FLUX.1's) on a CPU (0.75–0.81 s vs 0.92–1.16 s with native bf16; 6.41 vs 6.42 s without),
    but not on CUDA, where cuDNN ran it 11–19 % slower (SD3.5-M's VAE: 0.124 vs 0.111 s at 512² × 8, 0.235 vs
    0.210 s × 16, with and without cudnn.benchmark; FLUX.1's at 1024² × 2: 0.213 vs 0.179 s)."""
    three_d = any(isinstance(m, torch.nn.Conv3d) for m in vae.modules())
    return three_d or torch.device(device).type == "cpu"


def prepare_vae(vae: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The VAE cast to `dtype` (fp32 or bf16) on the device it is on, in place, and in bf16 its weights channels-last
    where that was measured faster (`uses_channels_last`). fp32 stays contiguous: on the CPU above channels_last fp32
    was as often slower as faster (1.57–2.24 s vs 1.59–1.74 s), on the H200 slower for SD3.5-M's VAE (0.172 vs
    0.157 s) and faster only for Qwen-Image's (0.203 vs 0.217 s), and on a GPU fp32 is not what auto picks."""
    if dtype not in VAE_DTYPES.values():
        raise ValueError(f"the VAE decodes in fp32 or bf16, not {dtype} (fp16 overflows to NaN in its decoder)")
    vae.to(dtype)
    device = next(vae.parameters()).device
    if dtype == torch.bfloat16 and uses_channels_last(vae, device):
        to_channels_last(vae)
    return vae


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """The VAE's images (B, 3, H, W) in [-1, 1] → uint8 (B, H, W, 3) on the same device, as the rewards see them."""
    x = images.float()
    return ((x / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)


def psnr(a: torch.Tensor, b: torch.Tensor, peak: float = 255.0) -> float:
    """Peak signal-to-noise ratio of `b` against `a` (same shape) in dB: 10·log10(peak² / mean((a − b)²)); inf when
    they are equal. uint8 images use peak 255."""
    mse = float((a.double() - b.double()).pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


@torch.no_grad()
def decode_psnr(vae: torch.nn.Module, reference_vae: torch.nn.Module, latents: torch.Tensor, family) -> float:
    """PSNR (dB) of `vae`'s uint8 images against `reference_vae`'s (the same weights in fp32) for the same canonical
    latents (B, C, h, w), both through the model family's decode (its scaling and shift). ≈ 50 dB for bf16 against
    fp32 on the tiny VAEs; a decode that skips a scaling factor falls below 25."""
    return psnr(to_uint8(family.decode(reference_vae, latents)).cpu(), to_uint8(family.decode(vae, latents)).cpu())
