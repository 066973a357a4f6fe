"""CLI: each kind of bad input gives one line on stderr, exit code 2, no traceback, and nothing written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gerl.cli import main

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "tiny_cpu.yaml")
FAST = ["max_steps=1", "log.tensorboard=false", "log.progress_bar=false", "validation.every=-1",
        f"data.train_prompts={REPO / 'assets/ocr/train.txt'}", f"data.test_prompts={REPO / 'assets/ocr/test.txt'}"]


def _fails(capsys, argv, pattern):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("gerl: error: "), err
    assert pattern in err[0], err[0]
    return err[0]


def test_missing_config_as_a_real_process(tmp_path):
    """The acceptance contract, through the installed console script: exit 2, one line, no traceback."""
    exe = Path(sys.executable).parent / "gerl"
    r = subprocess.run([str(exe), "train", str(tmp_path / "nope.yaml")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        main(["--debug", "train", str(tmp_path / "nope.yaml")])


def test_unreadable_and_invalid_configs(capsys, tmp_path):
    _fails(capsys, ["train", str(tmp_path)], "does not exist")  # a directory is not a config file
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    _fails(capsys, ["train", str(bad)], "not valid YAML")
    _fails(capsys, ["train", RECIPE, "train.lerning_rate=1"], "did you mean 'train.learning_rate'")
    _fails(capsys, ["train", RECIPE, "max_steps"], "not key=value")


@pytest.mark.parametrize("override, pattern", [
    ("sampling.sampler=ddim", "sampling.sampler: 'ddim' is not one of sde, cps"),
    ("model.dtype=fp64", "model.dtype: 'fp64' is not one of fp32, bf16, fp16"),
    ("sampling.micro_batch_size=5", "must divide images per step"),
    ("reward.name=no_such_reward", "no_such_reward"),
    ("data.train_prompts=/nonexistent/prompts.txt", "/nonexistent/prompts.txt"),
    ("model.init_lora=/nonexistent/lora", "LoRA /nonexistent/lora does not exist"),
    ("model.path=/nonexistent/model", "model.path"),
])
def test_bad_training_input_writes_nothing(capsys, tmp_path, override, pattern):
    out = tmp_path / "run"
    _fails(capsys, ["train", RECIPE, f"output_dir={out}", *FAST, override], pattern)
    assert not out.exists(), "a rejected run must not leave a half-written output directory"


def test_empty_dataset_and_prompt_without_quotes(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    _fails(capsys, ["train", RECIPE, f"output_dir={tmp_path / 'a'}", *FAST, f"data.train_prompts={empty}"], "empty")
    unquoted = tmp_path / "unquoted.txt"
    unquoted.write_text('a sign that says "OPEN"\na sign with no quoted text\n')
    msg = _fails(capsys, ["train", RECIPE, f"output_dir={tmp_path / 'b'}", *FAST, f"data.train_prompts={unquoted}",
                          "reward.name=ocr", "data.prompts_per_step=1"], "quote")
    assert "no quoted text" in msg
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_output_dir_not_writable(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _fails(capsys, ["train", RECIPE, f"output_dir={blocker / 'run'}", *FAST], "not writable")


def test_sample_and_eval_with_a_trained_lora(capsys, tmp_path):
    from PIL import Image

    # A run whose settings differ from the CLI defaults: sample/eval must take them from its config.yaml.
    assert main(["train", RECIPE, f"output_dir={tmp_path / 'run'}", *FAST, "data.prompts_per_step=1",
                 "data.group_size=4", "sampling.micro_batch_size=4", "train.mini_batch_size=4",
                 "train.micro_batch_size=4", "model.resolution=32", "model.tiny_seed=3",
                 "sampling.eval_num_steps=3"]) == 0
    ckpt = tmp_path / "run/checkpoints/step_000001"
    assert (ckpt / "pytorch_lora_weights.safetensors").is_file()
    capsys.readouterr()
    assert main(["sample", "--lora", str(ckpt), "--prompt", 'a sign that says "hi"', "--n", "2",
                 "--out", str(tmp_path / "imgs")]) == 0
    note = capsys.readouterr().err
    assert "model.resolution=32" in note and "model.tiny_seed=3" in note and "sampling.eval_num_steps=3" in note
    assert sorted(p.name for p in (tmp_path / "imgs").iterdir()) == ["0000.png", "0001.png", "grid.png"]
    with Image.open(tmp_path / "imgs/0000.png") as im:
        assert im.size == (32, 32)
    # a flag still wins over the run's config
    assert main(["sample", "--lora", str(ckpt / "pytorch_lora_weights.safetensors"), "--prompt", "x",
                 "--resolution", "48", "--num-steps", "2", "--out", str(tmp_path / "imgs48")]) == 0
    with Image.open(tmp_path / "imgs48/0000.png") as im:
        assert im.size == (48, 48)
    # the same seed, steps and run settings give the same image whether they come from config.yaml or from flags
    assert main(["sample", "--lora", str(ckpt), "--prompt", 'a sign that says "hi"', "--n", "2", "--resolution", "32",
                 "--num-steps", "3", "--model", "tiny", "--out", str(tmp_path / "explicit")]) == 0
    assert (tmp_path / "explicit/0000.png").read_bytes() == (tmp_path / "imgs/0000.png").read_bytes()
    capsys.readouterr()
    assert main(["eval", "--lora", str(ckpt), "--prompts", str(REPO / "assets/ocr/test.txt"), "--num-prompts", "3",
                 "--num-steps", "4", "--reward", "jpeg_compressibility", "--out", str(tmp_path / "eval.json")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_prompts"] == 3 and summary["mean"] < 0
    assert len(json.loads((tmp_path / "eval.json").read_text())["scores"]) == 3
    # the base and the LoRA on the same prompts, noise and sampler; the gain is paired per prompt
    assert main(["eval", "--lora", str(ckpt), "--prompts", str(REPO / "assets/ocr/test.txt"), "--num-prompts", "3",
                 "--num-steps", "4", "--images-per-prompt", "2", "--with-base", "--reward", "jpeg_compressibility",
                 "--out", str(tmp_path / "cmp.json")]) == 0
    out = capsys.readouterr()
    assert "eval sampler: 4 ODE steps" in out.err and "the same for the base and the LoRA" in out.err
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    assert cmp["images_per_prompt"] == 2 and len(cmp["scores"]) == len(cmp["base_scores"]) == 6
    diffs = [t["score"] - b["score"] for t, b in zip(cmp["scores"], cmp["base_scores"])]
    assert cmp["gain"]["mean"] == pytest.approx(sum(diffs) / 6, abs=1e-9)
    assert cmp["gain"]["mean"] == pytest.approx(cmp["mean"] - cmp["base"]["mean"], abs=1e-9)
    assert cmp["stderr"] > 0 and cmp["base"]["stderr"] > 0
    # A LoRA that changes nothing (every B matrix zero, as peft initialises it), beside the trained one: with paired
    # noise and one sampler for both passes each of its images is its base image, so every pair scores the same;
    # and the base pass does not depend on which LoRA follows it.
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(ckpt / "pytorch_lora_weights.safetensors")
    zeroed = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in weights.items()}
    assert any(torch.count_nonzero(weights[k]) for k in zeroed if "lora_B" in k)  # trained: B moved from zero
    noop = tmp_path / "run/checkpoints/step_000002"  # in the run: the same run settings from its config.yaml
    noop.mkdir()
    save_file(zeroed, noop / "pytorch_lora_weights.safetensors")
    assert main(["eval", "--lora", str(noop), "--prompts", str(REPO / "assets/ocr/test.txt"), "--num-prompts", "3",
                 "--num-steps", "4", "--images-per-prompt", "2", "--with-base", "--reward", "jpeg_compressibility",
                 "--out", str(tmp_path / "noop.json")]) == 0
    capsys.readouterr()
    same = json.loads((tmp_path / "noop.json").read_text())
    assert [s["score"] for s in same["scores"]] == [s["score"] for s in same["base_scores"]]
    assert same["gain"]["mean"] == 0 and same["gain"]["stderr"] == 0
    assert [s["score"] for s in same["base_scores"]] == [s["score"] for s in cmp["base_scores"]]
    assert [s["score"] for s in cmp["scores"]] != [s["score"] for s in cmp["base_scores"]]  # the trained LoRA differs


def test_mean_and_stderr_count_prompts_not_images():
    from gerl.cli import mean_and_stderr, paired_gain

    # prompt means 0.5 and 1.0 (a NaN image left out) → mean 0.75, stderr = std([0.5, 1.0]) / √2 = 0.25
    r = mean_and_stderr([0.0, 1.0, 1.0, float("nan")], per_prompt=2)
    assert r == {"mean": 0.75, "stderr": pytest.approx(0.25), "prompts_scored": 2}
    assert mean_and_stderr([None, None], per_prompt=2)["mean"] is None
    g = paired_gain([0.0, 0.5, 0.5, 0.5], [1.0, 0.5, 0.5, 1.5], per_prompt=2)  # per-prompt gains 0.5 and 0.5
    assert g["mean"] == 0.5 and g["stderr"] == 0.0


def test_a_shipped_model_is_sampled_with_its_own_settings():
    from gerl.models.loader import shipped_settings

    assert shipped_settings("ocr-mini") == {"resolution": 64, "max_sequence_length": 32, "num_steps": 20,
                                            "guidance": 1.0}
    assert shipped_settings("tiny") == {} and shipped_settings("some/hub-id") == {}


def test_training_starts_from_model_init_lora(tmp_path):
    import torch
    from safetensors.torch import load_file

    small = [*FAST, "data.prompts_per_step=1", "data.group_size=4", "sampling.micro_batch_size=4",
             "train.mini_batch_size=4", "train.micro_batch_size=4"]
    assert main(["train", RECIPE, f"output_dir={tmp_path / 'a'}", *small, "train.learning_rate=0.05"]) == 0
    start = tmp_path / "a/checkpoints/step_000001"
    # a learning rate too small to move the weights: run b must end where run a's LoRA began it
    assert main(["train", RECIPE, f"output_dir={tmp_path / 'b'}", *small, f"model.init_lora={start}",
                 "train.learning_rate=1e-12"]) == 0
    a = load_file(str(start / "trainable.safetensors"))
    b = load_file(str(tmp_path / "b/checkpoints/step_000001/trainable.safetensors"))
    assert a.keys() == b.keys()
    assert any(k for k in a if "lora_B" in k and a[k].abs().max() > 0), "run a's LoRA must have moved off zero"
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)


def test_sample_with_missing_lora(capsys, tmp_path):
    _fails(capsys, ["sample", "--lora", str(tmp_path / "missing"), "--prompt", "x", "--out", str(tmp_path / "o")],
           "does not exist")
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ bad input through the real executable
#
# One row per class of bad input, run by the installed `gerl` console script in a fresh process: exit 2, exactly one
# stderr line naming the problem, no traceback, and the sandbox directory holds nothing new afterwards.

BROKEN_MODULES = {
    "broken_at_import.py": "raise ValueError('this reward module is broken at import')\n",
    "raising_reward.py": "def reward(images, prompts, metadata):\n    raise ZeroDivisionError('bad reward math')\n",
    "picky_factory.py": ("from rewards.registry import reward_factory\n\n@reward_factory\ndef make(scale: float = 1.0):\n"
                         "    if scale <= 0:\n        raise ValueError('scale must be positive')\n"
                         "    return lambda images, prompts, metadata: [scale] * len(images)\n"),
}
TRAIN = ["train", RECIPE, *FAST]
PROMPT = ["--prompt", 'a sign that says "hi"']

# (case id, argv with {tmp} placeholders, text the one stderr line must contain)
BAD_INPUTS = [
    # numeric config values out of range, named by key before any model loads
    ("resolution_0", [*TRAIN, "output_dir={tmp}/run", "model.resolution=0"], "model.resolution=0 must be ≥ 16"),
    ("adv_clip_negative", [*TRAIN, "output_dir={tmp}/run", "train.adv_clip_max=-1"], "train.adv_clip_max=-1.0 must be > 0"),
    ("seed_negative", [*TRAIN, "output_dir={tmp}/run", "seed=-1"], "seed=-1 must be in"),
    ("checkpoint_every_negative", [*TRAIN, "output_dir={tmp}/run", "checkpoint.every=-5"], "checkpoint.every=-5"),
    ("unknown_key_and_range", [*TRAIN, "output_dir={tmp}/run", "train.lr=1", "validation.every=-2"],
     "did you mean 'train.learning_rate'?); validation.every=-2"),
    # numeric flags of sample out of range
    ("sample_n_0", ["sample", *PROMPT, "--n", "0", "--out", "{tmp}/imgs"], "--n 0 must be ≥ 1"),
    ("sample_batch_0", ["sample", *PROMPT, "--batch-size", "0", "--out", "{tmp}/imgs"], "--batch-size 0 must be ≥ 1"),
    ("sample_resolution_60", ["sample", *PROMPT, "--resolution", "60", "--out", "{tmp}/imgs"], "multiple of 16"),
    ("sample_steps_0", ["sample", *PROMPT, "--num-steps", "0", "--out", "{tmp}/imgs"], "--num-steps 0 must be ≥ 1"),
    # kwargs flags that are not a JSON object
    ("eval_kwargs_list", ["eval", *PROMPT, "--reward", "jpeg_compressibility", "--reward-kwargs", "[1, 2]"],
     "--reward-kwargs must be a JSON object"),
    ("score_kwargs_bad_json", ["score", "jpeg_compressibility", "{tmp}/img.png", "--kwargs", "{{oops"],
     "--kwargs is not valid JSON"),
    # reward modules that fail: at import (train, eval, score), in the factory, inside the call
    ("train_reward_import", [*TRAIN, "output_dir={tmp}/run", "reward.name=broken_at_import:reward"],
     "raised ValueError: this reward module is broken at import"),
    ("eval_reward_import", ["eval", *PROMPT, "--reward", "broken_at_import:reward"], "broken at import"),
    ("score_reward_import", ["score", "broken_at_import:reward", "{tmp}/img.png"], "broken at import"),
    ("score_factory_raises", ["score", "picky_factory:make", "{tmp}/img.png", "--kwargs", '{{"scale": -1}}'],
     "raised ValueError: scale must be positive"),
    ("score_reward_raises", ["score", "raising_reward:reward", "{tmp}/img.png"],
     "reward 'raising_reward:reward' raised ZeroDivisionError: bad reward math"),
    # a LoRA path to a file that is not a LoRA
    ("train_init_lora_text", [*TRAIN, "output_dir={tmp}/run", "model.init_lora={tmp}/img.png"],
     "not a readable safetensors file"),
    ("sample_lora_not_lora", ["sample", *PROMPT, "--lora", "{tmp}/plain.safetensors", "--out", "{tmp}/imgs"],
     "holds no LoRA weights"),
    # outputs that cannot be written (/proc refuses new files even to root, unlike what os.access says)
    ("train_output_proc", [*TRAIN, "output_dir=/proc/gerl_run"], "output_dir /proc/gerl_run is not writable"),
    ("sample_out_proc", ["sample", *PROMPT, "--out", "/proc/gerl_imgs"], "--out /proc/gerl_imgs is not writable"),
    ("eval_out_proc", ["eval", *PROMPT, "--reward", "jpeg_compressibility", "--out", "/proc/gerl/eval.json"],
     "--out /proc/gerl/eval.json is not writable"),
    ("report_out_proc", ["report", "{tmp}/fake_run", "--out", "/proc/gerl/report.html"],
     "--out /proc/gerl/report.html is not writable"),
    # a model directory gerl cannot train (found as a user would: a 40-line traceback and exit 1 before), named with
    # the pipeline class it holds and the families gerl trains, before anything loads
    ("train_sdxl_directory", [*TRAIN, "output_dir={tmp}/run", "model.path={tmp}/sdxl"],
     "holds a StableDiffusionXLPipeline, which gerl cannot train; it trains StableDiffusion3Pipeline"),
    ("train_model_index_not_json", [*TRAIN, "output_dir={tmp}/run", "model.path={tmp}/notjson"],
     "model_index.json is not readable JSON"),
    ("sample_sdxl_directory", ["sample", *PROMPT, "--model", "{tmp}/sdxl", "--out", "{tmp}/imgs"],
     "FluxPipeline (FLUX.1-dev / FLUX.1-schnell)"),
    # a resolution beyond the model's position embedding (pos_embed_max_size × patch_size × VAE factor), named
    # before any weights load: tiny covers 32 × 2 × 4 = 256 px, ocr-mini reads its limit from its config files
    ("train_resolution_over_tiny", [*TRAIN, "output_dir={tmp}/run", "model.resolution=512"],
     "model.resolution=512 is larger than the 256 px"),
    ("train_resolution_over_ocr_mini", [*TRAIN, "output_dir={tmp}/run", "model.path=ocr-mini", "model.resolution=512"],
     "pos_embed_max_size"),
    ("sample_resolution_over_tiny", ["sample", *PROMPT, "--resolution", "512", "--out", "{tmp}/imgs"],
     "--resolution 512 is larger than the 256 px"),
    # flags: no abbreviation is taken for a flag (argparse's default would run --res as --resolution), and a
    # mistyped flag or command is named with the closest one, on one line
    ("sample_flag_abbreviated", ["sample", *PROMPT, "--res", "64", "--out", "{tmp}/imgs"],
     "unrecognized arguments: --res 64; did you mean --resolution for --res?"),
    ("eval_flag_mistyped", ["eval", *PROMPT, "--reward", "ocr", "--images-per-promt", "2"],
     "did you mean --images-per-prompt for --images-per-promt?"),
    ("command_mistyped", ["trian", "recipes/tiny_cpu.yaml"], "invalid choice: 'trian'"),
    # an immutable directory (chattr +i): root may write anywhere else, but not there
    ("train_output_immutable", [*TRAIN, "output_dir={tmp}/immutable/run"], "immutable/run is not writable"),
    ("sample_out_immutable", ["sample", *PROMPT, "--out", "{tmp}/immutable"], "--out {tmp}/immutable is not writable"),
]


def _sandbox(tmp_path: Path) -> None:
    from PIL import Image
    from safetensors.torch import save_file
    import torch

    for name, text in BROKEN_MODULES.items():
        (tmp_path / name).write_text(text)
    Image.new("RGB", (32, 32), "white").save(tmp_path / "img.png")
    save_file({"weight": torch.zeros(2, 2)}, str(tmp_path / "plain.safetensors"))
    for name, index in (("sdxl", '{"_class_name": "StableDiffusionXLPipeline"}'), ("notjson", "{oops")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text(index)
    (tmp_path / "fake_run").mkdir()
    (tmp_path / "fake_run" / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


@pytest.fixture
def immutable_dir(tmp_path):
    """tmp_path/immutable with the immutable attribute set (needs CAP_LINUX_IMMUTABLE; skipped without it)."""
    d = tmp_path / "immutable"
    d.mkdir()
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not permitted here")
    yield d
    subprocess.run(["chattr", "-i", str(d)], check=True)


@pytest.mark.parametrize("case, argv, expected", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(request, tmp_path, case, argv, expected):
    import os

    if "immutable" in case:
        request.getfixturevalue("immutable_dir")
    _sandbox(tmp_path)
    before = _snapshot(tmp_path)
    exe = Path(sys.executable).parent / "gerl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's default environment: Python caches the bytecode it imports
    r = subprocess.run([str(exe), *[a.format(tmp=tmp_path) for a in argv]], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("gerl: error: ") and "Traceback" not in r.stderr, r.stderr
    assert expected.format(tmp=tmp_path) in lines[0], lines[0]
    assert _snapshot(tmp_path) == before, "a refused command must not write anything"


def test_version_and_train_usage():
    exe = Path(sys.executable).parent / "gerl"
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("gerl ") and r.stdout.split()[1][0].isdigit(), r.stdout
    r = subprocess.run([str(exe), "train"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    missing, usage = r.stderr.split("(usage: ")
    assert "[key=value ...]" in usage  # overrides are shown as optional...
    assert "required: CONFIG.yaml" in missing and "key=value" not in missing  # ...and are not required


def test_edit_prompt_files_are_checked_before_any_model_loads(capsys, tmp_path, monkeypatch):
    """Wherever a prompt file goes (gerl sample/eval --prompts, data.train_prompts / data.test_prompts): a missing or
    unreadable image is one line naming the file's line, exit 2; an editing model's prompt without an image, or a
    text-to-image model's prompt with one, too — each before any model loads."""
    from gerl.models import loader

    monkeypatch.setattr(loader, "load_pipeline", lambda *a, **k: pytest.fail("the model started loading"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "image": "gone.png"}\n')
    edit = str(REPO / "assets" / "edit" / "train.jsonl")
    out = ["--out", str(tmp_path / "out")]
    _fails(capsys, ["sample", "--model", "tiny-flux-kontext", "--prompts", str(bad), *out], "bad.jsonl:1: image gone.png")
    _fails(capsys, ["eval", "--model", "tiny-qwenimage-edit", "--prompts", str(bad), "--reward", "ocr"],
           "bad.jsonl:1: image gone.png")
    _fails(capsys, ["sample", "--model", "tiny-flux-kontext", "--prompt", "a cat", *out],
           "FLUX.1-Kontext edits an image, and prompt 1 has none")
    _fails(capsys, ["sample", "--model", "tiny", "--prompts", edit, *out],
           "prompt 1 has an \"image\", which SD3 / SD3.5 (text to image) does not take")
    _fails(capsys, ["train", RECIPE, *FAST, f"output_dir={tmp_path / 'run'}", f"data.train_prompts={bad}"],
           "bad.jsonl:1: image gone.png")
    _fails(capsys, ["train", RECIPE, *FAST, f"output_dir={tmp_path / 'run'}", "model.path=tiny-qwenimage-edit"],
           "Qwen-Image-Edit-Plus edits an image, and prompt 1 has none")
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()
