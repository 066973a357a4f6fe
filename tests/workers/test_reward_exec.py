"""Reward execution: order under out-of-order completion, timeouts, retries, dead workers, weighting, fault policy."""

import json
import math
import time

import pytest
import torch
from PIL import Image

from gerl.config import RewardComponent
from gerl.data.prompts import PromptSampler, load_prompts
from gerl.trainer import train
from gerl.workers.reward import RewardExecutor, RewardSet
from tests.train.helpers import small_config
from tests.workers import faulty

IMG = Image.new("RGB", (16, 16), "white")


def test_results_come_back_in_submission_order_when_completion_is_not():
    delays = {"a": 1.2, "b": 0.6, "c": 0.0}
    ex = RewardExecutor(faulty.Sleepy(delays), "thread", workers=3)
    t0 = time.perf_counter()
    futs = [ex.submit([IMG, IMG], [p, p], [{}, {}]) for p in "abc"]
    results = [ex.result(f) for f in futs]
    # one after another they could not finish in less than the sum of the sleeps (1.8 s); overlapped they take the
    # longest (1.2 s), and the 0.6 s between is slack for a loaded machine (the bar was 1.0 s for sleeps summing to
    # 0.9: it proved no overlap)
    assert time.perf_counter() - t0 < sum(delays.values()), "three sleeps in three workers must overlap"
    assert [r.scores for r in results] == [[1.2, 1.2], [0.6, 0.6], [0.0, 0.0]]
    ex.close()


def test_a_call_that_never_returns_times_out_and_is_counted():
    # the timeout is what a call that returns at once ("y" below) must beat on a loaded machine too (it was 0.2 s)
    ex = RewardExecutor(faulty.Sleepy({"x": 30.0}), "thread", workers=1, timeout_s=1.0, retries=1, backoff_s=0.01)
    t0 = time.perf_counter()
    r = ex.result(ex.submit([IMG], ["x"], [{}]))
    assert time.perf_counter() - t0 < 10, "two attempts of 1 s, not the 30 s call"
    assert r.failed == [True] and r.scores == [None] and r.timeouts == 2 and r.retries == 1
    # the pool is not blocked by the abandoned call
    ok = ex.result(ex.submit([IMG], ["y"], [{}]))
    assert ok.failed == [False] and ok.scores == [0.0]
    ex.close()


def test_dead_worker_process_is_replaced():
    ex = RewardExecutor(faulty.DiesOn(), "process", workers=1, timeout_s=30, retries=0)
    first = ex.result(ex.submit([IMG], ["ok"], [{}]))
    assert first.scores == [2.0]
    dead = ex.result(ex.submit([IMG], ["die"], [{}]))
    assert dead.failed == [True] and dead.errors == 1 and ex.worker_restarts == 1
    again = ex.result(ex.submit([IMG, IMG], ["abc", "de"], [{}, {}]))
    assert again.scores == [3.0, 2.0]
    ex.close()


def test_weighted_components_with_normalisation():
    a = RewardComponent(name="a", weight=2.0, normalize="zscore")
    b = RewardComponent(name="b", weight=0.5, normalize="scale", scale=10.0)
    va = {"p0": 1.0, "p1": 2.0, "p2": 3.0, "p3": None}
    vb = {"p0": 0.1, "p1": 0.2, "p2": None, "p3": None}
    rs = RewardSet([a, b], [faulty.Constant(va), faulty.Constant(vb)], 5.0, 0, 0.0)
    prompts = ["p0", "p1", "p2", "p3"]
    res = rs.score_now([IMG] * 4, prompts, [{}] * 4, micro_batch_size=2)
    z = torch.tensor([1.0, 2.0, 3.0])
    z = (z - z.mean()) / z.std(unbiased=False)
    expected = [2 * z[0] + 0.5 * 1.0, 2 * z[1] + 0.5 * 2.0, 2 * z[2]]  # b is not applicable to p2: contributes 0
    assert torch.allclose(res.total[:3], torch.tensor(expected), atol=1e-5)
    assert math.isnan(res.total[3]) and res.not_applicable.tolist() == [False, False, False, True]
    assert res.components["a"][:3].tolist() == [1.0, 2.0, 3.0]  # components are logged raw
    rs.close()


