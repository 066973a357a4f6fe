"""model.vae_dtype: the loader's VAE dtype and layout, and a bf16 decode against the stock pipelines' fp32 decode.

The reference is each stock pipeline's own decoding written out here (StableDiffusion3Pipeline and FluxPipeline:
latents / scaling_factor + shift_factor; QwenImagePipeline: latents · latents_std + latents_mean, frame 0; then the
image processor's (x / 2 + 0.5).clamp(0, 1) · 255 rounded), run by the fp32 VAE the tiny builder makes. The decode
under test is the rollout's (gerl.workers.rollout.decode) on the VAE that `load_pipeline(vae_dtype="bf16")` gives.

Measured (seed 0, 4 images of N(0, 1) latents at 64 px): PSNR 49.4 dB (tiny SD3), 51.6 (tiny FLUX), 53.1 (tiny
Qwen-Image) — an RMS error under one uint8 level, as bf16's 8-bit mantissa gives. A decode that skips the scaling
factor falls to 23.6 / 18.4 dB. The bar, 40 dB (an RMS error of 2.5 levels), sits 9 dB under the measured values and
15 dB over the broken ones.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gerl.models.family import TINY_MODELS, families
from gerl.models.loader import load_pipeline
from gerl.models.vae import decode_psnr, psnr, vae_dtype_for

PSNR_BAR_DB = 40.0


def stock_decode(name: str, vae, latents: torch.Tensor) -> np.ndarray:
    """The stock pipeline's decode of canonical latents (B, 16, h, w) to uint8 (B, H, W, 3), in the VAE's dtype."""
    c = vae.config
    with torch.no_grad():
        if name == "tiny-qwenimage":
            mean = torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1)
            std = 1.0 / torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)
            x = vae.decode((latents.unsqueeze(2) / std + mean).to(vae.dtype), return_dict=False)[0][:, :, 0]
        else:
            x = vae.decode((latents / c.scaling_factor + c.shift_factor).to(vae.dtype), return_dict=False)[0]
    x = (x.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    return (x * 255).round().astype("uint8")


@pytest.fixture(scope="module", params=["tiny", "tiny-flux", "tiny-qwenimage"])
def vaes(request):
    """(name, family, the loader's bf16 VAE, the builder's fp32 VAE with the same weights)."""
    name = request.param
    family_name, variant = TINY_MODELS[name]
    family = families()[family_name]
    bf16 = load_pipeline(name, components=("vae",), vae_dtype="bf16").vae
    return name, family, bf16, family.build_tiny(0, variant).vae.eval()


def latents(name: str) -> torch.Tensor:
    side = 8 if name == "tiny-qwenimage" else 16  # 64 px through an 8× (Qwen-Image) or 4× (the tiny AutoencoderKL)
    return torch.randn(4, 16, side, side, generator=torch.Generator().manual_seed(1))


def test_auto_is_bf16_on_cuda_and_fp32_elsewhere():
    assert vae_dtype_for("auto", "cuda") == vae_dtype_for("auto", torch.device("cuda:1")) == torch.bfloat16
    assert vae_dtype_for("auto", "cpu") == vae_dtype_for("fp32", "cuda") == torch.float32
    assert vae_dtype_for("bf16", "cpu") == torch.bfloat16
    with pytest.raises(KeyError):
        vae_dtype_for("fp16", "cuda")


def test_channels_last_where_it_was_measured_faster():
    """bf16 goes channels-last for Qwen-Image's 3-D VAE anywhere and for a 2-D AutoencoderKL only on a CPU: cuDNN
    ran SD3.5-M's VAE 11–19 % slower channels-last on an H200 (gerl/models/vae.py)."""
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage

    from gerl.models.tiny import VAE_KWARGS
    from gerl.models.tiny_qwenimage import VAE_KWARGS as QWEN_VAE_KWARGS
    from gerl.models.vae import uses_channels_last

    kl, qwen = AutoencoderKL(**VAE_KWARGS), AutoencoderKLQwenImage(**QWEN_VAE_KWARGS)
    assert uses_channels_last(kl, "cpu") and not uses_channels_last(kl, "cuda")
    assert uses_channels_last(qwen, "cpu") and uses_channels_last(qwen, torch.device("cuda", 0))


def test_psnr_by_hand():
    a = torch.zeros(2, 4, 4, 3, dtype=torch.uint8)
    b = a.clone()
    assert psnr(a, b) == math.inf
    b[0, 0, 0, 0] = 16  # one error of 16 levels in 96 values: MSE 256 / 96
    assert psnr(a, b) == pytest.approx(10 * math.log10(255**2 / (256 / 96)))


def test_a_bf16_decode_is_within_the_psnr_bar_of_the_stock_fp32_decode(vaes):
    """The rollout's decode with the loader's bf16 VAE: it runs in bf16 (the decoder's first convolution receives
    bf16 and holds a channels-last weight) and its images are ≥ 40 dB from the stock pipeline's fp32 decode. Fails
    if the VAE is left fp32 or its decode loses a scaling factor (checked once each: 49.4 → dtype assertion;
    scaling skipped → 23.6 dB for tiny SD3)."""
    from gerl.workers.rollout import decode

    name, family, bf16, fp32 = vaes
    seen = []
    conv_in = bf16.decoder.conv_in
    hook = conv_in.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    try:
        images = decode(bf16, latents(name), family)
    finally:
        hook.remove()
    assert seen == [torch.bfloat16] and bf16.dtype == torch.bfloat16
    layout = torch.channels_last_3d if conv_in.weight.dim() == 5 else torch.channels_last
    assert conv_in.weight.is_contiguous(memory_format=layout)
    got = torch.from_numpy(np.stack([np.asarray(im) for im in images]))
    ref = torch.from_numpy(stock_decode(name, fp32, latents(name)))
    assert ref.float().std() > 10, "the reference images must vary for the PSNR to mean anything"
    db = psnr(ref, got)
    assert PSNR_BAR_DB <= db < 80, db  # < 80: the two decodes did differ (an fp32 decode matches stock exactly)
    # the library's measure, both through the family's decode, agrees with the one against the stock formula
    assert decode_psnr(bf16, fp32, latents(name), family) == pytest.approx(db)


def test_fp32_decode_equals_the_stock_pipeline(vaes):
    """vae_dtype=fp32 is the decode as it was: the stock pipeline's images exactly."""
    from gerl.workers.rollout import decode

    name, family, _, fp32 = vaes
    images = decode(fp32, latents(name), family)
    assert np.array_equal(np.stack([np.asarray(im) for im in images]), stock_decode(name, fp32, latents(name)))


def test_the_loader_gives_the_vae_its_own_dtype_and_refuses_fp16():
    from gerl.errors import UserError

    pipe = load_pipeline("tiny", dtype="bf16", vae_dtype="fp32")
    assert pipe.vae.dtype == torch.float32 and pipe.transformer.dtype == torch.bfloat16
    assert pipe.vae.decoder.conv_in.weight.is_contiguous()  # fp32 stays contiguous
    assert load_pipeline("tiny", components=("vae",)).vae.dtype == torch.float32  # auto on this CPU
    with pytest.raises(UserError, match="fp16"):
        load_pipeline("tiny", vae_dtype="fp16")
