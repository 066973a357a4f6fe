"""Pure, stateless denoising steps for rectified-flow models (x_t = (1 − σ)·x0 + σ·ε, velocity v = ε − x0).

Each function maps the model's velocity at (x_t, σ) to the sample at σ_next < σ. The stochastic ones are Gaussian
transitions x_next ~ N(mean, std²) and return the log-density of `prev_sample` under that Gaussian, averaged over
all non-batch dimensions (Flow-GRPO's convention: a per-element log-prob, so its scale does not depend on the
image size). Passing `prev_sample` evaluates the log-prob of a recorded transition (training); omitting it samples
a new one (rollout). All math runs in fp32 whatever the model dtype: the std can be ~1e-2 and its square in
bf16 would swamp the log-prob differences that the policy ratio is built from.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class StepOutput(NamedTuple):
    prev_sample: torch.Tensor  # (B, C, H, W) fp32: the sample at sigma_next
    log_prob: torch.Tensor  # (B,) fp32: mean over C,H,W of log N(prev_sample; mean, std²); zeros for ODE
    mean: torch.Tensor  # (B, C, H, W) fp32
    std: torch.Tensor  # (B, 1, 1, 1) fp32: the transition's standard deviation (0 for ODE)
    noise_coef: torch.Tensor  # (B, 1, 1, 1) fp32: what Flow-GRPO/GeRL call std_dev_t: g for SDE (std = g·sqrt(−dt)), std for CPS, 0 for ODE


def _as_batch(x: torch.Tensor | float, ref: torch.Tensor) -> torch.Tensor:
    """σ given as a float, a 0-d tensor or a (B,) tensor → (B, 1, 1, 1) fp32 on ref's device."""
    t = torch.as_tensor(x, dtype=torch.float32, device=ref.device)
    if t.ndim == 0:
        t = t.expand(ref.shape[0])
    if t.shape != (ref.shape[0],):
        raise ValueError(f"sigma must be a scalar or have shape ({ref.shape[0]},), got {tuple(t.shape)}")
    return t.view(-1, *([1] * (ref.ndim - 1)))


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, std²), averaged over every dimension but the batch one. Shapes: (B, ...) → (B,)."""
    lp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, x.ndim)))


def _finish(mean, std, prev_sample, generator, noise=None, noise_coef=None) -> StepOutput:
    coef = std if noise_coef is None else noise_coef
    if prev_sample is None:
        # Noise is drawn on the CPU from the caller's generator so that a seed reproduces the same sample on any
        # device; the loop passes one generator per sample, so the batch split does not change the noise.
        noise = _randn(mean.shape, generator, mean.device) if noise is None else noise.to(mean.device, torch.float32)
        prev_sample = torch.addcmul(mean, std, noise)
        # x − mean = std·noise exactly, so the density needs no second pass over (x − mean)² / std²
        lp = (-0.5 * noise**2).mean(dim=tuple(range(1, noise.ndim))) - torch.log(std).flatten() - LOG_SQRT_2PI
        return StepOutput(prev_sample, lp, mean, std, coef)
    prev_sample = prev_sample.float()
    return StepOutput(prev_sample, gaussian_log_prob(prev_sample.detach(), mean, std), mean, std, coef)


def _randn(shape, generator, device) -> torch.Tensor:
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}; pass one per sample")
        out = torch.empty(shape, dtype=torch.float32)
        for i, g in enumerate(generator):
            torch.randn(shape[1:], generator=g, out=out[i])
        return out.to(device)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device)


def ode_step(model_output: torch.Tensor, sample: torch.Tensor, sigma, sigma_next) -> StepOutput:
    """Deterministic Euler step of the flow ODE: x_next = x + (σ_next − σ)·v (the stock SD3 scheduler's step)."""
    v, x = model_output.float(), sample.float()  # fp32: see module docstring
    s, s_next = _as_batch(sigma, x), _as_batch(sigma_next, x)
    mean = x + (s_next - s) * v
    zero = torch.zeros_like(s)
    return StepOutput(mean, torch.zeros(x.shape[0], device=x.device), mean, zero, zero)


def sde_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float,
    sigma_max: float,
    prev_sample: torch.Tensor | None = None,
    generator=None,
    noise: torch.Tensor | None = None,
) -> StepOutput:
    """Flow-GRPO's SDE step: the reverse-time SDE whose marginals equal the flow ODE's.

    With dt = σ_next − σ < 0 and diffusion coefficient g = noise_level·sqrt(σ / (1 − σ)):
        mean = x + [v + g²/(2σ)·(x + (1 − σ)·v)]·dt,   std = g·sqrt(−dt)
    (the score of x_t is −(x + (1 − σ)v)/σ for a rectified flow). At σ = 1 the coefficient is infinite, so
    `sigma_max` — the largest σ below 1 in the schedule — stands in for σ in the 1 − σ denominator, as in
    Flow-GRPO.

    Args:
        model_output: (B, C, H, W) velocity predicted at (sample, σ).
        sample: (B, C, H, W) x_t.
        sigma, sigma_next: floats or (B,) tensors, σ_next < σ.
        noise_level: the SDE's η (0 gives the ODE mean with a zero std, which has no density: use ode_step).
        sigma_max: see above.
        prev_sample: (B, C, H, W) a recorded x_next to score; None to sample one.
        generator: a torch.Generator or a list of one per sample (CPU), used only when sampling.
        noise: (B, C, H, W) standard-normal noise to use instead of drawing from `generator` when sampling.
    """
    v, x = model_output.float(), sample.float()  # fp32: see module docstring
    s, s_next = _as_batch(sigma, x), _as_batch(sigma_next, x)
    dt = s_next - s
    denom = 1 - torch.where(s >= 1, torch.full_like(s, sigma_max), s)
    g = noise_level * torch.sqrt(s / denom)
    g2_2s = g**2 / (2 * s)  # per-sample coefficients first (B,1,1,1), then two passes over the latents
    mean = torch.addcmul(x * (1 + g2_2s * dt), v, (1 + g2_2s * (1 - s)) * dt)
    std = g * torch.sqrt(-dt)
    return _finish(mean, std, prev_sample, generator, noise, noise_coef=g)


