"""ocr-mini: the pretraining script is seeded and writes a stock diffusers pipeline; the shipped model loads by name;
its dev and sealed test numbers never occur in training."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gerl.config import load_config
from gerl.errors import UserError
from gerl.models.loader import SHIPPED_MODELS, load_pipeline, resolve_model_path
from rewards.ocr import extract_target
from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]


def _pretrain_module():
    return load_script("pretrain_ocr_mini")


_POOLED_W = "time_text_embed.text_embedder.linear_2.weight"


def _short_run(mod, out: Path, seed: int = 0, extra=()) -> dict[str, torch.Tensor]:
    args = ["--out", str(out), "--steps", "3", "--vae-steps", "2", "--variants", "1", "--batch", "4",
            "--eval-steps", "0", "--seed", str(seed), *extra]
    assert mod.main(args) == 0
    return load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))


def test_pretraining_is_seeded_and_writes_a_stock_pipeline(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    mod = _pretrain_module()
    a = _short_run(mod, tmp_path / "a")
    b = _short_run(mod, tmp_path / "b")
    c = _short_run(mod, tmp_path / "c", seed=1)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "same seed, different weights: the pretraining is not reproducible"
    assert any(not torch.equal(a[k], c[k]) for k in a), "a different seed gave identical weights"
    assert json.loads((tmp_path / "a" / "pretrain.json").read_text())["args"]["steps"] == 3
    assert json.loads((tmp_path / "a" / "gerl_settings.json").read_text())["num_steps"] == 20  # what eval samples with
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "a"))  # stock diffusers, no gerl code
    pipe.set_progress_bar_config(disable=True)
    image = pipe('a sign that says "42"', num_inference_steps=2, height=64, width=64, guidance_scale=1.0,
                 max_sequence_length=32, output_type="pil").images[0]
    assert image.size == (64, 64)
    # the VAE's latent normalisation was fitted to the data, not left at the SD3 defaults
    assert pipe.vae.config.scaling_factor != 1.5305 and pipe.vae.config.shift_factor != 0.0609
    # --pooled zero (default): the pooled-text projection stays exactly zero through training, so the transformer's
    # output cannot depend on the pooled vector (a hash of the whole prompt) and must read the digits' tokens
    proj = pipe.transformer.time_text_embed.text_embedder.linear_2
    assert not proj.weight.any() and not proj.bias.any()
    used = _short_run(mod, tmp_path / "d", extra=["--pooled", "use", "--text-context", "full"])
    assert used[_POOLED_W].any(), "--pooled use must train the pooled projection"
    # --text-context token (the default): prompts that differ in one digit differ in that digit's tokens only (one in
    # the CLIP part, one in the T5 part), and swapped digits still differ (CLIP's absolute positions); with the random
    # encoders' attention kept (full), every token after the first digit carries the whole number
    assert _differing_tokens(pipe, "65", "15") == 2 and _differing_tokens(pipe, "65", "56") == 4
    assert _differing_tokens(StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "d")), "65", "15") > 20


def _differing_tokens(pipe, a: str, b: str) -> int:
    with torch.no_grad():
        e = pipe.encode_prompt(prompt=[f'a sign that says "{a}"', f'a sign that says "{b}"'], prompt_2=None,
                               prompt_3=None, do_classifier_free_guidance=False, max_sequence_length=32)[0]
    return int(((e[0] - e[1]).abs().amax(-1) > 1e-6).sum())


def test_rendered_data_is_seeded_and_holds_ink():
    import random

    import numpy as np

    mod = _pretrain_module()
    a = np.asarray(mod.render("42", random.Random(5)))
    b = np.asarray(mod.render("42", random.Random(5)))
    assert (a == b).all()
    dark = (a < 128).mean()
    assert 0.03 < dark < 0.4, f"the number should cover a visible part of the image, got {dark:.3f}"
    assert not set(mod.HELD_OUT) & set(mod.TRAIN) and len(mod.TRAIN) + len(mod.HELD_OUT) == 100
    assert not set(mod.DEV) & set(mod.TEST) and len(mod.DEV) == len(mod.TEST) == 16
    for pos in (0, 1):  # every digit still occurs in training at both positions
        assert {n[pos] for n in mod.TRAIN} == set("0123456789")


def test_shipped_model_loads_by_name_and_recipe_holds_out_its_test_targets():
    if not (SHIPPED_MODELS["ocr-mini"] / "model_index.json").is_file():
        pytest.fail("assets/models/ocr-mini is missing from the repository")
    pipe = load_pipeline("ocr-mini")
    assert pipe.transformer.config.num_layers == 4 and pipe.transformer.config.sample_size == 16
    card = json.loads((SHIPPED_MODELS["ocr-mini"] / "pretrain.json").read_text())
    assert 0.0 < card["ocr_dev"]["mean"] < 1.0  # the base model is imperfect: room for RL to improve
    assert "ocr_test" not in card and "ocr_held_out" not in card  # the sealed test numbers are never scored here
    assert card["args"]["pooled"] == "zero" and not pipe.transformer.time_text_embed.text_embedder.linear_2.weight.any()
    assert card["args"]["text_context"] == "token" and card["args"]["threads"] == 2
    assert _differing_tokens(pipe, "65", "15") == 2
    cfg = load_config(str(REPO / "recipes" / "ocr_mini.yaml"))
    assert cfg.model.path == "ocr-mini"
    targets = lambda f: {extract_target(line) for line in (REPO / f).read_text().splitlines() if line.strip()}  # noqa: E731
    train, dev = targets(cfg.data.train_prompts), targets(cfg.data.test_prompts)
    sealed = targets("assets/ocr_mini/test.txt")
    assert cfg.data.test_prompts.endswith("dev.txt"), "recipes validate on dev, never on the sealed test"
    assert len(dev) == len(sealed) == 16 and not train & dev and not train & sealed and not dev & sealed


def test_missing_shipped_model_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setitem(SHIPPED_MODELS, "ocr-mini", tmp_path / "nowhere")
    with pytest.raises(UserError, match="pretrain_ocr_mini.py"):
        resolve_model_path("ocr-mini")
    assert resolve_model_path("tiny") == "tiny"


class _RecordingTransformer(torch.nn.Module):
    """Stands in for the SD3 transformer inside `train_transformer`: one weight, and a record of which prompt
    embedding each sample of each batch was conditioned on (the embeddings are one-hot rows, so argmax names them)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[int] = []

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, return_dict):
        self.seen += encoder_hidden_states[:, 0].argmax(-1).tolist()
        return (hidden_states * self.w,)


