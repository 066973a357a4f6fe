"""The programs whose peaks the planner counts, one per phase of a role's work, at a given micro-batch b.

Each builds its inputs the way the workers do (the same shapes and dtypes on the device) and calls the workers' own
functions where they are free of host-side work: `replay_log_prob` + `grpo_loss` + backward for training,
`predict_velocity` + the step functions for generation, the VAE's decode, `encode_token_ids` for the text encoders.
Each returns a zero-argument callable for `count.peak_bytes`; what it allocates is dropped when it returns.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from gerl.algo.loss import grpo_loss
from gerl.config import Config
from gerl.sampling.loop import Embeds, Schedule, predict_velocity, replay_log_prob
from gerl.sampling.steps import log_prob_as, ode_step, stochastic_step


@dataclass(frozen=True)
class Shapes:
    latent: tuple[int, int, int]  # (C, h, w) of one sample's latent, fp32
    clip_tokens: int  # CLIP prompt length (77 for SD3)
    t5_tokens: int  # model.max_sequence_length
    joint_dim: int  # width of the transformer's text tokens (T5's, 4096 for SD3)
    pooled_dim: int  # CLIP-L + CLIP-G pooled width (2048 for SD3)
    dtype: torch.dtype  # model.dtype

    @property
    def text_tokens(self) -> int:
        return self.clip_tokens + self.t5_tokens


@dataclass
class _FixedSchedule(Schedule):
    # Schedule.sigma_max reads a tensor value, which fake tensors do not have; the value does not change memory.
    @property
    def sigma_max(self) -> float:
        return 0.9


def _schedule(num_steps: int = 2) -> Schedule:
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1)
    return _FixedSchedule(sigmas, sigmas[:-1] * 1000)


def _embeds(b: int, s: Shapes, guided: bool) -> Embeds:
    """Cached text embeddings moved to the device: prompt (b, Lc + Lt, D) and pooled (b, P) in model.dtype."""
    def pair():
        return torch.empty(b, s.text_tokens, s.joint_dim, dtype=s.dtype), torch.empty(b, s.pooled_dim, dtype=s.dtype)
    return Embeds(*pair(), *(pair() if guided else (None, None)))


@contextmanager
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


def train_step(transformer, b: int, s: Shapes, cfg: Config):
    """One micro-batch of ActorWorker.update: forward with grad, the reference forward (train.beta > 0) while the
    graph is held, the loss, backward into gradients that already exist (accumulation)."""
    t, smp = cfg.train, cfg.sampling

    def replay(model):
        # As ActorWorker._replay: the micro-batch's inputs are moved to the device here and live on only where
        # autograd saved them (the text embeddings feed a frozen projection, so they are freed before the peak).
        x = torch.empty(b, *s.latent)  # x_t and the recorded x_{t+1}, fp32, (b, C, h, w)
        nxt = torch.empty(b, *s.latent)
        emb = _embeds(b, s, smp.guidance_scale > 1.0)
        steps = torch.zeros(b, dtype=torch.long)
        return replay_log_prob(model, x, nxt, steps, emb, _schedule(), smp.sampler, smp.noise_level,
                               smp.guidance_scale)

    def run():
        out = replay(transformer)
        ref_mean = None
        if t.beta > 0:  # while the policy's graph is held
            with torch.no_grad(), _reference(transformer, cfg.model.lora) as ref:
                ref_mean = replay(ref).mean
        conv = cfg.conventions.cps_log_prob if smp.sampler == "cps" else cfg.conventions.sde_log_prob
        lp, old = log_prob_as(conv, out.log_prob, out.std), log_prob_as(conv, torch.empty(b), out.std)
        kl_std = out.std if cfg.conventions.kl_std == "transition" else out.noise_coef
        loss, _ = grpo_loss(lp, old, torch.empty(b), t.clip_range, t.beta, out.mean, ref_mean, kl_std,
                            cfg.engine.ratio_cap, t.loss, t.is_cap)
        loss.backward()
    return run


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
            grads = [p.grad for p in params]
            torch._foreach_mul_(grads, 0.5)
            torch.stack([torch.isfinite(g).all() for g in grads]).all()
        if cfg.train.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
        opt.step()
    return run


def denoise_step(transformer, b: int, s: Shapes, cfg: Config, guidance: float, recorded: int):
    """One step of RolloutWorker's denoising of a micro-batch (no grad; every step's peak is the same): the
    transformer forward (CFG doubles its batch), then the SDE step (or an ODE step when nothing is recorded), while
    the embeddings, the latents and the `recorded` steps' (x_t, x_t+1) pairs are held as `denoise` holds them."""
    smp = cfg.sampling

    def run():
        with torch.no_grad():
            emb = _embeds(b, s, guidance > 1.0)
            x = torch.empty(b, *s.latent)
            held = [torch.empty(b, *s.latent) for _ in range(2 * max(recorded - 1, 0))]  # noqa: F841 (kept alive)
            sched = _schedule()
            v = predict_velocity(transformer, x, sched.timesteps[0].expand(b), emb, guidance)
            sigma, sigma_next = sched.sigmas[0], sched.sigmas[1]
            if recorded:
                noise = torch.empty(b, *s.latent)
                stochastic_step(smp.sampler, v, x, sigma, sigma_next, smp.noise_level, sched.sigma_max, noise=noise)
            else:
                ode_step(v, x, sigma, sigma_next)
    return run


def vae_decode(vae, b: int, s: Shapes):
    """gerl.workers.rollout.decode up to the host copy: the fp32 VAE decode of b latents and the uint8 images."""
    def run():
        with torch.no_grad():
            z = torch.empty(b, *s.latent) / vae.config.scaling_factor + vae.config.shift_factor
            x = vae.decode(z.to(vae.dtype), return_dict=False)[0].float()
            (~torch.isfinite(x.flatten(1))).any(1).sum()
            ((x / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    return run


def text_encode(encoders, b: int, s: Shapes):
    """The three text encoders on b prompts' token ids (CLIP-L and CLIP-G: Lc tokens, T5: Lt), joined as SD3 does."""
    from gerl.models.sd35_arch import encode_token_ids

    def run():
        ids = (torch.zeros(b, s.clip_tokens, dtype=torch.long), torch.zeros(b, s.clip_tokens, dtype=torch.long),
               torch.zeros(b, s.t5_tokens, dtype=torch.long))
        encode_token_ids(encoders, ids)
    return run
