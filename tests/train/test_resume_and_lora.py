"""Checkpoints: LoRA files that stock diffusers loads with the right scaling, atomic writes, exact resume."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gerl.checkpoint import list_checkpoints
from gerl.models.loader import add_lora, load_pipeline, read_lora_metadata, save_lora
from gerl.trainer import train
from tests.train.helpers import small_config


def _stock_images(pipe, prompts, seeds):
    out = pipe(prompts, num_inference_steps=6, height=64, width=64, guidance_scale=1.0, max_sequence_length=32,
               generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="np")
    return out.images


def test_lora_saved_by_gerl_loads_into_stock_pipeline_with_identical_images(tiny_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    pipe = load_pipeline(str(tiny_dir))
    # alpha ≠ rank: a loader that ignored the saved metadata would scale the update by 1 instead of alpha/r = 4.
    add_lora(pipe.transformer, rank=4, alpha=16.0, targets=["to_q", "to_k", "to_v", "to_out.0", "proj_out"])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in pipe.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    save_lora(pipe.transformer, tmp_path)
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()
    meta = read_lora_metadata(tmp_path)
    assert meta["r"] == 4 and meta["lora_alpha"] == 16.0

    prompts, seeds = ['a sign that says "gerl"', 'a mug that says "hello"'], [3, 4]
    ours = _stock_images(pipe, prompts, seeds)

    fresh = StableDiffusion3Pipeline.from_pretrained(str(tiny_dir))
    fresh.set_progress_bar_config(disable=True)
    base = _stock_images(fresh, prompts, seeds)
    fresh.load_lora_weights(str(tmp_path), weight_name="pytorch_lora_weights.safetensors")
    loaded = _stock_images(fresh, prompts, seeds)

    assert np.abs(ours - base).max() > 1e-2, "the adapter must change the images for this test to mean anything"
    np.testing.assert_allclose(loaded, ours, atol=1e-5)


def _run(tmp, *overrides):
    cfg = small_config(tmp, *overrides)
    train(cfg)
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


def test_resume_equals_uninterrupted_run(tmp_path, tiny_dir):
    # From a directory, as a real model loads (the tiny builder would seed torch's global generator), and with
    # that generator in another state before each run: a run is its seed's, not the process's (the fresh
    # adapter's A drew from the global generator before add_lora took the seed, so the two runs differed).
    model = f"model.path={tiny_dir}"
    torch.manual_seed(1)
    full = _run(tmp_path / "full", "max_steps=4", "checkpoint.every=2", "checkpoint.keep_last=0", model)
    torch.manual_seed(2)
    _run(tmp_path / "split", "max_steps=2", "checkpoint.every=2", model)
    resumed = _run(tmp_path / "split", "max_steps=4", "checkpoint.every=2", "resume=true", model)

    a = load_file(str(tmp_path / "full/checkpoints/step_000004/trainable.safetensors"))
    b = load_file(str(tmp_path / "split/checkpoints/step_000004/trainable.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
    oa = load_file(str(tmp_path / "full/checkpoints/step_000004/optimizer.safetensors"))
    ob = load_file(str(tmp_path / "split/checkpoints/step_000004/optimizer.safetensors"))
    for k in oa:
        assert torch.equal(oa[k], ob[k]), k
    # metrics.jsonl of the resumed run holds each step once, with the uninterrupted run's rewards
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["reward_mean"] for r in resumed] == [r["reward_mean"] for r in full]
    # the weights did move, so equality is not vacuous
    first = load_file(str(tmp_path / "full/checkpoints/step_000002/trainable.safetensors"))
    assert any(not torch.equal(first[k], a[k]) for k in a)


def test_checkpoints_are_complete_and_pruned(tmp_path):
    _run(tmp_path, "max_steps=3", "checkpoint.every=1", "checkpoint.keep_last=2")
    ckpts = list_checkpoints(tmp_path)
    assert [c.name for c in ckpts] == ["step_000002", "step_000003"]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    names = {p.name for p in ckpts[-1].iterdir()}
    assert {"pytorch_lora_weights.safetensors", "trainable.safetensors", "optimizer.safetensors",
            "rng.safetensors", "trainer_state.json"} <= names
    state = json.loads((ckpts[-1] / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["sampler"]["index"] > 0


def test_full_finetune_with_kl_and_ema_runs_and_resumes(tmp_path):
    rows = _run(tmp_path, "max_steps=2", "model.lora=false", "train.beta=0.1", "train.ema_decay=0.5",
                "train.learning_rate=1e-4", "checkpoint.every=1", "validation.every=2", "validation.num_prompts=2")
    assert rows[-1]["step"] == 2 and rows[-1]["kl"] > 0  # the policy moved away from the frozen reference
    assert "val_reward_mean" in rows[-1]
    ckpt = tmp_path / "checkpoints/step_000002"
    assert (ckpt / "transformer" / "config.json").is_file() and (ckpt / "ema.safetensors").is_file()
    rows = _run(tmp_path, "max_steps=3", "model.lora=false", "train.beta=0.1", "train.ema_decay=0.5",
                "train.learning_rate=1e-4", "resume=true", "validation.every=2", "validation.num_prompts=2")
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3]


def test_refuses_to_clobber_an_existing_run(tmp_path):
    from gerl.errors import UserError

    _run(tmp_path, "max_steps=1")
    with pytest.raises(UserError, match="already holds a run"):
        _run(tmp_path, "max_steps=1")
