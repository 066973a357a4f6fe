"""The Ray engine with real Ray actors on CPU: one-step-off lag, exact weight sync, staleness bound, validation
pausing generation, a killed rollout worker replaced, resume, hybrid placement, and mis-placement errors."""

import json

import pytest

ray = pytest.importorskip("ray")  # a dev dependency: installed by scripts/setup.sh

from gerl.errors import UserError  # noqa: E402
from gerl.trainer import Trainer, prepare, train  # noqa: E402
from tests.train.helpers import small_config  # noqa: E402

DECOUPLED = ["engine.kind=ray", "engine.hybrid=false", "engine.device=cpu", "engine.cpus_per_worker=1",
             "engine.schedule=async", "engine.max_staleness=1"]


pytestmark = pytest.mark.usefixtures("ray_cluster")  # tests/engine/conftest.py


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train_checking_sync(cfg):
    """Run training; after every weight sync, check that each rollout's tensors equal the actor's exactly."""
    trainer = Trainer(cfg, prepare(cfg))
    engine, checks = trainer.engine, []
    real_sync = engine.sync

    def sync():
        seconds = real_sync()
        checks.append(engine.weights_equal())
        return seconds

    engine.sync = sync
    trainer.fit()
    return checks


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_one_step_off_lag_and_exact_weight_sync(tmp_path, mode):
    extra = ["model.lora=false", "train.learning_rate=1e-4"] if mode == "full" else []
    cfg = small_config(tmp_path, "max_steps=4", *DECOUPLED, *extra)
    checks = _train_checking_sync(cfg)
    rows = _rows(tmp_path)
    assert [r["policy_lag"] for r in rows] == [0, 1, 1, 1]  # the first batch is on-policy; then one step behind
    assert [r["policy_version"] for r in rows] == [0, 0, 1, 2]
    assert len(checks) == 4 and all(checks), "after each step's sync every rollout holds the actor's exact weights"
    assert all(0 < r["sync_s"] < r["step_s"] for r in rows)  # every step synced, inside its own step time


def test_staleness_bound_under_a_slow_actor(tmp_path):
    # three inner epochs make training slower than generation, so the rollout would run ahead if it could
    cfg = small_config(tmp_path, "max_steps=5", *DECOUPLED, "engine.max_staleness=2", "train.inner_epochs=3")
    train(cfg)
    lags = [r["policy_lag"] for r in _rows(tmp_path)]
    assert max(lags) <= 2 and lags == [0, 1, 2, 2, 2]


def test_validation_pauses_generation_then_resumes(tmp_path):
    cfg = small_config(tmp_path, "max_steps=4", *DECOUPLED, "validation.every=2", "validation.num_prompts=2")
    train(cfg)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows if "val_reward_mean" in r] == [0, 2, 4]
    spans = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    val = next(s for s in spans if s["lane"] == "trainer" and s["name"] == "validate" and s["step"] == 2)
    # the batch for step 4 is issued only once validation at step 2 is over
    gen4 = [s for s in spans if s["lane"].startswith("rollout") and s["step"] == 4 and s["name"].startswith("generate")]
    assert gen4 and min(s["start"] for s in gen4) >= val["end"]
    assert [r["policy_lag"] for r in rows if "policy_lag" in r] == [0, 1, 1, 1]


def test_killed_rollout_worker_is_replaced_and_the_run_completes(tmp_path):
    marker = tmp_path / "killed"
    cfg = small_config(tmp_path / "run", "max_steps=4", *DECOUPLED, "reward.name=tests.engine.killer:KillOnce",
                       f"reward.kwargs={{marker: {marker}, after_calls: 3}}")
    train(cfg)
    assert marker.exists(), "the reward must have killed its rollout worker"
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # every step once: nothing lost, nothing double-counted
    assert rows[-1]["rollout_restarts"] == 1
    assert all(r["reward_mean"] < 0 for r in rows)


