"""The denoising loop: ODE everywhere except the SDE steps, recording exactly what training needs to replay them.

A batch's schedule (σ_0 = 1 > σ_1 > … > σ_N = 0) comes from the model's own FlowMatchEulerDiscreteScheduler, set
as its family's stock pipeline sets it (gerl/models/<family>.py), so that ODE sampling here reproduces that
pipeline. The final step (σ_N = 0) is always an ODE step: the CPS std vanishes there and there is nothing left to
explore. Latents are the family's canonical unpacked ones, (B, C, h, w), whatever the transformer reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gerl.sampling.steps import StepOutput, ode_step, stochastic_step


@dataclass
class Embeds:
    """Conditioning for a batch, as the model family's velocity call reads it (gerl/models/<family>.py): the text, and
    for an image-conditioned family (image editing) the conditioning image's latents.

    prompt: (B, L, D) token embeddings; pooled: (B, P) or None (a family without a pooled vector); the negative
    pair is the unconditional branch of classifier-free guidance. mask / neg_mask: (B, L) 1 for real tokens, or None
    when every row has all L tokens (SD3, FLUX pad every prompt to one length). Rows of different lengths (a family
    that encodes each prompt to its own length) are padded with zeros and mask 0 when batches are concatenated.
    cond: (B, T, D_c) the conditioning image's VAE latents packed into tokens as the family packs its own latents
    (FLUX.1-Kontext, Qwen-Image-Edit: the reference tokens appended to the image tokens), or None; cond_hw: (B, 2)
    long, each row's unpacked latent grid (h, w) — rows of different grids are zero-padded to the longest T, and the
    family calls its transformer once per grid (`gerl.models.family.condition_groups`)."""

    prompt: torch.Tensor
    pooled: torch.Tensor | None
    neg_prompt: torch.Tensor | None = None
    neg_pooled: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    neg_mask: torch.Tensor | None = None
    cond: torch.Tensor | None = None
    cond_hw: torch.Tensor | None = None

    FIELDS = ("prompt", "pooled", "neg_prompt", "neg_pooled", "mask", "neg_mask", "cond", "cond_hw")

    def index(self, idx) -> "Embeds":
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return Embeds(*(pick(getattr(self, f)) for f in self.FIELDS))

    def to(self, device) -> "Embeds":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Embeds(*(move(getattr(self, f)) for f in self.FIELDS))

    @staticmethod
    def cat(items: list["Embeds"]) -> "Embeds":
        def cat(ts):
            if ts[0] is None:
                return None
            longest = max(t.shape[1] for t in ts) if ts[0].ndim >= 2 else 0
            # masked rows of different lengths: zero padding at the end, where the mask is 0
            return torch.cat([t if t.ndim < 2 or t.shape[1] == longest
                              else torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, longest - t.shape[1]))
                              for t in ts])
        out = Embeds(*(cat([getattr(e, f) for e in items]) for f in Embeds.FIELDS))
        for seq, mask in (("prompt", "mask"), ("neg_prompt", "neg_mask")):
            lengths = {getattr(e, seq).shape[1] for e in items if getattr(e, seq) is not None}
            if len(lengths) > 1 and getattr(out, mask) is None:
                raise ValueError(f"embeddings of different lengths {sorted(lengths)} need a mask to be concatenated")
        return out

    def with_negative(self, neg: "Embeds") -> "Embeds":
        """These embeddings with `neg`'s as the unconditional branch (the conditioning image stays this one's)."""
        return Embeds(self.prompt, self.pooled, neg.prompt, neg.pooled, self.mask, neg.mask, self.cond, self.cond_hw)


@dataclass
class Schedule:
    sigmas: torch.Tensor  # (N + 1,) fp32, from 1 down to 0
    timesteps: torch.Tensor  # (N,) fp32, the scheduler's timesteps (σ·1000); a family's velocity converts them for its transformer

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def sigma_max(self) -> float:
        # Largest σ below 1: Flow-GRPO's stand-in for σ = 1 in the SDE's 1 − σ denominator.
        return float(self.sigmas[1]) if self.num_steps > 1 else 0.5


def make_schedule(scheduler_config, num_steps: int) -> Schedule:
    """σ and timestep schedule of `num_steps` steps, computed by a private copy of the model's scheduler with its
    default spacing (what StableDiffusion3Pipeline uses; a family whose pipeline passes its own σ or a
    resolution-dependent shift builds its schedule in its `schedule`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    sched.set_timesteps(num_steps, device="cpu")
    return Schedule(sched.sigmas.float().clone(), sched.timesteps.float().clone())


@dataclass
class Trajectory:
    """The recorded SDE steps of a batch: everything needed to recompute their log-probs. K = recorded steps."""

    latents: torch.Tensor  # (B, K, C, h, w) fp32 x_t before each recorded step
    next_latents: torch.Tensor  # (B, K, C, h, w) fp32 x_{t+1} that the step produced
    log_probs: torch.Tensor  # (B, K) fp32 rollout log-probs
    step_indices: torch.Tensor  # (K,) long, index into the schedule; (B, K) when samples differ (streaming mixes SDE windows)
    final_latents: torch.Tensor  # (B, C, h, w) fp32, the clean latents that were decoded

    def steps_of(self, idx: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Schedule indices of recorded step k[i] of sample idx[i]."""
        return self.step_indices[idx, k] if self.step_indices.ndim == 2 else self.step_indices[k]

    def cpu(self) -> "Trajectory":
        return Trajectory(self.latents.cpu(), self.next_latents.cpu(), self.log_probs.cpu(), self.step_indices.cpu(),
                          self.final_latents.cpu())

    @staticmethod
    def cat(items: list["Trajectory"]) -> "Trajectory":
        if any(t.log_probs.shape[1] != items[0].log_probs.shape[1] for t in items):
            raise ValueError("trajectories of one batch must record the same number of steps")
        if all(t.step_indices.ndim == 1 and torch.equal(t.step_indices, items[0].step_indices) for t in items):
            steps = items[0].step_indices
        else:  # per-sample windows
            steps = torch.cat([t.step_indices.expand(len(t.log_probs), -1) for t in items])
        return Trajectory(
            torch.cat([t.latents for t in items]),
            torch.cat([t.next_latents for t in items]),
            torch.cat([t.log_probs for t in items]),
            steps,
            torch.cat([t.final_latents for t in items]),
        )


def predict_velocity(transformer, x: torch.Tensor, timestep: torch.Tensor, embeds: Embeds, guidance: float) -> torch.Tensor:
    """The transformer's velocity (B, C, h, w) fp32 at canonical latents x (B, C, h, w) for scheduler timesteps (B,),
    with the guidance of its model family (SD3: classifier-free when > 1; FLUX.1-dev: the guidance embedding), as
    that family's `velocity` computes it (gerl/models/family.py; the family is the transformer's class).

    The same function serves the rollout and the training replay: sharing it is what makes the recomputed
    log-prob equal the rollout's.
    """
    from gerl.models.family import family_of

    return family_of(transformer).velocity(transformer, x, timestep, embeds, guidance)


@torch.no_grad()
def denoise(
    transformer,
    embeds: Embeds,
    noise: torch.Tensor,
    schedule: Schedule,
    sde_steps: list[int],
    sampler: str,
    noise_level: float,
    guidance: float,
    generators: list[torch.Generator] | None,
    reuse_steps: frozenset[int] = frozenset(),
) -> Trajectory:
    """Run the whole schedule from `noise` (B, C, h, w), stochastic on `sde_steps`, ODE elsewhere.

    Args:
        sde_steps: sorted schedule indices that are stochastic and recorded (never the final step).
        generators: one CPU generator per sample for the SDE noise (sample-wise seeding keeps the images
            independent of how the batch is split); may be None when sde_steps is empty.
        reuse_steps: ODE steps that take the previous step's velocity instead of calling the transformer
            (sampling.reuse_velocity_steps: lossy, for rollouts whose log-probs nobody reads); never step 0 or an
            SDE step.
    """
    if reuse_steps & (set(sde_steps) | {0}):
        raise ValueError(f"reuse_steps {sorted(reuse_steps)} must avoid step 0 and the stochastic steps {sde_steps}")
    if sde_steps and generators is None:
        raise ValueError("stochastic steps need one generator per sample (got generators=None)")
    if sde_steps and sde_steps[-1] >= schedule.num_steps - 1:
        raise ValueError(f"the final step ({schedule.num_steps - 1}) cannot be stochastic; got sde_steps={sde_steps}")
    x = noise.float()
    B = x.shape[0]
    recorded_x, recorded_next, recorded_lp = [], [], []
    sde_set = set(sde_steps)
    # Everything the loop reads from the host goes to the device once, here: a copy from pageable host memory
    # (torch's .to(device) of a CPU tensor) waits for the device's queue to drain, and one such copy per step would
    # keep the host from queueing the next forward while the device runs this one (tests/sampling/test_loop.py
    # counts them). σ and t stay the same fp32 values.
    sigmas, timesteps = schedule.sigmas.to(x.device), schedule.timesteps.to(x.device)
    # Each sample's SDE noise for all its stochastic steps in one draw from its own generator: (B, K, C, h, w).
    step_noise = None
    if sde_steps:
        step_noise = torch.stack([torch.randn((len(sde_steps), *x.shape[1:]), generator=g) for g in generators])
        step_noise = step_noise.to(x.device)
    v = None  # the velocity of the last step that called the transformer (reuse_steps never include step 0)
    for i in range(schedule.num_steps):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        t = timesteps[i].expand(B)
        v = v if i in reuse_steps else predict_velocity(transformer, x, t, embeds, guidance)
        if i in sde_set:
            out: StepOutput = stochastic_step(sampler, v, x, sigma, sigma_next, noise_level, schedule.sigma_max,
                                              noise=step_noise[:, len(recorded_x)])
            recorded_x.append(x)
            recorded_next.append(out.prev_sample)
            recorded_lp.append(out.log_prob)
        else:
            out = ode_step(v, x, sigma, sigma_next)
        x = out.prev_sample
    shape = (B, 0, *x.shape[1:])
    return Trajectory(
        torch.stack(recorded_x, 1) if recorded_x else x.new_zeros(shape),
        torch.stack(recorded_next, 1) if recorded_next else x.new_zeros(shape),
        torch.stack(recorded_lp, 1) if recorded_lp else x.new_zeros(B, 0),
        torch.tensor(sorted(sde_set), dtype=torch.long),
        x,
    )


def replay_log_prob(transformer, traj_x, traj_next, step_idx, embeds, schedule, sampler, noise_level, guidance) -> StepOutput:
    """Recompute the log-prob of recorded transitions at the transformer's current weights (with grad).

    Args:
        traj_x, traj_next: (B, C, h, w) x_t and the recorded x_{t+1}.
        step_idx: (B,) long schedule indices (samples in a batch may be at different steps).
    """
    sigma = schedule.sigmas[step_idx].to(traj_x.device)
    sigma_next = schedule.sigmas[step_idx + 1].to(traj_x.device)
    t = schedule.timesteps[step_idx].to(traj_x.device)
    v = predict_velocity(transformer, traj_x, t, embeds, guidance)
    return stochastic_step(sampler, v, traj_x, sigma, sigma_next, noise_level, schedule.sigma_max, prev_sample=traj_next)


def sde_window(num_steps: int, window_size: int, window_range: tuple[int, int], rng: torch.Generator) -> list[int]:
    """The stochastic steps of one batch.

    window_size = 0: Flow-GRPO — every step but the final one. Otherwise Flow-GRPO-Fast — `window_size`
    consecutive steps starting at a uniform draw from [lo, hi − window_size] with window_range = (lo, hi).
    """
    if window_size == 0:
        return list(range(num_steps - 1))
    lo, hi = window_range
    start = lo + int(torch.randint(0, hi - window_size - lo + 1, (1,), generator=rng))
    return list(range(start, start + window_size))
