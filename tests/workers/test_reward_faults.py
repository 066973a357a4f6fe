"""Each way a reward can be broken becomes a counted failure that carries the reward's own error text, and NaN and
inf follow one rule (a failed sample), while None alone means "not applicable"."""

import json

import pytest
import torch
from PIL import Image

from gerl.config import RewardComponent
from gerl.workers.reward import RewardSet, merge_results
from tests.workers import broken

IMG = Image.new("RGB", (16, 16), "white")


def _score(fn, prompts, components=None):
    comps = components or [RewardComponent(name="r")]
    fns = fn if isinstance(fn, list) else [fn]
    rs = RewardSet(comps, fns, timeout_s=5.0, retries=1, backoff_s=0.0)
    try:
        return rs.score_now([IMG] * len(prompts), prompts, [{}] * len(prompts), micro_batch_size=2)
    finally:
        rs.close()


@pytest.mark.parametrize("fn, text", [
    (broken.wrong_length, "returned 3 scores for 2 images"),
    (broken.strings, "must return a list of floats"),
    (broken.all_nan, "returned non-finite scores (nan)"),
    (broken.raises, "RuntimeError: the reward model is not loaded"),
    (broken.returns_none, "must return a list of floats"),
])
def test_a_reward_broken_on_every_sample_fails_every_sample_with_its_own_message(fn, text):
    res = _score(fn, ["a", "b", "c", "d"])
    assert res.failed.all() and not res.not_applicable.any()
    assert torch.isnan(res.total).all() and torch.isnan(res.raw_total).all()
    (msg, n), = res.errors.items()  # one distinct message, counted over both micro-batches
    assert msg.startswith("r: ") and text in msg and n == 4


def test_nan_and_inf_are_both_failures_and_none_is_not_applicable():
    res = _score(broken.nan_and_inf, ["x nan", "x inf", "ok", "none"])
    assert res.failed.tolist() == [True, True, False, False]
    assert res.not_applicable.tolist() == [False, False, False, True]
    assert res.counts["nonfinite"] == 2 and res.counts["errors"] == 0 and res.counts["retries"] == 0
    assert res.total[2] == 2.0 and torch.isnan(res.total[[0, 1, 3]]).all()
    (msg, n), = res.errors.items()  # one call held both
    assert msg.startswith("r: returned non-finite scores (inf, nan)") and n == 2


def test_raw_total_is_the_weighted_sum_of_raw_components_while_total_is_normalised():
    a = RewardComponent(name="a", weight=2.0, normalize="zscore")
    b = RewardComponent(name="b", weight=0.5)
    prompts = ["p", "pp", "ppp", "pppp"]
    res = _score([broken.nan_and_inf, broken.nan_and_inf], prompts, [a, b])
    raw = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.allclose(res.raw_total, 2.0 * raw + 0.5 * raw)
    assert abs(float(res.total.mean()) - 0.5 * float(raw.mean())) < 1e-5  # the z-scored part averages to 0
    merged = merge_results([res, res], ["rollout0", "rollout1"])
    assert merged.raw_total.shape == (8,) and merged.errors == {}


def test_gerl_score_writes_nan_scores_as_null(capsys, tmp_path):
    from gerl.cli import main

    p = tmp_path / "x.png"
    IMG.save(p)
    assert main(["score", "tests.workers.broken:nan_and_inf", str(p), str(p), "--prompt", "a nan"]) == 0

    def strict(token):
        raise AssertionError(f"invalid JSON constant {token}")

    rows = json.loads(capsys.readouterr().out, parse_constant=strict)
    assert [r["score"] for r in rows] == [None, None]
