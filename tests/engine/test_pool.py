"""Hosts kept between runs on one Ray (gerl/engine/pool.py, on for every module-wide Ray of these tests): a run on
the hosts another run left trains exactly as on fresh ones — the same metrics, the same weights, the same process
settings — in the very processes of the run before. The runs have two colocated data-parallel hosts, so each host
joins a torch.distributed group: a kept host that had not left the last run's group could not join the next one."""

import json

import pytest

ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from gerl.engine import pool  # noqa: E402
from gerl.trainer import train  # noqa: E402
from tests.train.helpers import small_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_cluster")  # tests/engine/conftest.py: keeps hosts between runs

TWO_HOSTS = ["max_steps=2", "checkpoint.every=2", "engine.kind=ray", "engine.hybrid=true", "engine.device=cpu",
             "engine.actor_workers=2", "engine.rollout_workers=2", "engine.cpus_per_worker=1",
             "train.mini_batch_size=8"]


def _run(out, *extra):
    train(small_config(out, *TWO_HOSTS, *extra))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(str(out / "checkpoints/step_000002/trainable.safetensors"))
    return rows, weights, json.loads((out / "placement.json").read_text())


def test_a_kept_host_trains_as_a_fresh_one(tmp_path):
    # another run first, with another seed, learning rate and thread count: what it leaves must not leak
    pool.evict()
    _, _, first = _run(tmp_path / "first", "seed=7", "train.learning_rate=1e-2", "engine.cpus_per_worker=2",
                       "engine.actor_workers=1", "engine.rollout_workers=1")
    # 1 host of 2 cores kept; this run asks for 2 hosts of 1 core: not that key, so it is killed, both start fresh
    fresh_rows, fresh_w, fresh = _run(tmp_path / "fresh")
    assert pool.idle() == 2 and not {h["pid"] for h in fresh} & {h["pid"] for h in first}
    kept_rows, kept_w, kept = _run(tmp_path / "kept")  # on the two hosts the run before left
    # the same two processes (each now with the other's rank: the pool hands them out last in, first out)
    assert {h["pid"] for h in kept} == {h["pid"] for h in fresh}, "the run did not reuse the kept hosts"
    assert [h["reused_host"] for h in fresh] == [False, False] and [h["reused_host"] for h in kept] == [True, True]
    assert pool.idle() == 2

    def settings(hosts):
        return sorted((h["host"], h["rank"], h["torch_threads"], h["backends"], h["deterministic"]) for h in hosts)

    assert settings(kept) == settings(fresh)
    assert fresh_w.keys() == kept_w.keys() and all(fresh_w[k].equal(kept_w[k]) for k in fresh_w)
    keys = ("reward_mean", "policy_loss", "grad_norm", "ratio_max_dev_before_update", "policy_version")
    assert [[r[k] for k in keys] for r in kept_rows] == [[r[k] for k in keys] for r in fresh_rows]
    assert fresh_rows[-1]["grad_norm"] > 0  # it trained
