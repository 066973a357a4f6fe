"""DGPO's loss (gerl/algo/dgpo.py): hand-worked values and gradients, the paper's group preference log σ(R(G+) −
R(G−)) written with explicit positive and negative sets, and parity with the reference implementation's formula,
transcribed below from Luo-Yihong/DGPO scripts/train_sd3_dgpo.py (compute_group_dgpo_loss_allreduce, lines 162-193,
without the all-reduce of one process; the clip, lines 1133-1144)."""

import math

import pytest
import torch
import torch.nn.functional as F

from gerl.algo.dgpo import dgpo_clip, dgpo_loss, flow_matching_error, group_margins

# Six samples of two groups, interleaved (the groups come from ids, not positions), worked by hand with β = 10:
# group 0 (samples 0, 2, 3, 5): A = [1, 0.5, −0.5, −1], e − e_ref = [−0.1, 0, 0, 0.1]
#   Σ A·Δ = −0.1 − 0.1 = −0.2 → S_0 = 10 · (−0.2) / 4 = −0.5: positives below the reference, negatives above
#   (the preference already holds): σ(−0.5) = 0.3775407
# group 1 (samples 1, 4): A = [2, −2], e − e_ref = [0.2, −0.2] → Σ A·Δ = 0.8 → S_1 = 10 · 0.8 / 2 = 4: the wrong way
#   round, σ(4) = 0.9820138
GROUPS = torch.tensor([0, 1, 0, 0, 1, 0])
ADV = torch.tensor([1.0, 2.0, 0.5, -0.5, -2.0, -1.0])
ERR = torch.tensor([0.2, 1.2, 0.3, 0.4, 0.8, 0.5], dtype=torch.float64)
REF = torch.tensor([0.3, 1.0, 0.3, 0.4, 1.0, 0.4], dtype=torch.float64)
S0, S1 = -0.5, 4.0
W0, W1 = 1 / (1 + math.exp(0.5)), 1 / (1 + math.exp(-4.0))


def test_flow_matching_error_hand_worked():
    # x0 = [1, 0], ε = [0, 2]: target ε − x0 = [−1, 2]; v = [1, 1] → v − target = [2, −1], mean square 2.5
    v, x0, eps = (torch.tensor(a).view(1, 1, 1, 2) for a in ([1.0, 1.0], [1.0, 0.0], [0.0, 2.0]))
    assert flow_matching_error(v, x0, eps).tolist() == [2.5]


def test_group_margins_hand_worked():
    m = group_margins(ERR, REF, ADV, GROUPS, beta=10.0)
    torch.testing.assert_close(m, torch.tensor([S0, S1, S0, S0, S1, S0], dtype=torch.float64))
    # the group's size divides (n_g = 4 and 2 here), not the batch's: a group of 2 alone gives the same S_1
    torch.testing.assert_close(group_margins(ERR[[1, 4]], REF[[1, 4]], ADV[[1, 4]], GROUPS[[1, 4]], 10.0),
                               torch.tensor([S1, S1], dtype=torch.float64))


def test_dgpo_loss_value_and_gradient_hand_worked():
    """L = mean_i σ(S_g(i))·A_i·e_i; dL/de_i = σ(S_g(i))·A_i / B: the sigmoid weight of its group times its
    advantage — β only inside the sigmoid, A itself (not its sign) as the weight."""
    err = ERR.clone().requires_grad_(True)
    loss, stats = dgpo_loss(err, group_margins(ERR, REF, ADV, GROUPS, 10.0), ADV)
    group0 = W0 * (1 * 0.2 + 0.5 * 0.3 - 0.5 * 0.4 - 1 * 0.5)  # σ(S_0)·(−0.35)
    group1 = W1 * (2 * 1.2 - 2 * 0.8)  # σ(S_1)·0.8
    assert loss.item() == pytest.approx((group0 + group1) / 6, rel=1e-6)
    loss.backward()
    expected = torch.tensor([W0 * 1, W1 * 2, W0 * 0.5, W0 * -0.5, W1 * -2, W0 * -1], dtype=torch.float64) / 6
    torch.testing.assert_close(err.grad, expected)
    assert stats["dgpo_weight_mean"].item() == pytest.approx((4 * W0 + 2 * W1) / 6)


def test_gradient_descent_lowers_the_positive_errors_and_raises_the_negative_ones():
    """The direction a sign slip would reverse: a step down the gradient makes good samples likelier (their error
    falls) and bad ones less likely (their error rises)."""
    err = ERR.clone().requires_grad_(True)
    dgpo_loss(err, group_margins(ERR, REF, ADV, GROUPS, 10.0), ADV)[0].backward()
    after = ERR - 0.1 * err.grad
    assert ((after < ERR) == (ADV > 0)).all() and ((after > ERR) == (ADV < 0)).all()


def test_it_is_the_papers_group_preference_with_sets_split_by_the_advantages_sign():
    """log σ(R(G+) − R(G−)) with G+ = {A > 0}, G− = {A < 0}, each sample weighted |A|/n_g and R(x) = −β·(e − e_ref)
    (a sample with A = 0 belongs to neither, and its error moves nothing). The surrogate's gradient is the negative
    log-likelihood's times n_g/β per group (the reference's scale: β only sharpens the sigmoid)."""
    beta = 10.0
    err = ERR.clone().requires_grad_(True)
    nll = 0.0
    for g in (0, 1):
        m = GROUPS == g
        n = int(m.sum())
        pos, neg = m & (ADV > 0), m & (ADV < 0)
        r_pos = (ADV[pos].abs() / n * -beta * (err[pos] - REF[pos])).sum()
        r_neg = (ADV[neg].abs() / n * -beta * (err[neg] - REF[neg])).sum()
        nll = nll - F.logsigmoid(r_pos - r_neg) * n / beta
    (nll / len(ERR)).backward()
    paper = err.grad.clone()
    err.grad = None
    dgpo_loss(err, group_margins(ERR, REF, ADV, GROUPS, beta), ADV)[0].backward()
    torch.testing.assert_close(err.grad, paper)
    # a zero-advantage sample far from the reference changes no margin
    shifted = ERR.clone()
    shifted[2] += 5.0
    torch.testing.assert_close(group_margins(shifted, REF, ADV.where(torch.arange(6) != 2, 0.0), GROUPS, beta),
                               group_margins(ERR, REF, ADV.where(torch.arange(6) != 2, 0.0), GROUPS, beta))


