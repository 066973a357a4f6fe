"""gerl/plan/fit.py: the smallest change that fits a card, on role plans written by hand (resident GiB and phase lines
base + per-sample × micro-batch) for the tiny recipe's batch arithmetic — 4 prompts × 8 images = 32 per step,
train micro-batch 8 of a mini-batch of 8 (valid: 1, 2, 4, 8), sampling micro-batch 8 (valid: divisors of 32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gerl.config import load_config
from gerl.plan.fit import need_gib, smallest_changes
from gerl.plan.planner import Phase, RolePlan
from gerl.plan.work import SAMPLE, TRAIN, Item

TINY = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.yaml")


def _training(ckpt_off=(1.0, 2.0), ckpt_on=(0.5, 0.5)):
    """Training phases at micro-batch 8: without checkpointing 1 + 2·b GiB (the config's), with it 0.5 + 0.5·b."""
    return [Phase("training, checkpointing off", TRAIN, 8, *ckpt_off, True, False),
            Phase("training, checkpointing on", TRAIN, 8, *ckpt_on, False, True)]


def _hybrid(resident: float) -> list[RolePlan]:
    """One hybrid host: the training phases and a VAE decode of b GiB at sampling micro-batch 8."""
    return [RolePlan("hybrid", [Item("weights", resident)], _training() + [Phase("VAE decode", SAMPLE, 8, 0.0, 1.0)])]


def _no_replan(cfg):
    raise AssertionError("the decoupled placement is planned only when nothing on this one fits")


def test_a_smaller_micro_batch_comes_before_checkpointing():
    """Peak 10 + (1 + 2·8) = 27 GiB; a card of need(20): the train micro-batch's line gives b ≤ 4.5 → 4 (19 GiB),
    the decode fits as configured; checkpointing alone gives 10 + max(0.5 + 4, 8) = 18."""
    cfg = load_config(TINY, [])
    fit = smallest_changes(cfg, _hybrid(10.0), "test", need_gib(20.0), _no_replan)
    assert not fit.fits
    assert [(c.overrides, c.peaks) for c in fit.changes] == [
        (["train.micro_batch_size=4"], {"hybrid": 19.0}), (["model.gradient_checkpointing=true"], {"hybrid": 18.0})]


def test_both_micro_batches_when_each_alone_falls_short():
    """A card of need(15.5): train b ≤ 2.25 → 2, sampling b ≤ 5.5 → 4 (5 does not divide 32); either alone
    leaves the other phase too large (18, 27), together 10 + max(5, 4) = 15; with checkpointing the training fits as
    configured (4.5) and only the decode shrinks: 10 + max(4.5, 4) = 14.5."""
    cfg = load_config(TINY, [])
    fit = smallest_changes(cfg, _hybrid(10.0), "test", need_gib(15.5), _no_replan)
    assert [(c.overrides, c.peaks) for c in fit.changes] == [
        (["train.micro_batch_size=2", "sampling.micro_batch_size=4"], {"hybrid": 15.0}),
        (["model.gradient_checkpointing=true", "sampling.micro_batch_size=4"], {"hybrid": 14.5})]
    assert fit.changes[0].headroom_gib == pytest.approx(need_gib(15.5) - need_gib(15.0), abs=1e-3)


def test_decoupled_roles_when_nothing_fits_one_device():
    """Resident 11 GiB on a card of need(11.8): no train micro-batch fits even with checkpointing (0.5 + 0.5·1 >
    0.8), so the actor and the rollout go to devices of their own (a local run becomes a Ray run on two), planned
    again: actor 5 + training, rollout 6 + decode; there the train micro-batch 2 (5 + 5) and sampling 4 (6 + 4) fit."""
    cfg = load_config(TINY, [])
    seen = []

    def replan(split):
        seen.append(split)
        return [RolePlan("actor", [Item("weights + state", 5.0)], _training()),
                RolePlan("rollout", [Item("all parts", 6.0)], [Phase("VAE decode", SAMPLE, 8, 0.0, 1.0)])]

    fit = smallest_changes(cfg, _hybrid(11.0), "test", need_gib(11.8), replan)
    placement = ["engine.kind=ray", "engine.device=cuda", "engine.hybrid=false", "engine.actor_workers=1",
                 "engine.rollout_workers=1"]
    assert (seen[0].engine.kind, seen[0].engine.hybrid) == ("ray", False)
    assert fit.changes[0].overrides == placement + ["train.micro_batch_size=2", "sampling.micro_batch_size=4"]
    assert fit.changes[0].peaks == {"actor": 10.0, "rollout": 10.0}
    assert any("no valid value fits" in t for t in fit.tried)


def test_nothing_fits_says_what_was_tried():
    cfg = load_config(TINY, ["engine.kind=ray", "engine.hybrid=false"])
    roles = [RolePlan("actor", [Item("weights", 50.0)], _training()),
             RolePlan("rollout", [Item("weights", 10.0)], [Phase("VAE decode", SAMPLE, 8, 0.0, 1.0)])]
    fit = smallest_changes(cfg, roles, "test", need_gib(40.0), _no_replan)
    assert not fit.fits and fit.changes == [] and fit.tried
