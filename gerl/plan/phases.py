"""The programs whose peaks the planner counts, one per phase of a role's work, at a given micro-batch b.

Each builds its inputs the way the workers hold them (the same shapes and dtypes on the device) and runs the
workers' own functions where they are free of host-side work: the SDE/ODE steps and `grpo_loss` for Flow-GRPO,
`noised`, `nft_loss`, `awm_log_prob`, `awm_loss` and `velocity_penalty` for the matching objectives, `swapped_in`
for every weight swap (nft's anchor, the EMA), AdamW for the step. The model's own work — its inputs, the velocity
forward, the text encoders, the VAE decode — goes through the family (gerl/plan/family.py), the planner's one
architecture-specific part. Each returns a zero-argument callable for `count.peak_bytes`; what it allocates is
dropped when it returns.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from gerl.algo.loss import grpo_loss
from gerl.algo.matching import awm_log_prob, awm_loss, noised, nft_loss, velocity_penalty
from gerl.config import Config
from gerl.plan.family import PlanFamily
from gerl.sampling.loop import Schedule
from gerl.sampling.steps import log_prob_as, ode_step, stochastic_step
from gerl.workers.actor import swapped_in


@dataclass(frozen=True)
class Work:
    """What every program needs: the family, one sample's latent shape (fp32), the model dtype, the config."""
    fam: PlanFamily
    latent: tuple[int, ...]
    dtype: torch.dtype
    cfg: Config

    def cond(self, b: int, guidance: float):
        return self.fam.conditioning(b, self.fam.uses_negative(guidance), self.dtype)

    def latents(self, b: int) -> torch.Tensor:
        return torch.empty(b, *self.latent)


@dataclass
class _FixedSchedule(Schedule):
    # Schedule.sigma_max reads a tensor value, which fake tensors do not have; the value does not change memory.
    @property
    def sigma_max(self) -> float:
        return 0.9


def _schedule(num_steps: int = 2) -> Schedule:
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1)
    return _FixedSchedule(sigmas, sigmas[:-1] * 1000)


@contextlib.contextmanager
def _reference(transformer, lora: bool):
    """The KL reference the actor runs: the adapter switched off (LoRA); for full fine-tuning a frozen copy, whose
    activations equal the policy's own (its weights are a resident line of the plan)."""
    if not lora:
        yield transformer
        return
    transformer.disable_adapters()
    try:
        yield transformer
    finally:
        transformer.enable_adapters()


def _swapped(swap):
    """swap = (params, tensors): the params hold the tensors' values inside, a backup of their own alive meanwhile
    (gerl.workers.actor.swapped_in); None: nothing."""
    return swapped_in(*swap) if swap is not None else contextlib.nullcontext()


# ------------------------------------------------------------------ the actor: Flow-GRPO

def _replay(model, b: int, w: Work):
    """ActorWorker._replay → replay_log_prob: the recorded (x_t, x_t+1) moved to the device, the velocity, the
    step's log-prob of x_t+1."""
    smp = w.cfg.sampling
    x, nxt, cond = w.latents(b), w.latents(b), w.cond(b, smp.guidance_scale)
    steps = torch.zeros(b, dtype=torch.long)
    sched = _schedule()
    v = w.fam.velocity(model, x, sched.timesteps[steps], cond, smp.guidance_scale)
    return stochastic_step(smp.sampler, v, x, sched.sigmas[steps], sched.sigmas[steps + 1], smp.noise_level,
                           sched.sigma_max, prev_sample=nxt)


def flow_grpo_train(transformer, b: int, w: Work):
    """One micro-batch of ActorWorker._update_flow_grpo: the replay with grad, the reference replay (train.beta > 0)
    under no_grad while the graph is held, the loss, backward into gradients that already exist (accumulation)."""
    cfg = w.cfg
    t, smp = cfg.train, cfg.sampling

    def run():
        out = _replay(transformer, b, w)
        ref_mean = None
        if t.beta > 0:
            with torch.no_grad(), _reference(transformer, cfg.model.lora) as ref:
                ref_mean = _replay(ref, b, w).mean
        conv = cfg.conventions.cps_log_prob if smp.sampler == "cps" else cfg.conventions.sde_log_prob
        lp, old = log_prob_as(conv, out.log_prob, out.std), log_prob_as(conv, torch.empty(b), out.std)
        kl_std = out.std if cfg.conventions.kl_std == "transition" else out.noise_coef
        loss, _ = grpo_loss(lp, old, torch.empty(b), t.clip_range, t.beta, out.mean, ref_mean, kl_std,
                            cfg.engine.ratio_cap, t.loss, t.is_cap)
        loss.backward()
    return run