def _expected_faults(cfg, steps):
    sampler = PromptSampler(load_prompts(cfg.data.train_prompts), cfg.data.prompts_per_step, cfg.seed)
    per_step = []
    for _ in range(steps):
        kinds = [faulty.behaviour(p.text) for p in sampler.next_prompts()]
        per_step.append(kinds)
    return per_step


def test_training_survives_injected_faults_and_counts_them(tmp_path):
    # reward.timeout_s: only a 'hang' may overstay it, so it is sized for a loaded machine (a real call takes
    # milliseconds; it was 1 s, the hang 2.5 s)
    cfg = small_config(tmp_path, "max_steps=4", "data.prompts_per_step=4", "reward.name=tests.workers.faulty:flaky",
                       "reward.kwargs={hang_s: 10}", "reward.timeout_s=3.0", "reward.retries=1",
                       "reward.retry_backoff_s=0.01", "reward.workers=2", "train.mini_batch_size=16",
                       "sampling.micro_batch_size=4")
    faulty._ATTEMPTS.clear()
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected = _expected_faults(cfg, 4)
    assert any("raise" in k for k in expected) and any("hang" in k for k in expected), "the seed must exercise both"
    for row, kinds in zip(rows, expected):
        n_raise = kinds.count("raise")
        # each micro-batch is one group (4 images of one prompt): a raising group fails both attempts
        assert row["reward_errors"] == 2 * n_raise
        assert row["reward_failed_samples"] == 4 * n_raise
        assert row["dropped_samples"] == 4 * n_raise if n_raise else "dropped_samples" not in row
        assert row["images"] == 16
    total_hangs = sum(k.count("hang") for k in expected)  # the first call of each 'hang' prompt times out
    assert rows[-1]["reward_timeouts_total"] >= 1
    assert rows[-1]["reward_timeouts_total"] <= total_hangs
    assert rows[-1]["reward_errors_total"] == sum(2 * k.count("raise") for k in expected)
    for row, kinds in zip(rows, expected):
        if kinds.count("raise") < len(kinds):
            assert math.isfinite(row["reward_mean"]) and row["reward_mean"] < 0  # real jpeg scores, not a filler 0


def test_abort_policy_stops_with_a_clear_message(tmp_path):
    from gerl.errors import RunAborted

    cfg = small_config(tmp_path, "max_steps=3", "data.prompts_per_step=4", "reward.name=tests.workers.faulty:flaky",
                       "reward.timeout_s=1.0", "reward.retries=0", "reward.on_failure=abort",
                       "train.mini_batch_size=16", "sampling.micro_batch_size=4")
    with pytest.raises(RunAborted, match="reward.on_failure=abort"):
        train(cfg)


def test_fixed_policy_assigns_the_failure_score(tmp_path):
    cfg = small_config(tmp_path, "max_steps=1", "data.prompts_per_step=4", "reward.name=tests.workers.faulty:flaky",
                       "reward.kwargs={hang_s: 10}", "reward.timeout_s=3.0", "reward.retries=0",
                       "reward.workers=4",  # the micro-batches' timeouts run side by side, not one after another
                       "reward.on_failure=fixed", "reward.failure_score=-100", "train.mini_batch_size=16",
                       "sampling.micro_batch_size=4")
    faulty._ATTEMPTS.clear()
    train(cfg)
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    kinds = _expected_faults(cfg, 1)[0]
    n_fail = 4 * sum(k in ("raise", "hang") for k in kinds)  # retries=0: a hang is a failure too
    assert row["reward_failed_samples"] == n_fail and "dropped_samples" not in row
    if n_fail:
        assert row["reward_mean"] < -100 * n_fail / 16 + 1  # the fixed score entered the mean


def test_gerl_score_prints_json(capsys, tmp_path):
    from gerl.cli import main

    p = tmp_path / "x.png"
    IMG.save(p)
    assert main(["score", "jpeg_compressibility", str(p), str(p), "--prompt", "anything"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 and rows[0]["score"] < 0 and rows[0]["score"] == rows[1]["score"]
    assert main(["score", "tests.workers.faulty:Constant", str(p), "--kwargs", '{"values": {"hi": 0.5}}',
                 "--prompt", "hi"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["score"] == 0.5
    assert main(["score", "jpeg_compressibility", str(tmp_path / "missing.png")]) == 2
