"""The Qwen-Image family (gerl/models/qwenimage.py) on the tiny Qwen-Image: gerl's ODE sampling and decoding are the
stock QwenImagePipeline's for the same prompts (of different lengths), noise, steps and true_cfg_scale, with and
without true CFG (within 1e-5; bit-equal for one prompt without it, asserted with torch.equal; 1.1e-6 measured with
it); its σ schedule is the pipeline's at real sizes (resolution shift and shift_terminal worked by hand, and
bit-equal to the stock scheduler's σ and timesteps); and a directory written by QwenImagePipeline.save_pretrained
trains with model.path=DIR, its LoRA (the family's
default targets) loading back into the stock pipeline and peft with the trained policy's output. (The math pieces
alone: test_qwenimage_math.py; ratio = 1 before the first update: test_families.py; the Ray schedules:
tests/engine/test_families.py. How each check went red against a broken family: docs/lab_notebook.md.)"""

import copy
import math

import numpy as np
import pytest
import torch

from gerl.errors import UserError
from gerl.models.family import families, family_of
from gerl.models.loader import TextEmbedder
from gerl.models.tiny_qwenimage import SCHEDULER_CONFIG, build_tiny_qwenimage, save_tiny_qwenimage
from gerl.sampling.loop import denoise
from gerl.workers.rollout import decode, latent_noise

QWEN = families()["qwenimage"]
RES, TOKENS = 64, 32  # the tiny recipes' resolution and text length: 8×8 latents, 16 image tokens
PROMPTS = ["a red cat", 'A sign that says "OPEN" hanging on a wooden door']  # 8 and 14 tokens: a padded batch
SEEDS = [11, 12]


@pytest.fixture(scope="module")
def pipe():
    p = build_tiny_qwenimage(0)
    p.set_progress_bar_config(disable=True)
    return p


def stock_call(pipeline, prompts, seeds, steps, cfg, **kw):
    """The stock call as verl-omni drives it: with true CFG, the negative prompt " " (its data_process/
    qwenimage_ocr.py; the pipeline has no default negative prompt and then runs no CFG at all)."""
    from diffusers import QwenImagePipeline

    # a private scheduler: the stock call sets its timesteps and step index
    pipeline = QwenImagePipeline(**{**pipeline.components, "scheduler": copy.deepcopy(pipeline.scheduler)})
    pipeline.set_progress_bar_config(disable=True)
    return pipeline(prompt=prompts, negative_prompt=" " if cfg > 1 else None, true_cfg_scale=cfg,
                    num_inference_steps=steps, height=RES, width=RES, max_sequence_length=TOKENS,
                    generator=[torch.Generator().manual_seed(s) for s in seeds], **kw).images


def stock_latents(pipeline, prompts, seeds, steps, cfg):
    """The stock call's final latents, unpacked by the pipeline's own helper: (B, 16, h, w)."""
    out = stock_call(pipeline, prompts, seeds, steps, cfg, output_type="latent")
    return pipeline._unpack_latents(out, RES, RES, pipeline.vae_scale_factor)[:, :, 0].float()


def ours(pipe, prompts, seeds, steps, cfg):
    shape = QWEN.latent_shape(pipe, RES)
    noise, _ = latent_noise(seeds, shape)
    embeds = TextEmbedder(pipe, TOKENS)(prompts, with_negative=QWEN.uses_negative(cfg))
    return denoise(pipe.transformer, embeds, noise, QWEN.schedule(pipe.scheduler.config, steps, shape), [], "sde",
                   0.7, cfg, None).final_latents


