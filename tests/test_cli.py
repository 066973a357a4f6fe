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
    assert main(["train", RECIPE, f"output_dir={tmp_path / 'run'}", *FAST, "data.prompts_per_step=1",
                 "data.group_size=4", "sampling.micro_batch_size=4", "train.mini_batch_size=4",
                 "train.micro_batch_size=4"]) == 0
    ckpt = tmp_path / "run/checkpoints/step_000001"
    assert (ckpt / "pytorch_lora_weights.safetensors").is_file()
    assert main(["sample", "--lora", str(ckpt), "--prompt", 'a sign that says "hi"', "--n", "2", "--num-steps", "4",
                 "--out", str(tmp_path / "imgs")]) == 0
    assert sorted(p.name for p in (tmp_path / "imgs").iterdir()) == ["0000.png", "0001.png", "grid.png"]
    capsys.readouterr()
    assert main(["eval", "--lora", str(ckpt), "--prompts", str(REPO / "assets/ocr/test.txt"), "--num-prompts", "3",
                 "--num-steps", "4", "--reward", "jpeg_compressibility", "--out", str(tmp_path / "eval.json")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_prompts"] == 3 and summary["mean"] < 0
    assert len(json.loads((tmp_path / "eval.json").read_text())["scores"]) == 3


def test_sample_with_missing_lora(capsys, tmp_path):
    _fails(capsys, ["sample", "--lora", str(tmp_path / "missing"), "--prompt", "x", "--out", str(tmp_path / "o")],
           "does not exist")
    assert not (tmp_path / "o").exists()
