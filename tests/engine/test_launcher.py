"""torchrun on the CPU (gloo): `gerl train` started as 2 processes by `torchrun --nproc_per_node 2` trains as one
process does — step 1's statistics, gradient norm and trained adapter (each rank generates half of the groups, trains
on half through the data-parallel layer, and reduces its statistics over both), and step 2 on those weights — and rank 0 alone writes the
run directory (every rank's writes are audited: tests/engine/write_audit.py)."""

import json
import os
import subprocess
import sys

import torch
import yaml
from safetensors.torch import load_file

from gerl.trainer import train
from tests.train.helpers import REPO, SMALL_CLI, small_config

# unshuffled mini-batches of 8 in micro-batches of 2: rank r trains samples 4r … 4r + 3 in the 1-process order
LAYOUT = ["max_steps=2", "train.learning_rate=1e-3", "train.mini_batch_size=8", "train.micro_batch_size=2",
          "train.shuffle_mini_batches=false", "checkpoint.every=1"]


KEYS = ("reward_mean", "grad_norm", "policy_loss", "approx_kl", "ratio_mean", "clipfrac", "grad_zero_frac")


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def test_torchrun_two_processes_train_as_one_and_only_rank_0_writes(tmp_path):
    one, two, audit = tmp_path / "one", tmp_path / "two", tmp_path / "audit"
    audit.mkdir()
    train(small_config(one, *LAYOUT))
    env = dict(os.environ, GERL_WRITE_AUDIT=str(audit), PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(REPO / "tests" / "engine" / "write_audit.py"), "train", *SMALL_CLI, *LAYOUT,
                        f"output_dir={two}", "model.device=cpu"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "gerl: 2 processes (WORLD_SIZE): engine.actor_workers=rollout_workers=2" in r.stderr
    r1, r2 = _rows(one), _rows(two)
    assert [row["step"] for row in r2] == [1, 2] and r1[0]["grad_norm"] > 0
    a, b = r1[0], r2[0]  # step 1: the same rollouts, rewards and update, to rounding
    assert b["images"] == a["images"] == 8
    for key in KEYS:
        assert _rel(b[key], a[key]) <= 1e-5 or abs(b[key] - a[key]) <= 1e-12, (key, b[key], a[key])
    # the adapter after that step within AdamW's rounding (the gradients were summed in another order)
    l1, l2 = (load_file(str(run / "checkpoints/step_000001/pytorch_lora_weights.safetensors")) for run in (one, two))
    assert l1.keys() == l2.keys() and all(torch.allclose(l2[k], l1[k], rtol=0, atol=1e-2 * 1e-3) for k in l1)
    # step 2 generates with those weights: a last-bit difference may move a JPEG's size by a byte (the reward is the
    # image's compressed kB), so its statistics agree to that, and each rank's replay still equals its rollout
    a, b = r1[1], r2[1]
    assert b["images"] == 8 and _rel(b["reward_mean"], a["reward_mean"]) <= 1e-3 and b["grad_norm"] > 0
    assert max(r["ratio_max_dev_before_update"] for r in r2) <= 1e-6
    ran = yaml.safe_load((two / "config.yaml").read_text())["engine"]
    assert (ran["kind"], ran["actor_workers"], ran["rollout_workers"]) == ("local", 2, 2)
    # only rank 0 wrote the run directory (the audit sees rank 0's writes, so it would see rank 1's)
    rank0, rank1 = (json.loads((audit / f"rank{i}.json").read_text()) for i in (0, 1))
    assert any(w.endswith("metrics.jsonl") for w in rank0) and any("checkpoints" in w for w in rank0), rank0
    assert rank1 == [], rank1
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
