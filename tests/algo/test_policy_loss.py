"""The off-policy objectives of gerl/algo/policy_loss.py: values and gradients worked by hand on six samples, parity
with ROLL's formulas transcribed below from alibaba/ROLL (roll/pipeline/rlvr/actor_pg_worker.py at 8eb27cc), and
the config refusing option combinations that would silently not learn or be ignored."""

import math

import pytest
import torch

from gerl.algo.loss import grpo_loss
from gerl.algo.policy_loss import POLICY_LOSSES, get_policy_loss
from gerl.config import TrainConfig, load_config
from gerl.errors import UserError

# Six samples, chosen so that every branch of every loss is taken. The old log-probs are derived from the ratios
# below, so log π is a round number and every value is −w·A·log π with round factors.
#          s0     s1     s2     s3     s4     s5
LP = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0, -4.0])  # log π at the current weights
R = torch.tensor([2.0, 0.5, 1.1, 4.0, 0.5, 0.25])  # importance ratio π/μ
ADV = torch.tensor([1.0, -2.0, 0.5, -1.5, 2.0, -1.0])
REWARDS = torch.tensor([0.9, 0.2, 0.6, 0.3, 1.0, 0.0])  # all ≥ 0, as an OCR or PickScore reward; group mean 0.5
OLD = LP - torch.log(R)
EPS = 0.2  # clip range [0.8, 1.2]: s2 inside; s0, s3 above; s1, s4, s5 below


def _run(name, rewards=None, **options):
    lp = LP.clone().requires_grad_(True)
    loss, clipped = get_policy_loss(name)(lp, OLD, ADV, rewards, **options)
    loss.sum().backward()
    return loss.detach(), clipped.tolist(), lp.grad


def _check(got, value, grad, clipped):
    loss, was_clipped, g = got
    torch.testing.assert_close(loss, torch.tensor(value), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, torch.tensor(grad), rtol=1e-5, atol=1e-6)
    assert was_clipped == clipped


def test_registry_holds_the_four_and_rejects_unknown_names():
    assert {"ppo_clip", "tis", "topr", "cispo"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match="registered: cispo, ppo_clip, tis, topr"):
        get_policy_loss("vanilla")


# ------------------------------------------------------------------ hand-worked values

def test_ppo_clip():
    # max(−A·r, −A·clip(r, 0.8, 1.2)); gradient −A·r where the unclipped term is the max and varies, else 0
    # s0: max(−2, −1.2) = −1.2, clip holds → 0      s1: max(1, 1.6) = 1.6 → 0        s2: −0.55, grad −0.55
    # s3: max(6, 1.8) = 6 (pessimistic), grad 6     s4: max(−1, −1.6) = −1, grad −1   s5: max(0.25, 0.8) = 0.8 → 0
    _check(_run("ppo_clip", clip_range=EPS),
           [-1.2, 1.6, -0.55, 6.0, -1.0, 0.8], [0.0, 0.0, -0.55, 6.0, -1.0, 0.0],
           [True, True, False, True, True, True])


def test_ppo_clip_ratio_cap_is_a_dual_clip():
    # cap 3 ≥ 1 + ε: only s3 (A < 0, r = 4) changes: max(1.5·3, 1.8) = 4.5, a constant → no gradient
    _check(_run("ppo_clip", clip_range=EPS, ratio_cap=3.0),
           [-1.2, 1.6, -0.55, 4.5, -1.0, 0.8], [0.0, 0.0, -0.55, 0.0, -1.0, 0.0],
           [True, True, False, True, True, True])


def test_ratio_caps_below_the_clip_stop_learning():
    """What the config refuses, shown on the formula. On-policy (r = 1) with cap 0.5: r → 0.5, a constant, so
    every sample's gradient is 0. Cap 1 at r = 1.1 (inside the trust region): r → 1, gradient 0 for either sign
    of A, where uncapped PPO gives −A·1.1."""
    lp = torch.tensor([-1.0, -2.0]).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    loss, _ = get_policy_loss("ppo_clip")(lp, lp.detach(), adv, clip_range=EPS, ratio_cap=0.5)
    loss.sum().backward()
    assert lp.grad.tolist() == [0.0, 0.0]
    for cap, grad in ((1.0, [0.0, 0.0]), (0.0, [-1.1, 1.1])):
        lp.grad = None
        loss, _ = get_policy_loss("ppo_clip")(lp, lp.detach() - math.log(1.1), adv, clip_range=EPS, ratio_cap=cap)
        loss.sum().backward()
        torch.testing.assert_close(lp.grad, torch.tensor(grad))


