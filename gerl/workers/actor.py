"""ActorWorker: the policy update. One role: given a rewarded trajectory batch, take the GRPO optimizer steps."""

from __future__ import annotations

import contextlib
import copy
import math
from contextlib import contextmanager

import torch

from gerl.algo.loss import grpo_loss
from gerl.algo.matching import anchor_decay
from gerl.config import AlgoConfig, ConventionsConfig, ModelConfig, SamplingConfig, TrainConfig
from gerl.sampling.loop import replay_log_prob
from gerl.sampling.steps import log_prob_as
from gerl.workers.batch import RolloutBatch
from gerl.workers.loss_scale import DynamicLossScaler, grad_zero_counts
from gerl.workers.masters import MasterWeights, needs_masters


class EMA:
    """Exponential moving average of the trained parameters (the fp32 masters), swapped into the model's weights
    (`into`, the same tensors unless masters exist) for validation."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float, into: list[torch.nn.Parameter] | None = None):
        self.params, self.decay, self.into = params, decay, into if into is not None else params
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1 - self.decay)

    def swapped(self):
        return swapped_in(self.into, self.shadow)


def compute_dtype(transformer) -> torch.dtype:
    """The dtype the transformer computes in: its frozen base weights' (a LoRA adapter is kept in fp32), or its
    own weights' when all of them train (or the model dtype the data-parallel layer casts their fp32 masters to)."""
    cast = getattr(transformer, "gerl_compute_dtype", None)
    if cast is not None:
        return cast
    params = list(transformer.parameters())
    frozen = [p for p in params if not p.requires_grad and p.is_floating_point()]
    return (frozen or params)[0].dtype


@contextmanager
def swapped_in(params: list, tensors: list):
    """`params` hold `tensors`' values inside the block and their own again after it."""
    backup = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, s in zip(params, tensors):
            p.copy_(s)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, b in zip(params, backup):
                p.copy_(b)


def lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, total - warmup)
        if schedule == "linear":
            return max(0.0, 1 - frac)
        if schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        return 1.0
    return f


