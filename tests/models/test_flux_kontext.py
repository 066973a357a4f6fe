"""The FLUX.1-Kontext family (gerl/models/flux_kontext.py) on the tiny FLUX.1-Kontext: gerl's ODE sampling — the
conditioning image resized, VAE-encoded and packed once per (prompt, image) by the text cache, its tokens and
(1, row, column) ids appended in the velocity — equals the stock FluxKontextPipeline's `__call__` for the same
prompts, images, noise, steps and guidance (fp32, ≤ 1e-5) at 256 px (1024 packed tokens: the dynamic shift's real
512² regime); a batch whose reference images differ in size equals each image alone; the conditioning sizes are the
stock call's (worked by hand); and a directory written by FluxKontextPipeline.save_pretrained trains, its LoRA
loading back into the stock pipeline with the trained policy's output. (Ratio = 1 before the first update for every
algorithm: tests/models/test_families.py.)"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from gerl.models.family import families, family_of
from gerl.models.flux_kontext import condition_size
from gerl.models.loader import TextEmbedder
from gerl.models.tiny import TOKEN_LENGTH, build_tiny_flux_kontext, save_tiny_flux_kontext
from gerl.sampling.loop import denoise
from gerl.workers.rollout import latent_noise

KONTEXT = families()["flux_kontext"]
PROMPTS = ['make the sign say "OPEN"', "a red cat"]
SEEDS = [11, 12]
RES = 256  # the tiny VAE's 4×: 64 × 64 latents, 1024 packed tokens (mu = 0.63, as a real 512² image)


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A seeded test image: a colour gradient with noise, so that every pixel matters to the VAE."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype("uint8"))


@pytest.fixture(scope="module")
def pipe():
    p = build_tiny_flux_kontext(0)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two 96 × 64 images and one 80 × 80: sizes that model.condition_resolution=80 keeps as they are (80² at aspect
    1.5 → 98 × 65, at aspect 1 → 80 × 80, floored to the tiny pipeline's multiple of 8)."""
    d = tmp_path_factory.mktemp("kontext_images")
    paths = []
    for i, (w, h) in enumerate([(96, 64), (96, 64), (80, 80)]):
        picture(w, h, i).save(d / f"{i}.png")
        paths.append(str(d / f"{i}.png"))
    return paths


def stock_latents(pipeline, prompts, paths, seeds, steps, guidance, res=RES, noise=None):
    """FluxKontextPipeline's final latents (B, 16, h, w) for images given as they are (`_auto_resize=False`, the
    output at max_area = res², as flow_grpo calls it); `noise` (B, 16, h, w): the initial latents, in the
    pipeline's dtype, instead of the seeds' draw."""
    from diffusers import FluxKontextPipeline

    stock = FluxKontextPipeline(**{**pipeline.components, "scheduler": copy.deepcopy(pipeline.scheduler)})
    stock.set_progress_bar_config(disable=True)
    kw = {} if noise is None else {"latents": stock._pack_latents(noise, *noise.shape).to(stock.transformer.dtype)}
    out = stock(image=[Image.open(p).convert("RGB") for p in paths], prompt=prompts, height=res, width=res,
                max_area=res * res, _auto_resize=False, num_inference_steps=steps, guidance_scale=guidance,
                max_sequence_length=TOKEN_LENGTH, output_type="latent",
                generator=[torch.Generator().manual_seed(s) for s in seeds], **kw).images
    return stock._unpack_latents(out, res, res, stock.vae_scale_factor).float()


def ours(pipe, prompts, paths, seeds, steps, guidance, condition_resolution, res=RES):
    shape = KONTEXT.latent_shape(pipe, res)
    noise, _ = latent_noise(seeds, shape)
    embeds = TextEmbedder(pipe, TOKEN_LENGTH, condition_resolution=condition_resolution)(prompts, images=paths)
    return denoise(pipe.transformer, embeds, noise, KONTEXT.schedule(pipe.scheduler.config, steps, shape), [], "sde",
                   0.7, guidance, None).final_latents


