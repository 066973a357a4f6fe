"""The two roles a device can play, built from the config. Plain classes: the local engine instantiates them in
this process (sharing one model), the Ray engine wraps the *same* classes as Ray actors.

RolloutRole = RolloutWorker (generation) + RewardSet (reward futures per micro-batch), so reward calls are
submitted right where the images are decoded. ActorRole = ActorWorker (the update) + checkpointing + weights.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import time
from collections import deque

import torch

from gerl.checkpoint import load_checkpoint, load_inflight_weights, save_checkpoint
from gerl.data.prompts import condition_images
from gerl.config import Config, reward_components, trained_steps_per_sample, derived_sizes
from gerl.models.loader import (
    DTYPES, ROLE_COMPONENTS, TEXT_ENCODERS, TextEmbedder, add_lora, load_lora_into_pipeline, load_pipeline, resolve_device,
)
from gerl.models.attention import set_attention_backend
from gerl.models.compile import compile_transformer, take_compile_metrics, variant_bound
from gerl.models.family import family_of
from gerl.workers.actor import ActorWorker
from gerl.workers.reward import RewardResult, RewardSet
from gerl.workers.rollout import RolloutWorker
from rewards.registry import build_reward


def pin_cpus(cores: list[int] | None) -> None:
    """Restrict this process (and torch's thread pool) to `cores`: each role gets its own share of a CPU box."""
    if not cores:
        return
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))


def compute_context(cfg: Config):
    """Where the roles compute: a rehearsal of fp16 on the CPU runs its fp16 matrix products as a GPU does — fp32
    accumulation, one rounding to fp16 per output (gerl/numerics.py) — which is also 2–4× faster on ocr-mini than
    the CPU's own fp16 GEMMs (no avx512_fp16 here); everything else stays real fp16. Elsewhere: nothing."""
    if cfg.engine.rehearse and cfg.model.dtype == "fp16":
        from gerl.numerics import Fp16GemmEmulation

        return Fp16GemmEmulation()
    return contextlib.nullcontext()


def build_pipeline(cfg: Config, device: str | None = None, roles: tuple[str, ...] = ("actor", "rollout")):
    """The pipeline with the configured adapter attached (fresh, or cfg.model.init_lora) and the speed levers
    applied, holding only the parts `roles` use: an actor alone loads the transformer and nothing else."""
    parts = tuple(dict.fromkeys(c for r in roles for c in ROLE_COMPONENTS[r]))
    if cfg.model.text_cache:  # the prompts' embeddings are on disk (gerl prepare): no text encoder to load
        parts = tuple(c for c in parts if c not in TEXT_ENCODERS)
    device = device or cfg.model.device
    set_matmul_precision(cfg, device)  # before loading: TF32 is a process-wide switch
    pipe = load_pipeline(cfg.model.path, cfg.model.dtype, device, cfg.model.tiny_seed, parts, cfg.model.vae_dtype)
    return prepare_pipeline(pipe, cfg, device)


def set_matmul_precision(cfg: Config, device) -> None:
    if resolve_device(device).type == "cuda":  # Flow-GRPO's allow_tf32: fp32 matmuls (the LoRA's) on tensor cores
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.model.tf32


def prepare_pipeline(pipe, cfg: Config, device=None):
    """Everything `gerl train` does to a loaded pipeline before the roles use it: the TF32 switch, the adapter
    (fresh, or cfg.model.init_lora), then the speed levers (`apply_levers`). benchmarks/ call it on their
    random-weight architectures so that what they time is built exactly as a run is."""
    set_matmul_precision(cfg, device or cfg.model.device)
    if cfg.model.lora:
        if cfg.model.init_lora:
            load_lora_into_pipeline(pipe, cfg.model.init_lora, adapter_name="default")
            for name, p in pipe.transformer.named_parameters():
                if "lora_" in name:  # loaded adapters come frozen; they are what we train
                    p.data = p.data.float()
                    p.requires_grad_(True)
        else:
            # every rank the same adapter, every run of a seed the same; the default targets the pipeline's family's
            add_lora(pipe.transformer, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_targets,
                     cfg.model.lora_init, seed=cfg.seed, family=family_of(pipe))
    apply_levers(pipe, cfg)
    return pipe


