"""benchmarks/reproduce_tables.py: the target rule, and a real 2-step run of two strategies (local sync and Ray
one-step-off) on the tiny model with the JPEG reward, whose table must hold the numbers of the runs' own metrics."""

from __future__ import annotations

import json
import math
import signal

import pytest
from PIL import Image

from gerl.logging.throughput import gpu_hours_to_target
from tests.scripts import load_script

rt = load_script("reproduce_tables")

TINY = ["validation.every=1", "validation.num_prompts=2", "sampling.eval_num_steps=4", "data.prompts_per_step=2",
        "data.group_size=4", "sampling.num_steps=4", "sampling.sde_window_size=2", "sampling.sde_window_range=[0,3]",
        "sampling.micro_batch_size=4", "train.mini_batch_size=4", "train.micro_batch_size=4",
        "log.tensorboard=false", "log.images_every=0", "checkpoint.every=0", "reward.name=jpeg_compressibility"]


def test_steps_to_target_uses_the_same_reach_and_hold_rule_as_gpu_hours():
    rows = [{"step": 0, "val_reward_mean": 0.1, "validate_s": 1.0},
            {"step": 1, "step_s": 2.0}, {"step": 2, "step_s": 2.0, "validate_s": 1.0, "val_reward_mean": 0.6},
            {"step": 3, "step_s": 2.0}, {"step": 4, "step_s": 2.0, "validate_s": 1.0, "val_reward_mean": 0.4},
            {"step": 5, "step_s": 2.0, "validate_s": 1.0, "val_reward_mean": 0.7},
            {"step": 6, "step_s": 2.0, "validate_s": 1.0, "val_reward_mean": 0.8}]
    assert rt.steps_to_target(rows, 0.5, 1) == 2
    assert rt.steps_to_target(rows, 0.5, 2) == 5  # the reach at step 2 is lost at step 4
    assert rt.steps_to_target(rows, 0.9, 1) is None
    row = rt.summarize("sync", rows, 2, 0.5, 2)
    assert row["core_hours_to_target"] == pytest.approx(gpu_hours_to_target(rows, 2, 0.5, 2))
    assert row["core_hours_to_target"] == pytest.approx(2 * (1 + 2 + 3 + 2 + 3 + 3) / 3600)
    assert row["final_val_reward"] == 0.8 and row["best_val_reward"] == 0.8 and row["steps_run"] == 6
    assert row["images_per_s_per_core"] is None  # no "images" in these rows


def test_reproduce_tables_runs_two_strategies_and_tabulates_their_metrics(tmp_path, capsys):
    table, png = tmp_path / "table.md", tmp_path / "plot.png"
    argv = ["--recipe", "recipes/tiny_cpu.yaml", "--strategies", "sync,one_step_off", "--max-steps", "2",
            "--target", "-1000", "--hold", "2", "--runs-dir", str(tmp_path / "runs"), "--table", str(table),
            "--plot", str(png), *TINY]
    assert rt.main(argv) == 0
    lines = table.read_text().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == rt.COLUMNS
    rows = {r[0]: dict(zip(header, r)) for r in ([c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:])}
    assert set(rows) == {"sync", "one_step_off"}
    for name, row in rows.items():
        metrics = [json.loads(ln) for ln in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if "step_s" in m]
        assert len(steps) == 2
        tput = sum(m.get("images", 0) for m in metrics) / (2 * sum(m.get("step_s", 0) + m.get("validate_s", 0)
                                                                   for m in metrics))
        assert float(row["images/s/core"]) == pytest.approx(tput, abs=0.006)
        vals = [m for m in metrics if "val_reward_mean" in m]
        assert [m["step"] for m in vals] == [0, 1, 2]
        assert int(row["steps to target"]) == 0  # every validation is above -1000: reached at step 0, held at 1
        hours = 2 * vals[0]["validate_s"] / 3600
        assert float(row["core-hours to target"]) == pytest.approx(hours, abs=6e-5)
        assert float(row["final val reward"]) == pytest.approx(vals[-1]["val_reward_mean"], abs=6e-4)
        assert -10 < vals[-1]["val_reward_mean"] < 0 and math.isfinite(float(row["best val reward"]))
        assert row["speed-up vs sync (images/s)"].endswith("×")
    assert rows["sync"]["speed-up vs sync (images/s)"] == "1.00×"
    assert rows["one_step_off"]["cores actor / rollout"] == "1 / 1"
    data = json.loads(table.with_suffix(".json").read_text())
    assert [r["strategy"] for r in data["results"]] == ["sync", "one_step_off"]
    with Image.open(png) as im:
        assert im.size[0] > 600 and im.size[1] > 200


def test_reproduce_tables_needs_validation_during_training(tmp_path, capsys):
    argv = ["--recipe", "recipes/tiny_cpu.yaml", "--max-steps", "2", "--target", "0", "--table",
            str(tmp_path / "t.md"), "--plot", str(tmp_path / "p.png"), "validation.every=0"]
    assert rt.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "validation.every" in err[0]
    assert not (tmp_path / "t.md").exists()


def test_a_run_stopped_by_the_wall_clock_budget_still_gets_its_row(tmp_path):
    table = tmp_path / "table.md"
    argv = ["--recipe", "recipes/tiny_cpu.yaml", "--strategies", "sync", "--max-steps", "1000", "--budget-s", "2",
            "--target", "0", "--runs-dir", str(tmp_path / "runs"), "--table", str(table), "--plot",
            str(tmp_path / "p.png"), *TINY]
    # Started with SIGINT ignored, as `nohup … &` or a script's background job starts it: the ignore passes through
    # exec, so without the harness restoring SIGINT in the child, a budget's SIGINT sent while `gerl train` still
    # imports is lost and the run goes on (here for the harness's 60 s grace, ~250 steps) until it is killed.
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert rt.main(argv) == 0
    finally:
        signal.signal(signal.SIGINT, old)
    row = [c.strip() for c in table.read_text().splitlines()[2].strip("|").split("|")]
    metrics = (tmp_path / "runs" / "sync" / "metrics.jsonl")
    logged = [json.loads(ln) for ln in metrics.read_text().splitlines()] if metrics.is_file() else []
    assert row[0] == "sync" and int(row[2]) == max((m["step"] for m in logged), default=0) <= 3  # stopped where it was