def test_tis_default_cap_is_one():
    # w = min(r, 1) = [1, .5, 1, 1, .5, .25]; value −w·A·log π; gradient −w·A
    # s0: −1·1·(−1) = 1   s1: −.5·(−2)·(−2) = −2   s2: −1·.5·(−.5) = .25   s3: −1·(−1.5)·(−3) = −4.5
    # s4: −.5·2·(−1) = 1  s5: −.25·(−1)·(−4) = −1
    _check(_run("tis", is_cap=TrainConfig.is_cap),
           [1.0, -2.0, 0.25, -4.5, 1.0, -1.0], [-1.0, 1.0, -0.5, 1.5, -1.0, 0.25],
           [True, False, True, True, False, False])


def test_tis_cap_three():
    # w = min(r, 3) = [2, .5, 1.1, 3, .5, .25]: s0: 2; s2: −1.1·.5·(−.5) = .275; s3: −3·(−1.5)·(−3) = −13.5
    _check(_run("tis", is_cap=3.0),
           [2.0, -2.0, 0.275, -13.5, 1.0, -1.0], [-2.0, 1.0, -0.55, 4.5, -1.0, 0.25],
           [False, False, False, True, False, False])


def test_topr_split_by_advantage():
    # negative = A < 0: s1, s3, s5 get w = min(r, 1) = .5, 1, .25; the others w = 1 (s4 at r = .5 too: untapered)
    # s4: −1·2·(−1) = 2, where tis (cap 1) gives 1
    _check(_run("topr", topr_split="advantage"),
           [1.0, -2.0, 0.25, -4.5, 2.0, -1.0], [-1.0, 1.0, -0.5, 1.5, -2.0, 0.25],
           [False, False, False, True, False, False])


def test_topr_split_by_reward_is_rolls():
    # negative = reward ≤ 0: s5 only (its reward is exactly 0). s1 (A = −2, r = .5, reward .2 > 0) is no longer
    # tapered: −1·(−2)·(−2) = −4, gradient 2 — where the advantage split gives −2 and 1.
    _check(_run("topr", REWARDS, topr_split="reward"),
           [1.0, -4.0, 0.25, -4.5, 2.0, -1.0], [-1.0, 2.0, -0.5, 1.5, -2.0, 0.25],
           [False, False, False, False, False, False])
    with pytest.raises(ValueError, match="pass rewards"):
        _run("topr", None, topr_split="reward")


def test_cispo_symmetric_by_default():
    # eps 0 = clip_range: w = clip(r, .8, 1.2) = [1.2, .8, 1.1, 1.2, .8, .8]
    # s0: 1.2  s1: −.8·(−2)·(−2) = −3.2  s2: .275  s3: −1.2·(−1.5)·(−3) = −5.4  s4: −.8·2·(−1) = 1.6  s5: −3.2
    _check(_run("cispo", clip_range=EPS),
           [1.2, -3.2, 0.275, -5.4, 1.6, -3.2], [-1.2, 1.6, -0.55, 1.8, -1.6, 0.8],
           [True, True, False, True, True, True])


def test_cispo_asymmetric():
    # ε_low = .6, ε_high = .5: w = clip(r, .4, 1.5) = [1.5, .5, 1.1, 1.5, .5, .4]
    # s0: 1.5  s1: −2  s2: .275  s3: −1.5·(−1.5)·(−3) = −6.75  s4: 1  s5: −.4·(−1)·(−4) = −1.6
    _check(_run("cispo", clip_range=EPS, cispo_eps_low=0.6, cispo_eps_high=0.5),
           [1.5, -2.0, 0.275, -6.75, 1.0, -1.6], [-1.5, 1.0, -0.55, 2.25, -1.0, 0.4],
           [True, False, False, True, False, True])


@pytest.mark.parametrize("name,options", [("ppo_clip", {}), ("tis", {}), ("topr", {}),
                                          ("topr", {"topr_split": "reward"}), ("cispo", {})])
def test_on_policy_gradient_is_the_same_for_all(name, options):
    # At r = 1 every objective is vanilla policy gradient: d loss / d log π_i = −A_i / B through grpo_loss.
    lp = LP.clone().requires_grad_(True)
    loss, stats = grpo_loss(lp, LP, ADV, clip_range=EPS, policy=name, rewards=REWARDS, **options)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-1.0, 2.0, -0.5, 1.5, -2.0, 1.0]) / 6)
    assert stats["clipfrac"].item() == 0


