"""Log-prob conventions and peer parity of the steps: each convention against its formula written out here, and the
flow_grpo / gerl_mm_grpo conventions against the peers' step written out here (Flow-GRPO's sd3_sde_with_logprob.py
and GeRL's scheduling_flow_match_sde_discrete.py compute the same thing), on random tensors."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from gerl.config import PRESETS
from gerl.sampling.loop import make_schedule
from gerl.sampling.steps import LOG_PROB_CONVENTIONS, cps_step, log_prob_as, ode_step, sde_step

SHAPE = (4, 16, 8, 8)  # (B, C, H, W)
TOL = dict(rtol=0, atol=5e-7)


def rand(seed, shape=SHAPE):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def schedule(num_steps=10, shift=3.0):
    return make_schedule(FlowMatchEulerDiscreteScheduler(shift=shift).config, num_steps)


# ---- the peers' step, written out (fp32, as both peers upcast) ------------------------------------------------------

def peer_step(sde_type, v, x, sigma, sigma_next, sigma_max, noise_level, prev_sample):
    """Returns (mean, std_dev_t, log_prob) exactly as Flow-GRPO/GeRL define them."""
    dt = sigma_next - sigma
    if sde_type == "sde":
        std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * noise_level
        mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        s = std_dev_t * math.sqrt(-dt)
        lp = -((prev_sample - mean) ** 2) / (2 * s**2) - math.log(s) - math.log(math.sqrt(2 * math.pi))
    else:
        std_dev_t = sigma_next * math.sin(noise_level * math.pi / 2)
        x0 = x - sigma * v
        x1 = x + v * (1 - sigma)
        mean = x0 * (1 - sigma_next) + x1 * math.sqrt(sigma_next**2 - std_dev_t**2)
        lp = -((prev_sample - mean) ** 2)  # "remove all constants"
    return mean, std_dev_t, lp.mean(dim=(1, 2, 3))


def gerl_step(sampler, v, x, sigma, sigma_next, sigma_max, noise_level, prev_sample):
    if sampler == "sde":
        return sde_step(v, x, sigma, sigma_next, noise_level, sigma_max, prev_sample=prev_sample)
    return cps_step(v, x, sigma, sigma_next, noise_level, prev_sample=prev_sample)


# ---- each convention against its own formula ------------------------------------------------------------------------

def test_gaussian_convention_is_the_density_itself():
    x, mean, std = rand(0), rand(1), torch.rand(SHAPE[0], 1, 1, 1) + 0.05
    written = (-((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
    out = cps_step(rand(2), rand(3), 0.7, 0.5, 0.8, prev_sample=x)
    # log N(x; μ, s²) per element, averaged: the step's own log-prob, unchanged by the gaussian convention.
    ref = (-((x - out.mean) ** 2) / (2 * out.std**2) - torch.log(out.std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
    torch.testing.assert_close(log_prob_as("gaussian", out.log_prob, out.std), ref, **TOL)
    from gerl.sampling.steps import gaussian_log_prob
    torch.testing.assert_close(gaussian_log_prob(x, mean, std), written, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("std_scale", [1e-2, 0.1, 0.9])
def test_squared_error_convention_is_minus_mean_squared_error(std_scale):
    """−mean((x − μ)²): no 1/(2 std²), no normaliser — also for a std of 1e-2, where the map multiplies by 2e-4."""
    mean = rand(1)
    std = torch.full((SHAPE[0], 1, 1, 1), std_scale)
    x = mean + std * rand(2)
    from gerl.sampling.steps import gaussian_log_prob
    converted = log_prob_as("squared_error", gaussian_log_prob(x, mean, std), std)
    written = -((x - mean) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(converted, written, rtol=2e-6, atol=1e-9)


def test_squared_error_log_ratio_is_two_std_squared_times_the_gaussian_one():
    """Why a clip range does not transfer: the same two policies give log-ratios 2·std² apart."""
    from gerl.sampling.steps import gaussian_log_prob
    std = torch.full((SHAPE[0], 1, 1, 1), 0.05)
    m_old = rand(1)
    m_new, x = m_old + 1e-3 * rand(2), m_old + std * rand(0)  # a sample of the old policy, a slightly moved mean
    g = gaussian_log_prob(x, m_new, std) - gaussian_log_prob(x, m_old, std)
    se = log_prob_as("squared_error", gaussian_log_prob(x, m_new, std), std) - \
        log_prob_as("squared_error", gaussian_log_prob(x, m_old, std), std)
    torch.testing.assert_close(se, 2 * 0.05**2 * g, rtol=1e-3, atol=1e-9)


def test_unknown_convention_lists_the_valid_ones():
    with pytest.raises(ValueError, match="gaussian, squared_error"):
        log_prob_as("normalised", torch.zeros(2), torch.ones(2))
    assert LOG_PROB_CONVENTIONS == ("gaussian", "squared_error")


def test_noise_coef_is_the_peers_std_dev_t():
    v, x = rand(0), rand(1)
    sde = sde_step(v, x, 0.6, 0.5, 0.7, 0.95)
    torch.testing.assert_close(sde.noise_coef.flatten(), torch.full((4,), 0.7 * math.sqrt(0.6 / 0.4)), **TOL)
    torch.testing.assert_close(sde.std, sde.noise_coef * math.sqrt(0.1), rtol=1e-6, atol=0)
    cps = cps_step(v, x, 0.6, 0.5, 0.8)
    assert torch.equal(cps.noise_coef, cps.std)
    assert torch.equal(ode_step(v, x, 0.6, 0.5).noise_coef, torch.zeros(4, 1, 1, 1))


# ---- each preset against the peer's step on random tensors, over a real 10-step shift-3 schedule -------------------

@pytest.mark.parametrize("preset", ["flow_grpo", "gerl_mm_grpo"])
@pytest.mark.parametrize("sampler,noise_level", [("sde", 0.7), ("cps", 0.8)])
def test_preset_log_prob_matches_the_peer_step(preset, sampler, noise_level):
    sched = schedule()
    convention = PRESETS[preset][f"conventions.{sampler}_log_prob"]
    for i in range(sched.num_steps - 1):  # every step the peers train (σ_next > 0)
        sigma, sigma_next = float(sched.sigmas[i]), float(sched.sigmas[i + 1])
        v, x, z = rand(10 + i), rand(20 + i), rand(30 + i)
        sample = gerl_step(sampler, v, x, sigma, sigma_next, sched.sigma_max, noise_level, None)
        ours = gerl_step(sampler, v, x, sigma, sigma_next, sched.sigma_max, noise_level, sample.mean + sample.std * z)
        mean, std_dev_t, lp = peer_step(sampler, v, x, sigma, sigma_next, sched.sigma_max, noise_level, ours.prev_sample)
        torch.testing.assert_close(ours.mean, mean, **TOL)
        torch.testing.assert_close(ours.noise_coef.flatten(), torch.full((4,), std_dev_t), rtol=1e-6, atol=0)
        peer_lp = log_prob_as(convention, ours.log_prob, ours.std)
        # Flow-GRPO/GeRL's log-probs: Gaussian ones (SDE, magnitude ~ 1) to ≤ 5e-7 relative, squared errors exactly.
        torch.testing.assert_close(peer_lp, lp, rtol=5e-7, atol=5e-7 * float(ours.std.max()) ** 2 + 1e-9)


def test_cps_log_ratio_scale_on_the_schedule():
    """The issue's numbers: gerl's CPS log-ratio is 1/(2·std²) times the peers': ≈ 0.6–1.1× on steps 0–4 and
    thousands of times at step 8 of a 10-step shift-3 schedule (η = 0.8)."""
    sched = schedule()
    factors = [1 / (2 * (float(sched.sigmas[i + 1]) * math.sin(0.8 * math.pi / 2)) ** 2) for i in range(9)]
    assert all(0.5 < f < 1.2 for f in factors[:5]), factors
    assert factors[8] > 1000, factors