def cps_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float,
    prev_sample: torch.Tensor | None = None,
    generator=None,
    noise: torch.Tensor | None = None,
) -> StepOutput:
    """Coefficients-preserving sampling (CPS): re-noise the predicted x0 to σ_next with a fresh share of noise.

    x0 = x − σ·v and ε = x + (1 − σ)·v are the model's predictions; with std = σ_next·sin(noise_level·π/2):
        mean = (1 − σ_next)·x0 + sqrt(σ_next² − std²)·ε,   x_next = mean + std·z
    so x_next has exactly the noise coefficient σ_next the flow expects. The std vanishes at σ_next = 0, so the
    final step must be an ODE step (the sampling loop never trains it).

    Args: as `sde_step`, without `sigma_max`.
    """
    v, x = model_output.float(), sample.float()  # fp32: see module docstring
    s, s_next = _as_batch(sigma, x), _as_batch(sigma_next, x)
    std = s_next * math.sin(noise_level * math.pi / 2)
    x0 = x - s * v
    eps = x + (1 - s) * v
    mean = torch.addcmul(x0 * (1 - s_next), eps, torch.sqrt((s_next**2 - std**2).clamp_min(0)))
    return _finish(mean, std, prev_sample, generator, noise)


SAMPLERS = ("sde", "cps")


def stochastic_step(sampler: str, model_output, sample, sigma, sigma_next, noise_level, sigma_max,
                    prev_sample=None, generator=None, noise=None) -> StepOutput:
    """Dispatch to the named stochastic step; an unknown name lists the valid ones."""
    if sampler == "sde":
        return sde_step(model_output, sample, sigma, sigma_next, noise_level, sigma_max, prev_sample, generator, noise)
    if sampler == "cps":
        return cps_step(model_output, sample, sigma, sigma_next, noise_level, prev_sample, generator, noise)
    raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")


LOG_PROB_CONVENTIONS = ("gaussian", "squared_error")


def log_prob_as(convention: str, log_prob: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Re-express a step's log-prob (the Gaussian density above, averaged over elements) in another convention.

    gaussian:       mean[−(x − mean)²/(2·std²)] − log std − log sqrt(2π)    (the true density; gerl)
    squared_error:  mean[−(x − mean)²]                                     (Flow-GRPO's and GeRL's CPS code)
    The std depends only on σ and the noise level, never on the weights, so the second is an exact affine map
    of the first: squared_error = 2·std²·(gaussian + log std + log sqrt(2π)); its log-ratios are 2·std² times
    the Gaussian ones, which is why a clip range does not carry over between the two.

    Args:
        log_prob: (B,) Gaussian log-probs from a stochastic step.
        std: (B, 1, 1, 1) or (B,) the step's std.
    """
    if convention == "gaussian":
        return log_prob
    if convention == "squared_error":
        s = std.reshape(-1)
        return 2 * s**2 * (log_prob + torch.log(s) + LOG_SQRT_2PI)
    raise ValueError(f"unknown log-prob convention {convention!r}; choose one of {', '.join(LOG_PROB_CONVENTIONS)}")