def flow_grpo_recompute(transformer, b: int, w: Work):
    """ActorWorker.recompute_log_probs (train.recompute_old_log_probs): the replay under no_grad."""
    def run():
        with torch.no_grad():
            _replay(transformer, b, w).log_prob
    return run


# ------------------------------------------------------------------ the actor: NFT and AWM

def _point(b: int, w: Work):
    """gerl.workers.matching._point: (x0, ε, σ, x_σ, timestep, conditioning) of a micro-batch on the device."""
    x0, eps = w.latents(b), w.latents(b)
    sched = _schedule()
    k = torch.zeros(b, dtype=torch.long)
    sigma = sched.sigmas[k]
    return x0, eps, sigma, noised(x0, eps, sigma), sched.timesteps[k], w.cond(b, w.cfg.sampling.guidance_scale)


def anchor_forward(transformer, b: int, w: Work, swap):
    """matching_update's anchor velocity (nft's v_old; awm's anchor term): no grad, with the trained tensors
    swapped out for the anchor's, their backup alive meanwhile."""
    g = w.cfg.sampling.guidance_scale

    def run():
        _, _, _, x_t, t, cond = _point(b, w)
        with torch.no_grad(), swapped_in(*swap):
            w.fam.velocity(transformer, x_t, t, cond, g).float()
    return run


def awm_old_forward(transformer, b: int, w: Work):
    """AWM's old log-probs where the policy has moved before a point is trained: a no-grad forward and the
    surrogate at the weights the update started from."""
    a, g = w.cfg.algo, w.cfg.sampling.guidance_scale

    def run():
        x0, eps, sigma, x_t, t, cond = _point(b, w)
        with torch.no_grad():
            v = w.fam.velocity(transformer, x_t, t, cond, g)
            awm_log_prob(v, x0, eps, sigma, a.awm_weighting, a.awm_ghuber_power)
    return run


def matching_train(transformer, b: int, w: Work):
    """One micro-batch of gerl.workers.matching.matching_update after the anchor's velocity (held, fp32): the
    policy's velocity with grad, nft's or awm's loss, the reference velocity (train.beta > 0) under no_grad while
    the graph is held, the anchor penalty, backward into existing gradients."""
    cfg = w.cfg
    a, t, g = cfg.algo, cfg.train, cfg.sampling.guidance_scale

    def run():
        x0, eps, sigma, x_t, ts, cond = _point(b, w)
        v_anchor = w.latents(b) if a.name == "nft" or a.anchor_beta > 0 else None
        v = w.fam.velocity(transformer, x_t, ts, cond, g)
        adv = torch.empty(b)
        if a.name == "nft":
            loss, _ = nft_loss(v.float(), v_anchor, x0, x_t, sigma, adv, a.nft_beta, t.adv_clip_max)
        else:
            lp = awm_log_prob(v, x0, eps, sigma, a.awm_weighting, a.awm_ghuber_power)
            loss, _ = awm_loss(lp, torch.empty(b, dtype=torch.float64), adv, t.clip_range, t.adv_clip_max,
                               a.awm_advantage_max)
        if t.beta > 0:
            with torch.no_grad(), _reference(transformer, cfg.model.lora) as ref:
                v_ref = w.fam.velocity(ref, x_t, ts, cond, g)
            loss = loss + t.beta * velocity_penalty(v.float(), v_ref.float())
        if a.anchor_beta > 0:
            loss = loss + a.anchor_beta * velocity_penalty(v.float(), v_anchor)
        loss.backward()
    return run


# ------------------------------------------------------------------ the actor: the optimizer step

