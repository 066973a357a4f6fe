"""Asynchronous schedules with real Ray actors on CPU: an async run resumed from a checkpoint equals the
uninterrupted run bit for bit (the generations in flight are re-issued with their own older weights), and the
streaming schedule (groups pulled from one prompt stream, trained in completion order, staleness bounded)."""

import json

import pytest
import torch

ray = pytest.importorskip("ray")  # a dev dependency: installed by scripts/setup.sh

from safetensors.torch import load_file  # noqa: E402

from gerl.trainer import train  # noqa: E402
from tests.train.helpers import REPO, small_config  # noqa: E402

DECOUPLED = ["engine.kind=ray", "engine.hybrid=false", "engine.device=cpu", "engine.cpus_per_worker=1"]


pytestmark = pytest.mark.usefixtures("ray_cluster")  # tests/engine/conftest.py


def _run(out, *overrides):
    train(small_config(out, *DECOUPLED, *overrides))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("k", [1, 2])
def test_async_resume_is_bit_exact(tmp_path, k):
    """A run stopped after its step-2 checkpoint and resumed equals the uninterrupted run. k = 1 is one-step-off (the
    mission's schedule). A cosine LR with warm-up over the run's 5 steps makes every step's learning rate differ, so
    a scheduler or optimizer resumed one step off shows. The rollout hosts are fresh processes after the resume:
    any state of theirs that mattered (their sampling noise is a function of seed, step and sample only) would
    show in reward_mean."""
    import shutil

    a = ["max_steps=5", "engine.schedule=async", f"engine.max_staleness={k}", "checkpoint.every=2",
         "checkpoint.keep_last=0", "train.lr_schedule=cosine", "train.warmup_steps=1", "train.learning_rate=0.05"]
    full = _run(tmp_path / "full", *a)
    # the state a run killed during step 3 leaves: the step-2 checkpoint and the rows logged up to it
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "full", split)
    for later in sorted((split / "checkpoints").glob("step_*"))[1:]:  # step 4 and the final step 5
        shutil.rmtree(later)
    (split / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full if r["step"] <= 2))
    ckpt = split / "checkpoints/step_000002"
    # steps 3..2+k were in flight at the checkpoint, generated with versions 2−k, …, 1: saved with it
    assert {key.split("/")[0] for key in load_file(str(ckpt / "inflight_weights.safetensors"))} == \
        {f"v{v}" for v in range(2 - k, 2)}
    resumed = _run(split, *a, "resume=true")

    assert [r["policy_version"] for r in full] == [max(0, t - k - 1) for t in range(1, 6)]
    assert len({r["learning_rate"] for r in full}) == 5, "the LR must change every step for this test to bite"
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    for key in ("reward_mean", "policy_version", "policy_lag", "policy_loss", "grad_norm", "learning_rate"):
        assert [r[key] for r in resumed] == [r[key] for r in full], key
    a = load_file(str(tmp_path / "full/checkpoints/step_000004/trainable.safetensors"))
    b = load_file(str(split / "checkpoints/step_000004/trainable.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


STREAM = ["engine.schedule=stream", "engine.max_staleness=1", "reward.name=tests.engine.slow_reward:FirstCallSlow",
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
    P = 2
    state = json.loads((tmp_path / "checkpoints/step_000003/trainer_state.json").read_text())["stream"]
    dropped3 = next(r for r in rows if r["step"] == 3)["stale_groups_dropped_total"]
    # every group of the draws before first_draw, plus those listed in `consumed`, was trained or dropped, once:
    # 3 steps × P trained + the dropped ones, exactly
    assert (state["first_draw"] - 1) * P + len(state["consumed"]) == 3 * P + dropped3 == 3 * P + state["dropped_total"]
    assert all(g >= (state["first_draw"] - 1) * P for g in state["consumed"])
    resumed = _run(tmp_path, "max_steps=6", "resume=true", *STREAM)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert max(resumed[-1]["policy_lags"]) <= 1
    end = json.loads((tmp_path / "checkpoints/step_000006/trainer_state.json").read_text())["stream"]
    # the resumed run neither retrained nor skipped a group: the same identity holds over all 6 steps
    assert (end["first_draw"] - 1) * P + len(end["consumed"]) == 6 * P + end["dropped_total"]
    assert end["dropped_total"] == resumed[-1]["stale_groups_dropped_total"] >= dropped3


def test_downweighted_stale_groups_weigh_the_decay_in_the_loss(tmp_path):
    """stale=downweight: the straggler is kept (nothing dropped) and its samples weigh stale_decay^(lag −
    max_staleness) in the policy loss; checked on the stream's own assembly of a step's groups. And the run issues no
    group that its last steps cannot take: nothing is generated or scored past max_steps."""
    from types import SimpleNamespace

    from gerl.engine.stream import GroupStream
    from gerl.workers.batch import RolloutBatch

    from gerl.trainer import Trainer, prepare

    cfg = small_config(tmp_path, *DECOUPLED, "max_steps=5", *STREAM, "engine.stale=downweight", "engine.stale_decay=0.5")
    trainer = Trainer(cfg, prepare(cfg))
    end = {}
    real_close = trainer.engine.close

    def close():  # what the stream had issued and still had open when the run ended
        end.update(issued=trainer.engine.stream.next_group, open=trainer.engine.stream.cancel())
        real_close()

    trainer.engine.close = close
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lags = [lag for r in rows for lag in r["policy_lags"]]
    assert rows[-1]["stale_groups_dropped_total"] == 0 and max(lags) > 1, "the straggler was kept, stale"
    # nothing generated beyond max_steps: exactly the 5 steps × P = 2 groups trained were issued, none left open
    assert end == {"issued": 10, "open": 0}

    def unit(version):
        b = RolloutBatch(prompts=["p"] * 2, metadata=[{}] * 2, group_ids=torch.zeros(2, dtype=torch.long),
                         embeds=None, schedule=None, traj=None, images=[], policy_version=version)
        return b
    stream = GroupStream.__new__(GroupStream)
    stream.P, stream.n, stream.unit, stream.k, stream.stale, stream.decay = 3, 2, 1, 1, "downweight", 0.5
    stream.dropped_total = 0
    merged = SimpleNamespace(spans=[], group_ids=None, timings={}, stale_weight=None)
    import gerl.engine.stream as st
    real_merge, real_results = st.merge, st.merge_results
    st.merge, st.merge_results = (lambda bs: merged), (lambda rs, names: None)
    try:
        batch, _ = stream._assemble([(0, 0, unit(5), None), (1, 0, unit(4), None), (2, 0, unit(2), None)], 5, 0)
    finally:
        st.merge, st.merge_results = real_merge, real_results
    # lags 0, 1, 3 with max_staleness 1: weights 1, 1, 0.5^(3 − 1) = 0.25, one per image of each group
    assert batch.stale_weight.tolist() == [1.0, 1.0, 1.0, 1.0, 0.25, 0.25]
    assert batch.timings["policy_lags"] == [0, 1, 3]


def test_stream_validation_scores_the_actors_weights_and_the_last_one_the_saved_lora(tmp_path, capsys):
    """Under the stream the rollouts load new weights only when their next group starts: validation must be handed
    the actor's weights. The last validation equals a fresh `gerl eval` of the final checkpoint."""
    from gerl.cli import main

    rows = _run(tmp_path / "run", "max_steps=4", *STREAM, "validation.every=2", "validation.num_prompts=4")
    assert [r["step"] for r in rows if r.get("val_reward_mean") is not None] == [0, 2, 4]
    capsys.readouterr()
    assert main(["eval", "--lora", str(tmp_path / "run/checkpoints/step_000004"), "--prompts",
                 str(REPO / "assets/ocr/test.txt"), "--num-prompts", "4", "--seed", "1234", "--batch-size", "4",
                 "--reward", "jpeg_compressibility"]) == 0
    fresh = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mean"]
    assert rows[-1]["val_reward_mean"] == pytest.approx(fresh, abs=1e-6)


def test_full_fine_tuning_under_the_stream_loads_bucket_by_bucket(tmp_path):
    """Full weights are staged and loaded one bucket per micro-batch boundary (engine.sync_bucket_mb): the version
    changes only once the last bucket is in, so a group may straddle two versions and carries the older one."""
    rows = _run(tmp_path, "max_steps=4", *STREAM, "model.lora=false", "train.learning_rate=1e-4",
                "engine.sync_bucket_mb=1")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r["policy_version"] for r in rows) >= 1 and any(r["weight_load_s"] > 0 for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows)
