"""The Qwen-Image-Edit-Plus family (gerl/models/qwenimage_edit.py) on the tiny Qwen-Image-Edit-Plus: gerl's ODE
sampling — the prompt encoded with its image by Qwen2.5-VL's vision tower (the placeholder expanded and the pixel
values made by gerl, from the image processor alone), the reference image VAE-encoded and packed, both cached per
(prompt, image) — equals the stock QwenImageEditPlusPipeline's `__call__` (fp32, ≤ 1e-5) with and without true CFG, at
512 px (1024 packed tokens: the real 512² shift), one prompt at a time as the stock call takes them while gerl
batches prompts of different lengths and references of different sizes; and a directory written by
QwenImageEditPlusPipeline.save_pretrained trains, its LoRA loading back into the stock pipeline with the trained
policy's output. The stock call runs with a Qwen2VLProcessor built around its image processor (transformers insists
on a video processor, which needs torchvision) and, where the test asks for a smaller reference than its 1024²
default, with its module's VAE_IMAGE_SIZE set to that area (`model.condition_resolution`)."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from gerl.models.family import families, family_of
from gerl.models.loader import TextEmbedder
from gerl.models.tiny_qwenimage import build_tiny_qwenimage_edit_plus, save_tiny_qwenimage_edit_plus
from gerl.sampling.loop import denoise
from gerl.workers.rollout import latent_noise
from tests.models.test_flux_kontext import picture

EDIT = families()["qwenimage_edit"]
PROMPTS = ['make the sign say "OPEN"', "a red cat"]  # different lengths: a padded, masked batch in gerl
SEEDS = [11, 12]
RES, TOKENS, COND = 512, 64, 128  # 64 × 64 latents (1024 packed tokens); references at an area of 128²


def processor(tokenizer):
    """A Qwen2VLProcessor around Qwen2.5-VL's image processor, without the video processor it insists on."""
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    real = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, arg):
        return None if name == "video_processor" and arg is None else real(self, name, arg)

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", check):
        return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def pipe():
    p = build_tiny_qwenimage_edit_plus(0)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("edit_images")
    paths = []
    for i, (w, h) in enumerate([(160, 96), (160, 96), (96, 160)]):
        picture(w, h, 10 + i).save(d / f"{i}.png")
        paths.append(str(d / f"{i}.png"))
    return paths


def stock_latents(pipeline, prompts, paths, seeds, steps, cfg, res=RES, cond=COND, noise=None):
    """The stock call's final latents (B, 16, h, w), one prompt per call (its only batch size); `noise`
    (B, 16, h, w): the initial latents, in the pipeline's dtype, instead of the seeds' draw."""
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module
    from PIL import Image

    stock = QwenImageEditPlusPipeline(**{**pipeline.components, "processor": processor(pipeline.tokenizer),
                                         "scheduler": copy.deepcopy(pipeline.scheduler)})
    stock.set_progress_bar_config(disable=True)
    out = []
    with mock.patch.object(module, "VAE_IMAGE_SIZE", cond * cond):
        for i, (prompt, path, seed) in enumerate(zip(prompts, paths, seeds)):
            kw = {} if noise is None else {
                "latents": stock._pack_latents(noise[i:i + 1], 1, *noise.shape[1:]).to(stock.transformer.dtype)}
            tokens = stock(image=Image.open(path).convert("RGB"), prompt=prompt,
                           negative_prompt=" " if cfg > 1 else None, true_cfg_scale=cfg, height=res, width=res,
                           num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                           output_type="latent", **kw).images
            out.append(stock._unpack_latents(tokens, res, res, stock.vae_scale_factor)[:, :, 0].float())
    return torch.cat(out)


def ours(pipe, prompts, paths, seeds, steps, cfg, res=RES, cond=COND):
    shape = EDIT.latent_shape(pipe, res)
    noise, _ = latent_noise(seeds, shape)
    embeds = TextEmbedder(pipe, TOKENS, condition_resolution=cond)(prompts, with_negative=EDIT.uses_negative(cfg),
                                                                   images=paths)
    return denoise(pipe.transformer, embeds, noise, EDIT.schedule(pipe.scheduler.config, steps, shape), [], "sde",
                   0.7, cfg, None).final_latents