def make_optimizer(params: list[torch.nn.Parameter], cfg: Config) -> torch.optim.Optimizer:
    """AdamW as the actor builds it, with foreach=True (the default on CUDA), its state created by one step: the
    counted step then runs in the steady state."""
    t = cfg.train
    opt = torch.optim.AdamW(params, lr=t.learning_rate, betas=tuple(t.adam_betas), weight_decay=t.weight_decay,
                            eps=t.adam_eps, foreach=True)
    opt.step()
    return opt


def optimizer_step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], cfg: Config, loss_scaled: bool):
    """Unscale (fp16 loss scaling), clip the gradient norm, step: the foreach temporaries (one copy of the state)."""
    def run():
        if loss_scaled:
            grads = [p.grad for p in params if p.grad is not None]
            torch._foreach_mul_(grads, 0.5)
            torch.stack([torch.isfinite(g).all() for g in grads]).all()
        if cfg.train.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
        opt.step()
    return run


# ------------------------------------------------------------------ the rollout

def denoise_step(transformer, b: int, w: Work, guidance: float, recorded: int, swap=None):
    """The fullest moments of gerl.sampling.loop.denoise on a micro-batch (no grad). Alive throughout: the
    conditioning and the initial noise (`denoise`'s argument); at each forward also the current latent and the
    previous step's velocity and output, until the names are rebound. With `recorded` SDE steps (Flow-GRPO, one
    window of consecutive steps): the last one, its temporaries with its noise moved to the device; the next (ODE)
    step's forward, the fullest, while the records are held — the window's first x_t (the initial noise itself when
    the window starts at step 0) and each step's x_t+1, which is the next step's x_t — and `denoise`'s stacking of
    them at the end, lists and stacks alive together. nft/awm record nothing: one ODE step. `swap`: weights swapped
    in for the whole generation (nft's anchor on a shared transformer)."""
    smp = w.cfg.sampling

    def run():
        with torch.no_grad(), _swapped(swap):
            cond, noise = w.cond(b, guidance), w.latents(b)
            sched = _schedule()
            t, sigma, sigma_next = sched.timesteps[0].expand(b), sched.sigmas[0], sched.sigmas[1]
            if not recorded:
                x, v_prev = w.latents(b), w.latents(b)
                v = w.fam.velocity(transformer, x, t, cond, guidance)
                del v_prev
                ode_step(v, x, sigma, sigma_next)
                return
            rec_x = [noise if smp.sde_window_size == 0 else w.latents(b)]
            rec_next = []
            for _ in range(recorded - 1):
                rec_next.append(w.latents(b))
                rec_x.append(rec_next[-1])
            v = w.latents(b)  # the last recorded step's velocity
            mean_prev = w.latents(b) if recorded > 1 else None  # the step before's SDE mean (an ODE step's is x_t)
            out = stochastic_step(smp.sampler, v, rec_x[-1], sigma, sigma_next, smp.noise_level, sched.sigma_max,
                                  noise=w.latents(b))
            rec_next.append(out.prev_sample)
            del mean_prev
            v = w.fam.velocity(transformer, rec_next[-1], t, cond, guidance)  # the next step's; the last one freed
            out = ode_step(v, rec_next[-1], sigma, sigma_next)
            torch.stack(rec_x, 1), torch.stack(rec_next, 1), torch.empty(b, recorded)
    return run


def vae_decode(vae, b: int, w: Work, guidance: float, recorded: int, swap=None):
    """gerl.workers.rollout.decode of b latents up to the host copy, while the micro-batch's conditioning and its
    trajectory (the `recorded` steps' stacked x_t and x_t+1) are still on the device, as `generate` holds them."""
    def run():
        with _swapped(swap):
            cond = w.cond(b, guidance)  # noqa: F841 (kept alive)
            records = [torch.empty(b, recorded, *w.latent) for _ in range(2 if recorded else 0)]  # noqa: F841
            w.fam.decode(vae, w.latents(b))
    return run


def text_encode(encoders: dict, b: int, w: Work, swap=None):
    """The text encoders on b prompts, as the rollout's embedder runs them."""
    def run():
        with _swapped(swap):
            w.fam.encode_text(encoders, b)
    return run