class ActorWorker:
    """The update on one data-parallel rank.

    `parallel` (gerl/engine/parallel.py, given by the actor role when there are several actor ranks or
    engine.fsdp): a callable (transformer, frozen reference or None) → DataParallel that applies torch's DDP/FSDP2
    engine before the optimizer is built. `grad_sync`: a hook (params, loss_ok, grads_ok) → (loss_ok, grads_ok) called
    before every optimizer step once the gradients are in (the data-parallel layer's `agree` by default; tests pass
    observers)."""

    def __init__(self, transformer, train: TrainConfig, model: ModelConfig, sampling: SamplingConfig,
                 max_steps: int, images_per_step: int, seed: int, world: int = 1, grad_sync=None,
                 ratio_cap: float = 0.0, conventions: ConventionsConfig | None = None, algo: AlgoConfig | None = None,
                 rank: int = 0, parallel=None):
        self.transformer, self.cfg, self.sampling, self.seed = transformer, train, sampling, seed
        self.rank = rank  # data-parallel rank: nft/awm draw their training noise per rank (gerl/workers/matching.py)
        self.conventions = conventions or ConventionsConfig()
        self.algo = algo or AlgoConfig()
        # The rollout records Gaussian log-probs; the loss sees them in the configured convention (an exact map).
        self.log_prob_convention = (self.conventions.cps_log_prob if sampling.sampler == "cps"
                                    else self.conventions.sde_log_prob)
        self.lora = model.lora
        if not model.lora:
            transformer.requires_grad_(True)
        if model.gradient_checkpointing:  # diffusers recomputes each block in backward; inference is unaffected
            transformer.enable_gradient_checkpointing()
        # Reference policy for the KL term (and dgpo's base reference): the adapter switched off (LoRA) or a frozen
        # copy (full fine-tuning), copied before the data-parallel layer (a sharded module cannot be copied).
        self.ref = None
        needs_ref = train.beta > 0 or (self.algo.name == "dgpo" and self.algo.dgpo_reference == "base")
        if needs_ref and not model.lora:
            self.ref = copy.deepcopy(transformer).requires_grad_(False).eval()
            if model.compile:  # a deep copy drops the compiled blocks (Module.__getstate__): compile its own
                from gerl.models.compile import compile_transformer

                compile_transformer(self.ref, variants=None)
        # the data-parallel layer: replicas or shards over the actor ranks (gerl/engine/parallel.py), before any
        # tensor below is taken from the parameters it replaces
        self.dp = parallel(transformer, self.ref) if parallel is not None else None
        self.named_params = [(n, p) for n, p in transformer.named_parameters() if p.requires_grad]
        self.model_params = [p for _, p in self.named_params]  # the trained weights the forward reads
        # fp32 master weights for trained weights held in bf16/fp16 (gerl/workers/masters.py): what the optimizer,
        # the clip, the EMA, the anchor and checkpoints see. Under the data-parallel layer the parameters are them.
        self.masters = MasterWeights(self.model_params) if needs_masters(self.model_params) else None
        self.params = self.masters.params if self.masters is not None else self.model_params
        self.grad_sync = grad_sync if grad_sync is not None else (self.dp.agree if self.dp is not None else None)
        # foreach: what torch picks on a GPU, asked for on the CPU too (the same values, bit for bit), so that a CPU
        # run holds the optimizer step's temporaries a GPU run holds (gerl plan and its CPU-allocator tests)
        self.optimizer = torch.optim.AdamW(self.params, lr=train.learning_rate, betas=tuple(train.adam_betas),
                                           weight_decay=train.weight_decay, eps=train.adam_eps, foreach=True)
        self.mini = (train.mini_batch_size or images_per_step) // world  # samples per optimizer step on this rank
        self._zero_fracs: list[float] = []  # grad_zero_fraction of each optimizer step since the last step_metrics
        # fp16 compute: dynamic loss scaling, or the gradients underflow to zero (gerl/workers/loss_scale.py)
        self.scaler = None
        if compute_dtype(transformer) == torch.float16 and train.fp16_loss_scale > 0:
            self.scaler = DynamicLossScaler(train.fp16_loss_scale, growth_interval=train.fp16_scale_growth_interval)
        self.ratio_cap = ratio_cap
        total = max_steps * train.inner_epochs * (images_per_step // (self.mini * world))
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(train.lr_schedule, train.warmup_steps, total))
        self.ema = EMA(self.params, train.ema_decay, into=self.model_params) if train.ema_decay > 0 else None
        self.version = 0  # training steps (update calls) completed: the policy version handed to rollouts
        self.optimizer_steps = 0  # optimizer steps taken (the anchor's decay schedule counts these)
        # nft/awm/dgpo: noise levels trained per sample
        self.train_timesteps = (self.algo.train_timesteps or max(1, int(sampling.num_steps * sampling.timestep_fraction)))
        # nft/awm/dgpo: the anchor ("old" policy), a slow copy of the trained tensors (gerl/algo/matching.py anchor_decay)
        self.anchor = [p.detach().clone() for p in self.params] if self.algo.name != "flow_grpo" else None

    def mini_batches(self, B: int, step: int, epoch: int) -> list[torch.Tensor]:
        """The sample indices of each optimizer step of this inner epoch: slices of a permutation seeded by (seed,
        step, epoch) — the same on every rank and after a resume — or, with train.shuffle_mini_batches=false (GeRL's
        data.split), consecutive slices in rollout order."""
        perm = (torch.randperm(B, generator=torch.Generator().manual_seed(self.seed * 104_729 + step * 31 + epoch))
                if self.cfg.shuffle_mini_batches else torch.arange(B))
        return [perm[m0:m0 + self.mini] for m0 in range(0, B, self.mini)]

    @contextmanager
    def anchor_swapped(self):
        """The trained tensors temporarily replaced by the anchor's (nft's v_old, awm's anchor term, dgpo's old
        policy, sampling with the anchor); nothing when there is no anchor."""
        if self.anchor is None:
            yield
            return
        with swapped_in(self.model_params, self.anchor):
            yield

    @torch.no_grad()
    def _advance_anchor(self) -> float:
        a = self.algo
        d = anchor_decay(self.optimizer_steps, a.anchor_decay_flat, a.anchor_decay_rate, a.anchor_decay_max)
        for t, p in zip(self.anchor, self.params):
            t.mul_(d).add_(p.detach(), alpha=1 - d)
        return d

    def backward(self, loss: torch.Tensor, last: bool = True) -> bool:
        """loss.backward(), through the loss scaler when the model computes in fp16; `last`: the last backward
        before the next optimizer step (the data-parallel layer reduces the accumulated gradients in it). Returns
        whether the loss was finite. A non-finite loss goes backward only under the data-parallel layer, where
        every rank's backwards carry its collectives in lockstep; its step is skipped on every rank anyway."""
        finite = bool(torch.isfinite(loss))
        if not finite and self.dp is None:
            return False
        if self.dp is not None:
            self.dp.sync_gradients(last)
        (self.scaler.scale_loss(loss) if self.scaler is not None else loss).backward()
        return finite

    def optimizer_step(self, loss_ok: bool) -> tuple[float | None, str | None]:
        """After a mini-batch's backward passes (whose last reduced the gradients over the data-parallel ranks, in
        fp32): unscale (fp16; the scale is the same on every rank, so unscaling the reduced gradient is unscaling
        each rank's), agree over the ranks whether every loss and gradient was finite, clip by the total norm over
        every rank's shards, step the fp32 masters and re-cast the model's weights from them. Returns (the gradient
        norm, None) for a step taken, or (None, "overflow" | "nonfinite") for one skipped."""
        grads_ok = self.scaler.unscale_(self.params) if self.scaler is not None else True
        if self.grad_sync is not None:
            loss_ok, grads_ok = self.grad_sync(self.params, loss_ok, grads_ok)
        # partial fp16 underflow shows here long before the whole gradient is zero (logged as grad_zero_frac)
        zeros, total = grad_zero_counts(self.params)
        if self.dp is not None:
            zeros, total = self.dp.sum([zeros, total])
        self._zero_fracs.append(zeros / total if total else 0.0)
        grads = [p.grad for p in self.params if p.grad is not None]  # none at all when every loss was NaN
        if self.cfg.max_grad_norm > 0:
            gn = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        else:
            gn = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        gn = float(self.dp.full(gn) if self.dp is not None else gn)  # a DTensor norm over shards → its value
        taken = loss_ok and grads_ok and math.isfinite(gn)
        if self.scaler is not None:
            # only a step actually taken is evidence that the scale is safe; a non-finite loss (which the forward
            # produced before any scaling) says nothing about it, even where its NaN gradient reached the reduction
            self.scaler.update(overflow=loss_ok and not grads_ok, clean=taken)
        if not taken:
            # A non-finite loss or gradient: drop this optimizer step rather than poison the weights
            # (under fp16 loss scaling an overflow is expected now and then: the scale halves).
            self.optimizer.zero_grad(set_to_none=True)
            return None, "overflow" if loss_ok and not grads_ok and self.scaler is not None else "nonfinite"
        self.optimizer.step()
        if self.masters is not None:
            self.masters.to_model()
        self.lr_scheduler.step()
        if self.ema is not None:
            self.ema.update()
        self.optimizer_steps += 1
        return gn, None

    def mean_stats(self, sums: dict[str, float], count: int) -> dict[str, float]:
        """Each logged statistic's mean over the micro-batches of every data-parallel rank: a run reads the same at
        any world size."""
        if self.dp is not None:
            return self.dp.mean_stats(sums, count)
        return {k: v / max(count, 1) for k, v in sums.items()}

    def global_max(self, value: float) -> float:
        return self.dp.max(value) if self.dp is not None else value

    def step_metrics(self, metrics: dict, grad_norms: list[float], skipped: dict[str, int], T: int) -> dict:
        """The metrics every update reports, whatever the algorithm."""
        metrics.update({
            "grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "nonfinite_updates_skipped": skipped.get("nonfinite", 0),
            "optimizer_steps": len(grad_norms),
            "learning_rate": self.optimizer.param_groups[0]["lr"],
            "trained_steps_per_sample": T,
        })
        if self._zero_fracs:  # mean over this update's optimizer steps (taken or skipped)
            metrics["grad_zero_frac"] = sum(self._zero_fracs) / len(self._zero_fracs)
        self._zero_fracs = []
        if self.scaler is not None:
            metrics.update(loss_scale=self.scaler.scale, overflow_updates_skipped=skipped.get("overflow", 0),
                           overflow_updates_total=self.scaler.overflows)
        return metrics

    @contextmanager
    def _reference(self):
        if self.ref is not None:
            yield self.ref
            return
        self.transformer.disable_adapters()
        try:
            yield self.transformer
        finally:
            self.transformer.enable_adapters()

    def _replay(self, transformer, batch: RolloutBatch, idx: torch.Tensor, k: torch.Tensor):
        # The batch lives on the CPU (that is what crosses Ray); each micro-batch moves to the model's device.
        t = batch.traj
        device = next(transformer.parameters()).device
        return replay_log_prob(
            transformer, t.latents[idx, k].to(device), t.next_latents[idx, k].to(device), t.steps_of(idx, k),
            batch.embeds.index(idx).to(device), batch.schedule, self.sampling.sampler, self.sampling.noise_level,
            self.sampling.guidance_scale,
        )

    def train_steps_plan(self, batch: RolloutBatch, step: int) -> torch.Tensor:
        """(B, T) indices into the K recorded steps: which of its steps each sample trains (Flow-GRPO's random
        timestep_fraction subset; all of them, in order, when the fraction is 1)."""
        B, K = batch.traj.log_probs.shape
        if self.sampling.timestep_fraction >= 1.0:
            return torch.arange(K).expand(B, K)
        T = max(1, int(K * self.sampling.timestep_fraction + 0.5))
        g = torch.Generator().manual_seed(self.seed * 7919 + step)
        return torch.stack([torch.randperm(K, generator=g)[:T] for _ in range(B)])

    @torch.no_grad()
    def recompute_log_probs(self, batch: RolloutBatch, plan: torch.Tensor) -> torch.Tensor:
        """Old log-probs at the current weights, (B, K) with only the planned entries filled (others = rollout's)."""
        out = batch.traj.log_probs.clone()
        mb = self.cfg.micro_batch_size
        self.transformer.eval()
        for j in range(plan.shape[1]):
            for s in range(0, len(batch), mb):
                idx = torch.arange(s, min(s + mb, len(batch)))
                k = plan[idx, j]
                out[idx, k] = self._replay(self.transformer, batch, idx, k).log_prob.to(out.device)
        return out

    def update(self, batch: RolloutBatch, advantages: torch.Tensor, step: int) -> dict[str, float]:
        """Inner epochs of optimizer steps on `batch` with the configured algorithm. Returns step metrics.
        batch.stale_weight (streaming, engine.stale=downweight) weighs each sample's policy loss: every flow_grpo
        loss is linear in a positive scale of the advantage, so there it scales the advantages; nft, awm and dgpo
        weigh their per-sample losses (for nft a scaled advantage would pull toward the anchor, not shrink the
        update; for dgpo it would move its group's margin)."""
        if self.algo.name == "flow_grpo":
            w = batch.stale_weight
            m = self._update_flow_grpo(batch, advantages if w is None else advantages * w.to(advantages), step)
        else:
            from gerl.workers.matching import matching_update

            m = matching_update(self, batch, advantages, step)
        if self.anchor is not None:
            m["anchor_decay"] = self._advance_anchor()
        self.version += 1
        return m

    def _update_flow_grpo(self, batch: RolloutBatch, advantages: torch.Tensor, step: int) -> dict[str, float]:
        """Inner epochs of clipped-ratio updates on the recorded SDE steps. Returns step metrics (means over
        micro-batches)."""
        cfg = self.cfg
        plan = self.train_steps_plan(batch, step)
        B, T = plan.shape
        old = batch.traj.log_probs
        metrics: dict[str, float] = {}
        if cfg.recompute_old_log_probs:
            recomputed = self.recompute_log_probs(batch, plan)
            metrics["old_log_prob_recompute_max_dev"] = self.global_max(
                float((recomputed - old).abs().max()) if old.numel() else 0.0)
            old = recomputed
        sums: dict[str, float] = {}
        count = 0
        max_dev = 0.0
        stepped = False  # has any optimizer step been taken in this update? (for the pre-update ratio check)
        ratio_seen = False  # did any finite loss before the first step give the pre-update ratio a value?
        skipped: dict[str, int] = {}
        grad_norms = []
        self.transformer.train()
        for epoch in range(cfg.inner_epochs):
            for mini in self.mini_batches(B, step, epoch):
                self.optimizer.zero_grad(set_to_none=True)
                n_micro = math.ceil(len(mini) / cfg.micro_batch_size)
                finite = True
                for j in range(T):
                    for u0 in range(0, len(mini), cfg.micro_batch_size):
                        idx = mini[u0:u0 + cfg.micro_batch_size]
                        last = j == T - 1 and u0 + cfg.micro_batch_size >= len(mini)
                        log_ratio, stats = self._flow_grpo_micro(batch, idx, plan[idx, j], old, advantages,
                                                                 n_micro * T, last)
                        if stats is None:
                            finite = False
                            continue
                        if not stepped:
                            max_dev = max(max_dev, float((torch.exp(log_ratio) - 1).abs().max()))
                            ratio_seen = True
                        for key, v in stats.items():
                            sums[key] = sums.get(key, 0.0) + v
                        count += 1
                gn, why = self.optimizer_step(finite)
                if gn is None:
                    skipped[why] = skipped.get(why, 0) + 1
                    continue
                grad_norms.append(gn)
                stepped = True
        metrics.update(self.mean_stats(sums, count))
        # every loss non-finite before the first step: the ratio was never measured, and NaN (not 0) says so, so
        # that no "max |ratio - 1| <= bound" check passes on a run that computed nothing
        metrics["ratio_max_dev_before_update"] = self.global_max(max_dev if ratio_seen else float("nan"))
        return self.step_metrics(metrics, grad_norms, skipped, T)

    def _flow_grpo_micro(self, batch: RolloutBatch, idx: torch.Tensor, k: torch.Tensor, old: torch.Tensor,
                         advantages: torch.Tensor, parts: int,
                         last: bool) -> tuple[torch.Tensor | None, dict[str, float] | None]:
        """One micro-batch's replay with grad, its clipped-ratio loss (divided by the `parts` backwards of its
        optimizer step) and backward. Returns (the detached log-ratio, (b,), the loss statistics), or (None, None)
        for a non-finite loss. A function of its own so that the micro-batch's tensors (its replayed step, the loss)
        are freed before the next micro-batch's forward, as `gerl plan` counts the phase."""
        cfg = self.cfg
        out = self._replay(self.transformer, batch, idx, k)
        ref_mean = None
        if cfg.beta > 0:
            with torch.no_grad(), self._reference() as ref:
                ref_mean = self._replay(ref, batch, idx, k).mean
        device = out.log_prob.device
        conv = self.log_prob_convention
        lp = log_prob_as(conv, out.log_prob, out.std)
        old_lp = log_prob_as(conv, old[idx, k].to(device), out.std)  # same σ, same std
        kl_std = out.std if self.conventions.kl_std == "transition" else out.noise_coef
        loss, stats = grpo_loss(lp, old_lp, advantages[idx].to(device), cfg.clip_range, cfg.beta, out.mean, ref_mean,
                                kl_std, self.ratio_cap, cfg.loss, cfg.is_cap,
                                None if batch.rewards is None else batch.rewards[idx].to(device),
                                cfg.cispo_eps_low, cfg.cispo_eps_high, cfg.topr_split)
        if not self.backward(loss / parts, last):
            return None, None
        return lp.detach() - old_lp, {key: float(v) for key, v in stats.items()}

    # ------------------------------------------------------------------ checkpoint state
    def gather(self, tensors: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """{name: whole tensor on the CPU in `dtype`} of the trained parameters' `tensors` (the masters, the EMA, the
        anchor). Under shards every rank must call it (one all-gather per tensor) and only data-parallel rank 0
        keeps the result: the others get {} (replicas each hold the whole). On the CPU in fp32 a tensor is handed
        back itself, not copied."""
        keep = self.dp is None or not self.dp.sharded or self.dp.rank == 0
        out = {}
        for (n, _), t in zip(self.named_params, tensors):
            whole = self.dp.full(t.detach()) if self.dp is not None else t.detach()
            if keep:
                out[n] = whole.to(dtype).cpu().contiguous()
        return out

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trained weights by name, fp32 (the masters when the model holds bf16/fp16)."""
        return self.gather(self.params)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype a rollout holds the trained weights in: a LoRA adapter's fp32, else the model's compute dtype."""
        return torch.float32 if self.lora else compute_dtype(self.transformer)

    @property
    def samples_with_anchor(self) -> bool:
        """nft samples with the old policy (its anchor), as DiffusionNFT does; dgpo once it has taken more than
        algo.dgpo_sample_anchor_after optimizer steps (DGPO's switch_ema_ref); every other algorithm with θ."""
        a = self.algo
        if a.name == "dgpo":
            return 0 <= a.dgpo_sample_anchor_after < self.optimizer_steps
        return a.name == "nft"

    def sampling_tensors(self) -> list[torch.Tensor]:
        """What rollouts generate with: the anchor for nft (and dgpo after its switch), else the trained weights."""
        return self.anchor if self.samples_with_anchor else self.params

    def sampling_state(self) -> dict[str, torch.Tensor]:
        """`sampling_tensors` by name on the CPU, in the dtype the rollouts hold them in (`weight_dtype`: the values
        the model computes with, at half the bytes of fp32 for bf16 weights)."""
        return self.gather(self.sampling_tensors(), self.weight_dtype)

    def sampling_policy(self):
        """Context for a rollout that shares this transformer (local engine, hybrid hosts): its weights are the
        sampling ones inside (the anchor for nft)."""
        return self.anchor_swapped() if self.samples_with_anchor else contextlib.nullcontext()

    def anchor_state(self) -> dict[str, torch.Tensor]:
        return self.gather(self.anchor or [])

    def ema_state(self) -> dict[str, torch.Tensor]:
        return self.gather(self.ema.shadow if self.ema is not None else [])

    @torch.no_grad()
    def load_state(self, targets: list[torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        """Write whole tensors by name (every rank holds them) into `targets` (the masters, the EMA, the anchor)."""
        for (n, _), t in zip(self.named_params, targets):
            if self.dp is not None:
                self.dp.load_full(t, state[n])
            else:
                t.copy_(state[n].to(t.dtype))

    def load_anchor_state(self, state: dict[str, torch.Tensor]) -> None:
        self.load_state(self.anchor, state)

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        names = {n for n, _ in self.named_params}
        if set(state) != names:
            raise ValueError(f"checkpoint parameters do not match this model ({len(state)} vs {len(names)} tensors); "
                             "resume with the same model and LoRA settings")
        self.load_state(self.params, state)
        if self.masters is not None:
            self.masters.to_model()
