"""Every algorithm under every schedule: flow_grpo's own schedule tests live beside this file; here nft, awm and dgpo
run locally (sync, reward futures) and on real Ray actors (one-step-off, staleness 2, stream, hybrid), with the
rollouts holding exactly what each algorithm samples with — nft its anchor (old policy), awm the trained weights,
dgpo the trained weights and then, after its switch, the anchor — nft's validation scoring the trained weights, and
an nft resume that is bit-exact, anchor included."""

import json
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from PIL import Image

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
# groups of 4 in mini-batches of 4: one group per optimizer step; rollouts switch to the anchor after 1 optimizer step
DGPO = ["algo.name=dgpo", "algo.timesteps=shared", "sampling.num_steps=4", "algo.train_timesteps=2",
        "algo.dgpo_beta=10", "algo.anchor_decay_rate=0.1", "algo.anchor_decay_max=0.3",
        "algo.dgpo_sample_anchor_after=1", "train.clip_range=0.01", "train.beta=0.01"]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo", [NFT, AWM, DGPO], ids=["nft", "awm", "dgpo"])
def test_local_sync_with_reward_futures(algo, tmp_path):
    train(small_config(tmp_path, "max_steps=2", *algo))
    rows = _rows(tmp_path)
    assert all(r["grad_norm"] > 0 and r["optimizer_steps"] >= 1 and r["trained_steps_per_sample"] == 2 for r in rows)
    ckpt = tmp_path / "checkpoints/step_000002"
    anchor, trained = load_file(str(ckpt / "anchor.safetensors")), load_file(str(ckpt / "trainable.safetensors"))
    assert anchor.keys() == trained.keys() and any(not torch.equal(anchor[k], trained[k]) for k in anchor)


def _train_checking_sync(cfg):
    """Train; after every weight sync each rollout must hold what the actor samples with (nft: its anchor)."""
    trainer = Trainer(cfg, prepare(cfg))
    engine, checks = trainer.engine, []
    real_sync = engine.sync
    engine.sync = lambda: (real_sync(), checks.append(engine.weights_equal()))[0]
    trainer.fit()
    return checks


# The Ray tests below run in an order that lets the module's Ray keep its hosts from one run to the next
# (gerl/engine/pool.py keeps one shape at a time): the stream's hosts first, then every run of 1 actor + 1 rollout
# host or 2 hybrid hosts, then the deterministic hybrid run (one host, never pooled). Any order passes; this one
# starts 5 hosts where the file's former order started 13 (~7 s of CPU each).
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("algo, schedule", [
    (NFT, ["engine.schedule=stream", "engine.max_staleness=1"]),
    (DGPO, ["engine.schedule=stream", "engine.max_staleness=1"]),
    (NFT, ["engine.schedule=async", "engine.max_staleness=1"]),
    (AWM, ["engine.schedule=async", "engine.max_staleness=2"]),
    (DGPO, ["engine.schedule=async", "engine.max_staleness=1"]),
], ids=["nft-stream", "dgpo-stream", "nft-one-step-off", "awm-stale2", "dgpo-one-step-off"])
def test_decoupled_schedules_sync_the_sampling_weights(algo, schedule, tmp_path):
    cfg = small_config(tmp_path, "max_steps=3", *DECOUPLED, *algo, *schedule)
    checks = _train_checking_sync(cfg)
    rows = _rows(tmp_path)
    # (a streaming rollout is checked on what it holds once the buckets it has staged are loaded)
    assert len(checks) >= 3 and all(checks), "every rollout holds the actor's sampling weights after each sync"
    assert all(r["grad_norm"] > 0 for r in rows) and max(r["policy_lag"] for r in rows) >= 1


@pytest.mark.usefixtures("ray_cluster")
def test_dgpo_on_hybrid_hosts_trains_and_validates_the_weights(tmp_path):
    """Two hybrid hosts (data parallel, one group each per optimizer step): the host's rollout shares the actor's
    transformer and samples with the anchor after the switch; validation scores the trained weights."""
    train(small_config(tmp_path, "max_steps=2", "engine.kind=ray", "engine.hybrid=true", "engine.device=cpu",
                       "engine.cpus_per_worker=1", "engine.actor_workers=2", "engine.rollout_workers=2",
                       "train.mini_batch_size=8", "validation.every=1", "validation.num_prompts=2", *DGPO))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows if r.get("val_reward_mean") is not None] == [0, 1, 2]
    assert all(r["grad_norm"] > 0 and r["optimizer_steps"] == 1 for r in rows if "grad_norm" in r)


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