def test_grpo_loss_refuses_a_ratio_cap_the_loss_would_ignore():
    with pytest.raises(ValueError, match="truncates ppo_clip's ratio"):
        grpo_loss(LP, OLD, ADV, clip_range=EPS, ratio_cap=3.0, policy="tis")


# ------------------------------------------------------------------ parity with ROLL
# Transcribed from alibaba/ROLL roll/pipeline/rlvr/actor_pg_worker.py (ActorPGWorker): _compute_ppo_loss (without
# its metrics; use_pg_clip_range false, so pg_clip_low = pg_clip_high = pg_clip), _compute_tis_loss,
# _compute_topr_loss (scores = data.batch['scores'], the response's reward) and _compute_cispo_loss
# (use_unified_mask false). ROLL's tensors are [batch, seq_len]; here seq_len = 1.

def roll_ppo_loss(ratio, advantages, pg_clip, dual_clip_loss):
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - pg_clip, 1 + pg_clip) * advantages
    loss = -torch.min(surr1, surr2)
    if dual_clip_loss:
        dual_clip_loss = -torch.max(-loss, (1 + pg_clip * 2) * advantages)
        loss = torch.where(advantages < 0, dual_clip_loss, loss)
    return loss


def roll_tis_loss(ratio, log_probs, advantages, tis_lower_bound=0.0, tis_upper_bound=1.0):
    clipped_ratio = torch.clamp(ratio, min=tis_lower_bound, max=tis_upper_bound)
    TIS_loss = -clipped_ratio.detach() * advantages * log_probs
    return TIS_loss


def roll_topr_loss(ratio, log_probs, advantages, scores, positive_weight=1.0, negative_weight=1.0):
    positive_mask = (scores > 0).float()
    negative_mask = (scores <= 0).float()
    positive_token_mask = positive_mask.unsqueeze(-1)
    negative_token_mask = negative_mask.unsqueeze(-1)
    positive_loss = - advantages * log_probs * positive_token_mask
    clipped_ratio = torch.clamp(ratio, min=0.0, max=1.0).detach()
    negative_loss = - clipped_ratio * advantages * log_probs * negative_token_mask
    weighted_positive_loss = positive_weight * positive_loss
    weighted_negative_loss = negative_weight * negative_loss
    topr_loss = weighted_positive_loss + weighted_negative_loss
    return topr_loss


def roll_cispo_loss(ratio, log_probs, advantages, epsilon_low=0.1, epsilon_high=0.1):
    clip_lower = 1.0 - epsilon_low
    clip_upper = 1.0 + epsilon_high
    clipped_ratio = torch.clamp(ratio, min=clip_lower, max=clip_upper)
    cispo_loss = -clipped_ratio.detach() * advantages * log_probs
    return cispo_loss


def _random_batch(n=64):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(n, generator=g) - 2.0
    log_ratio = 0.6 * torch.randn(n, generator=g)  # ratios from ~0.2 to ~5: every clip is hit on both sides
    adv = torch.randn(n, generator=g)
    rewards = torch.rand(n, generator=g) * 1.5 - 0.5  # both signs, uncorrelated with the advantages
    rewards[:4] = 0.0  # ROLL counts a zero reward as negative
    return old, old + log_ratio, adv, rewards


def _both(gerl_fn, roll_fn):
    """Per-sample values and d(sum)/d log π of gerl's entry and of ROLL's transcription, on the same batch."""
    old, lp0, adv, rewards = _random_batch()
    out = []
    for fn in (gerl_fn, roll_fn):
        lp = lp0.clone().requires_grad_(True)
        loss = fn(lp, old, adv, rewards)
        loss.sum().backward()
        out.append((loss.detach().flatten(), lp.grad))
    return out


def _roll(fn, **kw):
    """ROLL's signature on (B, 1) token tensors, its ratio exp(log_probs − old_log_probs) with gradient."""
    def call(lp, old, adv, rewards):
        log_probs, old_log_probs, advantages = lp[:, None], old[:, None], adv[:, None]
        ratio = (log_probs - old_log_probs).exp()
        if fn is roll_ppo_loss:
            return fn(ratio, advantages, **kw)
        if fn is roll_topr_loss:
            return fn(ratio, log_probs, advantages, rewards, **kw)
        return fn(ratio, log_probs, advantages, **kw)
    return call


