"""The off-policy objectives of gerl/algo/policy_loss.py, each checked against its formula written out here:
value and gradient with respect to the current log-prob, on ratios inside and outside every clip."""

import math

import pytest
import torch

from gerl.algo.loss import grpo_loss
from gerl.algo.policy_loss import POLICY_LOSSES, get_policy_loss
from gerl.config import load_config
from gerl.errors import UserError

# Four samples: log-ratios chosen so that r = e^d lands below, inside and above the clips used below.
OLD = torch.tensor([-1.0, -2.0, 0.5, -0.3])
D = torch.tensor([0.9, -0.7, 0.01, 1.5])  # r ≈ 2.46, 0.50, 1.01, 4.48
ADV = torch.tensor([1.0, -2.0, 0.5, -1.5])
EPS, CAP = 0.2, 2.0


def _run(name, **kw):
    lp = (OLD + D).clone().requires_grad_(True)
    loss, clipped = get_policy_loss(name)(lp, OLD, ADV, **kw)
    loss.sum().backward()
    return loss.detach(), clipped, lp.grad


def _reinforce(weight):
    """REINFORCE with a detached weight w: value −w·A·log π, gradient −w·A (per sample)."""
    lp = OLD + D
    return -weight * ADV * lp, -weight * ADV


def test_registry_holds_the_four_and_rejects_unknown_names():
    assert {"ppo_clip", "tis", "topr", "cispo"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match="registered: cispo, ppo_clip, tis, topr"):
        get_policy_loss("vanilla")


def test_config_rejects_unknown_loss_listing_the_registered(tmp_path):
    with pytest.raises(UserError, match="train.loss='grpo' is not a registered policy loss; choose one of cispo, ppo_clip"):
        load_config(None, ["train.loss=grpo"])
    assert load_config(None, ["train.loss=topr"]).train.loss == "topr"


def test_ppo_clip():
    r = torch.exp(D)
    value, clipped, grad = _run("ppo_clip", clip_range=EPS)
    expected = torch.maximum(-ADV * r, -ADV * r.clamp(1 - EPS, 1 + EPS))
    torch.testing.assert_close(value, expected)
    # gradient of −A·r is −A·r where the unclipped branch is active; 0 where the clip holds it constant
    active = (-ADV * r) >= (-ADV * r.clamp(1 - EPS, 1 + EPS))
    active &= ~(((r > 1 + EPS) & (ADV > 0)) | ((r < 1 - EPS) & (ADV < 0)))
    torch.testing.assert_close(grad, torch.where(active, -ADV * r, torch.zeros_like(r)))
    assert clipped.tolist() == [True, True, False, True]
    # sample 0 (A > 0, r > 1 + ε) and sample 1 (A < 0, r < 1 − ε) get no gradient; sample 3 (A < 0, r ≫ 1) does
    assert grad[0] == 0 and grad[1] == 0 and grad[3] != 0


def test_ppo_clip_ratio_cap_truncates_before_clipping():
    value, _, grad = _run("ppo_clip", clip_range=EPS, ratio_cap=3.0)
    assert value[3].item() == pytest.approx(1.5 * 3.0)  # −A·min(r, cap) with A = −1.5, r ≈ 4.48
    assert grad[3].item() == 0  # the cap is a constant: no gradient through it


def test_tis():
    r = torch.exp(D)
    value, clipped, grad = _run("tis", is_cap=CAP)
    w = torch.minimum(r, torch.tensor(CAP))
    exp_value, exp_grad = _reinforce(w)
    torch.testing.assert_close(value, exp_value)
    torch.testing.assert_close(grad, exp_grad)
    assert clipped.tolist() == [True, False, False, True]


def test_topr():
    r = torch.exp(D)
    value, clipped, grad = _run("topr")
    w = torch.tensor([1.0, min(r[1].item(), 1.0), 1.0, min(r[3].item(), 1.0)])  # A ≥ 0 → 1; A < 0 → min(r, 1)
    exp_value, exp_grad = _reinforce(w)
    torch.testing.assert_close(value, exp_value)
    torch.testing.assert_close(grad, exp_grad)
    assert grad[1].item() == pytest.approx(2.0 * math.exp(-0.7), rel=1e-6)  # −A·r with r < 1 kept as is
    assert grad[3].item() == pytest.approx(1.5)  # r ≈ 4.48 tapered to 1
    assert clipped.tolist() == [False, False, False, True]


def test_cispo():
    r = torch.exp(D)
    value, clipped, grad = _run("cispo", clip_range=EPS)
    exp_value, exp_grad = _reinforce(r.clamp(1 - EPS, 1 + EPS))
    torch.testing.assert_close(value, exp_value)
    torch.testing.assert_close(grad, exp_grad)
    assert (grad != 0).all(), "unlike ppo_clip, no sample loses its gradient"
    assert clipped.tolist() == [True, True, False, True]


@pytest.mark.parametrize("name", ["ppo_clip", "tis", "topr", "cispo"])
def test_on_policy_gradient_is_the_same_for_all(name):
    # At r = 1 every objective is vanilla policy gradient: d loss / d log π_i = −A_i / B through grpo_loss.
    lp = OLD.clone().requires_grad_(True)
    loss, stats = grpo_loss(lp, OLD, ADV, clip_range=EPS, policy=name)
    loss.backward()
    torch.testing.assert_close(lp.grad, -ADV / len(ADV))
    assert stats["clipfrac"].item() == 0
