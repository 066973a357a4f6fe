"""Every algorithm under every schedule: flow_grpo's own schedule tests live beside this file; here nft and awm
run locally (sync, reward futures) and on real Ray actors (one-step-off, staleness 2, stream, hybrid), with the
rollouts holding exactly what each algorithm samples with — nft its anchor (old policy), awm the trained weights —
and an nft resume that is bit-exact, anchor included."""

import json

import pytest
import torch

ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from gerl.trainer import Trainer, prepare, train  # noqa: E402
from tests.train.helpers import small_config  # noqa: E402

DECOUPLED = ["engine.kind=ray", "engine.hybrid=false", "engine.device=cpu", "engine.cpus_per_worker=1"]
# a small, moving anchor (decay 0.5 from the first optimizer step) so that "the anchor" and "the weights" differ
NFT = ["algo.name=nft", "algo.nft_beta=0.5", "algo.anchor_decay_rate=1", "algo.anchor_decay_max=0.5",
       "sampling.num_steps=4", "algo.train_timesteps=2"]
AWM = ["algo.name=awm", "algo.timesteps=stratified", "sampling.num_steps=4", "algo.train_timesteps=2",
       "algo.awm_weighting=ghuber", "algo.anchor_beta=0.5", "algo.anchor_decay_max=0.3", "algo.anchor_decay_rate=0.1",
       "train.clip_range=0.5", "reward.name=jpeg_compressibility"]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo", [NFT, AWM], ids=["nft", "awm"])
def test_local_sync_with_reward_futures(algo, tmp_path):
    train(small_config(tmp_path, "max_steps=2", *algo))
    rows = _rows(tmp_path)
    assert all(r["grad_norm"] > 0 and r["optimizer_steps"] >= 1 and r["trained_steps_per_sample"] == 2 for r in rows)
    ckpt = tmp_path / "checkpoints/step_000002"
    anchor, trained = load_file(str(ckpt / "anchor.safetensors")), load_file(str(ckpt / "trainable.safetensors"))
    assert anchor.keys() == trained.keys() and any(not torch.equal(anchor[k], trained[k]) for k in anchor)
    if "algo.name=awm" in algo:
        assert all(r["ratio_max_dev_before_update"] < 1e-5 for r in rows)  # the surrogate's ratio starts at 1


def _train_checking_sync(cfg):
    """Train; after every weight sync each rollout must hold what the actor samples with (nft: its anchor)."""
    trainer = Trainer(cfg, prepare(cfg))
    engine, checks = trainer.engine, []
    real_sync = engine.sync
    engine.sync = lambda: (real_sync(), checks.append(engine.weights_equal()))[0]
    trainer.fit()
    return checks


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("algo, schedule", [
    (NFT, ["engine.schedule=async", "engine.max_staleness=1"]),
    (AWM, ["engine.schedule=async", "engine.max_staleness=2"]),
    (NFT, ["engine.schedule=stream", "engine.max_staleness=1"]),
], ids=["nft-one-step-off", "awm-stale2", "nft-stream"])
def test_decoupled_schedules_sync_the_sampling_weights(algo, schedule, tmp_path):
    cfg = small_config(tmp_path, "max_steps=3", *DECOUPLED, *algo, *schedule)
    checks = _train_checking_sync(cfg)
    rows = _rows(tmp_path)
    if "engine.schedule=async" in schedule:  # (the stream stages weights and loads them at the next micro-batch)
        assert checks and all(checks), "every rollout holds the actor's sampling weights after each sync"
    assert all(r["grad_norm"] > 0 for r in rows) and max(r["policy_lag"] for r in rows) >= 1


@pytest.mark.usefixtures("ray_cluster")
def test_nft_on_hybrid_hosts_samples_with_the_anchor_and_validates_the_weights(tmp_path):
    train(small_config(tmp_path, "max_steps=2", "engine.kind=ray", "engine.hybrid=true", "engine.device=cpu",
                       "engine.cpus_per_worker=2", "validation.every=1", "validation.num_prompts=2", *NFT))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows if r.get("val_reward_mean") is not None] == [0, 1, 2]
    assert all(r["grad_norm"] > 0 for r in rows if "grad_norm" in r)


@pytest.mark.usefixtures("ray_cluster")
def test_nft_async_resume_is_bit_exact(tmp_path):
    k = [*DECOUPLED, *NFT, "engine.schedule=async", "engine.max_staleness=1", "checkpoint.every=2",
         "checkpoint.keep_last=0"]
    train(small_config(tmp_path / "full", "max_steps=4", *k))
    train(small_config(tmp_path / "split", "max_steps=2", *k))
    train(small_config(tmp_path / "split", "max_steps=4", "resume=true", *k))
    full, split = _rows(tmp_path / "full"), _rows(tmp_path / "split")
    for key in ("reward_mean", "policy_loss", "grad_norm", "anchor_decay"):
        assert [r[key] for r in split] == [r[key] for r in full], key
    for name in ("trainable.safetensors", "anchor.safetensors"):
        a = load_file(str(tmp_path / "full/checkpoints/step_000004" / name))
        b = load_file(str(tmp_path / "split/checkpoints/step_000004" / name))
        assert all(torch.equal(a[n], b[n]) for n in a), name
