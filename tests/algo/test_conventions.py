"""Conventions of the algorithm: the group-std estimator, the KL denominator and the clipped loss, each against its
formula written out here, and each preset against the peer's formula (Flow-GRPO's stat_tracking.py + train_sd3.py,
GeRL's core_algos.py) on random tensors."""

import math

import numpy as np
import pytest
import torch

from gerl.algo.advantages import PerPromptTracker, compute_advantages, global_std_advantages, group_advantages
from gerl.algo.loss import grpo_loss, kl_penalty
from gerl.config import PRESETS
from gerl.sampling.steps import cps_step, log_prob_as, sde_step


def rewards_and_groups(seed, groups=8, n=8):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(groups * n, generator=g)
    ids = torch.arange(groups).repeat_interleave(n)[torch.randperm(groups * n, generator=g)]
    return rewards, ids


# ---- group std: the estimator ------------------------------------------------------------------------------------

def test_biased_and_unbiased_std_by_hand():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0])
    ids = torch.zeros(4, dtype=torch.long)
    mean = 3.0
    ss = sum((v - mean) ** 2 for v in (1.0, 2.0, 3.0, 6.0))  # 14
    biased = group_advantages(r, ids, unbiased=False)
    unbiased = group_advantages(r, ids, unbiased=True)
    torch.testing.assert_close(biased, (r - mean) / (math.sqrt(ss / 4) + 1e-4))
    torch.testing.assert_close(unbiased, (r - mean) / (math.sqrt(ss / 3) + 1e-4))


def flow_grpo_advantages(prompts, rewards, global_std):
    """Flow-GRPO's PerPromptStatTracker.update (grpo) on one epoch's gathered rewards, written out with numpy."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    adv = np.empty_like(rewards)
    for p in np.unique(prompts):
        r = rewards[prompts == p]
        std = (np.std(rewards) if global_std else np.std(r)) + 1e-4
        adv[prompts == p] = (r - np.mean(r)) / std
    return adv


def gerl_mm_grpo_advantages(rewards, index, global_std):
    """GeRL's compute_flow_grpo_outcome_advantage (norm_adv_by_std_in_grpo = True), written out with torch.std."""
    out = rewards.clone()
    batch_std = torch.std(rewards)  # torch's default: unbiased (n − 1)
    for g in index.unique():
        m = index == g
        std = batch_std if global_std else torch.std(rewards[m])
        out[m] = (rewards[m] - rewards[m].mean()) / (std + 1e-4)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flow_grpo_preset_advantages_match_its_tracker(seed):
    rewards, ids = rewards_and_groups(seed)
    p = PRESETS["flow_grpo"]
    ours = compute_advantages(p["train.advantage"], rewards, ids, clip=5.0,
                              unbiased=p["conventions.group_std"] == "unbiased")
    peer = flow_grpo_advantages([f"prompt {i}" for i in ids.tolist()], rewards.tolist(), global_std=True)
    np.testing.assert_allclose(ours.numpy(), np.clip(peer, -5, 5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gerl_mm_grpo_preset_advantages_match_core_algos(seed):
    rewards, ids = rewards_and_groups(seed)
    p = PRESETS["gerl_mm_grpo"]
    ours = compute_advantages(p["train.advantage"], rewards, ids, clip=5.0,
                              unbiased=p["conventions.group_std"] == "unbiased")
    torch.testing.assert_close(ours, gerl_mm_grpo_advantages(rewards, ids, global_std=True).clamp(-5, 5))
    # and GeRL's per-group variant (global_std False) is gerl's group mode with the unbiased estimator
    torch.testing.assert_close(group_advantages(rewards, ids, unbiased=True),
                               gerl_mm_grpo_advantages(rewards, ids, global_std=False))


def test_unbiased_global_std_is_sqrt_n_over_n_minus_one_smaller():
    rewards, ids = rewards_and_groups(3)
    n = len(rewards)
    ratio = global_std_advantages(rewards, ids) / global_std_advantages(rewards, ids, unbiased=True)
    torch.testing.assert_close(ratio, torch.full_like(ratio, math.sqrt(n / (n - 1))), rtol=1e-3, atol=1e-3)


def test_tracker_uses_the_estimator():
    t = PerPromptTracker(buffer=8, unbiased=True)
    adv = t.advantages(["a"] * 3, torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0]) / (1.0 + 1e-4))  # unbiased std of 1,2,3 = 1


# ---- KL: the denominator ------------------------------------------------------------------------------------------