@contextmanager
def _threads(n: int):
    """Run with torch's intra-op threads of a Ray host here (pinned to engine.cpus_per_worker cores), so that the
    same weights give the same images bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("ray_cluster")
def test_nft_on_hybrid_hosts_samples_with_the_anchor_and_validates_the_weights(tmp_path):
    """A hybrid host's rollout shares the actor's transformer: step 2's training images must be those of the anchor
    after update 1 (not of the trained weights), and the validation after update 2 those of the trained weights
    (not of the anchor). Both are regenerated here from the checkpoints and compared pixel for pixel with the
    grids the run saved. The host also runs train.deterministic=true (placement.json records it)."""
    from gerl.data.prompts import PromptSampler, load_prompts
    from gerl.engine.roles import build_pipeline
    from gerl.logging.images import image_grid
    from gerl.models.loader import TextEmbedder
    from gerl.workers.rollout import RolloutWorker

    cfg = small_config(tmp_path, "max_steps=2", "engine.kind=ray", "engine.hybrid=true", "engine.device=cpu",
                       "engine.cpus_per_worker=2", "validation.every=1", "validation.num_prompts=2",
                       "log.images_every=1", "checkpoint.every=1", "checkpoint.keep_last=0", "train.deterministic=true",
                       *NFT)
    train(cfg)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows if r.get("val_reward_mean") is not None] == [0, 1, 2]
    assert all(r["grad_norm"] > 0 for r in rows if "grad_norm" in r)
    placement = json.loads((tmp_path / "placement.json").read_text())
    assert placement and all(h["deterministic"] and h["cublas_workspace_config"] == ":4096:8" for h in placement)

    pipe = build_pipeline(cfg)  # the tiny model with the run's fresh adapter; the checkpoints' tensors go into it
    params = dict(pipe.transformer.named_parameters())
    worker = RolloutWorker(pipe, TextEmbedder(pipe, cfg.model.max_sequence_length), cfg.sampling,
                           cfg.model.resolution, cfg.seed, record_sde=False)
    n = cfg.data.group_size
    sampler = PromptSampler(load_prompts(cfg.data.train_prompts), cfg.data.prompts_per_step, cfg.seed)
    sampler.next_prompts()
    chosen = sampler.next_prompts()  # step 2's prompts
    test_prompts = [p.text for p in load_prompts(cfg.data.test_prompts)[: cfg.validation.num_prompts]]

    def with_weights(step: int, name: str, make):
        state = load_file(str(tmp_path / f"checkpoints/step_{step:06d}/{name}.safetensors"))
        with torch.no_grad():
            for k, t in state.items():
                params[k].copy_(t)
        with _threads(cfg.engine.cpus_per_worker):
            return np.asarray(make(), dtype=np.int16)

    def step2_rollout():
        prompts, metadata = [p.text for p in chosen for _ in range(n)], [dict(p.metadata) for p in chosen for _ in range(n)]
        batch = worker.generate(prompts, metadata, torch.arange(len(chosen)).repeat_interleave(n), step=2)
        return image_grid(batch.images[: 4 * n], cols=n)

    def validation():
        return image_grid(worker.sample_images(test_prompts, cfg.validation.seed, cfg.sampling.eval_num_steps,
                                               cfg.sampling.eval_guidance_scale))

    saved_train = np.asarray(Image.open(tmp_path / "samples/train_step_000002.png").convert("RGB"), dtype=np.int16)
    anchor1, trained1 = with_weights(1, "anchor", step2_rollout), with_weights(1, "trainable", step2_rollout)
    assert np.abs(trained1 - anchor1).max() > 0, "the anchor and the weights must differ for this test to see anything"
    assert np.array_equal(saved_train, anchor1), "step 2 was not sampled with the anchor of update 1"

    saved_val = np.asarray(Image.open(tmp_path / "samples/val_step_000002.png").convert("RGB"), dtype=np.int16)
    anchor2, trained2 = with_weights(2, "anchor", validation), with_weights(2, "trainable", validation)
    assert np.abs(trained2 - anchor2).max() > 0
    assert np.array_equal(saved_val, trained2), "validation after update 2 did not score the trained weights"