def apply_levers(pipe, cfg: Config) -> dict:
    """The speed levers that keep the ratio exact, on the transformer both roles call, in a fixed order (after the
    adapter; each idempotent, so each role calls it again on a pipeline it was handed): the VAE's dtype and layout
    (gerl/models/vae.py), the attention backend, the exact merged LoRA (gerl/models/lora_merge.py), then the compiled blocks (gerl/models/compile.py; nothing
    compiles before the first call, so the merged layers are in each block's graph). Returns what compile_transformer
    reports (empty when nothing was compiled now)."""
    m, info = cfg.model, {}
    family = family_of(pipe)
    if getattr(pipe, "vae", None) is not None:  # model.vae_dtype (load_pipeline applies it too; a pipeline handed in)
        from gerl.models.vae import prepare_vae, vae_dtype_for

        prepare_vae(pipe.vae, vae_dtype_for(m.vae_dtype, pipe.transformer.device))
    if getattr(pipe.transformer, "_gerl_attention", "sdpa") != m.attention_backend:
        set_attention_backend(pipe.transformer, m.attention_backend, family)
        pipe.transformer._gerl_attention = m.attention_backend
    if m.merge_lora:
        from gerl.models.lora_merge import use_merged_lora

        use_merged_lora(pipe.transformer)
    if m.compile and not getattr(pipe.transformer, "_gerl_compiled", False):
        info = compile_transformer(pipe.transformer, family, variants=variant_bound(cfg, family))
        pipe.transformer._gerl_compiled = True
    return info


def trainable_names(transformer, lora: bool) -> list[str]:
    return [n for n, p in transformer.named_parameters() if (("lora_" in n) if lora else True)]


