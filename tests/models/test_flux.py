"""The FLUX.1 family (gerl/models/flux.py) on the tiny FLUX.1-dev and -schnell: gerl's ODE sampling and decoding are
the stock FluxPipeline's for the same prompts, noise, steps and guidance; its σ schedules are FluxPipeline's
(resolution-dependent shift worked by hand at 512² and 1024²); packing is the 2×2 patch layout; and a directory
written by FluxPipeline.save_pretrained trains with model.path=DIR, its LoRA loading back into the stock pipeline
(and peft) with the trained policy's output. (Ratio = 1 before the first update: tests/models/test_families.py.)"""

import copy
import math

import numpy as np
import pytest
import torch

from gerl.models.family import families, family_of
from gerl.models.flux import image_ids, pack, unpack
from gerl.models.loader import TextEmbedder
from gerl.models.tiny import FLUX_SCHEDULERS, RESOLUTION, TOKEN_LENGTH, build_tiny_flux, save_tiny_flux
from gerl.sampling.loop import denoise
from gerl.workers.rollout import decode, latent_noise

FLUX = families()["flux"]
PROMPTS = ["a red cat", 'a sign that says "hello 42"']
SEEDS = [11, 12]


@pytest.fixture(scope="module", params=["dev", "schnell"])
def pipe(request):
    p = build_tiny_flux(0, schnell=request.param == "schnell")
    p.set_progress_bar_config(disable=True)
    return p


def stock(pipe):
    from diffusers import FluxPipeline

    # a private scheduler: the stock call sets its timesteps and step index
    return FluxPipeline(**{**pipe.components, "scheduler": copy.deepcopy(pipe.scheduler)})


def stock_latents(pipeline, prompts, seeds, steps, guidance, res=RESOLUTION, **kw):
    """The stock call's final latents, unpacked by the stock pipeline's own helper: (B, 16, h, w)."""
    out = pipeline(prompt=prompts, num_inference_steps=steps, guidance_scale=guidance, height=res,
                   width=res, max_sequence_length=TOKEN_LENGTH, output_type="latent",
                   generator=[torch.Generator().manual_seed(s) for s in seeds], **kw).images
    return pipeline._unpack_latents(out, res, res, pipeline.vae_scale_factor).float()


def ours(pipe, prompts, seeds, steps, guidance, res=RESOLUTION):
    shape = FLUX.latent_shape(pipe, res)
    noise, _ = latent_noise(seeds, shape)
    schedule = FLUX.schedule(pipe.scheduler.config, steps, shape)
    return denoise(pipe.transformer, TextEmbedder(pipe, TOKEN_LENGTH)(prompts), noise, schedule, [], "sde", 0.7,
                   guidance, None).final_latents


@pytest.mark.parametrize("steps", [1, 4])
def test_ode_sampling_and_decoding_reproduce_the_stock_flux_pipeline(pipe, steps):
    assert family_of(pipe) is FLUX and FLUX.latent_shape(pipe, RESOLUTION) == (16, 16, 16)
    ref = stock_latents(stock(pipe), PROMPTS, SEEDS, steps, 3.5)
    got = ours(pipe, PROMPTS, SEEDS, steps, 3.5)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    if steps == 4:  # our decode = the stock unpack + VAE + post-processing
        images = stock(pipe)(prompt=PROMPTS, num_inference_steps=steps, guidance_scale=3.5, height=RESOLUTION,
                             width=RESOLUTION, max_sequence_length=TOKEN_LENGTH,
                             generator=[torch.Generator().manual_seed(s) for s in SEEDS]).images
        for a, b in zip(decode(pipe.vae, got, FLUX), images):
            assert np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int)).max() <= 1


