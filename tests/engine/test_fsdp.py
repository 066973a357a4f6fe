"""The data-parallel layer end to end on real Ray hosts (gloo process groups on the CPU): two hosts sharded with FSDP2
(engine.fsdp=true) train exactly as one unsharded host, resume bit-exactly from a sharded checkpoint and export a
transformer stock `from_pretrained` loads; LoRA replicas (FSDP2's replicate: DDP) equal one host and log global
metrics; sharded actors hand whole weights, bucket by bucket, to a decoupled rollout.

Layouts are chosen so that 1 and 2 ranks compute the same micro-batches: unshuffled mini-batches (rank r trains
samples r·B/2 … of the step's batch, in the order the 1-rank run does), 2 samples per training micro-batch, 4 per
rollout micro-batch. The differences left are the order in which fp32 sums of gradients are taken."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from gerl.engine import pool  # noqa: E402
from gerl.engine.resources import own_ray_env  # noqa: E402
from gerl.trainer import Trainer, prepare, train  # noqa: E402
from tests.train.helpers import small_config  # noqa: E402

HYBRID = ["engine.kind=ray", "engine.hybrid=true", "engine.device=cpu", "engine.cpus_per_worker=1",
          "train.mini_batch_size=8", "train.micro_batch_size=2", "train.shuffle_mini_batches=false"]
ONE = ["engine.actor_workers=1", "engine.rollout_workers=1"]
TWO = ["engine.actor_workers=2", "engine.rollout_workers=2"]
FULL_FLUX = ["model.path=tiny-flux", "model.lora=false", "sampling.guidance_scale=3.5"]
# the KL term's frozen reference copy (sharded too) and an EMA of the weights (each rank averages its shard)
KL_EMA = ["train.beta=0.01", "train.ema_decay=0.9"]
LR = 1e-4


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """One local Ray for the module: 2 CPUs for the hosts pinned to this machine's 2 cores, and 3 declared GPUs
    (and CPUs) for the rehearsed decoupled layout, whose hosts are not pinned; hosts are kept between runs
    (gerl/engine/pool.py), as tests/engine/conftest.py does."""
    own_ray_env()
    ray.init(address="local", num_cpus=3, num_gpus=3, include_dashboard=False, log_to_driver=False)
    with pool.kept():
        yield
    ray.shutdown()


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _transformer(run_dir, step: int) -> dict[str, torch.Tensor]:
    d = run_dir / f"checkpoints/step_{step:06d}/transformer"
    return load_file(str(d / "diffusion_pytorch_model.safetensors"))


def test_two_sharded_hosts_train_as_one_unsharded_host_and_resume_bit_exactly(tmp_path):
    """tiny-flux, full fine-tuning, fp32, with a KL term (its frozen reference sharded as well) and an EMA. Broken
    versions this catches (commit messages): statistics of rank 0 alone (policy_loss differs); AdamW moments left out
    of the sharded checkpoint, or a kept host loading another rank's shards (the resumed step 2 differs)."""
    one, two = tmp_path / "one", tmp_path / "two"
    steps = ["max_steps=2", "checkpoint.every=1", "checkpoint.keep_last=0", f"train.learning_rate={LR}"]
    train(small_config(one, *steps, *FULL_FLUX, *KL_EMA, *HYBRID, *ONE))
    train(small_config(two, *steps, *FULL_FLUX, *KL_EMA, *HYBRID, *TWO, "engine.fsdp=true"))
    r1, r2 = _rows(one)[0], _rows(two)[0]
    assert r1["grad_norm"] > 0 and _rel(r2["grad_norm"], r1["grad_norm"]) <= 1e-5
    for key in ("policy_loss", "approx_kl", "ratio_mean"):  # every rank's micro-batches, not rank 0's
        assert _rel(r2[key], r1[key]) <= 1e-5, (key, r2[key], r1[key])
    # the KL to the (sharded) frozen reference, once the policy has moved away from it
    k1, k2 = _rows(one)[1]["kl"], _rows(two)[1]["kl"]
    assert k1 > 0 and _rel(k2, k1) <= 1e-5, (k2, k1)
    # the sharded hosts generate with the very module they train: their log-probs are the rollout's
    assert r2["ratio_max_dev_before_update"] <= 1e-6
    # one AdamW step: every weight within 1 % of the step size of the unsharded run's (an entry whose gradient is
    # about AdamW's eps moves by a fraction of lr that the gradient's last bits decide)
    w1, w2 = _transformer(one, 1), _transformer(two, 1)
    assert w1.keys() == w2.keys()
    assert (w1["proj_out.weight"] - _initial("proj_out.weight")).abs().max() > 0.5 * LR  # the step moved it
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-2 * LR)
    # the export is a plain diffusers directory (in model.dtype, under the stock class name)
    from diffusers import FluxTransformer2DModel

    d = two / "checkpoints/step_000001/transformer"
    assert json.loads((d / "config.json").read_text())["_class_name"] == "FluxTransformer2DModel"
    stock = FluxTransformer2DModel.from_pretrained(str(d))
    assert stock.dtype == torch.float32 and torch.equal(stock.state_dict()["proj_out.weight"], w2["proj_out.weight"])
    # the sharded checkpoint's EMA: every rank's shard of 0.9·w0 + 0.1·w1
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(two / "checkpoints/step_000001/sharded"), str(tmp_path / "sharded.pt"))
    ema2 = torch.load(tmp_path / "sharded.pt", weights_only=False)["ema"]
    ema1 = load_file(str(one / "checkpoints/step_000001/ema.safetensors"))
    assert ema1.keys() == ema2.keys()
    for k in ema1:
        torch.testing.assert_close(ema2[k], ema1[k], rtol=0, atol=1e-3 * LR)

    # resume step 2 from the sharded checkpoint of step 1: bit for bit the uninterrupted run
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(two / "checkpoints/step_000001", resumed / "checkpoints/step_000001")
    shutil.copy(two / "config.yaml", resumed / "config.yaml")
    (resumed / "metrics.jsonl").write_text((two / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    train(small_config(resumed, "max_steps=2", "checkpoint.every=1", "checkpoint.keep_last=0", "resume=true",
                       f"train.learning_rate={LR}", *FULL_FLUX, *KL_EMA, *HYBRID, *TWO, "engine.fsdp=true"))
    a, b = _rows(two)[1], _rows(resumed)[1]
    assert a["step"] == b["step"] == 2
    for key in ("policy_loss", "grad_norm", "ratio_max_dev_before_update", "approx_kl", "kl"):
        assert a[key] == b[key], key
    u, r = _transformer(two, 2), _transformer(resumed, 2)
    assert all(torch.equal(u[k], r[k]) for k in u)


def _initial(key: str) -> torch.Tensor:
    """A weight of the tiny FLUX as built, before training."""
    from gerl.models.loader import load_pipeline

    return load_pipeline("tiny-flux", "fp32", "cpu", 0, ("transformer",)).transformer.state_dict()[key]


def test_lora_replicas_through_ddp_equal_one_host_with_global_metrics(tmp_path):
    """The tiny SD3 with a LoRA on 2 hybrid replicas (FSDP2's replicate: gradients all-reduced per block) and on 1
    host: the same step-1 statistics — every logged mean over both ranks' micro-batches, where rank 0's own
    policy_loss differed (2.85e-6 against 3.21e-6 before) — and the same adapter after the step."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["max_steps=1", "train.learning_rate=1e-3", *HYBRID]
    train(small_config(two, *common, *TWO))  # on the 2 hosts the test before left (gerl/engine/pool.py)
    train(small_config(one, *common, *ONE))
    r1, r2 = _rows(one)[0], _rows(two)[0]
    assert r1["grad_norm"] > 0
    for key in ("grad_norm", "policy_loss", "approx_kl", "ratio_mean", "clipfrac", "grad_zero_frac"):
        assert _rel(r2[key], r1[key]) <= 1e-5 or abs(r2[key] - r1[key]) <= 1e-12, (key, r2[key], r1[key])
    assert r2["ratio_max_dev_before_update"] <= 1e-6
    l1 = load_file(str(one / "checkpoints/step_000001/pytorch_lora_weights.safetensors"))
    l2 = load_file(str(two / "checkpoints/step_000001/pytorch_lora_weights.safetensors"))
    assert l1.keys() == l2.keys()
    for k in l1:
        torch.testing.assert_close(l2[k], l1[k], rtol=0, atol=1e-2 * 1e-3)


NFT = ["algo.name=nft", "algo.nft_beta=0.5", "algo.anchor_decay_rate=1", "algo.anchor_decay_max=0.5",
       "sampling.num_steps=4", "algo.train_timesteps=2", "sampling.guidance_scale=1"]


def test_sharded_actors_broadcast_the_whole_anchor_to_a_decoupled_rollout(tmp_path):
    """The GPU layout 2 sharded actor ranks + 1 rollout, rehearsed on the CPU (3 hosts on 2 cores: gloo in place of
    NCCL, the GPU run's backend map), NFT full fine-tuning in bf16: after every update each bucket of what the
    rollout samples with — NFT's anchor, a moving average kept on each rank's shard — is gathered whole over the
    actor ranks and broadcast in the rollout's dtype, so the rollout holds exactly the bf16 anchor the actors hold
    (their fp32 one rounded once), not the trained weights (the broadcast sent those before)."""
    cfg = small_config(tmp_path, "max_steps=2", *FULL_FLUX, *NFT, "model.dtype=bf16", "engine.kind=ray",
                       "engine.hybrid=false", "engine.device=cuda", "engine.rehearse=true", "engine.cpus_per_worker=1",
                       "engine.actor_workers=2", "engine.rollout_workers=1", "engine.fsdp=true", "train.mini_batch_size=8",
                       "train.micro_batch_size=2", f"train.learning_rate={LR}")
    trainer = Trainer(cfg, prepare(cfg))
    engine, checks = trainer.engine, []
    assert engine.sync_mode == "broadcast"
    real_sync = engine.sync

    def sync():
        seconds = real_sync()
        held = ray.get(engine.rollouts[0].rollout_weights.remote())
        checks.append((engine.weights_equal(), {t.dtype for t in held.values()}))
        return seconds

    engine.sync = sync
    trainer.fit()
    rows = _rows(tmp_path)
    assert checks == [(True, {torch.bfloat16})] * 2 and all(r["grad_norm"] > 0 for r in rows)  # after each update
    assert all(0 < r["anchor_decay"] < 1 for r in rows)  # the anchor is not the trained weights