def test_ode_sampling_reproduces_the_stock_kontext_pipeline(pipe, images):
    assert family_of(pipe) is KONTEXT and KONTEXT.conditioned
    ref = stock_latents(pipe, PROMPTS, images[:2], SEEDS, 3, 2.5)
    got = ours(pipe, PROMPTS, images[:2], SEEDS, 3, 2.5, condition_resolution=80)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    # the reference image reaches the velocity: another image, another result
    other = ours(pipe, PROMPTS, images[1::-1], SEEDS, 3, 2.5, condition_resolution=80)
    assert (other - got).abs().max() > 1e-3


def test_a_batch_of_reference_images_of_different_sizes_equals_each_alone(pipe, images):
    """One call per reference grid (the transformer takes one layout per call): a 96 × 64 and an 80 × 80 reference
    in one batch give what each gives alone, which is the stock call's."""
    both = ours(pipe, PROMPTS, [images[0], images[2]], SEEDS, 2, 2.5, condition_resolution=80, res=128)
    first = ours(pipe, PROMPTS[:1], images[:1], SEEDS[:1], 2, 2.5, condition_resolution=80, res=128)
    second = stock_latents(pipe, PROMPTS[1:], images[2:], SEEDS[1:], 2, 2.5, res=128)
    torch.testing.assert_close(both, torch.cat([first, second]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("size, resolution, want", [
    ((640, 480), 0, (1184, 880)),  # aspect 4/3: the preferred 1184 × 880 (1.345) is the closest
    ((480, 640), 0, (880, 1184)),
    ((500, 500), 0, (1024, 1024)),
    ((1920, 1080), 0, (1392, 752)),  # 16:9 = 1.778 → 1392 / 752 = 1.851 (1328 / 800 = 1.66 is farther)
    ((640, 480), 512, (576, 432)),  # √(512² · 4/3) = 591.2 → 591 → 576; √(512² · 3/4) = 443.4 → 443 → 432
    ((64, 64), 64, (64, 64)),
])
def test_the_conditioning_size_is_the_stock_call_s(size, resolution, want):
    """condition_resolution 0 is the stock call's `_auto_resize` (the preferred resolution of the closest aspect,
    worked by hand from PREFERRED_KONTEXT_RESOLUTIONS); N > 0 keeps the aspect at N², floored to 16."""
    assert condition_size(*size, 16, resolution) == want


def test_a_stock_saved_directory_trains_and_its_lora_loads_back_into_the_stock_pipeline(tmp_path, images):
    """FluxKontextPipeline.save_pretrained's directory trains with model.path=DIR on an edit prompt file (2 steps,
    local sync); the LoRA the run saved loads with FluxKontextPipeline.load_lora_weights and reproduces the trained
    policy; the family's default targets include flow_grpo's proj_mlp."""
    import json

    from diffusers import FluxKontextPipeline

    from gerl.trainer import Trainer, prepare
    from tests.train.helpers import small_config

    model = tmp_path / "model"
    save_tiny_flux_kontext(model, 0)
    prompts = tmp_path / "edit.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "image": i}) + "\n" for p, i in zip(PROMPTS, images[:2])))
    cfg = small_config(tmp_path / "run", f"model.path={model}", f"data.train_prompts={prompts}",
                       f"data.test_prompts={prompts}", "data.prompts_per_step=2", "model.condition_resolution=80",
                       "model.lora_targets=[]", "max_steps=2", "sampling.num_steps=4", "sampling.sde_window_range=[0,3]",
                       "sampling.guidance_scale=2.5", "train.learning_rate=0.1", "checkpoint.every=2")
    trainer = Trainer(cfg, prepare(cfg))
    trainer.fit()
    trained = trainer.engine.rollout.pipe
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    assert any(n.endswith("proj_mlp.lora_A.default.weight") for n, _ in trained.transformer.named_parameters())
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    mine = ours(trained, PROMPTS, images[:2], SEEDS, 4, 2.5, condition_resolution=80, res=64)
    fresh = FluxKontextPipeline.from_pretrained(str(model))
    base = stock_latents(fresh, PROMPTS, images[:2], SEEDS, 4, 2.5, res=64)
    fresh.load_lora_weights(str(ckpt), weight_name="pytorch_lora_weights.safetensors")
    loaded = stock_latents(fresh, PROMPTS, images[:2], SEEDS, 4, 2.5, res=64)
    assert (mine - base).abs().max() > 1e-2, "training must change the policy for this test to mean anything"
    torch.testing.assert_close(loaded, mine, rtol=0, atol=1e-5)