def gaussian_kl(m1, m2, s):
    """KL(N(m1, s²) ‖ N(m2, s²)) per element from the closed form for two Gaussians, averaged like the log-prob."""
    s1 = s2 = s
    kl = torch.log(s2 / s1) + (s1**2 + (m1 - m2) ** 2) / (2 * s2**2) - 0.5
    return kl.mean(dim=(1, 2, 3)).mean()


def test_transition_kl_is_the_exact_gaussian_kl():
    v, x = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    a = sde_step(v, x, 0.7, 0.6, 0.7, 0.95)
    b = sde_step(v + 0.05 * torch.randn_like(v), x, 0.7, 0.6, 0.7, 0.95)
    torch.testing.assert_close(kl_penalty(a.mean, b.mean, a.std), gaussian_kl(a.mean, b.mean, a.std),
                               rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("preset", ["flow_grpo", "gerl_mm_grpo"])
@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_preset_kl_matches_the_peers(preset, sampler):
    """Both peers: ((μ − μ_ref)²).mean(dim=(1,2,3)) / (2·std_dev_t²), then mean — with their std_dev_t."""
    assert PRESETS[preset]["conventions.kl_std"] == "noise_coef"
    v, x = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    sigma, sigma_next = 0.7, 0.6
    step = (lambda vv: sde_step(vv, x, sigma, sigma_next, 0.7, 0.95)) if sampler == "sde" else \
        (lambda vv: cps_step(vv, x, sigma, sigma_next, 0.8))
    a, b = step(v), step(v + 0.05 * torch.randn_like(v))
    std_dev_t = 0.7 * math.sqrt(sigma / (1 - sigma)) if sampler == "sde" else sigma_next * math.sin(0.8 * math.pi / 2)
    peer = (((a.mean - b.mean) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)).mean()
    torch.testing.assert_close(kl_penalty(a.mean, b.mean, a.noise_coef), peer, rtol=1e-5, atol=0)
    exact = kl_penalty(a.mean, b.mean, a.std)
    # gerl's exact KL is the peers' divided by −dt for the SDE (3.7–25× on 10 steps), identical for CPS
    expected = peer / (sigma - sigma_next) if sampler == "sde" else peer
    torch.testing.assert_close(exact, expected, rtol=1e-5, atol=0)


# ---- the clipped loss under a preset equals the peers' loss --------------------------------------------------------

@pytest.mark.parametrize("preset", ["flow_grpo", "gerl_mm_grpo"])
@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_preset_loss_matches_the_peers(preset, sampler):
    torch.manual_seed(0)
    B, clip, beta = 6, 1e-4, 0.04
    x, v_old = torch.randn(B, 4, 6, 6), torch.randn(B, 4, 6, 6)
    v_new = v_old + 2e-3 * torch.randn_like(v_old)
    v_ref = v_old + 2e-3 * torch.randn_like(v_old)
    sigma, sigma_next = 0.5, 0.4
    step = (lambda vv, prev=None: sde_step(vv, x, sigma, sigma_next, 0.7, 0.95, prev_sample=prev)) if sampler == "sde" \
        else (lambda vv, prev=None: cps_step(vv, x, sigma, sigma_next, 0.8, prev_sample=prev))
    old = step(v_old, None)
    z = torch.randn_like(x)
    nxt = old.mean + old.std * z
    old, new, ref = step(v_old, nxt), step(v_new, nxt), step(v_ref, nxt)
    adv = torch.randn(B).clamp(-5, 5)
    # peer: the log-probs their step returns (Gaussian for sde, −mean squared error for cps), their loss, their KL
    if sampler == "sde":
        def peer_lp(s):
            return (-((nxt - s.mean) ** 2) / (2 * s.std**2) - torch.log(s.std) - math.log(math.sqrt(2 * math.pi))).mean(dim=(1, 2, 3))
    else:
        def peer_lp(s):
            return (-((nxt - s.mean) ** 2)).mean(dim=(1, 2, 3))
    ratio = torch.exp(peer_lp(new) - peer_lp(old))
    policy = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)))
    peer_loss = policy + beta * torch.mean(((new.mean - ref.mean) ** 2).mean(dim=(1, 2, 3), keepdim=True)
                                           / (2 * new.noise_coef**2))
    conv = PRESETS[preset][f"conventions.{sampler}_log_prob"]
    loss, stats = grpo_loss(log_prob_as(conv, new.log_prob, new.std), log_prob_as(conv, old.log_prob, old.std), adv,
                            clip, beta, new.mean, ref.mean, new.noise_coef)
    torch.testing.assert_close(loss, peer_loss, rtol=1e-5, atol=1e-7)
    assert float(stats["kl"]) > 0 and float((ratio - 1).abs().max()) > 0  # both terms are live, not trivially 0
