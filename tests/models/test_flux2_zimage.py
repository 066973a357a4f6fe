"""FLUX.2-klein (gerl/models/flux2.py) and Z-Image (gerl/models/zimage.py) on their tiny models: gerl's ODE sampling
equals the stock Flux2KleinPipeline's and ZImagePipeline's `__call__` (fp32, ≤ 1e-5) with and without guidance, at
resolutions that put the image at a real model's token count (the shift's regime); their σ schedules are the stock
ones (FLUX.2's empirical mu by hand, Z-Image-Turbo's static shift 3); and a directory written by each stock
`save_pretrained` trains, its LoRA loading back into the stock pipeline with the trained policy's output. (Ratio = 1
before the first update for every algorithm: tests/models/test_families.py.)"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from gerl.models.family import families, family_of
from gerl.models.flux2 import vae_latents
from gerl.models.loader import TextEmbedder
from gerl.sampling.loop import denoise
from gerl.workers.rollout import latent_noise

PROMPTS = ["a red cat", 'A sign that says "OPEN" hanging on a wooden door']
SEEDS, TOKENS = [11, 12], 32
KLEIN, ZIMAGE = families()["flux2"], families()["zimage"]


@pytest.fixture(scope="module")
def klein():
    from gerl.models.tiny_qwen3 import build_tiny_flux2_klein

    p = build_tiny_flux2_klein(0)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def zimage():
    from gerl.models.tiny_qwen3 import build_tiny_zimage

    p = build_tiny_zimage(0)
    p.set_progress_bar_config(disable=True)
    return p


def stock_call(pipe, prompts, seeds, steps, guidance, res, **kw):
    stock = type(pipe)(**{**pipe.components, "scheduler": copy.deepcopy(pipe.scheduler)},
                       **({"is_distilled": pipe.config.is_distilled} if hasattr(pipe.config, "is_distilled") else {}))
    stock.set_progress_bar_config(disable=True)
    return stock(prompt=list(prompts), height=res, width=res, num_inference_steps=steps, guidance_scale=guidance,  # a copy: ZImagePipeline templates the list in place
                 max_sequence_length=TOKENS, generator=[torch.Generator().manual_seed(s) for s in seeds],
                 output_type="latent", **kw).images


def ours(pipe, family, prompts, seeds, steps, guidance, res):
    shape = family.latent_shape(pipe, res)
    noise, _ = latent_noise(seeds, shape)
    embeds = TextEmbedder(pipe, TOKENS)(prompts, with_negative=family.uses_negative(guidance))
    return denoise(pipe.transformer, embeds, noise, family.schedule(pipe.scheduler.config, steps, shape), [], "sde",
                   0.7, guidance, None).final_latents


# The tiny VAEs downsample 4×: at 256 px both images have 1024 tokens (32 × 32 after the 2 × 2 patches), a real 512²
# image's count, inside the shifts' lines.
@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["distilled_no_cfg", "base_cfg"])
def test_klein_ode_sampling_reproduces_the_stock_pipeline(klein, guidance):
    """The stock call returns the VAE's latents (de-normalised, unpatchified); gerl's canonical latents are the
    normalised patchified grid the noise is drawn in: `vae_latents` maps one onto the other."""
    assert family_of(klein) is KLEIN and KLEIN.latent_shape(klein, 256) == (128, 32, 32)
    ref = stock_call(klein, PROMPTS, SEEDS, 3, guidance, 256)
    got = ours(klein, KLEIN, PROMPTS, SEEDS, 3, guidance, 256)
    with torch.no_grad():
        torch.testing.assert_close(vae_latents(klein.vae, got), ref, rtol=0, atol=1e-5)
    if guidance > 1:
        assert (got - ours(klein, KLEIN, PROMPTS, SEEDS, 3, 1.0, 256)).abs().max() > 1e-3


@pytest.mark.parametrize("stock_g", [0.0, 3.0], ids=["turbo_no_cfg", "base_cfg"])
def test_zimage_ode_sampling_reproduces_the_stock_pipeline(zimage, stock_g):
    """gerl's guidance s is the stock call's 1 + g (1: Turbo's g = 0, no second pass)."""
    assert family_of(zimage) is ZIMAGE and ZIMAGE.latent_shape(zimage, 256) == (16, 64, 64)
    ref = stock_call(zimage, PROMPTS, SEEDS, 3, stock_g, 256)
    got = ours(zimage, ZIMAGE, PROMPTS, SEEDS, 3, 1.0 + stock_g, 256)
    torch.testing.assert_close(got, ref.float(), rtol=0, atol=1e-5)
    if stock_g > 0:
        assert (got - ours(zimage, ZIMAGE, PROMPTS, SEEDS, 3, 1.0, 256)).abs().max() > 1e-3


@pytest.mark.parametrize("steps, tokens", [(4, 1024), (28, 4096)])
def test_klein_schedule_is_flux2_s_empirical_shift(steps, tokens):
    """FLUX.2's mu is a straight line in N between its lines for 10 and 200 steps (each linear in the token count):
    mu = a·N + b with m10 = 8.738e-5·L + 1.8983, m200 = 1.6927e-4·L + 0.45667, a = (m200 − m10)/190, b = m200 − 200a
    (L ≤ 4300). By hand for L = 1024, N = 4: m10 = 1.98781, m200 = 0.63000, a = −0.0071464, b = 2.05928,
    mu = 2.03070."""
    from gerl.models.tiny_qwen3 import KLEIN_SCHEDULER

    m10, m200 = 8.73809524e-05 * tokens + 1.89833333, 0.00016927 * tokens + 0.45666666
    a = (m200 - m10) / 190
    mu = a * steps + (m200 - 200 * a)
    if steps == 4:
        assert mu == pytest.approx(2.03070, abs=1e-4)
    side = int(tokens ** 0.5)
    s = KLEIN.schedule(KLEIN_SCHEDULER, steps, (128, side, side))
    lin = np.linspace(1.0, 1 / steps, steps)
    want = [math.exp(mu) / (math.exp(mu) + 1 / x - 1) for x in lin] + [0.0]
    np.testing.assert_allclose(s.sigmas.numpy(), want, rtol=0, atol=1e-6)


def test_zimage_turbo_schedule_is_the_static_shift_of_3():
    """Z-Image-Turbo's scheduler: no dynamic shifting, shift 3: σ = 3s / (1 + 2s) for s = linspace(1, 1/N, N)."""
    from gerl.models.tiny_qwen3 import ZIMAGE_SCHEDULER

    s = ZIMAGE.schedule(ZIMAGE_SCHEDULER, 8, (16, 128, 128))
    lin = np.linspace(1.0, 1 / 8, 8)
    np.testing.assert_allclose(s.sigmas.numpy(), list(3 * lin / (1 + 2 * lin)) + [0.0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["flux2", "zimage"])
def test_a_stock_saved_directory_trains_and_its_lora_loads_back_into_the_stock_pipeline(name, tmp_path):
    """The stock pipeline's save_pretrained directory trains with model.path=DIR (2 steps, local sync, with guidance);
    the LoRA the run saved (the family's default targets, Flow-Factory's) loads with the stock pipeline's
    load_lora_weights and reproduces the trained policy."""
    from gerl.models.tiny_qwen3 import save_tiny_flux2_klein, save_tiny_zimage
    from gerl.trainer import Trainer, prepare
    from tests.train.helpers import small_config

    model = tmp_path / "model"
    (save_tiny_flux2_klein if name == "flux2" else save_tiny_zimage)(model, 0)
    guidance = 4.0
    cfg = small_config(tmp_path / "run", f"model.path={model}", "model.lora_targets=[]", "max_steps=2",
                       "sampling.num_steps=4", "sampling.sde_window_range=[0,3]", f"sampling.guidance_scale={guidance}",
                       "train.learning_rate=0.1", "checkpoint.every=2")
    trainer = Trainer(cfg, prepare(cfg))
    trainer.fit()
    trained = trainer.engine.rollout.pipe
    family = family_of(trained)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    mine = ours(trained, family, PROMPTS, SEEDS, 4, guidance, 64)
    fresh = family.pipeline_cls().from_pretrained(str(model))
    stock_g = guidance if name == "flux2" else guidance - 1
    base = stock_call(fresh, PROMPTS, SEEDS, 4, stock_g, 64)
    fresh.load_lora_weights(str(ckpt), weight_name="pytorch_lora_weights.safetensors")
    loaded = stock_call(fresh, PROMPTS, SEEDS, 4, stock_g, 64)
    if name == "flux2":
        with torch.no_grad():
            mine = vae_latents(trained.vae, mine)
    assert (mine - base.float()).abs().max() > 1e-2, "training must change the policy for this test to mean anything"
    torch.testing.assert_close(loaded.float(), mine, rtol=0, atol=1e-5)


def test_z_image_turbo_s_shipped_configs_count_its_published_sizes_and_plan_offline():
    """assets/configs/z-image-turbo: the transformer (diffusers' class defaults, Z-Image's) counts the model card's
    6 B, the text encoder Qwen3-4B's 4.0 B; the hub id names the family offline (its model_index.json), and its scheduler
    is the tiny model's (Turbo's static shift 3)."""
    from gerl.config import ModelConfig
    from gerl.models import arch
    from gerl.models.family import family_for_path
    from gerl.models.tiny_qwen3 import ZIMAGE_SCHEDULER
    from gerl.plan.family import family_for
    from gerl.plan.qwen3 import ZImagePlan

    with torch.device("meta"):
        built = arch.build("Tongyi-MAI/Z-Image-Turbo", ["transformer", "text_encoder"])
    assert arch.param_counts(built) == {"transformer": 6_154_908_736, "text_encoder": 4_022_468_096}
    assert family_for_path("Tongyi-MAI/Z-Image-Turbo") is ZIMAGE
    assert type(family_for(ModelConfig(path="Tongyi-MAI/Z-Image-Turbo"))) is ZImagePlan
    sched = arch.load_config("z-image-turbo", "scheduler")
    assert {k: sched[k] for k in ZIMAGE_SCHEDULER} == ZIMAGE_SCHEDULER


def test_flux2_klein_base_4b_s_shipped_configs_count_its_published_sizes_and_plan_offline():
    """assets/configs/flux.2-klein-base-4b: built on the meta device, each component has the size the Hub's file
    listing gives in bf16 (transformer 7.75 GB: the card's "4B", text encoder 8.05 GB: Qwen3-4B, VAE 168 MB;
    README names the sources), exactly as counted there; the layout is the one the family and the plan read (text
    width 3 × Qwen3-4B's, deepest hidden state read 27 ≤ 36 layers, RoPE axes = the head width); the hub id names
    the family offline, the recipe plans from the folder, and the scheduler has the tiny klein's keys."""
    from gerl.config import ModelConfig, load_config
    from gerl.models import arch
    from gerl.models.family import family_for_path
    from gerl.models.flux2 import TEXT_LAYERS, position_ids
    from gerl.models.tiny_qwen3 import KLEIN_SCHEDULER
    from gerl.plan.arch import architecture
    from gerl.plan.family import family_for
    from gerl.plan.qwen3 import Flux2KleinPlan
    from tests.train.helpers import REPO

    hub = "black-forest-labs/FLUX.2-klein-base-4B"
    with torch.device("meta"):
        built = arch.build(hub)
    counts = arch.param_counts(built)
    assert counts == {"transformer": 3_875_544_576, "vae": 84_046_115, "text_encoder": 4_022_468_096}
    # bytes as the listing rounds them: to 10 MB (the text encoder's, a sum of rounded shards, 8.045 → 8.05), 1 MB
    published_bf16 = {"transformer": (7.75e9, 0.01e9), "text_encoder": (8.05e9, 0.01e9), "vae": (0.168e9, 0.001e9)}
    for c, (size, tol) in published_bf16.items():
        assert 2 * counts[c] == pytest.approx(size, abs=tol), c
    tf, te = arch.load_config(hub, "transformer"), arch.load_config(hub, "text_encoder")
    assert tf["joint_attention_dim"] == len(TEXT_LAYERS) * te["hidden_size"]
    assert max(TEXT_LAYERS) <= te["num_hidden_layers"]
    assert sum(tf["axes_dims_rope"]) == tf["attention_head_dim"]
    assert len(tf["axes_dims_rope"]) == position_ids(1, 1, "cpu").shape[1]  # (0, row, column, 0): four axes
    assert tf["in_channels"] == 4 * arch.load_config(hub, "vae")["latent_channels"]  # 2 × 2 patches
    assert built["text_encoder"].lm_head.weight is built["text_encoder"].model.embed_tokens.weight  # tied
    assert family_for_path(hub) is KLEIN
    assert type(family_for(ModelConfig(path=hub))) is Flux2KleinPlan
    sched = arch.load_config(hub, "scheduler")
    assert {k: sched[k] for k in KLEIN_SCHEDULER} == KLEIN_SCHEDULER
    cfg = load_config(str(REPO / "recipes" / "flow_grpo_flux2_klein_ocr.yaml"))
    assert cfg.model.path == hub
    assert architecture(hub).source.startswith("flux.2-klein-base-4b configs")