class RolloutRole:
    """Generation + rewards on one device. `generate` returns a rewarded batch (futures already gathered)."""

    def __init__(self, cfg: Config, pipe=None, reward_fns=None, rank: int = 0, cores: list[int] | None = None,
                 device: str | None = None):
        pin_cpus(cores)
        self.cfg, self.rank = cfg, rank
        self.pipe = pipe if pipe is not None else build_pipeline(cfg, device, roles=("rollout",))
        apply_levers(self.pipe, cfg)  # a pipeline handed in (the local engine's, a test's) gets them too
        disk = None
        if cfg.model.text_cache:  # gerl/models/text_cache.py: rows memory-mapped, no text encoder on this host
            from gerl.models.text_cache import DiskTextCache

            disk = DiskTextCache(cfg)
        self.embedder = TextEmbedder(self.pipe, cfg.model.max_sequence_length, cfg.model.text_cache_size,
                                     cfg.model.condition_resolution, disk)
        # nft/awm/dgpo learn from clean samples alone: the rollout samples a plain ODE and records no SDE step
        self.worker = RolloutWorker(self.pipe, self.embedder, cfg.sampling, cfg.model.resolution, cfg.seed,
                                    record_sde=cfg.algo.name == "flow_grpo",
                                    reference_guidance=cfg.algo.dgpo_reference_guidance)
        comps = reward_components(cfg.reward)
        fns = reward_fns if reward_fns is not None else [build_reward(c.name, c.kwargs) for c in comps]
        r = cfg.reward
        self.rewards = RewardSet(comps, fns, r.timeout_s, r.retries, r.retry_backoff_s)
        self.names = trainable_names(self.pipe.transformer, cfg.model.lora)
        self._lock = threading.Lock()
        self._staged: tuple[int, list] | None = None  # (version, buckets of (param, new tensor) not yet loaded)
        self._load_s = 0.0  # seconds spent loading staged weights since the last generate returned
        self._started: dict[int, tuple] = {}  # key → (batch with reward futures, start time) awaiting finish()
        self._keys = itertools.count()

    def pid(self) -> int:
        return os.getpid()

    @property
    def version(self) -> int:
        return self.worker.policy_version

    def generate(self, prompts, metadata, group_ids, step: int, index_offset: int = 0):
        """One shard of a step: generate, submit each micro-batch's reward as it is decoded, gather at the end.

        Returns (RolloutBatch with futures removed, RewardResult)."""
        return self.finish(self.start(prompts, metadata, group_ids, step, index_offset))

    def start(self, prompts, metadata, group_ids, step: int, index_offset: int = 0) -> int:
        """Generate and submit the rewards; returns a key for `finish` (the streaming schedule calls the two
        from different threads, so the next group generates while this one is scored)."""
        t0 = time.time()
        submit = self.rewards.submit if self.cfg.reward.with_reward else None
        with compute_context(self.cfg):
            batch = self.worker.generate(prompts, metadata, group_ids, step, submit=submit, index_offset=index_offset,
                                         between=self._load_staged)
        if self.cfg.model.compile:  # what compiled since the last report (validation's shapes included)
            batch.timings.update(take_compile_metrics("rollout"))
        if self.embedder.disk is not None:  # the text encoders this host never loaded (model.text_cache)
            batch.timings["text_encoders_freed_gib"] = self.embedder.disk.encoder_bytes / 2**30
        with self._lock:
            batch.timings["weight_load_s"], self._load_s = self._load_s, 0.0
            key = next(self._keys)
            self._started[key] = (batch, t0)
        return key

    def finish(self, key: int):
        """Wait for `start(...)`'s rewards. Returns (RolloutBatch with futures removed, RewardResult)."""
        with self._lock:
            batch, t0 = self._started.pop(key)
        t1 = time.time()
        if batch.reward_futures:
            res = self.rewards.gather([f for _, f in batch.reward_futures])
        else:
            res = self.rewards.score_now(batch.images, batch.prompts, batch.metadata, self.cfg.sampling.micro_batch_size)
        batch.reward_futures = []
        batch.rewards, batch.reward_extras = res.total, res.extras
        batch.timings.update(reward_wait_s=res.wait_s, reward_compute_s=res.compute_s)
        batch.spans.append({"name": "wait_reward", "start": t1, "end": time.time()})
        batch.timings["rollout_s"] = time.time() - t0
        return batch, res

    def validate(self, prompts, metadata) -> tuple[list, RewardResult]:
        cfg = self.cfg
        with compute_context(cfg):
            images = self.worker.sample_images(prompts, cfg.validation.seed, cfg.sampling.eval_num_steps,
                                               cfg.sampling.eval_guidance_scale, images=condition_images(metadata))
        return images, self.rewards.score_now(images, prompts, metadata, cfg.sampling.micro_batch_size)

    @torch.no_grad()
    def stage_weights(self, state: dict[str, torch.Tensor], version: int) -> float:
        """Copy the actor's tensors into a second buffer (on this device, in the model dtype) while generation
        goes on; `_load_staged` swaps them in between micro-batches. Returns the staging seconds."""
        t0 = time.perf_counter()
        params = dict(self.pipe.transformer.named_parameters())
        limit = max(1, self.cfg.engine.sync_bucket_mb * 2**20)
        buckets, size = [[]], 0
        for n, t in state.items():
            p = params[n]
            if size and size + t.numel() * p.element_size() > limit:
                buckets.append([])
                size = 0
            buckets[-1].append((p, t.to(p.device, p.dtype, copy=True)))
            size += t.numel() * p.element_size()
        with self._lock:
            self._staged = (version, buckets)  # a newer version replaces one not yet (fully) loaded
        return time.perf_counter() - t0

    @torch.no_grad()
    def _load_staged(self) -> None:
        """Between micro-batches: load one bucket of staged weights (a LoRA adapter is one bucket; full weights go
        bucket by bucket, one per micro-batch boundary). The version changes when the last bucket is in."""
        with self._lock:
            if self._staged is None:
                return
            version, buckets = self._staged
            t0 = time.perf_counter()
            for p, t in buckets.pop(0):
                p.copy_(t)
            if not buckets:
                self._staged = None
                self.worker.policy_version = version
            self._load_s += time.perf_counter() - t0

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Take the actor's trained tensors (adapter only for LoRA) and the policy version they carry."""
        params = dict(self.pipe.transformer.named_parameters())
        for n, t in state.items():
            params[n].copy_(t.to(params[n].device, params[n].dtype))
        self.worker.policy_version = version

    def weights(self, pending: bool = False) -> dict[str, torch.Tensor]:
        """The trained tensors this rollout generates with, in the dtype it holds them in; pending=True: those it
        will generate with once the staged buckets (streaming) are in."""
        params = dict(self.pipe.transformer.named_parameters())
        with self._lock:
            staged = {id(p): t for bucket in (self._staged[1] if pending and self._staged else []) for p, t in bucket}
            return {n: staged.get(id(params[n]), params[n]).detach().cpu() for n in self.names}

    def close(self) -> None:
        self.rewards.close()