def test_resume_mid_run_reissues_the_step_in_flight_with_its_version(tmp_path):
    """That the resumed run equals the uninterrupted one bit for bit is test_stream.py's test_async_resume_is_bit_exact;
    here: the LoRA checkpoint layout and the in-flight step's version across a resume of the default one-step-off."""
    train(small_config(tmp_path, "max_steps=2", "checkpoint.every=2", *DECOUPLED))
    train(small_config(tmp_path, "max_steps=4", "checkpoint.every=2", "resume=true", *DECOUPLED))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # step 3 was in flight at the checkpoint: re-issued with the version it had (1), as uninterrupted
    assert [r["policy_version"] for r in rows][2:] == [1, 2]
    assert (tmp_path / "checkpoints/step_000004/pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("sync", ["object_store", "broadcast"])
def test_the_merged_lora_stays_exact_across_weight_sync(tmp_path, sync):
    """model.merge_lora on decoupled hosts in bf16 with the sync schedule (each step generated with the weights
    the last one trained, synced through `sync`): every rollout host re-merges the adapter it receives, so the
    ratio before every update is 1 up to the SDE step's own fp32 rounding (one ulp), as in one process. Rollout
    hosts that never re-merged (the actor re-merging) gave 3.4e-4 at step 2 and 1.9e-3 at step 3."""
    cfg = small_config(tmp_path, "max_steps=3", "engine.kind=ray", "engine.hybrid=false", "engine.device=cpu",
                       "engine.cpus_per_worker=1", f"engine.weight_sync={sync}", "model.dtype=bf16",
                       "model.merge_lora=true")
    checks = _train_checking_sync(cfg)
    rows = _rows(tmp_path)
    assert len(checks) == 3 and all(checks)
    assert [r["policy_lag"] for r in rows] == [0, 0, 0] and [r["policy_version"] for r in rows] == [0, 1, 2]
    assert all(r["ratio_max_dev_before_update"] <= 2.0**-23 for r in rows), rows


def test_misplacement_names_the_numbers(tmp_path):
    cfg = small_config(tmp_path, "max_steps=1", "engine.kind=ray", "engine.hybrid=false", "engine.device=cpu",
                       "engine.actor_workers=2", "engine.rollout_workers=2", "engine.cpus_per_worker=1",
                       "train.mini_batch_size=8", "data.prompts_per_step=2")
    with pytest.raises(UserError, match=r"asks for 4 CPUs \(2 actor \+ 2 rollout hosts × 1 engine.cpus_per_worker\) but the Ray cluster has 2"):
        train(cfg)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_data_parallel_actors_stay_identical(tmp_path, tiny_dir):
    """Two colocated hosts (1 core each): generation sharded over both, gradients all-reduced over gloo, so the
    two ranks' weights stay bit-identical after every update while each trained on its own half of the batch.
    The model comes from a directory, as SD3.5-M does: the tiny builder seeds torch's global generator, loading
    seeds nothing, and each Ray process starts from another random seed, so a fresh adapter's A must come from
    the run's seed for the ranks to start equal (they did not, before add_lora took the seed)."""
    import torch

    cfg = small_config(tmp_path, "max_steps=2", "engine.kind=ray", "engine.hybrid=true", "engine.device=cpu",
                       "engine.actor_workers=2", "engine.rollout_workers=2", "engine.cpus_per_worker=1",
                       "data.prompts_per_step=2", "train.mini_batch_size=8", f"model.path={tiny_dir}")
    trainer = Trainer(cfg, prepare(cfg))
    engine, same = trainer.engine, []
    before, before1 = ray.get([h.actor_weights.remote() for h in engine.actors])
    assert all(torch.equal(before[k], before1[k]) for k in before), "the ranks start from different adapters"
    real_sync = engine.sync

    def sync():
        w0, w1 = ray.get([h.actor_weights.remote() for h in engine.actors])
        same.append(all(torch.equal(w0[k], w1[k]) for k in w0) and any(not torch.equal(w0[k], before[k]) for k in w0))
        return real_sync()

    engine.sync = sync
    trainer.fit()
    assert same == [True, True], "ranks must move, and move identically"
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["devices"] == 2
    spans = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert {"rollout0", "rollout1", "actor0", "actor1"} <= {s["lane"] for s in spans}


def test_actor_death_stops_the_run_with_the_last_checkpoint_intact(tmp_path):
    from gerl.checkpoint import list_checkpoints
    from gerl.errors import RunAborted

    cfg = small_config(tmp_path, "max_steps=4", "checkpoint.every=2", *DECOUPLED)
    trainer = Trainer(cfg, prepare(cfg))
    engine = trainer.engine
    real_update = engine.update

    def update(batch, adv, step):
        if step == 3:
            ray.kill(engine.actors[0])  # the training process dies mid-run
        return real_update(batch, adv, step)

    engine.update = update
    with pytest.raises(RunAborted, match="actor .* died at step 3.*resume=true"):
        trainer.fit()
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_000002"]
    state = json.loads((tmp_path / "checkpoints/step_000002/trainer_state.json").read_text())
    assert state["step"] == 2
    # and the run resumes from it
    train(small_config(tmp_path, "max_steps=3", "checkpoint.every=2", "resume=true", *DECOUPLED))
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]