@pytest.mark.parametrize("res, tokens", [(256, 1024), (512, 4096)])
def test_ode_sampling_at_real_token_counts_reproduces_the_stock_pipeline(pipe, res, tokens):
    """The tiny VAE downsamples 4×, so 256 px gives the 1024 packed tokens of a real 512² image (dev's mu = 0.63,
    inside the dynamic shift's line from 256 to 4096 tokens) and 512 px the 4096 of a real 1024² one (mu = 1.15, its
    end), where the 128 px parity above (64 tokens, below base_image_seq_len) extrapolates the line. The stock
    FluxPipeline and gerl agree there too. (Schnell has no shift: its 128 px parity says all there is.)"""
    if not pipe.transformer.config.guidance_embeds:
        pytest.skip("schnell's σ do not depend on the token count")
    ref = stock_latents(stock(pipe), PROMPTS[:1], SEEDS[:1], 3, 3.5, res=res)
    got = ours(pipe, PROMPTS[:1], SEEDS[:1], 3, 3.5, res=res)
    assert got.shape[1:] == FLUX.latent_shape(pipe, res) and (got.shape[2] // 2) * (got.shape[3] // 2) == tokens
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_guidance_is_dev_s_embedding_and_schnell_has_none(pipe):
    """dev's guidance scale is an input of the transformer (no negative pass): another scale, another image, as in
    the stock pipeline; schnell has no such input and both ignore the scale."""
    assert not FLUX.uses_negative(3.5)
    other = ours(pipe, PROMPTS[:1], SEEDS[:1], 2, 1.0)
    same = ours(pipe, PROMPTS[:1], SEEDS[:1], 2, 3.5)
    ref_other = stock_latents(stock(pipe), PROMPTS[:1], SEEDS[:1], 2, 1.0)
    torch.testing.assert_close(other, ref_other, rtol=0, atol=1e-5)
    if pipe.transformer.config.guidance_embeds:
        assert (other - same).abs().max() > 1e-3
    else:
        torch.testing.assert_close(other, same, rtol=0, atol=0)


@pytest.mark.parametrize("side, mu", [(512, 0.63), (1024, 1.15), (256, 0.5 + 0.65 * (256 - 256) / 3840)])
def test_dev_schedule_shifts_by_the_token_count_as_flux_pipeline(side, mu):
    """FLUX.1-dev's released scheduler config: mu = 0.5 + (1.15 − 0.5)·(tokens − 256)/(4096 − 256), tokens =
    (side/16)²; σ_i = e^mu / (e^mu + 1/s_i − 1) for s = linspace(1, 1/N, N), then 0; timesteps = 1000·σ."""
    tokens = (side // 16) ** 2
    assert mu == pytest.approx(0.5 + 0.65 * (tokens - 256) / 3840)
    n = 6
    s = FLUX.schedule(FLUX_SCHEDULERS["dev"], n, (16, side // 8, side // 8))
    lin = np.linspace(1.0, 1 / n, n)
    want = [math.exp(mu) / (math.exp(mu) + 1 / x - 1) for x in lin] + [0.0]
    np.testing.assert_allclose(s.sigmas.numpy(), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(s.timesteps.numpy(), np.array(want[:-1]) * 1000, rtol=1e-6)


def test_schnell_schedule_is_the_plain_linspace():
    s = FLUX.schedule(FLUX_SCHEDULERS["schnell"], 4, (16, 128, 128))
    np.testing.assert_allclose(s.sigmas.numpy(), [1.0, 0.75, 0.5, 0.25, 0.0], rtol=0, atol=1e-7)


def test_packing_puts_each_2x2_patch_in_one_token_row_by_row():
    x = torch.arange(2 * 2 * 4 * 6, dtype=torch.float32).reshape(2, 2, 4, 6)  # B=2, C=2, h=4, w=6
    t = pack(x)
    assert t.shape == (2, 2 * 3, 8)
    # token 4 = patch (row 1, column 1): channel 0's 2×2 values row-major, then channel 1's
    b = 1
    want = torch.cat([x[b, c, 2:4, 2:4].flatten() for c in range(2)])
    torch.testing.assert_close(t[b, 4], want, rtol=0, atol=0)
    torch.testing.assert_close(unpack(t, 4, 6), x, rtol=0, atol=0)
    ids = image_ids(4, 6, "cpu", torch.float32)
    assert ids.shape == (6, 3) and ids[4].tolist() == [0.0, 1.0, 1.0] and ids[2].tolist() == [0.0, 0.0, 2.0]


@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_a_stock_saved_directory_trains_and_its_lora_loads_back_into_the_stock_pipeline(variant, tmp_path):
    """FluxPipeline.save_pretrained's directory trains with model.path=DIR (2 steps, local sync); the LoRA the run
    saved loads with FluxPipeline.load_lora_weights and with peft, and both reproduce the trained policy."""
    from diffusers import FluxPipeline
    from peft import PeftModel

    from gerl.trainer import Trainer, prepare
    from tests.train.helpers import small_config

    model = tmp_path / "model"
    save_tiny_flux(model, 0, schnell=variant == "schnell")
    cfg = small_config(tmp_path / "run", f"model.path={model}", "max_steps=2", "sampling.num_steps=4",
                       "sampling.sde_window_range=[0,3]", "sampling.guidance_scale=3.5", "train.learning_rate=0.1",
                       "checkpoint.every=2")
    trainer = Trainer(cfg, prepare(cfg))
    trainer.fit()
    trained = trainer.engine.rollout.pipe  # the trained policy (local engine: one shared transformer)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"

    mine = ours(trained, PROMPTS, SEEDS, 4, 3.5)
    fresh = FluxPipeline.from_pretrained(str(model))
    fresh.set_progress_bar_config(disable=True)
    base = stock_latents(fresh, PROMPTS, SEEDS, 4, 3.5)
    fresh.load_lora_weights(str(ckpt), weight_name="pytorch_lora_weights.safetensors")
    loaded = stock_latents(fresh, PROMPTS, SEEDS, 4, 3.5)
    assert (mine - base).abs().max() > 1e-2, "training must change the policy for this test to mean anything"
    torch.testing.assert_close(loaded, mine, rtol=0, atol=1e-5)

    peft = PeftModel.from_pretrained(FluxPipeline.from_pretrained(str(model)).transformer, str(ckpt))
    x, _ = latent_noise(SEEDS, (16, 16, 16))
    embeds = TextEmbedder(trained, TOKEN_LENGTH)(PROMPTS)
    t = torch.tensor([700.0, 300.0])
    with torch.no_grad():
        torch.testing.assert_close(FLUX.velocity(peft, x, t, embeds, 3.5),
                                   FLUX.velocity(trained.transformer, x, t, embeds, 3.5), rtol=0, atol=1e-5)
