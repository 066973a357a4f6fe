"""One typed config tree. Defaults live only here; every field says its unit and how it enters the batch arithmetic.

Batch arithmetic of one training step (checked and printed once at start-up by `derived_sizes`):
    images per step        = data.prompts_per_step × data.group_size
    rollout micro-batches  = images per step / sampling.micro_batch_size
    optimizer steps/epoch  = images per step / train.mini_batch_size
    grad accumulation      = (train.mini_batch_size / train.micro_batch_size) × trained denoising steps
The group (the n images of one prompt that share an advantage baseline) is fixed by data.group_size alone: it never
depends on device count or micro-batch size.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from gerl.errors import UserError


@dataclass
class ModelConfig:
    path: str = "tiny"  # "tiny" (built offline, seeded), a local diffusers directory, or a hub id (e.g. stabilityai/stable-diffusion-3.5-medium)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # transformer/VAE/text-encoder weights; SDE math is always fp32
    device: str = "auto"  # "auto" = cuda if available else cpu; or an explicit torch device string
    resolution: int = 64  # image side in pixels (must be divisible by the VAE factor × patch size)
    max_sequence_length: int = 32  # T5 tokens per prompt (SD3.5 uses 256; the tiny model 32)
    lora: bool = True  # train a LoRA adapter; false = full fine-tuning of the transformer
    lora_rank: int = 8  # LoRA rank r
    lora_alpha: float = 16.0  # LoRA alpha; the update is scaled by alpha / r
    lora_targets: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"])  # transformer module names to adapt
    init_lora: str = ""  # a directory or .safetensors of a LoRA to start from ("" = fresh adapter)
    text_cache_size: int = 4096  # prompts whose text embeddings are kept (LRU); text encoders never re-run for these
    tiny_seed: int = 0  # seed of the randomly initialised tiny model (model.path = tiny)


@dataclass
class DataConfig:
    train_prompts: str = "assets/ocr/train.txt"  # .txt (one prompt per line) or .jsonl ({"prompt": ..., other fields → metadata})
    test_prompts: str = "assets/ocr/test.txt"  # validation prompts; the first validation.num_prompts are used
    prompts_per_step: int = 8  # distinct prompts drawn per step (without replacement within an epoch)
    group_size: int = 8  # n: images per prompt; advantages are normalised within this group


@dataclass
class SamplingConfig:
    sampler: Literal["sde", "cps"] = "cps"  # stochastic step: Flow-GRPO's SDE or coefficients-preserving sampling
    num_steps: int = 10  # denoising steps during training rollouts
    eval_num_steps: int = 40  # ODE steps for validation, `gerl sample` and `gerl eval`
    guidance_scale: float = 1.0  # classifier-free guidance in rollouts (1.0 = no negative pass)
    eval_guidance_scale: float = 1.0  # classifier-free guidance for validation/eval
    noise_level: float = 0.8  # SDE η (sde) or CPS angle fraction (cps)
    sde_window_size: int = 3  # Flow-GRPO-Fast: consecutive stochastic (and trained) steps; 0 = Flow-GRPO (all steps but the last)
    sde_window_range: list[int] = field(default_factory=lambda: [0, 5])  # [lo, hi): the window lies inside these step indices
    timestep_fraction: float = 1.0  # fraction of the recorded steps trained per sample (random subset; Flow-GRPO uses 0.99)
    micro_batch_size: int = 8  # images denoised together; each decoded micro-batch's reward is submitted at once


@dataclass
class TrainConfig:
    learning_rate: float = 1e-4  # AdamW peak learning rate
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    weight_decay: float = 1e-4  # AdamW weight decay
    adam_eps: float = 1e-8  # AdamW epsilon
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # decay over max_steps after warmup
    warmup_steps: int = 0  # linear warm-up, in optimizer steps
    inner_epochs: int = 1  # passes over each step's batch
    mini_batch_size: int = 0  # samples per optimizer step; 0 = all images of the step (one update per epoch)
    micro_batch_size: int = 8  # samples per forward/backward; gradients accumulate up to mini_batch_size
    clip_range: float = 1e-4  # PPO ratio clip ε (Flow-GRPO uses 1e-4 on the per-element log-prob)
    adv_clip_max: float = 5.0  # advantages are clamped to [−adv_clip_max, adv_clip_max]
    beta: float = 0.0  # KL penalty weight to the reference policy (0 = no reference forward)
    max_grad_norm: float = 1.0  # gradient-norm clipping (0 = off)
    advantage: Literal["group", "global_std"] = "group"  # normalise by the group's std, or by the std of the whole batch
    per_prompt_tracker: bool = False  # normalise with each prompt's reward history across steps instead of this step's group
    tracker_buffer: int = 32  # rewards kept per prompt by the tracker
    recompute_old_log_probs: bool = False  # recompute old log-probs at the current weights instead of using the rollout's
    ema_decay: float = 0.0  # EMA of the trained weights used for validation (0 = off; e.g. 0.9 on small runs)
    flip_advantage: bool = False  # negate advantages — a sanity check: the reward must then NOT rise
    loss: str = "ppo_clip"  # policy objective from gerl/algo/policy_loss.py: ppo_clip | tis | topr | cispo (off-policy corrections for stale batches)
    is_cap: float = 2.0  # loss=tis: importance weights are truncated at this value (dimensionless, > 0)


@dataclass
class RewardComponent:
    name: str = ""  # registered reward name, entry point, or package.module:callable
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the reward factory
    weight: float = 1.0  # weight in the total reward
    normalize: Literal["none", "zscore", "scale"] = "none"  # per-step z-score over the batch, or multiply by `scale`, before weighting
    scale: float = 1.0  # used by normalize=scale
    pool: Literal["thread", "process", "ray"] = "thread"  # threads for I/O-bound calls (HTTP) or GIL-free libraries; processes for CPU-bound Python; Ray actors (replicas with their own CPU/GPU)
    workers: int = 1  # pool size (replicas) for this component
    num_cpus: float = 1.0  # pool=ray: CPUs reserved by each replica
    num_gpus: float = 0.0  # pool=ray: GPUs reserved by each replica (e.g. 1 for an OCR or VLM model on its own GPU)


@dataclass
class RewardConfig:
    name: str = "ocr"  # single-reward shorthand: registered name, entry point, or package.module:callable ("" when using components)
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the reward factory
    pool: Literal["thread", "process", "ray"] = "thread"  # where the single reward's calls run (components set their own)
    workers: int = 1  # pool size for the single reward
    components: list[RewardComponent] = field(default_factory=list)  # several weighted rewards; replaces name/kwargs when given
    with_reward: bool = True  # submit each decoded micro-batch's reward as a future and keep generating
    timeout_s: float = 120.0  # per call of a reward on one micro-batch; a call past it counts as a timeout and is retried
    retries: int = 2  # extra attempts after an error or timeout, with exponential backoff
    retry_backoff_s: float = 0.5  # first backoff; doubles each retry
    on_failure: Literal["drop", "fixed", "abort"] = "drop"  # a sample still failing: drop it (a group left with < 2 samples is dropped), give it failure_score, or stop the run
    failure_score: float = 0.0  # score given to failed samples when on_failure=fixed


@dataclass
class ValidationConfig:
    every: int = 0  # validate every N steps (0 = only at the end; -1 = never)
    num_prompts: int = 8  # first N prompts of data.test_prompts
    seed: int = 1234  # fixed noise for comparable grids


@dataclass
class LogConfig:
    tensorboard: bool = True  # scalars + image grids under output_dir/tensorboard
    wandb: bool = False  # also log to Weights & Biases (pip install gerl[wandb])
    wandb_project: str = "gerl"
    images_every: int = 10  # write a training sample grid every N steps (0 = never)
    progress_bar: bool = True  # tqdm bar on stderr


@dataclass
class EngineConfig:
    kind: Literal["local", "ray"] = "local"  # local: one process; ray: roles as Ray actors on resource pools
    hybrid: bool = True  # colocate actor and rollout on the same devices sharing one model (no weight sync); false = decoupled pools
    actor_workers: int = 1  # N: data-parallel training ranks (devices) in the actor pool
    rollout_workers: int = 1  # M: generation workers (devices) in the rollout pool; a step's groups are split across them
    device: Literal["auto", "cpu", "cuda"] = "auto"  # what each worker's share is: a GPU each, or cpus_per_worker cores
    cpus_per_worker: int = 1  # CPU cores pinned to each worker when device=cpu (torch threads = this)
    schedule: Literal["sync", "async", "stream"] = "sync"  # sync: generate → reward → train → sync; async: generation runs max_staleness batches ahead; stream: rollouts pull groups from one prompt stream, the trainer takes the first complete ones (docs/architecture.md)
    max_staleness: int = 1  # async: batches generated ahead of training (1 = one-step-off; ROLL's async_generation_ratio); stream: also the lag in versions beyond which a group is stale
    stale: Literal["drop", "downweight"] = "drop"  # stream: a group older than max_staleness versions is dropped, or kept with its advantages scaled down
    stale_decay: float = 0.5  # stream, stale=downweight: advantages × stale_decay^(lag − max_staleness), in (0, 1]
    ratio_cap: float = 0.0  # truncate the importance ratio at this value for stale batches (0 = off)
    weight_sync: Literal["auto", "object_store", "broadcast"] = "auto"  # auto: object store for LoRA, bucketed broadcast for full fine-tuning
    sync_bucket_mb: int = 256  # bucket size of the broadcast weight sync
    ray_address: str = ""  # "" = start a local Ray; "auto" or host:port = join an existing cluster (ray start --head)
    max_rollout_restarts: int = 3  # a dead rollout worker is replaced this many times before the run fails


@dataclass
class MetricsConfig:
    target_val_reward: float = 0.8  # "GPU-hours to target": first validation whose mean reward reaches this...
    target_hold: int = 1  # ...and stays at or above it for this many consecutive validations
    peak_tflops: float = 0.0  # device peak dense TFLOP/s for MFU in the model dtype (0 = guess from the device name; CPU → no MFU)


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps (0 = only at the end)
    keep_last: int = 3  # older step_NNNNNN directories are deleted (0 = keep all)


@dataclass
class Config:
    output_dir: str = "runs/default"  # run directory: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, samples/
    max_steps: int = 100  # training steps (one rollout batch + its updates each)
    seed: int = 0  # seeds data order, SDE windows, noise and training shuffles
    resume: str = "false"  # "true" = latest checkpoint in output_dir, a checkpoint path, or "false"
    overwrite: bool = False  # allow writing into a non-empty output_dir without resuming
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    log: LogConfig = field(default_factory=LogConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# ---------------------------------------------------------------- parsing ------------------------------------------

def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, key: str, errors: list[str]) -> Any:
    """Check `value` against `tp`, converting only lossless cases (int → float, "true" → bool from the CLI)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            errors.append(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}"
                          + (f" (did you mean {hint[0]!r}?)" if hint else ""))
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            errors.append(f"{key}: expected a list, got {value!r}")
            return value
        if dataclasses.is_dataclass(inner):
            out = []
            for i, v in enumerate(value):
                if not isinstance(v, dict):
                    errors.append(f"{key}[{i}]: expected a mapping, got {v!r}")
                    continue
                out.append(_build(inner, v, f"{key}[{i}].", errors))
            return out
        return [_coerce(v, inner, f"{key}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{key}: expected a mapping, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        errors.append(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string; it is plainly a number
            try:
                return float(value)
            except ValueError:
                pass
        errors.append(f"{key}: expected a number, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        errors.append(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if isinstance(value, (str, bool, int, float)):
            return str(value).lower() if isinstance(value, bool) else str(value)
        errors.append(f"{key}: expected a string, got {value!r}")
        return value
    return value


def _build(cls, data: dict, prefix: str, errors: list[str]):
    types = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in types:
            valid = [f"{prefix}{k}" for k in types]
            hint = difflib.get_close_matches(full, valid, n=1)
            errors.append(f"unknown key {full!r}" + (f" (did you mean {hint[0]!r}?)" if hint else f"; valid keys: {', '.join(valid)}"))
            continue
        tp = types[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                errors.append(f"{full}: expected a section (mapping), got {value!r}")
                continue
            kwargs[key] = _build(tp, value, f"{full}.", errors)
        else:
            kwargs[key] = _coerce(value, tp, full, errors)
    return cls(**kwargs)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise UserError(f"override {item!r} is not key=value; write e.g. train.learning_rate=3e-4")
    key, raw = item.split("=", 1)
    # YAML parsing gives numbers, booleans and [lists] their types; a bare word stays a string.
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply dotted key=value overrides, type-check everything and report all errors at once."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {path} does not exist; pass a YAML file such as recipes/tiny_cpu.yaml")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read config file {path}: {e}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise UserError(f"config file {path} is not valid YAML{where}; fix the syntax") from None
        if not isinstance(data, dict):
            raise UserError(f"config file {path} must be a mapping of keys, got {type(data).__name__}")
    for item in overrides:
        keys, value = _parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise UserError(f"override {item!r}: {k} is not a section")
        node[keys[-1]] = value
    errors: list[str] = []
    cfg = _build(Config, data, "", errors)
    if not errors:
        errors += validate(cfg)
    if errors:
        raise UserError("invalid config: " + "; ".join(errors))
    return cfg


def validate(cfg: Config) -> list[str]:
    """Cross-field checks (batch divisibility, windows). Returns error strings, each naming the fix."""
    e = []
    d, s, t = cfg.data, cfg.sampling, cfg.train
    if cfg.max_steps < 1:
        e.append("max_steps must be ≥ 1")
    if d.group_size < 2:
        e.append(f"data.group_size={d.group_size}: a group needs ≥ 2 images to normalise advantages")
    if d.prompts_per_step < 1:
        e.append("data.prompts_per_step must be ≥ 1")
    images = d.prompts_per_step * d.group_size
    if s.micro_batch_size < 1 or images % s.micro_batch_size:
        e.append(f"sampling.micro_batch_size={s.micro_batch_size} must divide images per step "
                 f"(data.prompts_per_step × data.group_size = {images})")
    mini = t.mini_batch_size or images
    if mini < 1 or images % mini:
        e.append(f"train.mini_batch_size={t.mini_batch_size} must divide images per step ({images})")
    if t.micro_batch_size < 1 or mini % t.micro_batch_size:
        e.append(f"train.micro_batch_size={t.micro_batch_size} must divide train.mini_batch_size ({mini})")
    if s.num_steps < 2:
        e.append("sampling.num_steps must be ≥ 2 (the final step is always deterministic)")
    if s.eval_num_steps < 1:
        e.append("sampling.eval_num_steps must be ≥ 1")
    if not 0 < s.noise_level <= (1.0 if s.sampler == "cps" else 10.0):
        e.append(f"sampling.noise_level={s.noise_level} out of range (cps: (0, 1]; sde: (0, 10])")
    if s.sde_window_size < 0:
        e.append("sampling.sde_window_size must be ≥ 0 (0 = Flow-GRPO, all steps)")
    elif s.sde_window_size > 0:
        if len(s.sde_window_range) != 2:
            e.append("sampling.sde_window_range must be [lo, hi]")
        else:
            lo, hi = s.sde_window_range
            if not (0 <= lo and hi - lo >= s.sde_window_size and hi <= s.num_steps - 1):
                e.append(f"sampling.sde_window_range={s.sde_window_range} must satisfy 0 ≤ lo, hi − lo ≥ "
                         f"sde_window_size ({s.sde_window_size}) and hi ≤ num_steps − 1 ({s.num_steps - 1}, the final step is deterministic)")
    if not 0 < s.timestep_fraction <= 1:
        e.append("sampling.timestep_fraction must be in (0, 1]")
    if t.inner_epochs < 1:
        e.append("train.inner_epochs must be ≥ 1")
    if t.learning_rate <= 0:
        e.append("train.learning_rate must be > 0")
    if len(t.adam_betas) != 2:
        e.append("train.adam_betas must be [beta1, beta2]")
    if t.clip_range <= 0:
        e.append("train.clip_range must be > 0")
    if not 0 <= t.ema_decay < 1:
        e.append("train.ema_decay must be in [0, 1)")
    from gerl.algo.policy_loss import POLICY_LOSSES

    if t.loss not in POLICY_LOSSES:
        e.append(f"train.loss={t.loss!r} is not a registered policy loss; choose one of {', '.join(sorted(POLICY_LOSSES))}")
    if t.is_cap <= 0:
        e.append("train.is_cap must be > 0")
    if cfg.model.lora and cfg.model.lora_rank < 1:
        e.append("model.lora_rank must be ≥ 1")
    if cfg.model.resolution % 16:
        e.append(f"model.resolution={cfg.model.resolution} must be a multiple of 16")
    r = cfg.reward
    if r.workers < 1 or any(c.workers < 1 for c in r.components):
        e.append("reward.workers (and each component's workers) must be ≥ 1")
    if not r.components and not r.name:
        e.append("no reward: set reward.name (e.g. ocr) or reward.components")
    if r.components and any(not c.name for c in r.components):
        e.append("every reward.components entry needs a name")
    if r.timeout_s <= 0 or r.retries < 0 or r.retry_backoff_s < 0:
        e.append("reward.timeout_s must be > 0, reward.retries and reward.retry_backoff_s ≥ 0")
    g = cfg.engine
    if g.actor_workers < 1 or g.rollout_workers < 1 or g.cpus_per_worker < 1:
        e.append("engine.actor_workers, engine.rollout_workers and engine.cpus_per_worker must be ≥ 1")
    elif g.kind == "local" and (g.actor_workers > 1 or g.rollout_workers > 1 or not g.hybrid or g.schedule != "sync"):
        e.append("engine.kind=local runs one colocated worker with schedule=sync; set engine.kind=ray for more "
                 "workers, hybrid=false or schedule=async")
    elif g.hybrid and g.schedule != "sync":
        e.append(f"engine.schedule={g.schedule} needs engine.hybrid=false (a colocated rollout cannot generate while "
                 "its device trains)")
    elif g.hybrid and g.actor_workers != g.rollout_workers:
        e.append(f"engine.hybrid=true colocates one actor and one rollout per device: actor_workers "
                 f"({g.actor_workers}) must equal rollout_workers ({g.rollout_workers})")
    if g.schedule != "sync" and g.max_staleness < 1:
        e.append(f"engine.max_staleness must be ≥ 1 with schedule={g.schedule}")
    if g.schedule == "stream" and g.weight_sync == "broadcast":
        e.append("engine.schedule=stream stages weights through the object store; set engine.weight_sync=auto or object_store")
    if not 0 < g.stale_decay <= 1:
        e.append("engine.stale_decay must be in (0, 1]")
    if d.prompts_per_step % g.rollout_workers:
        e.append(f"data.prompts_per_step={d.prompts_per_step} must be divisible by engine.rollout_workers "
                 f"({g.rollout_workers}): each rollout worker generates whole groups")
    if mini % g.actor_workers or (mini // g.actor_workers) % max(t.micro_batch_size, 1):
        e.append(f"train.mini_batch_size ({mini}) must split evenly over engine.actor_workers ({g.actor_workers}) "
                 f"in multiples of train.micro_batch_size ({t.micro_batch_size})")
    if cfg.validation.num_prompts < 1:
        e.append("validation.num_prompts must be ≥ 1")
    return e


def reward_components(r: RewardConfig) -> list[RewardComponent]:
    """The rewards to run: the components, or the single-reward shorthand as one component of weight 1."""
    return list(r.components) or [RewardComponent(name=r.name, kwargs=r.kwargs, pool=r.pool, workers=r.workers)]


def derived_sizes(cfg: Config, trained_steps: int) -> dict[str, int]:
    """The batch arithmetic printed at start-up (see the module docstring)."""
    images = cfg.data.prompts_per_step * cfg.data.group_size
    mini = cfg.train.mini_batch_size or images
    return {
        "images_per_step": images,
        "groups_per_step": cfg.data.prompts_per_step,
        "group_size": cfg.data.group_size,
        "rollout_micro_batches": images // cfg.sampling.micro_batch_size,
        "optimizer_steps_per_epoch": images // mini,
        "grad_accumulation": (mini // cfg.train.micro_batch_size) * trained_steps,
        "trained_denoising_steps": trained_steps,
    }


def trained_steps_per_sample(cfg: Config) -> int:
    s = cfg.sampling
    recorded = s.sde_window_size if s.sde_window_size > 0 else s.num_steps - 1
    return max(1, int(recorded * s.timestep_fraction + 0.5)) if s.timestep_fraction < 1 else recorded


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


SECRET_WORDS = ("key", "token", "secret", "password")


def redact(obj):
    """Copy of a config dict with secret-looking values (api_key, token, ...) replaced, for files and loggers."""
    if isinstance(obj, dict):
        return {k: "***" if any(w in str(k).lower() for w in SECRET_WORDS) and v else redact(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(redact(to_dict(cfg)), sort_keys=False)