@pytest.mark.parametrize("cfg", [1.0, 4.0], ids=["no_cfg", "true_cfg"])
def test_ode_sampling_and_decoding_reproduce_the_stock_pipeline(pipe, cfg):
    assert family_of(pipe) is QWEN and QWEN.latent_shape(pipe, RES) == (16, 8, 8)
    ref = stock_latents(pipe, PROMPTS, SEEDS, 4, cfg)
    got = ours(pipe, PROMPTS, SEEDS, 4, cfg)
    assert (ref - latent_noise(SEEDS, (16, 8, 8))[0]).abs().max() > 0.5, "sampling must move the latents"
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    if cfg == 1.0:  # one pass, the stock path operation for operation: bit-equal (true CFG: |Δ| ≤ 1.1e-6 measured)
        # for one prompt: gerl encodes each prompt alone (a row must not depend on its batch-mates: the text cache
        # writes rows one by one), where the stock call encodes its prompts as one batch, which rounds differently
        one = PROMPTS[:1], SEEDS[:1], 4, cfg
        assert torch.equal(ours(pipe, *one), stock_latents(pipe, *one))
    images = stock_call(pipe, PROMPTS, SEEDS, 4, cfg)  # PIL, as the reward sees them
    for a, b in zip(decode(pipe.vae, got, QWEN), images):
        assert np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int)).max() <= 1
    if cfg > 1:  # the guidance reached the velocity: without it the image is another one
        assert (got - ours(pipe, PROMPTS, SEEDS, 4, 1.0)).abs().max() > 1e-2


