"""DiffusionNFT and AWM losses (gerl/algo/matching.py): hand-worked values, the direction of their gradients, and
parity with the formulas of the reference implementations, transcribed below from NVlabs/DiffusionNFT
(scripts/train_nft_sd3.py) and scxue/advantage_weighted_matching (scripts/train_sd3_awm.py)."""

import math

import pytest
import torch

from gerl.algo.matching import (
    anchor_decay, awm_log_prob, awm_loss, noised, nft_loss, timestep_indices, velocity_penalty,
)

# Two samples of two latent elements, worked by hand: σ = 0.5, x0 = [1, 0], ε = [0, 2] → x_σ = [0.5, 1];
# v_old = [0, 0], v = [1, 1], β = 1: v+ = [1, 1], v− = [−1, −1]; x̂0+ = [0, 0.5], x̂0− = [1, 1.5];
# x̂0+ − x0 = [−1, 0.5]: w+ = 0.75, ‖·‖² = 0.625 → L+ = 5/6; x̂0− − x0 = [0, 1.5]: w− = 0.75, ‖·‖² = 1.125 → L− = 1.5.
X0 = torch.tensor([[1.0, 0.0]]).view(1, 1, 1, 2).repeat(2, 1, 1, 1)
EPS = torch.tensor([[0.0, 2.0]]).view(1, 1, 1, 2).repeat(2, 1, 1, 1)
SIGMA = torch.tensor([0.5, 0.5])


def test_noising_is_sd3s_forward_process():
    assert noised(X0, EPS, SIGMA)[0].flatten().tolist() == [0.5, 1.0]


@pytest.mark.parametrize("adv, expected", [(5.0, 5 / 6 * 5), (-5.0, 1.5 * 5), (0.0, (5 / 6 + 1.5) / 2 * 5),
                                           (9.0, 5 / 6 * 5)])  # an advantage beyond A_max is clipped: r = 1
def test_nft_loss_hand_worked(adv, expected):
    x_t = noised(X0, EPS, SIGMA)
    v = torch.ones_like(X0)
    loss, stats = nft_loss(v, torch.zeros_like(X0), X0, x_t, SIGMA, torch.tensor([adv, adv]), beta=1.0,
                           adv_clip_max=5.0)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["r_mean"].item() == pytest.approx(min(1.0, max(0.0, adv / 5 / 2 + 0.5)))


def test_nft_beta_mixes_the_old_velocity_and_divides_the_loss():
    # β = 0.5, v_old = [2, 2]: v+ = 0.5·[1, 1] + 0.5·[2, 2] = [1.5, 1.5] → x̂0+ = [−0.25, 0.25], error [−1.25, 0.25]:
    # w+ = 0.75, ‖·‖² = (1.5625 + 0.0625)/2 = 0.8125 → L+ = 1.0833; r = 1; loss = 5 · L+ / 0.5
    x_t = noised(X0, EPS, SIGMA)
    loss, _ = nft_loss(torch.ones_like(X0), torch.full_like(X0, 2.0), X0, x_t, SIGMA, torch.tensor([5.0, 5.0]),
                       beta=0.5, adv_clip_max=5.0)
    assert loss.item() == pytest.approx(5 * (0.8125 / 0.75) / 0.5, rel=1e-6)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_nft_gradient_pulls_good_samples_toward_x0_and_pushes_bad_ones_away(sign):
    """A step down the gradient moves the policy's own x0-prediction (x_σ − σ·v) toward x0 for a positive advantage
    and away from it for a negative one: the sign a flipped implementation would get wrong."""
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(4, 16, 4, 4, generator=g), torch.randn(4, 16, 4, 4, generator=g)
    sigma = torch.full((4,), 0.6)
    x_t = noised(x0, eps, sigma)
    v_old = (eps - x0) + 0.3 * torch.randn(4, 16, 4, 4, generator=g)  # an imperfect old policy
    v = v_old.clone().requires_grad_(True)
    loss, _ = nft_loss(v, v_old, x0, x_t, sigma, torch.full((4,), sign * 2.0), beta=1.0, adv_clip_max=5.0)
    loss.backward()
    before = ((x_t - 0.6 * v_old - x0) ** 2).mean()
    after = ((x_t - 0.6 * (v - 1e-2 * v.grad) - x0) ** 2).mean()
    assert (after < before) if sign > 0 else (after > before)