class ActorRole:
    """The policy update on one device (one data-parallel rank), plus checkpoints and weight export."""

    def __init__(self, cfg: Config, pipe=None, rank: int = 0, world: int = 1, cores: list[int] | None = None,
                 device: str | None = None, grad_sync=None, group=None):
        pin_cpus(cores)
        self.cfg, self.rank, self.world = cfg, rank, world
        self.pipe = pipe if pipe is not None else build_pipeline(cfg, device, roles=("actor",))
        apply_levers(self.pipe, cfg)  # a pipeline handed in (the local engine's, a test's) gets them too
        sizes = derived_sizes(cfg, trained_steps_per_sample(cfg))
        parallel = None
        if group is not None:  # the actor ranks' group: torch's DDP/FSDP2 engine over it (gerl/engine/parallel.py)
            from gerl.engine.parallel import parallelize

            parallel = functools.partial(parallelize, group=group, shard=cfg.engine.fsdp,
                                         dtype=DTYPES[cfg.model.dtype], lora=cfg.model.lora)
        self.worker = ActorWorker(self.pipe.transformer, cfg.train, cfg.model, cfg.sampling, cfg.max_steps,
                                  sizes["images_per_step"], cfg.seed, world=world, grad_sync=grad_sync,
                                  ratio_cap=cfg.engine.ratio_cap, conventions=cfg.conventions, algo=cfg.algo, rank=rank,
                                  parallel=parallel)
        # async: the weights of the last max_staleness versions, which generations still in flight were issued
        # with — a checkpoint keeps them so that a resumed run re-issues those generations bit-exactly.
        self.history = deque(maxlen=cfg.engine.max_staleness + 1) if cfg.engine.schedule == "async" else None
        self._remember()

    def _remember(self) -> None:
        if self.history is not None:
            # clone: on CPU in fp32, weights() hands back the live parameters themselves (under shards every rank
            # gathers and rank 0 alone keeps them)
            self.history.append((self.version, {n: t.clone() for n, t in self.weights().items()}))

    def pid(self) -> int:
        return os.getpid()

    @property
    def version(self) -> int:
        return self.worker.version

    def update(self, batch, advantages, step: int) -> dict:
        with compute_context(self.cfg):
            m = self.worker.update(batch, advantages, step)
        if self.cfg.model.compile:
            m.update(take_compile_metrics("actor"))
        self._remember()
        return m

    def older_versions(self) -> dict[int, dict[str, torch.Tensor]]:
        """{version: weights} of the remembered versions older than the current one."""
        return {v: w for v, w in (self.history or []) if v < self.version}

    def weights(self) -> dict[str, torch.Tensor]:
        """What rollouts generate with: the trained tensors, or the anchor (nft's old policy; dgpo's after its
        switch)."""
        return self.worker.sampling_state()

    def validation_weights(self) -> dict[str, torch.Tensor] | None:
        """What validation scores when it differs from what rollouts hold: the EMA, or the trained tensors where
        rollouts sample with the anchor (nft; dgpo after its switch)."""
        w = self.worker
        if w.ema is not None:
            return w.ema_state()
        return w.trainable_state() if w.samples_with_anchor else None

    def save(self, run_dir, step: int, extra_state: dict, keep_last: int) -> None:
        """Rank 0 writes the checkpoint; under shards every rank takes part (gerl/checkpoint.py)."""
        if self.rank == 0 or self.worker.dp is not None and self.worker.dp.sharded:
            inflight = {f"v{v}/{n}": t for v, w in self.older_versions().items() for n, t in w.items()}
            save_checkpoint(run_dir, step, self.worker, extra_state, keep_last, inflight)

    def load(self, path) -> dict:
        state = load_checkpoint(path, self.worker)
        if self.history is not None:
            self.history.clear()
            self.history.extend(sorted(load_inflight_weights(path).items()))
            self._remember()
        return state

    def ema_swapped(self):
        return self.worker.ema.swapped() if self.worker.ema is not None else None

    def validation_policy(self):
        """Context for validating on the transformer the rollout shares (local engine, hybrid hosts): the EMA swapped
        in, else the trained weights as they are (nft's anchor is swapped in only while generating for training)."""
        return self.ema_swapped() or contextlib.nullcontext()
