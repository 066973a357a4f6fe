"""The SD3 family (gerl/models/sd3.py) across its generations: SD3-Medium (plain MMDiT blocks), SD3.5-Medium (q/k RMS
norm, dual-attention blocks) and SD3.5-Large (q/k RMS norm, no dual-attention blocks, 38 layers) differ only in the
transformer's layout switches; gerl's ODE sampling with classifier-free guidance equals the stock pipeline's for
each, and SD3.5-Large's published transformer config (built on the meta device: no weights) is the family's, with
the default LoRA targets attaching where its blocks have them. (The tiny SD3's own parity: tests/sampling/test_loop.py.)"""

import copy
import math

import pytest
import torch

from gerl.models.family import families, family_of
from gerl.models.loader import TextEmbedder, add_lora
from gerl.models.tiny import RESOLUTION, TOKEN_LENGTH, TRANSFORMER_KWARGS
from gerl.sampling.loop import denoise
from gerl.workers.rollout import latent_noise

SD3 = families()["sd3"]
# SD3.5-Large's transformer/config.json (stabilityai/stable-diffusion-3.5-large): 38 heads × 64 = 2432 wide,
# no dual_attention_layers (SD3.5-Medium has blocks 0-12), q/k RMS norm.
SD35_LARGE = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                  num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm",
                  dual_attention_layers=())


@pytest.mark.parametrize("layout", [dict(), dict(qk_norm="rms_norm", dual_attention_layers=(0,)),
                                    dict(qk_norm="rms_norm", dual_attention_layers=())],
                         ids=["sd3-medium", "sd3.5-medium", "sd3.5-large"])
def test_each_sd3_generation_samples_as_the_stock_pipeline_with_cfg(tiny_pipe, layout):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        tr = SD3Transformer2DModel(**TRANSFORMER_KWARGS, **layout).eval()
    pipe = StableDiffusion3Pipeline(**{**tiny_pipe.components, "transformer": tr,
                                       "scheduler": copy.deepcopy(tiny_pipe.scheduler)})
    pipe.set_progress_bar_config(disable=True)
    prompts, seeds = ["a red cat", "hello 42"], [5, 6]
    ref = pipe(prompt=prompts, negative_prompt="", num_inference_steps=3, guidance_scale=3.0, height=RESOLUTION,
               width=RESOLUTION, max_sequence_length=TOKEN_LENGTH, output_type="latent",
               generator=[torch.Generator().manual_seed(s) for s in seeds]).images
    shape = SD3.latent_shape(pipe, RESOLUTION)
    noise, _ = latent_noise(seeds, shape)
    embeds = TextEmbedder(pipe, TOKEN_LENGTH)(prompts, with_negative=SD3.uses_negative(3.0))
    got = denoise(tr, embeds, noise, SD3.schedule(pipe.scheduler.config, 3, shape), [], "sde", 0.7, 3.0, None)
    torch.testing.assert_close(got.final_latents, ref.float(), rtol=0, atol=1e-5)


def test_a_scheduler_with_dynamic_shifting_is_shifted_by_the_token_count_as_the_stock_pipeline(tiny_pipe):
    """No released SD3 scheduler shifts dynamically, but StableDiffusion3Pipeline does when the config asks (mu from
    the (h/2)(w/2) tokens): the family follows it rather than ignoring the key."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=16,
                                            max_image_seq_len=256)
    pipe = StableDiffusion3Pipeline(**{**tiny_pipe.components, "scheduler": sched})
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt=["a red cat"], num_inference_steps=3, guidance_scale=1.0, height=RESOLUTION, width=RESOLUTION,
               max_sequence_length=TOKEN_LENGTH, output_type="latent",
               generator=[torch.Generator().manual_seed(5)]).images
    shape = SD3.latent_shape(pipe, RESOLUTION)
    schedule = SD3.schedule(sched.config, 3, shape)
    # 64 tokens of the 16×16 latent; max_shift is the scheduler config's own (1.15, its constructor default), not
    # the pipeline's fallback 1.16 for a config without the key
    mu = 0.5 + (1.15 - 0.5) * (64 - 16) / (256 - 16)
    s = torch.linspace(1.0, 0.001, 3, dtype=torch.float64)  # unshifted σ: timesteps 1000 → 1 evenly, / 1000
    expected = math.exp(mu) / (math.exp(mu) + 1 / s - 1)
    torch.testing.assert_close(schedule.sigmas[:-1], expected.float(), rtol=0, atol=1e-6)
    noise, _ = latent_noise([5], shape)
    got = denoise(pipe.transformer, TextEmbedder(pipe, TOKEN_LENGTH)(["a red cat"]), noise, schedule, [], "sde",
                  0.7, 1.0, None)
    torch.testing.assert_close(got.final_latents, ref.float(), rtol=0, atol=1e-5)


def test_sd35_large_is_an_sd3_transformer_without_dual_attention_and_takes_the_default_lora():
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        tr = SD3Transformer2DModel.from_config(SD35_LARGE)
    assert family_of(tr) is SD3 and len(tr.transformer_blocks) == 38
    assert not any(".attn2." in n for n, _ in tr.named_modules()), "SD3.5-Large has no dual-attention blocks"
    assert 8.0e9 < sum(p.numel() for p in tr.parameters()) < 8.2e9  # the published 8.1B
    add_lora(tr, 4, 4.0, [])  # [] = the family's targets: every attention projection of both streams
    adapted = {n.rsplit(".", 1)[0] for n, _ in tr.named_modules() if n.endswith(".lora_A")}
    # 4 image + 4 context projections per block, but the last block's context stream has no output (context_pre_only)
    assert len(adapted) == 38 * 8 - 1


def test_sd35_large_s_shipped_configs_are_the_family_s_and_plan_offline():
    """assets/configs/sd3.5-large: the transformer config is the layout above (the published values) and counts the
    model card's 8.1 B exactly as built (8,056,627,520); the hub id resolves to the shipped folder without the HF
    cache, so `gerl plan` and the SD3.5-Large recipe need no download; the other parts are SD3.5-Medium's files."""
    from gerl.config import ModelConfig, load_config
    from gerl.models import arch
    from gerl.plan.arch import architecture
    from gerl.plan.family import family_for
    from tests.train.helpers import REPO

    shipped = arch.load_config("sd3.5-large", "transformer")
    assert {k: v for k, v in shipped.items() if k != "_class_name"} == {
        k: v for k, v in SD35_LARGE.items() if k != "dual_attention_layers"}
    with torch.device("meta"):
        tr = arch.build("stabilityai/stable-diffusion-3.5-large", ["transformer"])["transformer"]
    assert sum(p.numel() for p in tr.parameters()) == 8_056_627_520 and family_of(tr) is SD3
    for part in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3", "scheduler"):
        assert arch.load_config("sd3.5-large", part) == arch.load_config("sd3.5-medium", part)
    cfg = load_config(str(REPO / "recipes" / "flow_grpo_sd35_large_ocr.yaml"))
    assert cfg.model.path == "stabilityai/stable-diffusion-3.5-large"
    assert architecture(cfg.model.path).source.startswith("sd3.5-large configs")
    assert family_for(ModelConfig(path=cfg.model.path)).components("actor") == ("transformer",)
