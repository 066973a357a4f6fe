"""The FLOPs model of every family against torch's FlopCounterMode on the tiny models, forward and training.

FlopCounterMode is the reference: it counts each matmul and convolution as it is dispatched (2·m·n·k), the backward
included, and the math SDPA backend runs attention as two bmm's whose backward autograd computes operand by operand —
so the counted backward is exactly what autograd runs (a frozen Linear's input gradient only; nothing through the
embedders). The tiny models are the real diffusers classes at toy size; each is counted at two shapes (resolution,
text tokens) so that a wrong token count (N, L, S = N + L) cannot hide behind one coincidence — Z-Image's padding of
both to a multiple of 32 included (8 and 13 text tokens, 16 image tokens at 32 px). The editing families carry a
reference image of another size than the generated one (a 6 × 4 token grid: `COND`). What the model leaves out
(norms, activations, softmax, RoPE) FlopCounterMode does not count either, so the two agree exactly.
"""

from __future__ import annotations

import pytest
import torch

from gerl.logging.flops import Lora, backward_flops, forward_flops, transformer_ops, vae_decode_flops
from gerl.models.family import TINY_MODELS, families
from gerl.sampling.loop import Embeds

SHAPES = [(64, 8), (32, 13)]  # (resolution px, text tokens)
COND = (12, 8)  # the editing families' reference latent grid (h, w): 6 × 4 = 24 packed tokens


@pytest.fixture(scope="module", params=["tiny", "tiny-flux", "tiny-qwenimage", "tiny-flux2-klein", "tiny-zimage",
                                        "tiny-flux-kontext", "tiny-qwenimage-edit"])
def tiny(request):
    family_name, variant = TINY_MODELS[request.param]
    family = families()[family_name]
    return family, family.build_tiny(0, variant)


