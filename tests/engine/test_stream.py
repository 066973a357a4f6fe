"""Asynchronous schedules with real Ray actors on CPU: an async run resumed from a checkpoint equals the
uninterrupted run bit for bit (the generations in flight are re-issued with their own older weights), and the
streaming schedule (groups pulled from one prompt stream, trained in completion order, staleness bounded)."""

import json

import pytest
import torch

ray = pytest.importorskip("ray")  # a dev dependency: installed by scripts/setup.sh

from safetensors.torch import load_file  # noqa: E402

from gerl.trainer import train  # noqa: E402
from tests.train.helpers import small_config  # noqa: E402

DECOUPLED = ["engine.kind=ray", "engine.hybrid=false", "engine.device=cpu", "engine.cpus_per_worker=1"]


pytestmark = pytest.mark.usefixtures("ray_cluster")  # tests/engine/conftest.py


def _run(out, *overrides):
    train(small_config(out, *DECOUPLED, *overrides))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_async_resume_is_bit_exact(tmp_path):
    k = ["engine.schedule=async", "engine.max_staleness=2", "checkpoint.every=2", "checkpoint.keep_last=0"]
    full = _run(tmp_path / "full", "max_steps=5", *k)
    _run(tmp_path / "split", "max_steps=2", *k)
    ckpt = tmp_path / "split/checkpoints/step_000002"
    assert set(load_file(str(ckpt / "inflight_weights.safetensors"))) and \
        {key.split("/")[0] for key in load_file(str(ckpt / "inflight_weights.safetensors"))} == {"v0", "v1"}
    resumed = _run(tmp_path / "split", "max_steps=5", "resume=true", *k)

    assert [r["policy_version"] for r in full] == [0, 0, 0, 1, 2]  # steps 3..4 were in flight at the checkpoint
    for key in ("reward_mean", "policy_version", "policy_lag", "policy_loss", "grad_norm"):
        assert [r[key] for r in resumed] == [r[key] for r in full], key
    a = load_file(str(tmp_path / "full/checkpoints/step_000004/trainable.safetensors"))
    b = load_file(str(tmp_path / "split/checkpoints/step_000004/trainable.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


STREAM = ["engine.schedule=stream", "engine.max_staleness=1", "reward.name=tests.engine.slow_reward:first_call_slow",
          "reward.workers=4"]


def test_stream_trains_groups_in_completion_order(tmp_path):
    from gerl.trainer import Trainer, prepare

    trainer = Trainer(*(lambda c: (c, prepare(c)))(small_config(tmp_path, "max_steps=2", *DECOUPLED, *STREAM)))
    try:
        batch, res = trainer.engine.collect({"stream": 1})
        draws = trainer.engine.stream.draws
        n = 4
        # group 0 of draw 1 was generated first but its reward straggles: step 1 gets the next two groups
        assert batch.prompts == draws[1][0][n:2 * n] + draws[2][0][:n]
        assert batch.group_ids.tolist() == [0] * n + [1] * n and torch.isfinite(res.total).all()
        assert batch.timings["policy_lags"] == [0, 0] and batch.policy_version == 0
    finally:
        trainer.engine.close()


def test_stream_bounds_staleness_stages_weights_and_resumes(tmp_path):
    rows = _run(tmp_path, "max_steps=5", "checkpoint.every=3", *STREAM)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(len(r["policy_lags"]) == 2 and max(r["policy_lags"]) <= 1 for r in rows)
    # the straggler (generated at version 0, scored after 8 later groups) is older than max_staleness by then
    assert rows[-1]["stale_groups_dropped_total"] >= 1
    assert rows[-1]["stale_groups_dropped_total"] == sum(r["stale_groups_dropped"] for r in rows)
    assert max(r["policy_version"] for r in rows) >= 2  # new weights reached the rollout while it kept generating
    assert any(r["weight_load_s"] > 0 for r in rows)  # loaded from the staged buffer between micro-batches
    state = json.loads((tmp_path / "checkpoints/step_000003/trainer_state.json").read_text())
    assert state["stream"]["first_draw"] >= 1 and state["stream"]["dropped_total"] >= 0
    resumed = _run(tmp_path, "max_steps=6", "resume=true", *STREAM)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert max(resumed[-1]["policy_lags"]) <= 1