def _conditioning(mod, caption_dropout: float, rows: int, caption_noise: float = 0.0) -> list[int]:
    n, steps, batch = 5, 40, 16
    latents, std = torch.randn(n, 2, 4, 4), torch.zeros(n, 2, 4, 4)
    embeds = torch.eye(rows).unsqueeze(1)  # row i: the embedding of prompt i (row n: the empty prompt, when present)
    t = _RecordingTransformer()
    mod.train_transformer(t, latents, std, list(range(n)), (embeds, torch.zeros(rows, 4)), steps, batch, 1e-3, 0,
                          lambda _: None, caption_dropout, caption_noise)
    assert len(t.seen) == steps * batch
    return t.seen


def test_caption_dropout_conditions_that_fraction_on_the_empty_prompt_and_is_off_by_default():
    mod = _pretrain_module()
    plain = _conditioning(mod, 0.0, rows=5)
    assert set(plain) == set(range(5))
    dropped = _conditioning(mod, 0.25, rows=6)  # the empty prompt's embedding is the extra last row
    null = sum(i == 5 for i in dropped) / len(dropped)
    assert 0.18 < null < 0.32, f"{null:.3f} of the samples saw the empty prompt, expected about 0.25"
    # a sample that was not dropped is conditioned on its own number: the same draw as without dropout
    assert all(d in (p, 5) for d, p in zip(dropped, plain))


def test_caption_noise_swaps_that_fraction_for_another_numbers_caption_never_the_empty_prompt():
    mod = _pretrain_module()
    plain = _conditioning(mod, 0.0, rows=5)
    noisy = _conditioning(mod, 0.0, rows=5, caption_noise=0.5)
    swapped = sum(a != b for a, b in zip(noisy, plain)) / len(plain)
    # half the samples get a random one of the 5 captions, which is another number's 4 times in 5: about 0.4
    assert 0.32 < swapped < 0.48, f"{swapped:.3f} of the captions were swapped, expected about 0.4"
    assert set(noisy) == set(range(5))
    both = _conditioning(mod, 0.25, rows=6, caption_noise=0.5)  # dropout still the only way to the empty prompt
    assert 0.18 < sum(i == 5 for i in both) / len(both) < 0.32
    assert all(b == 5 or b == n for b, n in zip(both, noisy))


def test_caption_dropout_outside_0_1_is_a_clear_error(tmp_path, capsys):
    mod = _pretrain_module()
    assert mod.main(["--out", str(tmp_path / "m"), "--caption-dropout", "1.0"]) == 2
    assert "--caption-dropout 1.0 must be in [0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
    assert mod.main(["--out", str(tmp_path / "m"), "--caption-noise", "-0.1"]) == 2
    assert "--caption-noise -0.1 must be in [0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
