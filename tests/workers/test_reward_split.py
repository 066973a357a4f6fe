"""A micro-batch of a per-sample reward (the OCR) split over the reward pool's workers and joined back in order, and
reward.workers=0 sized from the CPUs this process may run on."""

from __future__ import annotations

import threading

import pytest
import torch

from gerl.config import RewardComponent, RewardConfig, load_config, reward_components
from gerl.workers import reward as reward_mod
from gerl.workers.reward import RewardSet, chunks


class Recorder:
    """Scores each sample by its metadata's "i" (so order is checkable); records every call's indices."""

    def __init__(self, per_sample: bool, fail_on: int | None = None):
        self.per_sample = per_sample
        self.calls: list[list[int]] = []
        self.fail_on = fail_on
        self.lock = threading.Lock()

    def __call__(self, images, prompts, metadata):
        idx = [m["i"] for m in metadata]
        with self.lock:
            self.calls.append(idx)
        if self.fail_on in idx:
            raise RuntimeError(f"sample {self.fail_on} breaks this call")
        return [float(i) for i in idx], {"seen": [f"p{i}" for i in idx]}


def _score(fn, workers: int, split: bool = True, n: int = 8, retries: int = 0):
    comp = RewardComponent(name="rec", pool="thread", workers=workers, split=split)
    rs = RewardSet([comp], [fn], timeout_s=30.0, retries=retries, backoff_s=0.0)
    try:
        meta = [{"i": i} for i in range(n)]
        return rs.gather([rs.submit([None] * n, ["p"] * n, meta)])
    finally:
        rs.close()


def test_chunks_are_contiguous_and_within_one_of_each_other():
    assert chunks(8, 3) == [slice(0, 2), slice(2, 5), slice(5, 8)]
    assert chunks(2, 4) == [slice(0, 1), slice(1, 2)]  # never an empty call
    assert chunks(5, 1) == [slice(0, 5)]


def test_a_per_sample_reward_is_split_over_the_workers_and_joined_in_sample_order():
    fn = Recorder(per_sample=True)
    res = _score(fn, workers=3)
    assert sorted(fn.calls) == [[0, 1], [2, 3, 4], [5, 6, 7]]  # three calls, one per worker
    assert res.total.tolist() == list(range(8)) and not res.failed.any()
    assert res.extras["seen"] == [f"p{i}" for i in range(8)]


def test_a_reward_that_is_not_per_sample_or_not_split_gets_the_whole_micro_batch():
    for fn, split in ((Recorder(per_sample=False), True), (Recorder(per_sample=True), False)):
        res = _score(fn, workers=3, split=split)
        assert fn.calls == [list(range(8))]
        assert res.total.tolist() == list(range(8))


def test_a_failing_slice_fails_only_its_samples_and_is_counted():
    fn = Recorder(per_sample=True, fail_on=3)
    res = _score(fn, workers=3)
    assert res.failed.tolist() == [False, False, True, True, True, False, False, False]
    assert res.counts["errors"] == 1 and any("sample 3 breaks this call" in k for k in res.errors)
    assert torch.isnan(res.total[2:5]).all() and res.total[[0, 1, 5, 6, 7]].tolist() == [0, 1, 5, 6, 7]


def test_zero_workers_means_one_per_cpu_of_this_process_less_one(monkeypatch):
    monkeypatch.setattr(reward_mod.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert reward_mod.auto_workers("thread") == 15 and reward_mod.auto_workers("process") == 15
    assert reward_mod.auto_workers("ray") == 1
    monkeypatch.setattr(reward_mod.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert reward_mod.auto_workers("thread") == 1
    monkeypatch.setattr(reward_mod.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    cfg = load_config(None, [])
    assert cfg.reward.workers == 0 and cfg.reward.split  # the defaults: auto, split
    comp = reward_components(cfg.reward)[0]
    ex = reward_mod.RewardExecutor(Recorder(True), comp.pool, comp.workers, split=comp.split)
    try:
        assert ex.workers == 3 and ex.split
    finally:
        ex.close()


def test_the_ocr_reward_says_it_scores_each_image_alone():
    from rewards.registry import build_reward

    assert build_reward("ocr", {}).per_sample is True


@pytest.mark.parametrize("workers", [2, 4])
def test_split_ocr_scores_equal_the_whole_micro_batch(workers):
    """The real OCR on rendered text, split or not: the same scores and texts in the same order."""
    from PIL import Image, ImageDraw

    from rewards.registry import build_reward

    words = ["CAT", "SUN", "RED", "MAP", "OWL", "BOX"]
    images = []
    for w in words:
        img = Image.new("RGB", (160, 64), "white")
        ImageDraw.Draw(img).text((20, 20), w, fill="black", font_size=28)
        images.append(img)
    prompts = [f'a sign that says "{w}"' for w in words]
    out = {}
    for split in (False, True):
        rs = RewardSet(reward_components(RewardConfig(name="ocr", workers=workers, split=split)),
                       [build_reward("ocr", {})], 60.0, 0, 0.0)
        try:
            res = rs.gather([rs.submit(images, prompts, [{}] * len(words))])
        finally:
            rs.close()
        out[split] = (res.total.tolist(), res.extras["ocr_text"])
    assert out[True] == out[False] and sum(out[True][0]) / len(words) > 0.8, out
