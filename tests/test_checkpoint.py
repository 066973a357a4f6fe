"""Resume from damaged files: every check runs before anything is written; the error names the damaged file and the
checkpoint to resume from instead; a half-written last line of metrics.jsonl (a crash mid-write) is tolerated."""

import json
import shutil

import pytest

from gerl.errors import UserError
from gerl.trainer import train
from tests.train.helpers import small_config


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A finished 2-step run with a checkpoint after each step (built once; tests work on copies)."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    train(small_config(run, "max_steps=2", "checkpoint.every=1", "checkpoint.keep_last=0"))
    return run


def _copy(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = [
    ("trainable_truncated", "trainable.safetensors", _truncate, "trainable.safetensors is damaged"),
    ("optimizer_missing", "optimizer.safetensors", lambda p: p.unlink(), "optimizer.safetensors is missing"),
    ("optimizer_truncated", "optimizer.safetensors", _truncate, "optimizer.safetensors is damaged"),
    ("state_truncated", "trainer_state.json", _truncate, "trainer_state.json is damaged"),
    ("rng_missing", "rng.safetensors", lambda p: p.unlink(), "rng.safetensors is missing"),
]


@pytest.mark.parametrize("case, name, damage, expected", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damaged_checkpoint_names_the_file_offers_the_previous_one_and_writes_nothing(
        two_checkpoints, tmp_path, case, name, damage, expected):
    run = _copy(two_checkpoints, tmp_path)
    damage(run / "checkpoints/step_000002" / name)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(UserError) as e:
        train(small_config(run, "max_steps=3", "resume=true", "train.learning_rate=5e-4"))
    msg = str(e.value)
    assert "step_000002" in msg and expected in msg and "\n" not in msg, msg
    assert f"resume={run / 'checkpoints/step_000001'}" in msg, msg
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before, "a refused resume must leave config.yaml, metrics.jsonl and the checkpoints untouched"


def test_the_offered_checkpoint_resumes(two_checkpoints, tmp_path):
    run = _copy(two_checkpoints, tmp_path)
    _truncate(run / "checkpoints/step_000002/optimizer.safetensors")
    train(small_config(run, "max_steps=3", f"resume={run / 'checkpoints/step_000001'}"))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_no_intact_earlier_checkpoint_says_start_over(two_checkpoints, tmp_path):
    run = _copy(two_checkpoints, tmp_path)
    (run / "checkpoints/step_000001/rng.safetensors").unlink()
    (run / "checkpoints/step_000002/rng.safetensors").unlink()
    with pytest.raises(UserError, match="no earlier checkpoint is intact: start over with overwrite=true"):
        train(small_config(run, "max_steps=3", "resume=true"))


def test_half_written_last_metrics_line_is_tolerated_on_resume(two_checkpoints, tmp_path):
    run = _copy(two_checkpoints, tmp_path)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward_me')  # the process died mid-write
    with (run / "timeline.jsonl").open("a") as f:
        f.write('{"lane": "trainer", "na')
    train(small_config(run, "max_steps=3", "resume=true"))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for line in (run / "timeline.jsonl").read_text().splitlines():
        json.loads(line)


def test_damaged_line_inside_metrics_is_refused_before_config_is_rewritten(two_checkpoints, tmp_path):
    run = _copy(two_checkpoints, tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text(lines[0][:10] + "\n" + "\n".join(lines[1:]) + "\n")
    config = (run / "config.yaml").read_text()
    with pytest.raises(UserError, match=r"metrics.jsonl line 1 is not JSON"):
        train(small_config(run, "max_steps=3", "resume=true", "train.learning_rate=5e-4"))
    assert (run / "config.yaml").read_text() == config


def test_checkpoint_of_another_lora_shape_is_refused_before_config_is_rewritten(two_checkpoints, tmp_path):
    run = _copy(two_checkpoints, tmp_path)
    config = (run / "config.yaml").read_text()
    with pytest.raises(UserError, match=r"does not fit this config .*resume with the model and LoRA settings"):
        train(small_config(run, "max_steps=3", "resume=true", "model.lora_rank=2", "model.lora_alpha=4"))
    assert (run / "config.yaml").read_text() == config