def cond_tokens(family) -> int:
    return (COND[0] // 2) * (COND[1] // 2) if family.conditioned else 0


def _embeds(family, transformer, b: int, text: int, g: torch.Generator) -> Embeds:
    c = transformer.config
    width = c.cap_feat_dim if family.name == "zimage" else c.joint_attention_dim
    prompt = torch.randn(b, text, width, generator=g)
    if family.name in ("qwenimage", "qwenimage_edit", "zimage"):
        e = Embeds(prompt, None, mask=torch.ones(b, text, dtype=torch.long))
    elif family.name == "flux2":
        e = Embeds(prompt, None)
    else:
        e = Embeds(prompt, torch.randn(b, c.pooled_projection_dim, generator=g))
    if family.conditioned:  # the reference's packed tokens, as wide as the image's
        e.cond = torch.randn(b, cond_tokens(family), c.in_channels, generator=g)
        e.cond_hw = torch.tensor([list(COND)] * b)
    return e


def counted(family, pipe, transformer, resolution: int, text: int, batch: int, train: bool) -> int:
    """FlopCounterMode over the family's velocity (its packing, guidance, ids) on `batch` samples, and with `train`
    the backward of a loss on it, with the math attention backend (bmm's the counter sees operand by operand)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *family.latent_shape(pipe, resolution), generator=g)
    embeds = _embeds(family, transformer, batch, text, g)
    t = torch.full((batch,), 500.0)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.set_grad_enabled(train):
        v = family.velocity(transformer, x, t, embeds, 3.5 if transformer.config.get("guidance_embeds") else 1.0)
        if train:
            v.pow(2).mean().backward()
    return counter.get_total_flops()


def vae_factor(pipe) -> int:
    from gerl.logging.throughput import vae_scale_factor

    return vae_scale_factor(pipe.vae.config)


def ops_for(family, pipe, resolution: int, text: int):
    config = dict(pipe.transformer.config, _class_name=type(pipe.transformer).__name__)
    return transformer_ops(config, resolution, text, vae_factor(pipe), cond_tokens(family))


@pytest.mark.parametrize("resolution,text", SHAPES)
def test_forward_matches_the_flop_counter(tiny, resolution, text):
    family, pipe = tiny
    ops = ops_for(family, pipe, resolution, text)
    assert counted(family, pipe, pipe.transformer, resolution, text, 2, train=False) == 2 * forward_flops(ops)


@pytest.mark.parametrize("resolution,text", SHAPES)
def test_lora_training_matches_the_flop_counter(tiny, resolution, text):
    """A LoRA on the family's default targets: the counted forward + backward equals the model's — and is ≈ 2.1×
    the base forward here, where the old convention charged 3× (a weight gradient frozen weights never get)."""
    from gerl.models.loader import add_lora
    import copy

    family, pipe = tiny
    tr = add_lora(copy.deepcopy(pipe.transformer), 4, 8.0, [], seed=0, family=family)  # Kontext: its own targets
    lora = Lora(tuple(family.lora_targets), 4)
    ops = ops_for(family, pipe, resolution, text)
    model = forward_flops(ops, lora) + backward_flops(ops, lora)
    assert counted(family, pipe, tr, resolution, text, 2, train=True) == 2 * model
    assert 1.9 < model / forward_flops(ops) < 2.6


def test_full_fine_tuning_matches_the_flop_counter(tiny):
    import copy

    family, pipe = tiny
    tr = copy.deepcopy(pipe.transformer).requires_grad_(True)
    ops = ops_for(family, pipe, *SHAPES[0])
    model = forward_flops(ops) + backward_flops(ops)
    assert counted(family, pipe, tr, *SHAPES[0], 1, train=True) == model
    assert 2.5 < model / forward_flops(ops) <= 3.0  # < 3: no input gradient for the embedders (the tiny Qwen-Image: 2.76)


def test_the_vae_decode_counted_on_the_meta_device_is_what_runs(tiny):
    """`vae_decode_flops` counts a meta copy of the VAE (built from its config): the same count as decoding real
    latents with the real VAE, per image; at twice the side 4× the convolutions and 16× the mid-block attention.
    (The real decode runs the math attention backend: FlopCounterMode has no formula for the CPU's flash kernel,
    and would leave the mid-block attention out — 4.2 of 84.2 MFLOP per image for the tiny SD3.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    family, pipe = tiny
    latent = family.latent_shape(pipe, 64)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        family.decode(pipe.vae, torch.randn(3, *latent))
    per_image = vae_decode_flops(pipe.vae, family, latent)
    assert per_image > 0 and counter.get_total_flops() == 3 * per_image
    assert 4 <= vae_decode_flops(pipe.vae, family, family.latent_shape(pipe, 128)) / per_image < 5


def test_qwen_image_edit_2511_s_zero_cond_t_runs_its_time_twice():
    """Qwen-Image-Edit-2511's `zero_cond_t`: the timestep MLP and every block's image modulation also run on the
    reference's zero time (two rows per sample, the text modulation and the output layer's on one) — forward and LoRA
    training, as counted, on the tiny Qwen-Image-Edit-Plus's transformer with the flag on."""
    import copy

    from gerl.models.loader import add_lora

    family = families()["qwenimage_edit"]
    pipe = family.build_tiny(0, "")
    config = {k: v for k, v in pipe.transformer.config.items() if k != "_use_default_values"}  # else the default wins
    config["zero_cond_t"] = True
    tr = type(pipe.transformer).from_config(config)
    assert tr.zero_cond_t
    tr.load_state_dict(pipe.transformer.state_dict())
    ops = transformer_ops(dict(config, _class_name=type(tr).__name__), *SHAPES[1], vae_factor(pipe),
                          cond_tokens(family))
    assert counted(family, pipe, tr.eval(), *SHAPES[1], 2, train=False) == 2 * forward_flops(ops)
    lora = Lora(tuple(family.lora_targets), 4)
    tr = add_lora(copy.deepcopy(tr), 4, 8.0, [], seed=0, family=family)
    assert counted(family, pipe, tr, *SHAPES[1], 1, train=True) == forward_flops(ops, lora) + backward_flops(ops, lora)