@pytest.mark.parametrize("cfg", [1.0, 4.0], ids=["no_cfg", "true_cfg"])
def test_ode_sampling_reproduces_the_stock_edit_pipeline(pipe, images, cfg):
    """Two prompts of different lengths with two 160 × 96 references (at an area of 128²): gerl's one batch — one
    transformer call, the shorter prompt padded and masked — against the stock call's two. (References of
    different sizes in one batch: the ratio test in test_families.py.)"""
    assert family_of(pipe) is EDIT and EDIT.conditioned
    ref = stock_latents(pipe, PROMPTS, images[:2], SEEDS, 3, cfg)
    got = ours(pipe, PROMPTS, images[:2], SEEDS, 3, cfg)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    if cfg > 1:  # the reference reaches the velocity: another image, another result
        other = ours(pipe, PROMPTS, images[1::-1], SEEDS, 3, cfg)
        assert (other - got).abs().max() > 1e-3


def test_the_text_sees_the_image_and_the_tokenizer_drops_the_edit_template():
    """The tiny tokenizer splits the edit template's system turn into exactly the 64 tokens the stock pipeline drops
    (its builder checks it), and the prompt's embeddings carry the image's placeholder tokens: 384² at aspect 1 →
    a 384 × 384 image → 392 × 392 after the vision processor's 28-pixel rounding → 28 × 28 patches → 196 merged."""
    from gerl.models.qwenimage_edit import EDIT_DROP_IDX, EDIT_TEMPLATE
    from gerl.models.tiny_qwenimage import build_qwen_tokenizer

    tok = build_qwen_tokenizer(edit=True)
    assert len(tok(EDIT_TEMPLATE.split("{}")[0]).input_ids) == EDIT_DROP_IDX == 64
    pipe = build_tiny_qwenimage_edit_plus(0)
    text = EDIT.encode_text(pipe, "a cat", picture(64, 64, 0))
    words = len(tok("Picture 1: <|vision_start|><|vision_end|>a cat<|im_end|>\n<|im_start|>assistant\n").input_ids)
    assert text.shape[1] == words + 196


def test_a_stock_saved_directory_trains_and_its_lora_loads_back_into_the_stock_pipeline(tmp_path, images):
    """QwenImageEditPlusPipeline.save_pretrained's directory (no processor) trains with model.path=DIR on an edit
    prompt file (2 steps, local sync, true CFG); the LoRA the run saved loads with the stock pipeline's
    load_lora_weights and reproduces the trained policy."""
    import json

    from diffusers import QwenImageEditPlusPipeline

    from gerl.trainer import Trainer, prepare
    from tests.train.helpers import small_config

    model = tmp_path / "model"
    save_tiny_qwenimage_edit_plus(model, 0)
    prompts = tmp_path / "edit.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "image": i}) + "\n" for p, i in zip(PROMPTS, images[:2])))
    cfg = small_config(tmp_path / "run", f"model.path={model}", f"data.train_prompts={prompts}",
                       f"data.test_prompts={prompts}", f"model.condition_resolution={COND}", "model.lora_targets=[]",
                       "max_steps=2", "sampling.num_steps=4", "sampling.sde_window_range=[0,3]",
                       "sampling.guidance_scale=4.0", "train.learning_rate=0.1", "checkpoint.every=2")
    trainer = Trainer(cfg, prepare(cfg))
    trainer.fit()
    trained = trainer.engine.rollout.pipe
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    mine = ours(trained, PROMPTS, images[:2], SEEDS, 4, 4.0, res=64)
    fresh = QwenImageEditPlusPipeline.from_pretrained(str(model), processor=None)  # it saved none; the stock call
    # gets one around the same image processor (`processor`)
    base = stock_latents(fresh, PROMPTS, images[:2], SEEDS, 4, 4.0, res=64)
    fresh.load_lora_weights(str(ckpt), weight_name="pytorch_lora_weights.safetensors")
    loaded = stock_latents(fresh, PROMPTS, images[:2], SEEDS, 4, 4.0, res=64)
    assert (mine - base).abs().max() > 1e-2, "training must change the policy for this test to mean anything"
    torch.testing.assert_close(loaded, mine, rtol=0, atol=1e-5)