def nft_reference(forward_prediction, old_prediction, x0, xt, t, advantages, beta, adv_clip_max):
    """NVlabs/DiffusionNFT scripts/train_nft_sd3.py, the policy loss (adv_mode "all"), as written there."""
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    r = torch.clamp(normalized_advantages_clip, 0, 1)
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = (torch.abs(x0_prediction.double() - x0.double())
                         .mean(dim=tuple(range(1, x0.ndim)), keepdim=True).clip(min=0.00001))
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = (torch.abs(negative_x0_prediction.double() - x0.double())
                                  .mean(dim=tuple(range(1, x0.ndim)), keepdim=True).clip(min=0.00001))
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    return (ori_policy_loss * adv_clip_max).mean()


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_matches_the_reference_formula_and_its_gradient(beta):
    g = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(6, 16, 8, 8, generator=g), torch.randn(6, 16, 8, 8, generator=g)
    sigma = torch.rand(6, generator=g)
    x_t = noised(x0, eps, sigma)
    v_old = torch.randn(6, 16, 8, 8, generator=g)
    adv = torch.randn(6, generator=g) * 3
    v1 = torch.randn(6, 16, 8, 8, generator=g).requires_grad_(True)
    v2 = v1.detach().clone().requires_grad_(True)
    ours, _ = nft_loss(v1, v_old, x0, x_t, sigma, adv, beta, 5.0)
    theirs = nft_reference(v2, v_old, x0, x_t, sigma, adv, beta, 5.0)
    ours.backward()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    torch.testing.assert_close(v1.grad, v2.grad.float(), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("weighting, expected", [
    ("uniform", -2.5), ("t", -1.25), ("t2", -0.625), ("huber", -(math.sqrt(2.5 + 1e-10) - 1e-5) * 0.5),
    ("ghuber", -((2.5 + 1e-10) ** 0.5 - (1e-10) ** 0.5) * 0.5 / 0.5)])
def test_awm_log_prob_hand_worked(weighting, expected):
    # v = [1, 1], target ε − x0 = [−1, 2]: err = mean([4, 1]) = 2.5, σ = 0.5
    lp = awm_log_prob(torch.ones_like(X0), X0, EPS, SIGMA, weighting, ghuber_power=0.5)
    assert lp.tolist() == pytest.approx([expected, expected], rel=1e-9)


def test_awm_loss_hand_worked():
    # ratio = [e^0.1, 1]; A = [2, −1], ε = 0.05: max(−2·1.10517, −2·1.05) = −2.1 and max(1, 1) = 1 → mean −0.55
    loss, stats = awm_loss(torch.tensor([-1.0, -2.0], dtype=torch.float64), torch.tensor([-1.1, -2.0]),
                           torch.tensor([2.0, -1.0]), clip_range=0.05, adv_clip_max=5.0)
    assert loss.item() == pytest.approx(-0.55, rel=1e-6)
    assert stats["clipfrac"].item() == 0.5 and stats["ratio_mean"].item() == pytest.approx((math.exp(0.1) + 1) / 2)
    scaled, _ = awm_loss(torch.tensor([-1.0]), torch.tensor([-1.0]), torch.tensor([8.0]), 1.0, 5.0, advantage_max=1.0)
    assert scaled.item() == pytest.approx(-1.0)  # clipped to 5, then × 1/5


def awm_reference(noise_pred, clean_latents, random_noise, timestep, old_log_prob, advantages, clip_range,
                  adv_clip_max, advantage_max, ghuber_power):
    """scxue/advantage_weighted_matching scripts/train_sd3_awm.py: compute_log_prob_awm (weighting ghuber) and the
    'exp_first' policy loss, as written there."""
    model_output = noise_pred.double()
    log_prob = -(model_output - (random_noise.double() - clean_latents.double())) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    log_prob = -(torch.pow(-log_prob + 1e-10, ghuber_power)
                 - torch.pow(torch.tensor(1e-10, dtype=log_prob.dtype), ghuber_power)) * timestep.view(-1) / ghuber_power
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    advantages = advantages / adv_clip_max * advantage_max
    ratio = torch.exp(log_prob - old_log_prob.detach())
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss))