def test_unreachable_ray_address_fails_fast_naming_it():
    """A host:port where nothing listens is refused in well under ray.init's minutes of retries."""
    import socket
    import time

    from gerl.engine.ray_engine import check_ray_address
    from gerl.errors import UserError

    with socket.socket() as s:  # a port that was free a moment ago and that nothing listens on now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=rf"engine.ray_address=127.0.0.1:{port}: nothing answers"):
        check_ray_address(f"127.0.0.1:{port}")
    assert time.perf_counter() - t0 < 30
    with pytest.raises(UserError, match="not a number"):
        check_ray_address("127.0.0.1:head")
    check_ray_address("auto")  # left to ray.init, which fails fast itself when no cluster runs here


# Last: these two take the cluster's 2 CPUs from the 1 actor + 1 rollout (or 2 hybrid) hosts the runs above
# leave for each other (gerl/engine/pool.py keeps one shape of hosts at a time): placed before, each sent the
# next run back to starting hosts (~7 s of CPU each). Any order passes.
def test_hybrid_on_ray(tmp_path):
    train(small_config(tmp_path, "max_steps=2", "engine.kind=ray", "engine.hybrid=true", "engine.device=cpu",
                       "engine.cpus_per_worker=2"))
    rows = _rows(tmp_path)
    assert [r["policy_lag"] for r in rows] == [0, 0] and [r["policy_version"] for r in rows] == [0, 1]
    # Lag 0 is more than a version number: step 2 was generated with the weights step 1 trained, so before its
    # update the actor's log-probs of those very transitions are the rollout's, up to fp32 rounding (1.2e-7 here;
    # a rollout left on its own copy of the weights gives 3.4e-4)
    assert rows[0]["grad_norm"] > 0 and all(r["ratio_max_dev_before_update"] < 1e-5 for r in rows)


def test_reward_replicas_as_ray_actors_keep_order_and_survive_a_death():
    from PIL import Image

    from gerl.workers.reward import RewardExecutor
    from tests.workers import faulty

    img = Image.new("RGB", (8, 8))
    ex = RewardExecutor(faulty.DiesOn(), "ray", workers=2, timeout_s=30, retries=0, num_cpus=0.5)
    futs = [ex.submit([img, img], [p, p + "x"], [{}, {}]) for p in ("a", "bb", "ccc")]
    assert [ex.result(f).scores for f in futs] == [[1.0, 2.0], [2.0, 3.0], [3.0, 4.0]]
    dead = ex.result(ex.submit([img], ["die"], [{}]))
    assert dead.failed == [True] and ex.worker_restarts == 1
    again = [ex.result(ex.submit([img], ["ok"], [{}])) for _ in range(2)]  # both replicas answer again
    assert [r.scores for r in again] == [[2.0], [2.0]]
    ex.close()
