"""The pure denoising steps: one contract every stochastic step passes, then each step's math pinned against an
independent re-derivation (Flow-GRPO's SDE, CPS, the stock diffusers Euler step, marginal preservation)."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from gerl.sampling.steps import SAMPLERS, cps_step, gaussian_log_prob, ode_step, sde_step, stochastic_step

SIGMA_MAX = 0.95  # stands in for σ = 1 in the SDE's 1 − σ denominator
SHAPE = (3, 4, 5, 6)  # (B, C, H, W)


def step(sampler, v, x, sigma, sigma_next, noise_level=0.7, prev_sample=None, generator=None):
    return stochastic_step(sampler, v, x, sigma, sigma_next, noise_level, SIGMA_MAX, prev_sample, generator)


def inputs(seed=0, shape=SHAPE, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)  # v, x


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ the shared contract (every stochastic step)

@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shapes_and_fp32_outputs(sampler, dtype):
    v, x = inputs(dtype=dtype)
    out = step(sampler, v, x, 0.8, 0.6, generator=gen(0))
    B = SHAPE[0]
    assert out.prev_sample.shape == SHAPE and out.mean.shape == SHAPE
    assert out.log_prob.shape == (B,)
    assert out.std.shape == (B, 1, 1, 1)
    for t in out:
        assert t.dtype == torch.float32, "the step math must run in fp32 whatever the model dtype"
        assert torch.isfinite(t).all()
    # Scoring a bf16 recorded sample also comes back fp32.
    scored = step(sampler, v, x, 0.8, 0.6, prev_sample=out.prev_sample.to(dtype))
    assert scored.log_prob.dtype == torch.float32
    # The math itself is fp32: low-precision inputs give exactly what their fp32 upcast gives.
    upcast = step(sampler, v.float(), x.float(), 0.8, 0.6, generator=gen(0))
    for a, b in zip(out, upcast):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_seeded_determinism(sampler):
    v, x = inputs()
    a = step(sampler, v, x, 0.8, 0.6, generator=gen(7))
    b = step(sampler, v, x, 0.8, 0.6, generator=gen(7))
    c = step(sampler, v, x, 0.8, 0.6, generator=gen(8))
    assert torch.equal(a.prev_sample, b.prev_sample) and torch.equal(a.log_prob, b.log_prob)
    assert not torch.allclose(a.prev_sample, c.prev_sample)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_per_sample_generators_match_drawing_each_sample_alone(sampler):
    v, x = inputs()
    seeds = [3, 1, 4]
    batch = step(sampler, v, x, 0.8, 0.6, generator=[gen(s) for s in seeds])
    for i, s in enumerate(seeds):
        alone = step(sampler, v[i:i + 1], x[i:i + 1], 0.8, 0.6, generator=[gen(s)])
        torch.testing.assert_close(batch.prev_sample[i:i + 1], alone.prev_sample, rtol=0, atol=1e-6)
        torch.testing.assert_close(batch.log_prob[i:i + 1], alone.log_prob, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="one per sample"):
        step(sampler, v, x, 0.8, 0.6, generator=[gen(0), gen(1)])


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_per_sample_sigmas_match_scalar_calls(sampler):
    # Replay batches mix samples at different steps: a (B,) σ must act sample-wise.
    v, x = inputs()
    sig, sig_next = torch.tensor([1.0, 0.7, 0.3]), torch.tensor([0.8, 0.5, 0.1])
    prev = x + 0.1
    batch = step(sampler, v, x, sig, sig_next, prev_sample=prev)
    for i in range(3):
        one = step(sampler, v[i:i + 1], x[i:i + 1], float(sig[i]), float(sig_next[i]), prev_sample=prev[i:i + 1])
        torch.testing.assert_close(batch.mean[i:i + 1], one.mean)
        torch.testing.assert_close(batch.std[i:i + 1], one.std)
        torch.testing.assert_close(batch.log_prob[i:i + 1], one.log_prob)
    with pytest.raises(ValueError, match="shape"):
        step(sampler, v, x, torch.tensor([0.8, 0.7]), 0.5)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_log_prob_of_given_sample_is_the_gaussian_density(sampler):
    v, x = inputs()
    prev = inputs(seed=1)[1]
    out = step(sampler, v, x, 0.8, 0.6, prev_sample=prev)
    assert torch.equal(out.prev_sample, prev), "a given prev_sample is scored, not replaced"
    ref = torch.distributions.Normal(out.mean.double(), out.std.double()).log_prob(prev.double()).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob.double(), ref, rtol=0, atol=1e-5)
    # The sampled transition's own log-prob is the same density at the sample it drew.
    drawn = step(sampler, v, x, 0.8, 0.6, generator=gen(0))
    rescored = step(sampler, v, x, 0.8, 0.6, prev_sample=drawn.prev_sample)
    torch.testing.assert_close(drawn.log_prob, rescored.log_prob, rtol=0, atol=1e-6)
    # gaussian_log_prob itself, on a case worked by hand: x = mean + std → −1/2 − log std − log √(2π).
    std = torch.full((1, 1, 1, 1), 0.3)
    lp = gaussian_log_prob(torch.full((1, 2, 2, 2), 1.3), torch.ones(1, 2, 2, 2), std)
    torch.testing.assert_close(lp, torch.tensor([-0.5 - math.log(0.3) - 0.5 * math.log(2 * math.pi)]))


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_log_prob_gradient_flows_through_the_model_output(sampler):
    # The policy gradient reaches the weights only via the mean: the recorded sample is a constant.
    v, x = inputs()
    v.requires_grad_(True)
    prev = x.clone().requires_grad_(True)
    step(sampler, v, x, 0.8, 0.6, prev_sample=prev).log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert prev.grad is None, "the recorded sample must be detached from the log-prob"


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_sample_statistics_match_returned_mean_and_std(sampler):
    # 8000 draws of the same transition: empirical mean/std per element vs the returned mean/std.
    v, x = inputs(shape=(1, 2, 3, 3))
    n = 8000
    out = step(sampler, v.expand(n, -1, -1, -1), x.expand(n, -1, -1, -1), 0.8, 0.6, generator=gen(0))
    std = out.std[0].item()
    assert std > 0
    se = std / math.sqrt(n)
    assert (out.prev_sample.mean(0) - out.mean[0]).abs().max() < 5 * se
    emp_std = out.prev_sample.std(0)
    assert ((emp_std / std) - 1).abs().max() < 0.05


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_std_grows_with_noise_level(sampler):
    v, x = inputs()
    stds = [step(sampler, v, x, 0.8, 0.6, noise_level=n, generator=gen(0)).std[0].item() for n in (0.2, 0.5, 0.9)]
    assert stds[0] < stds[1] < stds[2]


def test_unknown_sampler_lists_valid_names():
    v, x = inputs()
    with pytest.raises(ValueError, match="unknown sampler 'ddim'") as e:
        step("ddim", v, x, 0.8, 0.6)
    assert all(name in str(e.value) for name in SAMPLERS)


def test_sde_and_cps_differ():
    v, x = inputs()
    sde = step("sde", v, x, 0.8, 0.6, noise_level=0.7, prev_sample=x)
    cps = step("cps", v, x, 0.8, 0.6, noise_level=0.7, prev_sample=x)
    assert not torch.allclose(sde.std, cps.std)
    assert not torch.allclose(sde.mean, cps.mean)


# ------------------------------------------------------------------ each step's math, re-derived

@pytest.mark.parametrize("sigma,sigma_next", [(0.8, 0.6), (0.3, 0.05), (1.0, 0.9)])
def test_sde_matches_flow_grpo(sigma, sigma_next):
    v, x = inputs()
    eta = 0.7
    out = sde_step(v, x, sigma, sigma_next, eta, SIGMA_MAX, generator=gen(0))
    # std = η·sqrt(σ / (1 − σ))·sqrt(σ − σ_next), with σ_max in the denominator at σ = 1 (Flow-GRPO).
    denom = 1 - (SIGMA_MAX if sigma == 1.0 else sigma)
    g = eta * math.sqrt(sigma / denom)
    std = g * math.sqrt(sigma - sigma_next)
    torch.testing.assert_close(out.std, torch.full((SHAPE[0], 1, 1, 1), std))
    # Mean written as Euler–Maruyama on dx = [v − g²/2·∇log p]dσ with ∇log p = −(x + (1 − σ)v)/σ (the score of a
    # rectified flow), i.e. a different arrangement of Flow-GRPO's
    # x·(1 + g²/(2σ)·dt) + v·(1 + g²(1 − σ)/(2σ))·dt.
    dt = sigma_next - sigma
    score = -(x + (1 - sigma) * v) / sigma
    mean = x + (v - g**2 / 2 * score) * dt
    torch.testing.assert_close(out.mean, mean, rtol=1e-5, atol=1e-5)
    flow_grpo = x * (1 + g**2 / (2 * sigma) * dt) + v * (1 + g**2 * (1 - sigma) / (2 * sigma)) * dt
    torch.testing.assert_close(out.mean, flow_grpo, rtol=1e-5, atol=1e-5)


def test_sde_with_exact_velocity_preserves_the_marginals():
    # Data x0 ~ N(0, s²) in 1-D: x_σ ~ N(0, (1 − σ)²s² + σ²) and the exact velocity E[ε − x0 | x_σ] is linear in x.
    # Many SDE steps from σ = 1 (final step ODE) must keep every marginal's std, and end at std s.
    s, n_steps, eta = 0.5, 50, 0.7

    def var(sig):
        return (1 - sig) ** 2 * s**2 + sig**2

    g = gen(0)
    x = torch.randn(20000, 1, 1, 1, generator=g)
    sigmas = torch.linspace(1, 0, n_steps + 1).tolist()
    worst = 0.0
    for i in range(n_steps):
        sig, sig_next = sigmas[i], sigmas[i + 1]
        v = (sig - (1 - sig) * s**2) / var(sig) * x
        if i < n_steps - 1:
            x = sde_step(v, x, sig, sig_next, eta, sigmas[1], generator=g).prev_sample
        else:
            x = ode_step(v, x, sig, sig_next).prev_sample
        worst = max(worst, abs(x.std().item() / math.sqrt(var(sig_next)) - 1))
    assert abs(x.std().item() / s - 1) < 0.03
    assert abs(x.mean().item()) < 0.02
    assert worst < 0.1  # discretisation error near σ = 1 (the σ_max stand-in); a wrong sign or std gives > 0.25


@pytest.mark.parametrize("sigma,sigma_next,eta", [(0.8, 0.6, 0.7), (1.0, 0.5, 0.3), (0.4, 0.1, 1.0)])
def test_cps_matches_its_definition(sigma, sigma_next, eta):
    # With the exact velocity of a known (x0, ε), the mean re-noises x0 to σ_next with a shrunken share of ε.
    g = gen(0)
    x0, eps = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    x = (1 - sigma) * x0 + sigma * eps
    v = eps - x0
    out = cps_step(v, x, sigma, sigma_next, eta, generator=gen(1))
    std = sigma_next * math.sin(eta * math.pi / 2)
    torch.testing.assert_close(out.std, torch.full((SHAPE[0], 1, 1, 1), std))
    expected_mean = (1 - sigma_next) * x0 + math.sqrt(sigma_next**2 - std**2) * eps
    torch.testing.assert_close(out.mean, expected_mean, rtol=1e-5, atol=1e-5)


def test_cps_sample_has_total_noise_coefficient_sigma_next():
    # x_next − (1 − σ_next)·x0 = sqrt(σ_next² − std²)·ε + std·z: its std over elements is σ_next exactly.
    sigma, sigma_next, eta = 0.9, 0.5, 0.8
    g = gen(0)
    shape = (4, 16, 32, 32)
    x0, eps = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    x = (1 - sigma) * x0 + sigma * eps
    out = cps_step(eps - x0, x, sigma, sigma_next, eta, generator=g)
    residual = out.prev_sample - (1 - sigma_next) * x0
    assert abs(residual.std().item() / sigma_next - 1) < 0.01
    # ... and its correlation with the original noise is the deterministic share.
    share = (residual * eps).mean().item()
    assert abs(share - math.sqrt(sigma_next**2 - out.std[0].item() ** 2)) < 0.01


def test_cps_std_vanishes_at_the_final_step():
    v, x = inputs()
    out = cps_step(v, x, 0.2, 0.0, 0.7, prev_sample=x)
    assert torch.all(out.std == 0)


def test_ode_step_matches_the_stock_scheduler():
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(6)
    g = gen(0)
    x = torch.randn(SHAPE, generator=g)
    ours = x.clone()
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(SHAPE, generator=g)
        x = sched.step(v, t, x, return_dict=False)[0]
        out = ode_step(v, ours, sched.sigmas[i], sched.sigmas[i + 1])
        ours = out.prev_sample
        torch.testing.assert_close(ours, x, rtol=0, atol=1e-6)
        assert torch.all(out.std == 0) and torch.all(out.log_prob == 0)