def _gerl(name, **options):
    return lambda lp, old, adv, rewards: get_policy_loss(name)(lp, old, adv, rewards, **options)[0]


def _assert_same(pair):
    (v_gerl, g_gerl), (v_roll, g_roll) = pair
    torch.testing.assert_close(v_gerl, v_roll)
    torch.testing.assert_close(g_gerl, g_roll)


@pytest.mark.parametrize("pg_clip", [0.1, 0.2])
def test_ppo_clip_is_rolls_ppo_and_ratio_cap_its_dual_clip(pg_clip):
    _assert_same(_both(_gerl("ppo_clip", clip_range=pg_clip), _roll(roll_ppo_loss, pg_clip=pg_clip, dual_clip_loss=False)))
    _assert_same(_both(_gerl("ppo_clip", clip_range=pg_clip, ratio_cap=1 + 2 * pg_clip),
                       _roll(roll_ppo_loss, pg_clip=pg_clip, dual_clip_loss=True)))


def test_tis_default_is_rolls_default():
    _assert_same(_both(_gerl("tis", is_cap=TrainConfig.is_cap), _roll(roll_tis_loss)))  # tis_upper_bound 1.0
    _assert_same(_both(_gerl("tis", is_cap=2.0), _roll(roll_tis_loss, tis_upper_bound=2.0)))


def test_topr_reward_split_is_rolls_and_the_advantage_split_is_not():
    _assert_same(_both(_gerl("topr", topr_split="reward"), _roll(roll_topr_loss)))
    (v_adv, _), (v_roll, _) = _both(_gerl("topr", topr_split="advantage"), _roll(roll_topr_loss))
    assert not torch.allclose(v_adv, v_roll), "the two splits must differ on a batch where reward and A disagree"


def test_cispo_is_rolls_with_its_epsilons():
    _assert_same(_both(_gerl("cispo", clip_range=1.0, cispo_eps_low=0.1, cispo_eps_high=0.1), _roll(roll_cispo_loss)))
    _assert_same(_both(_gerl("cispo", clip_range=1.0, cispo_eps_low=0.2, cispo_eps_high=0.28),
                       _roll(roll_cispo_loss, epsilon_low=0.2, epsilon_high=0.28)))
    # the default (both 0) is ROLL's symmetric form with ε = train.clip_range
    _assert_same(_both(_gerl("cispo", clip_range=0.3), _roll(roll_cispo_loss, epsilon_low=0.3, epsilon_high=0.3)))


# ------------------------------------------------------------------ the config

def test_config_rejects_unknown_loss_listing_the_registered():
    with pytest.raises(UserError, match="train.loss='grpo' is not a registered policy loss; choose one of cispo, ppo_clip"):
        load_config(None, ["train.loss=grpo"])
    assert load_config(None, ["train.loss=topr"]).train.loss == "topr"


@pytest.mark.parametrize("cap", ["0.5", "1.0", "1.00005"])
def test_config_refuses_a_ratio_cap_below_the_clip(cap):
    with pytest.raises(UserError, match=rf"engine.ratio_cap={cap} must be 0 \(off\) or ≥ 1 \+ train.clip_range \(1.0001\)"):
        load_config(None, [f"engine.ratio_cap={cap}", "train.clip_range=1e-4"])


def test_config_accepts_a_dual_clip_cap():
    assert load_config(None, ["engine.ratio_cap=3"]).engine.ratio_cap == 3.0
    assert load_config(None, ["engine.ratio_cap=1.0001", "train.clip_range=1e-4"]).engine.ratio_cap == 1.0001


@pytest.mark.parametrize("loss", ["tis", "topr", "cispo"])
def test_config_refuses_ratio_cap_with_the_reinforce_losses(loss):
    with pytest.raises(UserError, match=f"engine.ratio_cap=3.0 truncates ppo_clip's ratio only; train.loss={loss}"):
        load_config(None, ["engine.ratio_cap=3", f"train.loss={loss}"])


@pytest.mark.parametrize("override,owner", [("train.is_cap=2", "tis"), ("train.cispo_eps_low=0.1", "cispo"),
                                            ("train.cispo_eps_high=0.1", "cispo"), ("train.topr_split=reward", "topr")])
def test_config_refuses_an_option_of_another_loss(override, owner):
    key = override.split("=")[0]
    with pytest.raises(UserError, match=f"{key} applies to train.loss={owner} only \\(here ppo_clip\\)"):
        load_config(None, [override])
    load_config(None, [override, f"train.loss={owner}"])