def test_awm_matches_the_reference_formula_and_its_gradient():
    g = torch.Generator().manual_seed(2)
    x0, eps = torch.randn(6, 16, 8, 8, generator=g), torch.randn(6, 16, 8, 8, generator=g)
    sigma = torch.rand(6, generator=g)
    adv = torch.randn(6, generator=g) * 3
    v1 = (eps - x0 + 0.5 * torch.randn(6, 16, 8, 8, generator=g)).requires_grad_(True)
    v2 = v1.detach().clone().requires_grad_(True)
    old = awm_log_prob(v1.detach() + 0.01, x0, eps, sigma, "ghuber", 0.25)
    lp = awm_log_prob(v1, x0, eps, sigma, "ghuber", 0.25)
    ours, _ = awm_loss(lp, old, adv, clip_range=0.2, adv_clip_max=5.0, advantage_max=1.0)
    theirs = awm_reference(v2, x0, eps, sigma, old, adv, 0.2, 5.0, 1.0, 0.25)
    ours.backward()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    torch.testing.assert_close(v1.grad, v2.grad.float(), rtol=1e-5, atol=1e-12)


def test_awm_gradient_lowers_the_matching_error_of_good_samples_only():
    """Advantage-weighted matching: a positive advantage raises the surrogate log-likelihood (lowers the error),
    a negative one lowers it."""
    g = torch.Generator().manual_seed(3)
    x0, eps = torch.randn(2, 16, 4, 4, generator=g), torch.randn(2, 16, 4, 4, generator=g)
    sigma = torch.tensor([0.7, 0.7])
    v = (eps - x0 + 0.5 * torch.randn(2, 16, 4, 4, generator=g)).requires_grad_(True)
    lp = awm_log_prob(v, x0, eps, sigma)
    loss, _ = awm_loss(lp, lp.detach(), torch.tensor([1.0, -1.0]), clip_range=0.2, adv_clip_max=5.0)
    loss.backward()
    after = awm_log_prob(v.detach() - 1e-2 * v.grad, x0, eps, sigma)
    assert after[0] > lp[0] and after[1] < lp[1]


def test_velocity_penalty_and_the_anchor_schedule():
    assert velocity_penalty(torch.ones(2, 1, 1, 2), torch.zeros(2, 1, 1, 2)).item() == 1.0
    # NVlabs' return_decay type 2 (flat 75, 0.0075 per step, up to 0.999) and type 1 (0, 0.001, 0.5)
    assert [anchor_decay(s, 75, 0.0075, 0.999) for s in (0, 74, 75, 100, 300)] == pytest.approx(
        [0.0, 0.0, 0.0, 0.1875, 0.999])
    assert anchor_decay(600, 0, 0.001, 0.5) == 0.5 and anchor_decay(10, 0, 0.0, 0.0) == 0.0


def test_timestep_indices():
    g = torch.Generator().manual_seed(0)
    r = timestep_indices(10, 1.0, 4, 3, "random", g)
    assert r.shape == (3, 4) and all(len(set(row.tolist())) == 4 for row in r) and r.max() < 10
    # AWM's discrete_wo_init for its SD3 configs: 14 steps, fraction 0.9, 6 strata of [1, 12)
    s = timestep_indices(14, 0.9, 6, 3, "stratified", g)
    assert (s == s[0]).all(), "one draw for the whole batch"
    lows, highs = [1, 2, 4, 6, 8, 10], [2, 4, 6, 8, 10, 12]
    assert all(lo <= int(i) < hi for i, lo, hi in zip(s[0], lows, highs))
    with pytest.raises(ValueError, match="unknown timestep mode"):
        timestep_indices(10, 1.0, 2, 1, "logit", g)
