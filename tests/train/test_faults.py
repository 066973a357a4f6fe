"""Faults that used to pass silently: a reward that never scores stops the run (exit 3) with its own message shown
once; validation without any score logs null; z-scored rewards log their raw values; resume mistakes and failed
starts are refused or leave nothing behind; the run always ends with a validation and a checkpoint."""

import json
import math

import pytest

from gerl.checkpoint import list_checkpoints
from gerl.cli import main
from gerl.errors import UserError
from gerl.trainer import train
from tests.train.helpers import REPO, SMALL_CLI, small_config

CLI = SMALL_CLI


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_reward_that_stops_scoring_stops_the_run_with_its_message_once(tmp_path, capsys):
    # 2 calls per step (2 groups of 4): step 1 is scored, then every call raises the same error.
    code = main(["train", *CLI, f"output_dir={tmp_path}", "max_steps=10", "checkpoint.every=1",
                 "reward.name=tests.workers.broken:BreaksAfter", "reward.kwargs={calls: 2}", "reward.retries=0",
                 "reward.max_failed_steps=2"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.count("reward server returned HTTP 500") == 2  # shown once when it happens + once in the abort line
    assert "gerl: reward reward: ValueError: reward server returned HTTP 500" not in err  # named once, not twice
    assert "no sample got a valid reward in 2 consecutive steps (up to step 3" in err
    assert "resume=true" in err
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["reward_failed_samples"] == 0 and rows[1]["reward_failed_samples"] == 8
    assert rows[2]["reward_errors_total"] == 4 and rows[2]["reward_raw_mean"] is None
    # the checkpoints are intact and the run can be resumed from the last one
    assert [c.name for c in list_checkpoints(tmp_path)][-1] == "step_000003"


def test_validation_without_any_score_logs_null_and_the_run_ends_with_validation(tmp_path, capsys):
    # only training prompts are scored; the disjoint validation prompts all get None
    cfg = small_config(tmp_path, "max_steps=2", "validation.every=5", "validation.num_prompts=2",
                       "reward.name=tests.workers.broken:OnlyPrompts",
                       f"reward.kwargs={{path: {REPO / 'assets/ocr/train.txt'}}}")
    train(cfg)
    rows = _rows(tmp_path)
    final = rows[-1]
    assert [r["step"] for r in rows if "val_reward_mean" in r] == [0, 2]  # every=5 > max_steps: still validated at 2
    assert final["val_reward_mean"] is None and final["val_scored_prompts"] == 0
    assert final["val_reward/OnlyPrompts_raw"] is None
    assert math.isfinite(final["reward_mean"])
    assert "validation at step 2: no prompt got a valid reward; val_reward_mean is logged as null" in capsys.readouterr().err
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_000002"]  # checkpoint.every=0: the final one


def test_zscored_components_log_their_raw_scores_for_training_and_validation(tmp_path):
    cfg = small_config(tmp_path, "max_steps=1", "validation.every=0", "validation.num_prompts=2",
                       "reward.name=", "reward.components=[{name: jpeg_compressibility, normalize: zscore, weight: 2.0}]")
    train(cfg)
    (row,) = _rows(tmp_path)
    assert abs(row["reward_mean"]) < 1e-5  # what z-scoring does to the mean: it says nothing
    raw = row["reward/jpeg_compressibility_raw"]
    assert raw < -1 and row["reward_raw_mean"] == pytest.approx(2.0 * raw, rel=1e-6)
    assert row["val_reward/jpeg_compressibility_raw"] < -1
    assert row["val_reward_raw_mean"] == pytest.approx(2.0 * row["val_reward/jpeg_compressibility_raw"], rel=1e-6)


def test_nan_and_inf_rewards_drop_their_groups_and_the_update_runs(tmp_path):
    # jsonl prompts: one group's reward is NaN, another's inf for one sample only, two are fine
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a nan", "an inf", "b", "c"]))
    cfg = small_config(tmp_path / "run", "max_steps=1", "data.prompts_per_step=4", "train.mini_batch_size=16",
                       f"data.train_prompts={prompts}", "reward.name=tests.workers.broken:nan_and_inf")
    train(cfg)
    (row,) = _rows(tmp_path / "run")
    assert row["reward_nonfinite"] == 8 and row["reward_failed_samples"] == 8 and row["dropped_samples"] == 8
    assert row["nonfinite_reward_steps_skipped"] == 0 and "grad_norm" in row  # the other two groups trained


def test_resume_mistakes_are_refused_without_touching_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *CLI, f"output_dir={run}", "max_steps=1"]) == 0
    before = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", *CLI, f"output_dir={run}", "max_steps=1", "resume=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is at step 1 and max_steps=1, so there is nothing left to train" in err[0]
    for c in list_checkpoints(run):
        import shutil

        shutil.rmtree(c)
    assert main(["train", *CLI, f"output_dir={run}", "max_steps=2", "resume=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no checkpoint to resume from (metrics.jsonl holds 1 steps)" in err[0]
    assert (run / "metrics.jsonl").read_text() == before


def test_a_failed_start_leaves_nothing_a_rerun_refuses(tmp_path, monkeypatch):
    import sys

    import gerl.trainer

    monkeypatch.setitem(sys.modules, "wandb", None)  # wandb not installed
    with pytest.raises(UserError, match="log.wandb=true needs wandb"):
        train(small_config(tmp_path / "a", "max_steps=1", "log.wandb=true"))
    assert not (tmp_path / "a").exists()

    class Broken:  # any failure after the run directory was created (a logger backend that cannot start)
        def __init__(self, *a, **k):
            raise OSError("disk full")

    monkeypatch.setattr(gerl.trainer, "MetricsLogger", Broken)
    with pytest.raises(OSError):
        train(small_config(tmp_path / "b", "max_steps=1"))
    assert not (tmp_path / "b").exists()
    monkeypatch.undo()
    # a crash before step 1 finished leaves an empty metrics.jsonl: the rerun is accepted
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "metrics.jsonl").write_text("")
    (tmp_path / "c" / "config.yaml").write_text("max_steps: 1\n")
    train(small_config(tmp_path / "c", "max_steps=1"))
    assert [r["step"] for r in _rows(tmp_path / "c")] == [1]


@pytest.mark.parametrize("reward, said", [
    ("raises", "the reward model is not loaded"), ("all_nan", "non-finite scores"),
    ("strings", "could not convert string to float"), ("returns_none", "got None"),
    ("wrong_length", "returned 5 scores for 4 images"),
])
def test_a_run_shorter_than_max_failed_steps_with_no_valid_reward_exits_3(tmp_path, capsys, reward, said):
    # 2 steps < reward.max_failed_steps=3: the streak rule cannot fire, so the end of the run must say it trained nothing
    code = main(["train", *CLI, f"output_dir={tmp_path}", "max_steps=2", "reward.max_failed_steps=3",
                 "reward.retries=0", f"reward.name=tests.workers.broken:{reward}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3, err
    aborted = [ln for ln in err if ln.startswith("gerl: run aborted: ")]
    assert len(aborted) == 1 and err[-1] == aborted[0], err
    assert "no sample got a valid reward in any of the 2 steps of this run" in aborted[0]
    assert "reward.max_failed_steps=3" in aborted[0] and said in aborted[0] and "overwrite=true" in aborted[0]
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]


def test_max_failed_steps_0_never_stops_a_run_for_missing_rewards(tmp_path):
    assert main(["train", *CLI, f"output_dir={tmp_path}", "max_steps=2", "reward.max_failed_steps=0",
                 "reward.retries=0", "reward.name=tests.workers.broken:raises"]) == 0
