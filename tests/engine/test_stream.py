"""Asynchronous schedules with real Ray actors on CPU: an async run resumed from a checkpoint equals the
uninterrupted run bit for bit (the generations in flight are re-issued with their own older weights), and the
streaming schedule (groups pulled from one prompt stream, trained in completion order, staleness bounded)."""

import json
import os

import pytest
import torch

ray = pytest.importorskip("ray")  # a dev dependency: installed by scripts/setup.sh

from safetensors.torch import load_file  # noqa: E402

from gerl.trainer import train  # noqa: E402
from tests.train.helpers import small_config  # noqa: E402

DECOUPLED = ["engine.kind=ray", "engine.hybrid=false", "engine.device=cpu", "engine.cpus_per_worker=1"]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


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