@pytest.mark.parametrize("side", [512, 1024])
def test_schedule_shifts_by_the_token_count_and_ends_at_shift_terminal(pipe, side):
    """Qwen-Image's published scheduler config: mu = 0.5 + (0.9 − 0.5)·(tokens − 256)/(8192 − 256) with tokens =
    (side/16)², σ_i = e^mu / (e^mu + 1/s_i − 1) for s = linspace(1, 1/N, N), then stretched so that its last value
    is 0.02: σ ← 1 − (1 − σ)·0.98 / (1 − σ_N); then 0. Timesteps = 1000·σ."""
    tokens = (side // 16) ** 2
    mu = 0.5 + 0.4 * (tokens - 256) / 7936
    assert mu == pytest.approx({512: 0.5387, 1024: 0.6935}[side], abs=1e-4)
    shape = QWEN.latent_shape(pipe, side)
    assert shape == (16, side // 8, side // 8)
    n = 10
    s = QWEN.schedule(SCHEDULER_CONFIG, n, shape)
    lin = np.linspace(1.0, 1 / n, n)
    shifted = np.array([math.exp(mu) / (math.exp(mu) + 1 / x - 1) for x in lin])
    want = list(1 - (1 - shifted) * 0.98 / (1 - shifted[-1])) + [0.0]
    np.testing.assert_allclose(s.sigmas.numpy(), want, rtol=0, atol=1e-6)
    assert s.sigmas[-2] == pytest.approx(0.02, abs=1e-6)
    # and the stock pipeline's own σ and timesteps at this size, bit for bit (its calculate_shift, retrieve_timesteps)
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    stock = copy.deepcopy(pipe.scheduler)
    c = stock.config
    mu_stock = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    timesteps, _ = retrieve_timesteps(stock, n, "cpu", sigmas=np.linspace(1.0, 1 / n, n), mu=mu_stock)
    assert torch.equal(s.sigmas, stock.sigmas) and torch.equal(s.timesteps, timesteps)
    with pytest.raises(UserError, match="at least 2 steps"):
        QWEN.schedule(SCHEDULER_CONFIG, 1, shape)


def test_the_velocity_of_a_prompt_does_not_depend_on_its_batch(pipe):
    """A short prompt in a batch padded for a longer one (mask 0 on the padding) and alone (no padding) get the same
    velocity: the text cache pads, and the family masks the padding as the stock pipeline does."""
    shape = QWEN.latent_shape(pipe, RES)
    x, _ = latent_noise(SEEDS, shape)
    embedder = TextEmbedder(pipe, TOKENS)
    both = embedder(PROMPTS, with_negative=True)
    alone = embedder(PROMPTS[:1], with_negative=True)
    assert both.mask[0].sum() < both.mask.shape[1] and alone.mask.all()
    t = torch.tensor([800.0, 800.0])
    with torch.no_grad():
        v_both = QWEN.velocity(pipe.transformer, x, t, both, 4.0)
        v_alone = QWEN.velocity(pipe.transformer, x[:1], t[:1], alone, 4.0)
    torch.testing.assert_close(v_both[:1], v_alone, rtol=0, atol=1e-5)


def test_a_stock_saved_directory_trains_and_its_lora_loads_back_into_the_stock_pipeline(tmp_path):
    """QwenImagePipeline.save_pretrained's directory trains with model.path=DIR (2 steps, local sync, true CFG, the
    family's default LoRA targets); the LoRA the run saved loads with QwenImagePipeline.load_lora_weights and with
    peft, and both reproduce the trained policy."""
    from diffusers import QwenImagePipeline
    from peft import PeftModel

    from gerl.trainer import Trainer, prepare
    from tests.train.helpers import small_config

    model = tmp_path / "model"
    save_tiny_qwenimage(model, 0)
    cfg = small_config(tmp_path / "run", f"model.path={model}", "model.lora_targets=[]", "max_steps=2",
                       "sampling.num_steps=4", "sampling.sde_window_range=[0,3]", "sampling.guidance_scale=4.0",
                       "train.learning_rate=0.1", "checkpoint.every=2")
    trainer = Trainer(cfg, prepare(cfg))
    trainer.fit()
    trained = trainer.engine.rollout.pipe  # the trained policy (local engine: one shared transformer)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    adapted = [n.rsplit(".lora_A", 1)[0] for n, _ in trained.transformer.named_modules() if n.endswith(".lora_A")]
    blocks = len(trained.transformer.transformer_blocks)
    assert len(adapted) == 12 * blocks, "the 12 default targets in every block, nothing else"
    assert all(sum(n.endswith("." + t) for n in adapted) == blocks for t in QWEN.lora_targets)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"

    mine = ours(trained, PROMPTS, SEEDS, 4, 4.0)
    fresh = QwenImagePipeline.from_pretrained(str(model))
    fresh.set_progress_bar_config(disable=True)
    base = stock_latents(fresh, PROMPTS, SEEDS, 4, 4.0)
    fresh.load_lora_weights(str(ckpt), weight_name="pytorch_lora_weights.safetensors")
    loaded = stock_latents(fresh, PROMPTS, SEEDS, 4, 4.0)
    assert (mine - base).abs().max() > 1e-2, "training must change the policy for this test to mean anything"
    torch.testing.assert_close(loaded, mine, rtol=0, atol=1e-5)

    peft = PeftModel.from_pretrained(QwenImagePipeline.from_pretrained(str(model)).transformer, str(ckpt))
    x, _ = latent_noise(SEEDS, (16, 8, 8))
    embeds = TextEmbedder(trained, TOKENS)(PROMPTS, with_negative=True)
    t = torch.tensor([700.0, 300.0])
    with torch.no_grad():
        torch.testing.assert_close(QWEN.velocity(peft, x, t, embeds, 4.0),
                                   QWEN.velocity(trained.transformer, x, t, embeds, 4.0), rtol=0, atol=1e-5)


def test_the_default_lora_targets_adapt_every_block_of_the_real_transformer():
    """Qwen-Image's published transformer config (assets/configs/qwen-image) at 2 of its 60 blocks, on the meta
    device: the peers' 12 targets each match one layer per block — both streams' q, k, v and output projections
    (3072 → 3072) and both feed-forwards (3072 → 12288 → 3072) — and nothing else. By hand at r = 64:
    8·64·(3072 + 3072) + 4·64·(3072 + 12288) = 7,077,888 LoRA parameters per block (424,673,280 for all 60)."""
    import json
    from pathlib import Path

    from diffusers import QwenImageTransformer2DModel

    from gerl.models.loader import add_lora

    real = json.loads((Path(__file__).resolve().parents[2] / "assets/configs/qwen-image/transformer/config.json")
                      .read_text())
    with torch.device("meta"):
        tr = QwenImageTransformer2DModel.from_config({**real, "num_layers": 2})
    assert family_of(tr) is QWEN
    add_lora(tr, 64, 128, [])  # [] = the family's targets
    adapted = [n for n, m in tr.named_modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 2 * 12 and all(n.startswith("transformer_blocks.") for n in adapted)
    assert sum(p.numel() for p in tr.parameters() if p.requires_grad) == 2 * 7_077_888
