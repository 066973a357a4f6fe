"""metrics.jsonl and wandb: one wandb run per run directory, continued on resume, with a configurable name, id and
tags. wandb cannot reach a server here, so it runs in its real offline mode (WANDB_MODE=offline)."""

import json
import re

import pytest

from gerl.logging.metrics import MetricsLogger


def test_non_finite_values_are_written_as_null(tmp_path):
    log = MetricsLogger(tmp_path, False, False, "gerl", {}, None)
    log.log(1, {"val_reward_mean": float("nan"), "reward_mean": float("inf"), "x": 1.5})
    log.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert row == {"step": 1, "val_reward_mean": None, "reward_mean": None, "x": 1.5}


def test_wandb_resume_continues_the_same_run_with_name_and_tags(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = MetricsLogger(tmp_path, False, True, "gerl-test", {"seed": 0}, None, wandb_name="lr-sweep-a",
                          wandb_tags=["tiny", "cpu"])
    run_id = first.wandb.id
    assert first.wandb.name == "lr-sweep-a" and set(first.wandb.tags) == {"tiny", "cpu"}
    first.log(1, {"reward_mean": 1.0})
    first.close()
    assert (tmp_path / "wandb_id").read_text().strip() == run_id

    resumed = MetricsLogger(tmp_path, False, True, "gerl-test", {"seed": 0}, 1, wandb_name="lr-sweep-a")
    assert resumed.wandb.id == run_id  # the same wandb run continues
    resumed.log(2, {"reward_mean": 2.0})
    resumed.close()
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    # wandb names each directory offline-run-<time>-<id>, adding "-1" when both start within the same second
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", r) for r in runs), runs

    fresh = tmp_path / "other"
    fresh.mkdir()
    explicit = MetricsLogger(fresh, False, True, "gerl-test", {}, None, wandb_id="my-run-7")
    assert explicit.wandb.id == "my-run-7"
    explicit.close()