def test_clip_hand_worked():
    """ratio = exp(e_old − e) = [e^0.02, e^−0.02, e^0.02, e^−0.02], ε = 0.01: a positive sample is done once its
    ratio exceeds 1.01, a negative one once it falls below 0.99. A clipped point keeps its place in the margin and
    loses its gradient."""
    err = torch.ones(4, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([1.02, 0.98, 1.02, 0.98], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    ratio, clipped = dgpo_clip(err, old, adv, clip_range=0.01)
    torch.testing.assert_close(ratio, torch.tensor([0.02, -0.02, 0.02, -0.02], dtype=torch.float64).exp())
    assert clipped.tolist() == [True, False, False, True]
    margin = group_margins(err, old, adv, torch.zeros(4, dtype=torch.long), 10.0)
    dgpo_loss(err, margin, adv, clipped)[0].backward()
    assert err.grad[0] == 0 and err.grad[3] == 0 and err.grad[1] > 0 > err.grad[2]


def test_a_weight_scales_each_samples_share():
    err = ERR.clone().requires_grad_(True)
    w = torch.tensor([1.0, 0.5, 0.0, 1.0, 2.0, 1.0])
    dgpo_loss(err, group_margins(ERR, REF, ADV, GROUPS, 10.0), ADV, weight=w)[0].backward()
    plain = ERR.clone().requires_grad_(True)
    dgpo_loss(plain, group_margins(ERR, REF, ADV, GROUPS, 10.0), ADV)[0].backward()
    torch.testing.assert_close(err.grad, plain.grad * w.double())


def dgpo_reference(model_v, ref_v, old_v, target_v, advantages, prompt_ids, beta_dpo, group_size, clip_range):
    """Luo-Yihong/DGPO scripts/train_sd3_dgpo.py, one process: the clip (lines 1132-1144, clip_dsm) and
    compute_group_dgpo_loss_allreduce (lines 162-193; the all-reduce of the group sums is the identity here)."""
    batch_size = model_v.shape[0]
    dsm_loss = 1 * (target_v - model_v).square().reshape(batch_size, -1).mean(dim=1)
    old_dsm_loss = 1 * (target_v - old_v).square().reshape(batch_size, -1).mean(dim=1)
    ratio = torch.exp(-dsm_loss + old_dsm_loss)
    should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    dsm_loss = torch.where(should_clip, dsm_loss.detach(), dsm_loss)
    with torch.no_grad():
        ref_dsm_loss = (target_v - ref_v).square().reshape(batch_size, -1).mean(dim=1)
    delta_diff = dsm_loss.detach() - ref_dsm_loss.detach()
    per_sample_term = advantages * beta_dpo * delta_diff / group_size
    _, local_group_indices = torch.unique(prompt_ids.view(batch_size, -1), dim=0, return_inverse=True)
    num_groups = int(local_group_indices.max()) + 1
    local_group_sums = torch.zeros(num_groups, dtype=per_sample_term.dtype)
    local_group_sums.scatter_add_(0, local_group_indices, per_sample_term)
    group_weights = torch.sigmoid(local_group_sums.detach())
    local_weights = group_weights[local_group_indices]
    return (local_weights.detach() * advantages * dsm_loss).mean(), should_clip


@pytest.mark.parametrize("beta_dpo, clip_range", [(100.0, 1e-2), (2000.0, 1e-5), (10.0, 1.0)])
def test_parity_with_the_reference_implementation(beta_dpo, clip_range):
    """Random velocities, two groups of four interleaved, fp64: the same loss and the same gradient on the policy's
    velocity, with the clip active (ε 1e-2, 1e-5) and idle (ε 1)."""
    g = torch.Generator().manual_seed(0)
    shape = (8, 4, 3, 3)
    x0, eps = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    target = eps - x0
    ref_v = target + 0.5 * torch.randn(shape, generator=g, dtype=torch.float64)
    old_v = ref_v + 0.02 * torch.randn(shape, generator=g, dtype=torch.float64)
    start = old_v + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
    adv = torch.randn(8, generator=g, dtype=torch.float64)
    groups = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1])
    v_ref = start.clone().requires_grad_(True)
    want, want_clip = dgpo_reference(v_ref, ref_v, old_v, target, adv, groups, beta_dpo, 4, clip_range)
    want.backward()
    v = start.clone().requires_grad_(True)
    err = flow_matching_error(v, x0, eps)
    ratio, clipped = dgpo_clip(err, flow_matching_error(old_v, x0, eps), adv, clip_range)
    margin = group_margins(err, flow_matching_error(ref_v, x0, eps), adv, groups, beta_dpo)
    loss, _ = dgpo_loss(err, margin, adv, clipped)
    loss.backward()
    assert torch.equal(clipped, want_clip)
    if clip_range < 1:
        assert 0 < int(clipped.sum()) < 8, "the clip must act on some samples and not all for this case to test it"
    assert loss.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-12)
    torch.testing.assert_close(v.grad, v_ref.grad, rtol=1e-6, atol=1e-12)
