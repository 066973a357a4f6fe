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
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from gerl.errors import UserError


@dataclass
class ModelConfig:
    path: str = "tiny"  # "tiny" (an SD3 built offline, seeded), "tiny-flux" / "tiny-flux-schnell" (FLUX.1-dev / -schnell built offline), "tiny-qwenimage" (Qwen-Image built offline), "tiny-flux-kontext" / "tiny-qwenimage-edit" (image editing: prompts need an "image"), "tiny-flux2-klein", "tiny-zimage", "ocr-mini" (shipped, draws 2-digit numbers), a local diffusers directory, or a hub id (e.g. stabilityai/stable-diffusion-3.5-medium, black-forest-labs/FLUX.1-dev, Qwen/Qwen-Image); its model_index.json picks the family (gerl/models/family.py)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # transformer and text-encoder weights (the VAE: vae_dtype; LoRA weights stay fp32; SDE math is always fp32)
    vae_dtype: Literal["auto", "fp32", "bf16"] = "auto"  # the VAE's weights and decode: auto = bf16 on CUDA (1.4× fp32 with TF32 for SD3's VAE on an H200, 1.7× for Qwen-Image's), fp32 on a CPU, where bf16 is 3× slower without native bf16 instructions and CPU runs stay reproducible (gerl/models/vae.py). Images feed only the reward, so the ratio is exact either way; bf16's images are ≈ 50 dB PSNR from fp32's. No fp16: the decoder overflows to NaN
    device: str = "auto"  # "auto" = cuda if available else cpu; or an explicit torch device string
    resolution: int = 64  # image side in pixels (must be divisible by the VAE factor × patch size)
    max_sequence_length: int = 32  # text tokens per prompt: T5's for SD3 and FLUX (SD3.5 uses 256; the tiny models 32), Qwen-Image's after its chat template's system turn (verl-omni uses 256)
    lora: bool = True  # train a LoRA adapter; false = full fine-tuning of the transformer
    lora_rank: int = 8  # LoRA rank r
    lora_alpha: float = 16.0  # LoRA alpha; the update is scaled by alpha / r
    lora_targets: list[str] = field(default_factory=list)  # transformer module names to adapt (peft matches name endings); [] = the model family's default (gerl/models/<family>.py lora_targets: SD3 every attention projection to_q … to_add_out; FLUX flow_grpo's attn.* + ff.* + ff_context.*; Qwen-Image verl-omni's and flow_grpo's attention projections + img_mlp.* + txt_mlp.*)
    lora_init: Literal["default", "gaussian"] = "default"  # a fresh adapter's A: peft's default (Kaiming-uniform) or "gaussian" (N(0, 1/r): NFT's, AWM's and GeRL's); B starts at 0 either way, so the policy starts as the base
    init_lora: str = ""  # a directory or .safetensors of a LoRA to start from ("" = fresh adapter)
    text_cache_size: int = 4096  # prompts whose text embeddings are kept (LRU); text encoders never re-run for these
    condition_resolution: int = 0  # image editing (FLUX.1-Kontext, Qwen-Image-Edit-Plus): the conditioning image is resized to this side's area (N² pixels) at its own aspect before the VAE encodes it; 0 = the stock pipeline's size (Kontext's preferred ~1 MP resolutions, Qwen-Image-Edit-Plus's 1024²). flow_grpo's edit runs use 512. Ignored by text-to-image families
    text_cache: str = ""  # a directory of every prompt's embeddings written once by `gerl prepare CONFIG` (memory-mapped: one copy in a node's page cache for all its hosts); rollout hosts then load no text encoder (T5-XXL 9.5 GB, Qwen2.5-VL-7B 16.6 GB in bf16; logged as text_encoders_freed_gib). Refused in one line when the prompt files, the model, model.dtype or max_sequence_length changed since. "" = encode on the fly (gerl/models/text_cache.py)
    tiny_seed: int = 0  # seed of the randomly initialised tiny model (model.path = tiny)
    gradient_checkpointing: bool = False  # recompute each transformer block's activations in the backward pass: SD3.5-M's training activations at 512² micro-batch 8 drop from 23.8 to 1.8 GiB (28.5 → 6.5 GiB with the fp16 weights) for ~1/3 more training compute (`gerl plan` shows both)
    tf32: bool = True  # TF32 tensor cores for fp32 matmuls on Ampere+ GPUs (Flow-GRPO's allow_tf32); no effect on CPU
    merge_lora: bool = False  # rollout and training both compute each adapted linear as one matmul with W0 + s·B·A merged in the model dtype, re-merged whenever the adapter changes (gerl/models/lora_merge.py): faster than PEFT's three matmuls on a GPU, and the ratio stays exactly 1 before an update; costs one more copy of the adapted linears' weights in the model dtype on every host holding the transformer; needs model.lora
    compile: bool = False  # torch.compile each transformer block in place (regional; inductor, one graph per block, static shapes), once at start-up after the LoRA is attached, so the rollout and the training replay run the same compiled blocks (gerl/models/compile.py). Effect: fused elementwise ops and fewer kernel launches in every denoising step and training forward. Cost: compilation in the first step — each distinct (grad mode, batch rows, adapter on/off) compiles once per block structure (SD3.5-M with its LoRA: 55 s on an H200; the tiny SD3 on 2 CPU cores: 1–2 min), logged as rollout_compile_s / actor_compile_s — and nothing after it; measured on an H200 at random weights: denoising 2.0×, a training micro-batch 1.6× faster; not for Qwen-Image (its text length varies per batch) nor an fp16 rehearsal (its GEMM emulation is eager-only)
    attention_backend: Literal["sdpa", "cudnn", "flash", "flash3"] = "sdpa"  # attention kernel of the transformer, the same for rollout and training (diffusers' dispatcher; gerl/models/attention.py): sdpa = torch's scaled_dot_product_attention as the stock pipelines call it; cudnn = cuDNN attention; flash = FlashAttention-2 (the flash-attn package); flash3 = FlashAttention-3 (Hopper). All but sdpa need a CUDA GPU and model.dtype bf16/fp16 and are probed at start-up on the device (a missing kernel is an error there, naming the fix)


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
    guidance_scale: float = 1.0  # guidance in rollouts and their training replays, as the model family reads it: SD3 classifier-free (1.0 = no negative pass); FLUX.1-dev the distilled guidance embedding (one pass; flow_grpo uses 3.5); FLUX.1-schnell none (ignored); Qwen-Image true_cfg_scale (> 1: a second pass on the negative prompt " ", norm-rescaled; verl-omni uses 4.0)
    eval_guidance_scale: float = 1.0  # the same for validation/eval
    noise_level: float = 0.8  # SDE η (sde) or CPS angle fraction (cps)
    sde_window_size: int = 3  # Flow-GRPO-Fast: consecutive stochastic (and trained) steps; 0 = Flow-GRPO (all steps but the last)
    sde_window_range: list[int] = field(default_factory=lambda: [0, 5])  # [lo, hi): the window lies inside these step indices
    timestep_fraction: float = 1.0  # fraction of the recorded steps trained per sample (random subset; Flow-GRPO uses 0.99)
    micro_batch_size: int = 8  # images denoised together; each decoded micro-batch's reward is submitted at once
    init_same_noise: bool = False  # a group's images start from one initial noise (DanceGRPO's init_same_noise): only the SDE window's noise differs
    reuse_velocity_steps: list[int] = field(default_factory=list)  # lossy step caching for the rollouts of nft/awm/dgpo, which read no rollout log-probs: at these schedule indices (1 … num_steps − 1) the ODE step takes the previous step's velocity, with no transformer call (each index saves one forward, × 2 with CFG); flow_grpo refuses it (its ratio compares the rollout's log-probs with the replay's). Validation and `gerl sample`/`eval` never skip


@dataclass
class AlgoConfig:
    """Which policy objective trains the model (gerl/algo/). flow_grpo replays the rollout's recorded SDE steps;
    nft, awm and dgpo need only the clean final latents and their rewards (the rollout then samples a plain ODE and
    records nothing else), and re-noise them at `train_timesteps` noise levels of the sampling schedule."""
    name: Literal["flow_grpo", "nft", "awm", "dgpo"] = "flow_grpo"  # flow_grpo: Flow-GRPO(-Fast), PPO-clipped ratio of SDE-step log-probs; nft: DiffusionNFT (NVlabs), implicit positive/negative flow matching weighted by the normalised advantage; awm: Advantage Weighted Matching, a PPO-clipped ratio of a flow-matching likelihood surrogate; dgpo: Direct Group Preference Optimization (Luo et al.), a DPO-style log-sigmoid preference of each group's positive over its negative samples, by their flow-matching errors against a reference (gerl/algo/dgpo.py)
    train_timesteps: int = 0  # nft/awm/dgpo: noise levels trained per sample (0 = int(sampling.num_steps × sampling.timestep_fraction)); grad accumulation counts each
    timesteps: Literal["random", "stratified", "shared"] = "random"  # nft/awm/dgpo: which schedule indices: `train_timesteps` distinct random ones per sample (NFT); one per stratum of [1, num_steps × timestep_fraction), the same for each training micro-batch (AWM's discrete_wo_init); or `train_timesteps` distinct ones of [0, num_steps × timestep_fraction), the same for every sample and rank (DGPO: timestep_fraction 0.7 of 10 steps is its trunc_steps 6). random and stratified draw per data-parallel rank and inner epoch, with fresh noise ε per sample, as NFT and AWM do; shared per inner epoch
    nft_beta: float = 1.0  # nft: β of v+ = β·v + (1−β)·v_old and v− = (1+β)·v_old − β·v (NVlabs 1.0; 0.1 in its SD3 OCR config); the loss divides by β
    awm_weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "uniform"  # awm: log p ≈ −w(σ, ‖v − (ε − x0)‖²): uniform = −err; t = −σ·err; t2 = −σ²·err; huber = −σ·(√err − 1e-5); ghuber = −σ·(err^p − 0^p)/p
    awm_ghuber_power: float = 0.25  # awm, weighting ghuber: p
    awm_advantage_max: float = 0.0  # awm: advantages × awm_advantage_max / train.adv_clip_max after clipping (0 = unscaled; AWM's configs use 1)
    dgpo_beta: float = 100.0  # dgpo: β of the group margin S_g = (β/n_g)·Σ A_i·(e_i − e_ref_i), dimensionless; it only sharpens the sigmoid weight σ(S_g), the gradient's scale is A·∇e (DGPO's train.beta_dpo: 100 with the frozen reference in its OCR configs, 2000 with the anchor as reference)
    dgpo_reference: Literal["base", "anchor"] = "base"  # dgpo: whose flow-matching error e_ref the policy's is compared with: the frozen base model (the adapter off, or a frozen copy; DGPO's OCR scripts) or the anchor below (its use_ema_ref, "emaref" configs, after TDM-R1)
    dgpo_reference_guidance: float = 1.0  # dgpo: guidance of the frozen base's velocity, in the margin (reference base) and in the KL (train.beta); 1 = the guidance the policy trains at (no classifier-free pass); > 1 = the family's guidance at that scale (DGPO's kl_cfg: 1 in its OCR config, 4.5 in its CFG-free one; the rollout then records the negative embeddings it needs)
    dgpo_shared_noise: bool = True  # dgpo: one ε per group at each training point, shared by the group's samples (DGPO's use_shared_noise, on in all its configs); false = an ε per sample and rank as nft/awm
    dgpo_sample_anchor_after: int = 200  # dgpo: after this many optimizer steps the rollouts sample with the anchor instead of the trained weights (DGPO's switch_ema_ref: 200 in its OCR configs, 500 for GenEval); −1 = never. Validation scores the trained weights (or the train.ema_decay EMA)
    anchor_beta: float = 0.0  # nft/awm: weight of ‖v − v_anchor‖² in the loss (AWM's ema_beta; the anchor is the slow copy below)
    anchor_decay_flat: int = 0  # the anchor ("old" policy) θ_old ← d·θ_old + (1 − d)·θ after each update, d = min(max(0, s − flat)·rate, max) at s optimizer steps. nft samples with θ_old and regresses against it; dgpo clips its ratio against it (and compares with it when dgpo_reference=anchor)
    anchor_decay_rate: float = 0.0  # per optimizer step (NVlabs SD3 OCR: flat 75, rate 0.0075, max 0.999; AWM: 0, 0.001, 0.3; DGPO's ema_ref, updated after its one optimizer step per batch: 1, 0.001, 0.3)
    anchor_decay_max: float = 0.0  # the cap of d (0 with rate 0: the anchor is the current policy after every update)


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
    shuffle_mini_batches: bool = True  # each inner epoch draws its mini-batches from a seeded random permutation of the step's samples (Flow-GRPO); false = consecutive slices in rollout order, a group's images together (GeRL's data.split)
    micro_batch_size: int = 8  # samples per forward/backward; gradients accumulate up to mini_batch_size
    clip_range: float = 1e-4  # PPO ratio clip ε; its scale depends on conventions.*_log_prob (Flow-GRPO: 1e-4 for its SDE configs, 1e-5 for CPS with squared_error; GeRL: 1e-5)
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
    is_cap: float = 1.0  # loss=tis: importance weights are truncated at this value (dimensionless, > 0; ROLL's tis_upper_bound, also 1.0)
    cispo_eps_low: float = 0.0  # loss=cispo: the importance weight is clipped below at 1 − this (ROLL's cispo_epsilon_low); 0 = train.clip_range
    cispo_eps_high: float = 0.0  # loss=cispo: the importance weight is clipped above at 1 + this (ROLL's cispo_epsilon_high); 0 = train.clip_range
    topr_split: Literal["advantage", "reward"] = "advantage"  # loss=topr: a sample is tapered to weight min(r, 1) when its advantage is < 0, or (ROLL's rule) its reward is ≤ 0 — then always-positive rewards taper nothing (gerl/algo/policy_loss.py)
    fp16_loss_scale: float = 65536.0  # model.dtype=fp16: initial dynamic loss scale (halved on an inf/NaN gradient, that step skipped on every rank; doubled after fp16_scale_growth_interval clean steps). 0 = off: per-element gradients of a 512² log-prob (~1e-9) then flush to zero in fp16 and nothing is learned
    fp16_scale_growth_interval: int = 2000  # optimizer steps without an overflow before the loss scale doubles (torch.amp.GradScaler's default; GeRL 400)
    deterministic: bool = False  # GPU runs that repeat bit for bit (CPU runs already do): every process that trains or generates (this one, each Ray host) sets CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA starts, torch.use_deterministic_algorithms(True) (an op without a deterministic kernel then raises), cuDNN deterministic without autotuning, and seeds Python, NumPy and torch from seed. Cost: slower deterministic kernels where torch has a choice (attention backward, scatter/index_add), no cuDNN autotuning (the VAE's convolutions), NaN-filled torch.empty, ~32 MiB of cuBLAS workspace per stream; not yet measured on a GPU (docs/architecture.md, "Determinism")


@dataclass
class RewardComponent:
    name: str = ""  # registered reward name, entry point, or package.module:callable
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the reward factory
    weight: float = 1.0  # weight in the total reward
    normalize: Literal["none", "zscore", "scale"] = "none"  # per-step z-score over the batch, or multiply by `scale`, before weighting
    scale: float = 1.0  # used by normalize=scale
    pool: Literal["thread", "process", "ray"] = "thread"  # threads for I/O-bound calls (HTTP) or GIL-free libraries; processes for CPU-bound Python; Ray actors (replicas with their own CPU/GPU)
    workers: int = 0  # pool size (replicas) for this component; 0 = auto: one per CPU this process may run on, less the one that drives generation (os.sched_getaffinity: a Ray host's pinned share), at least 1 — pool=ray: 1
    split: bool = True  # a reward that scores each image on its own (it says so: per_sample, e.g. ocr) gets each micro-batch split over the pool's workers, so the last micro-batch's scores come back in 1/workers of the time; false = one call per micro-batch
    num_cpus: float = 1.0  # pool=ray: CPUs reserved by each replica
    num_gpus: float = 0.0  # pool=ray: GPUs reserved by each replica (e.g. 1 for an OCR or VLM model on its own GPU)


@dataclass
class RewardConfig:
    name: str = "ocr"  # single-reward shorthand: registered name, entry point, or package.module:callable ("" when using components)
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the reward factory
    pool: Literal["thread", "process", "ray"] = "thread"  # where the single reward's calls run (components set their own)
    workers: int = 0  # pool size for the single reward (0 = auto, as reward.components[].workers)
    split: bool = True  # split each micro-batch of a per-sample reward over the pool's workers (as reward.components[].split)
    components: list[RewardComponent] = field(default_factory=list)  # several weighted rewards; replaces name/kwargs when given
    with_reward: bool = True  # submit each decoded micro-batch's reward as a future and keep generating
    timeout_s: float = 120.0  # per call of a reward on one micro-batch; a call past it counts as a timeout and is retried
    retries: int = 2  # extra attempts after an error or timeout, with exponential backoff
    retry_backoff_s: float = 0.5  # first backoff; doubles each retry
    on_failure: Literal["drop", "fixed", "abort"] = "drop"  # a sample still failing: drop it (a group left with < 2 samples is dropped), give it failure_score, or stop the run
    failure_score: float = 0.0  # score given to failed samples when on_failure=fixed
    max_failed_steps: int = 3  # stop the run (exit 3) after this many consecutive steps with no valid reward at all (0 = never)


@dataclass
class ValidationConfig:
    every: int = 0  # validate at step 0, every N steps and always at the last step (0 = only at the last step; -1 = never)
    num_prompts: int = 8  # first N prompts of data.test_prompts
    images_per_prompt: int = 1  # validation images per prompt, each with its own fixed noise (more = a less noisy val_reward_mean)
    seed: int = 1234  # fixed noise for comparable grids


@dataclass
class LogConfig:
    tensorboard: bool = True  # scalars + image grids under output_dir/tensorboard
    wandb: bool = False  # also log to Weights & Biases (pip install gerl[wandb])
    wandb_project: str = "gerl"
    wandb_name: str = ""  # wandb run name ("" = wandb's own)
    wandb_id: str = ""  # wandb run id ("" = generated at the first start and kept in output_dir/wandb_id, so resume continues that run)
    wandb_tags: list[str] = field(default_factory=list)  # wandb run tags
    images_every: int = 10  # write a training sample grid every N steps (0 = never)
    progress_bar: bool = True  # tqdm bar on stderr when it is a terminal; otherwise plain lines (print_every)
    print_every: int = 10  # without a progress bar: one plain stderr line every N steps (0 = none)


@dataclass
class EngineConfig:
    kind: Literal["local", "ray"] = "local"  # local: one process (torchrun / accelerate launch: one colocated host per process, gerl/engine/launcher.py); ray: roles as Ray actors on resource pools, one placement group with a bundle per host
    hybrid: bool = True  # colocate actor and rollout on the same devices sharing one model (no weight sync); false = decoupled pools
    actor_workers: int = 1  # N: data-parallel training ranks (devices) in the actor pool; under torchrun / accelerate launch it is their process count (left at 1, it is set to that)
    rollout_workers: int = 1  # M: generation workers (devices) in the rollout pool; a step's groups are split across them
    device: Literal["auto", "cpu", "cuda"] = "auto"  # what each worker's share is: a GPU each, or cpus_per_worker cores
    cpus_per_worker: int = 0  # CPU cores per host: device=cpu pins this many (torch threads = this); device=cuda reserves them beside the GPU for the host's reward threads and data work. 0 = auto: 1 on cpu, 4 on cuda
    gpus_per_worker: float = 1.0  # each host's share of a GPU when device=cuda; 0.5 puts two hosts (1 actor + 1 rollout) on one GPU
    schedule: Literal["sync", "async", "stream"] = "sync"  # sync: generate → reward → train → sync; async: generation runs max_staleness batches ahead; stream: rollouts pull groups from one prompt stream, the trainer takes the first complete ones (docs/architecture.md)
    max_staleness: int = 1  # async: batches generated ahead of training (1 = one-step-off; ROLL's async_generation_ratio); stream: also the lag in versions beyond which a group is stale
    stale: Literal["drop", "downweight"] = "drop"  # stream: a group older than max_staleness versions is dropped, or kept with a smaller weight in the policy loss
    stale_decay: float = 0.5  # stream, stale=downweight: a stale sample's policy loss × stale_decay^(lag − max_staleness), in (0, 1] (flow_grpo: its advantage × that, the same thing; nft/awm/dgpo: a per-sample loss weight)
    ratio_cap: float = 0.0  # train.loss=ppo_clip: truncate the importance ratio at this value before the clip (0 = off; ≥ 1 + train.clip_range: dual-clip PPO, bounding a negative-advantage sample's loss at −ratio_cap·A; ROLL's dual_clip_loss is 1 + 2·ε)
    weight_sync: Literal["auto", "object_store", "broadcast"] = "auto"  # auto: object store for LoRA, bucketed broadcast for full fine-tuning
    sync_bucket_mb: int = 256  # bucket size of the broadcast weight sync
    ray_address: str = ""  # "" = start a local Ray; "auto" or host:port = join an existing cluster (ray start --head)
    env: dict[str, Any] = field(default_factory=dict)  # environment variables set in every host's process before it starts (Ray's runtime_env; the local engine and torchrun: this process), e.g. {NCCL_SOCKET_IFNAME: eth0, NCCL_IB_HCA: mlx5, NCCL_DEBUG: WARN}: NCCL reads them where the process group starts, on each node. Values are strings (numbers are written as they read)
    max_rollout_restarts: int = 3  # a dead rollout worker is replaced this many times before the run fails
    setup_timeout_s: float = 900.0  # a Ray host that has not loaded its model within this many seconds stops the run with its name and the likely cause
    fsdp: bool = False  # shard the actor ranks' transformer with torch FSDP2 (fully_shard per block, then the root): each of the engine.actor_workers ranks holds 1/N of the weights, gradients and AdamW state (fp32 masters, computing in model.dtype); for full fine-tuning that does not fit one GPU, or a LoRA over a base that does not (`gerl plan` counts the shards and the per-block gathers, and proposes it when nothing smaller fits). false = every actor rank holds the whole model (replicas, gradients averaged by DDP). docs/architecture.md, "Data parallel layer"
    rehearse: bool = False  # run this config's GPU topology on CPU: Ray declares the GPUs it needs (one CUDA_VISIBLE_DEVICES per host), process groups use the GPU backend map with NCCL replaced by gloo, the model in model.dtype on the CPU (docs/architecture.md, "Rehearsing a GPU launcher")


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
class ConventionsConfig:
    """Where the peers' code and gerl's differ in a formula, not a hyperparameter (docs/conventions.md has the table).

    A preset fills in every convention of a peer (and the few settings elsewhere that belong to it, e.g.
    train.advantage and the OCR reward's normalisation); keys given explicitly in the config or on the command
    line win over the preset. `gerl train CONFIG --print-config` shows what was resolved.
    """
    preset: Literal["gerl", "flow_grpo", "gerl_mm_grpo"] = "gerl"  # gerl = the defaults below; flow_grpo / gerl_mm_grpo = that peer's code exactly
    sde_log_prob: Literal["gaussian", "squared_error"] = "gaussian"  # SDE step log-prob: gaussian = mean[−(x−μ)²/(2s²)] − log s − log√(2π) (all three codes); squared_error = mean[−(x−μ)²]
    cps_log_prob: Literal["gaussian", "squared_error"] = "gaussian"  # CPS step log-prob, as above; Flow-GRPO and GeRL use squared_error, so their log-ratios are 2s² × gerl's
    kl_std: Literal["transition", "noise_coef"] = "transition"  # KL = ‖μ−μ_ref‖²/(2s²) with s = the transition std (exact KL) or the peers' std_dev_t (g for SDE, no √(−dt); same for CPS)
    group_std: Literal["biased", "unbiased"] = "biased"  # std estimator of group/global advantages: biased divides by n (Flow-GRPO), unbiased by n − 1 (GeRL)


# A preset: dotted config keys → values, applied where the config does not set the key itself. "ocr:" keys go to
# the kwargs of every OCR reward (reward.kwargs when reward.name is ocr, and each ocr component's kwargs).
PRESETS: dict[str, dict[str, Any]] = {
    "gerl": {},
    "flow_grpo": {  # yifan123/flow_grpo: sd3_sde_with_logprob.py, train_sd3.py, stat_tracking.py, ocr.py
        "conventions.sde_log_prob": "gaussian",
        "conventions.cps_log_prob": "squared_error",
        "conventions.kl_std": "noise_coef",
        "conventions.group_std": "biased",
        "train.advantage": "global_std",  # sample.global_std = True in base.py and every SD3 config
        "train.per_prompt_tracker": False,  # its PerPromptStatTracker is cleared every epoch: this step's group
        "train.shuffle_mini_batches": True,  # train_sd3.py: samples[perm] before rebatching, every inner epoch
        "ocr:strip": "spaces",
        "ocr:strict_confidence": True,
    },
    "gerl_mm_grpo": {  # GeRL (leibniz-csi/mm_grpo): scheduling_flow_match_sde_discrete.py, core_algos.py, ocr.py
        "conventions.sde_log_prob": "gaussian",
        "conventions.cps_log_prob": "squared_error",
        "conventions.kl_std": "noise_coef",
        "conventions.group_std": "unbiased",
        "train.fp16_loss_scale": 2.0**24,  # diffusers_actor.py: ShardedGradScaler(init_scale=2**24, growth_interval=400)
        "train.fp16_scale_growth_interval": 400,
        "train.advantage": "global_std",  # algorithm.global_std = True in ppo_trainer.yaml
        "train.per_prompt_tracker": False,
        "train.shuffle_mini_batches": False,  # diffusers_actor.py update_policy: data.split(ppo_mini_batch_size), unshuffled
        "ocr:strip": "spaces",
        "ocr:strict_confidence": True,
    },
}
OCR_REWARDS = ("ocr",)  # reward names whose kwargs take the preset's "ocr:" keys


def apply_preset(data: dict) -> dict:
    """Fill the preset named in data["conventions"]["preset"] into the raw config mapping, in place, never
    overwriting a key the config sets. An unknown preset is left for the type check to report."""
    conv = data.get("conventions")
    name = conv.get("preset", "gerl") if isinstance(conv, dict) else "gerl"
    preset = PRESETS.get(name) if isinstance(name, str) else None
    if not preset:
        return data
    reward = data.get("reward") if isinstance(data.get("reward"), dict) else {}
    ocr_kwargs = []
    comps = reward.get("components")
    if isinstance(comps, list) and comps:
        ocr_kwargs = [c.setdefault("kwargs", {}) for c in comps if isinstance(c, dict) and c.get("name") in OCR_REWARDS]
    elif reward.get("name", RewardConfig.name) in OCR_REWARDS:
        ocr_kwargs = [data.setdefault("reward", {}).setdefault("kwargs", {})]
    for key, value in preset.items():
        if key.startswith("ocr:"):
            for kw in ocr_kwargs:
                if isinstance(kw, dict):
                    kw.setdefault(key[4:], value)
            continue
        *path, leaf = key.split(".")
        node = data
        for k in path:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                break
        else:
            node.setdefault(leaf, value)
    return data


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
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    log: LogConfig = field(default_factory=LogConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    conventions: ConventionsConfig = field(default_factory=ConventionsConfig)


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


# Keys that moved: an old key is an error naming its new place (never silently read).
MOVED = {"sampling.merge_lora": "model.merge_lora (the merged LoRA now serves the rollout and the training alike)"}


def _build(cls, data: dict, prefix: str, errors: list[str]):
    types = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if full in MOVED:
            errors.append(f"{full} has moved to {MOVED[full]}: rename the key")
            continue
        if key not in types:
            valid = [f"{prefix}{k}" for k in types]
            hint = _suggest(full, valid)
            errors.append(f"unknown key {full!r}" + (f" (did you mean {hint!r}?)" if hint else f"; valid keys: {', '.join(valid)}"))
            continue
        tp = types[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                errors.append(f"{full}: expected a section (mapping), got {value!r}")
                continue
            kwargs[key] = _build(tp, value, f"{full}.", errors)
        else:
            before = len(errors)
            coerced = _coerce(value, tp, full, errors)
            if len(errors) == before:  # a mistyped value keeps the default, so `validate` still sees a typed tree
                kwargs[key] = coerced
    return cls(**kwargs)


def _leaf_keys(cls=None, prefix: str = "") -> list[str]:
    """Every dotted key of the tree (list-of-section fields such as reward.components stay one key)."""
    out = []
    for name, tp in _field_types(cls or Config).items():
        if dataclasses.is_dataclass(tp):
            out += _leaf_keys(tp, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def _suggest(full: str, valid: list[str]) -> str | None:
    """The key the user most likely meant, first match wins: a key anywhere in the tree whose last component is the
    typed one, or has it as initials (lr → learning_rate); a close spelling in the same section; a key whose last
    component starts with the typed one (≥ 3 letters) or is spelled closely."""
    last = full.rsplit(".", 1)[-1].lower()
    section = full.rsplit(".", 1)[0] + "." if "." in full else ""
    # keys of the typed section first, so train.lr prefers train.* over a namesake elsewhere
    everything = sorted(_leaf_keys(), key=lambda k: not k.startswith(section))
    leaf = lambda k: k.rsplit(".", 1)[-1]  # noqa: E731
    initials = lambda k: "".join(w[0] for w in leaf(k).split("_")) if "_" in leaf(k) else None  # noqa: E731
    for match in (lambda k: leaf(k) == last, lambda k: initials(k) == last):
        found = [k for k in everything if match(k)]
        if found:
            return found[0]
    hint = difflib.get_close_matches(full, valid, n=1)
    if hint:
        return hint[0]
    found = [k for k in everything if len(last) >= 3 and leaf(k).startswith(last)]
    if found:
        return found[0]
    close = difflib.get_close_matches(last, [leaf(k) for k in everything], n=1, cutoff=0.75)
    return next(k for k in everything if leaf(k) == close[0]) if close else None


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
    apply_preset(data)
    errors: list[str] = []
    cfg = _build(Config, data, "", errors)
    errors += validate(cfg)  # mistyped values kept their defaults, so every other error is reported in the same run
    if errors:
        raise UserError("invalid config: " + "; ".join(errors))
    return cfg


# ---------------------------------------------------------------- ranges ---------------------------------------------

@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts: lo ≤ v ≤ hi (strict where lo_open / hi_open), always finite."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""  # appended to the error: what the bound protects

    def ok(self, v: float) -> bool:
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def text(self) -> str:
        num = lambda x: str(int(x)) if float(x).is_integer() else f"{x:g}"  # noqa: E731
        if self.lo is None and self.hi is None:
            return "a finite number"
        if self.hi is None:
            return f"{'>' if self.lo_open else '≥'} {num(self.lo)}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '≤'} {num(self.hi)}"
        return f"in {'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}{')' if self.hi_open else ']'}"


def _ge(lo: float, why: str = "") -> Range:
    return Range(lo=lo, why=why)


def _gt(lo: float, why: str = "") -> Range:
    return Range(lo=lo, lo_open=True, why=why)


FINITE = Range()
SEED = Range(0, 2**32 - 1, why="NumPy seeds are unsigned 32-bit")

# Every numeric field of the tree and the values it accepts, checked before anything loads or is written. A field of
# reward.components is keyed "reward.components[].<name>"; a list of numbers applies its range to each element.
# tests/test_config.py walks the tree and fails if a numeric field is missing here.
RANGES: dict[str, Range] = {
    "max_steps": _ge(1),
    "seed": SEED,
    "model.resolution": _ge(16, "image side in pixels, a multiple of 16"),
    "model.max_sequence_length": Range(1, 512, why="T5 reads at most 512 tokens"),
    "model.lora_rank": _ge(1),
    "model.lora_alpha": _gt(0),
    "model.text_cache_size": _ge(0),
    "model.condition_resolution": Range(0, 4096, why="pixels per side of the conditioning image's area; 0 = the stock size"),
    "model.tiny_seed": SEED,
    "data.prompts_per_step": _ge(1),
    "data.group_size": _ge(2, "a group needs ≥ 2 images to normalise advantages"),
    "sampling.num_steps": _ge(2, "the final step is always deterministic"),
    "sampling.eval_num_steps": _ge(1),
    "sampling.guidance_scale": _ge(1, "1 = no guidance"),
    "sampling.eval_guidance_scale": _ge(1, "1 = no guidance"),
    "sampling.noise_level": _gt(0),  # the upper bound depends on the sampler: see _relations
    "sampling.sde_window_size": _ge(0, "0 = Flow-GRPO, all steps"),
    "sampling.sde_window_range": _ge(0),
    "sampling.reuse_velocity_steps": _ge(1, "step 0 has no velocity to reuse"),
    "sampling.timestep_fraction": Range(0, 1, lo_open=True),
    "sampling.micro_batch_size": _ge(1),
    "algo.train_timesteps": _ge(0, "0 = sampling.num_steps × sampling.timestep_fraction"),
    "algo.nft_beta": _gt(0, "the NFT loss divides by β"),
    "algo.awm_ghuber_power": _gt(0),
    "algo.awm_advantage_max": _ge(0, "0 = unscaled"),
    "algo.dgpo_beta": _gt(0, "the sigmoid's sharpness; its weight is σ(S_g)"),
    "algo.dgpo_reference_guidance": _ge(1, "1 = the policy's own training guidance"),
    "algo.dgpo_sample_anchor_after": _ge(-1, "-1 = never"),
    "algo.anchor_beta": _ge(0),
    "algo.anchor_decay_flat": _ge(0),
    "algo.anchor_decay_rate": _ge(0),
    "algo.anchor_decay_max": Range(0, 1, hi_open=True, why="the anchor must keep moving"),
    "train.learning_rate": _gt(0),
    "train.adam_betas": Range(0, 1, hi_open=True),
    "train.weight_decay": _ge(0),
    "train.adam_eps": _gt(0),
    "train.warmup_steps": _ge(0),
    "train.inner_epochs": _ge(1),
    "train.mini_batch_size": _ge(0, "0 = all images of the step"),
    "train.micro_batch_size": _ge(1),
    "train.clip_range": _gt(0),
    "train.is_cap": _gt(0),
    "train.cispo_eps_low": _ge(0, "0 = train.clip_range"),
    "train.cispo_eps_high": _ge(0, "0 = train.clip_range"),
    "train.fp16_loss_scale": _ge(0, "0 = no loss scaling"),
    "train.fp16_scale_growth_interval": _ge(1),
    "train.adv_clip_max": _gt(0, "advantages are clamped to [−adv_clip_max, adv_clip_max]"),
    "train.beta": _ge(0),
    "train.max_grad_norm": _ge(0, "0 = no clipping"),
    "train.tracker_buffer": _ge(2, "a std needs ≥ 2 rewards"),
    "train.ema_decay": Range(0, 1, hi_open=True),
    "reward.workers": _ge(0),
    "reward.timeout_s": _gt(0),
    "reward.retries": _ge(0),
    "reward.retry_backoff_s": _ge(0),
    "reward.max_failed_steps": _ge(0, "0 = never stop for missing rewards"),
    "reward.failure_score": FINITE,
    "reward.components[].weight": FINITE,
    "reward.components[].scale": FINITE,
    "reward.components[].workers": _ge(0),
    "reward.components[].num_cpus": _ge(0),
    "reward.components[].num_gpus": _ge(0),
    "validation.every": _ge(-1, "0 = only at the end, -1 = never"),
    "validation.num_prompts": _ge(1),
    "validation.images_per_prompt": _ge(1),
    "validation.seed": SEED,
    "log.images_every": _ge(0, "0 = never"),
    "log.print_every": _ge(0, "0 = no plain progress lines"),
    "engine.actor_workers": _ge(1),
    "engine.rollout_workers": _ge(1),
    "engine.cpus_per_worker": _ge(0, "0 = auto: 1 on cpu, 4 on cuda"),
    "engine.gpus_per_worker": Range(0, 1, lo_open=True),
    "engine.max_staleness": _ge(1, "1 = one-step-off"),
    "engine.stale_decay": Range(0, 1, lo_open=True),
    "engine.ratio_cap": _ge(0, "0 = off"),
    "engine.sync_bucket_mb": _ge(1),
    "engine.max_rollout_restarts": _ge(0),
    "engine.setup_timeout_s": _gt(0),
    "metrics.target_val_reward": FINITE,
    "metrics.target_hold": _ge(1),
    "metrics.peak_tflops": _ge(0, "0 = guess from the device"),
    "checkpoint.every": _ge(0, "0 = only at the end"),
    "checkpoint.keep_last": _ge(0, "0 = keep all"),
}


def numeric_fields(obj, prefix: str = "", key_prefix: str = ""):
    """Yield (RANGES key, dotted key as the user writes it, value) for every number in the config tree; a list of
    numbers yields one entry per element, each section of reward.components its own fields."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key, shown = f"{key_prefix}{f.name}", f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            yield from numeric_fields(v, f"{shown}.", f"{key}.")
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                if dataclasses.is_dataclass(x):
                    yield from numeric_fields(x, f"{shown}[{i}].", f"{key}[].")
                elif isinstance(x, (int, float)) and not isinstance(x, bool):
                    yield key, f"{shown}[{i}]", x
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield key, shown, v


def _range_errors(cfg: Config) -> list[str]:
    e = []
    for key, shown, v in numeric_fields(cfg):
        r = RANGES[key]  # a KeyError here means a new numeric field without a range: add it to RANGES
        if not r.ok(v):
            e.append(f"{shown}={v!r} must be {r.text()}" + (f" ({r.why})" if r.why else ""))
    return e


def validate(cfg: Config) -> list[str]:
    """Every numeric field against RANGES, then (once each is in range) the relations between fields: batch
    divisibility, the SDE window, engine placement. Returns error strings, each naming the key and the fix."""
    e = _range_errors(cfg)
    r = cfg.reward
    if not r.components and not r.name:
        e.append("no reward: set reward.name (e.g. ocr) or reward.components")
    if r.components and any(not c.name for c in r.components):
        e.append("every reward.components entry needs a name")
    if len(cfg.train.adam_betas) != 2:
        e.append("train.adam_betas must be [beta1, beta2]")
    # The relations divide by sizes and compare bounds, which only means something once every field is in range.
    return e if e else _relations(cfg)


def weight_sync_mode(cfg: Config) -> str:
    """engine.weight_sync with "auto" resolved: the object store for LoRA or the stream schedule, else broadcast."""
    g = cfg.engine
    if g.weight_sync != "auto":
        return g.weight_sync
    return "object_store" if cfg.model.lora or g.schedule == "stream" else "broadcast"


def gpu_topology(cfg: Config) -> bool:
    """Whether the engine lays its hosts out on GPUs: engine.device=cuda, auto on a machine with CUDA, or a
    rehearsal of that layout on CPU (engine.rehearse)."""
    g = cfg.engine
    if g.rehearse or g.device == "cuda":
        return True
    if g.device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def host_cpus(cfg: Config) -> int:
    """engine.cpus_per_worker with 0 (auto) resolved: 1 core per CPU host; 4 per GPU host, so that the reward's
    threads (OCR on the CPU: 2 by default) and data work beside the GPU are not squeezed onto one core."""
    return cfg.engine.cpus_per_worker or (4 if gpu_topology(cfg) else 1)


def _relations(cfg: Config) -> list[str]:
    e = []
    d, s, t = cfg.data, cfg.sampling, cfg.train
    images = d.prompts_per_step * d.group_size
    if images % s.micro_batch_size:
        e.append(f"sampling.micro_batch_size={s.micro_batch_size} must divide images per step "
                 f"(data.prompts_per_step × data.group_size = {images})")
    mini = t.mini_batch_size or images
    if images % mini:
        e.append(f"train.mini_batch_size={t.mini_batch_size} must divide images per step ({images})")
    if mini % t.micro_batch_size:
        e.append(f"train.micro_batch_size={t.micro_batch_size} must divide train.mini_batch_size ({mini})")
    if s.sampler == "cps" and s.noise_level > 1 or s.noise_level > 10:
        e.append(f"sampling.noise_level={s.noise_level} out of range (cps: (0, 1]; sde: (0, 10])")
    if s.sde_window_size > 0 and cfg.algo.name == "flow_grpo":  # nft/awm/dgpo rollouts have no SDE window
        if len(s.sde_window_range) != 2:
            e.append("sampling.sde_window_range must be [lo, hi]")
        else:
            lo, hi = s.sde_window_range
            if not (0 <= lo and hi - lo >= s.sde_window_size and hi <= s.num_steps - 1):
                e.append(f"sampling.sde_window_range={s.sde_window_range} must satisfy 0 ≤ lo, hi − lo ≥ "
                         f"sde_window_size ({s.sde_window_size}) and hi ≤ num_steps − 1 ({s.num_steps - 1}, the final step is deterministic)")
    a = cfg.algo
    if s.reuse_velocity_steps:
        if a.name == "flow_grpo":
            e.append("sampling.reuse_velocity_steps is lossy: flow_grpo compares the rollout's log-probs with the "
                     "replay's, which a skipped forward would break; use it with algo.name nft, awm or dgpo, or drop it")
        bad = sorted(i for i in s.reuse_velocity_steps if not 1 <= i < s.num_steps)
        if bad:
            e.append(f"sampling.reuse_velocity_steps {bad} out of range: schedule indices 1 … num_steps − 1 "
                     f"({s.num_steps - 1}); step 0 has no velocity to reuse")
    if a.name != "flow_grpo":
        n = trained_steps_per_sample(cfg)
        top = int(s.num_steps * s.timestep_fraction)
        if a.timesteps == "random" and n > s.num_steps:
            e.append(f"algo.train_timesteps={n} exceeds sampling.num_steps ({s.num_steps}): {a.name} trains distinct "
                     "noise levels of the sampling schedule")
        if a.timesteps == "stratified" and n > top - 1:
            e.append(f"algo.train_timesteps={n} needs ≥ that many schedule indices in [1, num_steps × timestep_fraction) "
                     f"(here {max(0, top - 1)}); lower it or raise sampling.num_steps")
        if a.timesteps == "shared" and n > top:
            e.append(f"algo.train_timesteps={n} needs ≥ that many schedule indices in [0, num_steps × timestep_fraction) "
                     f"(here {top}); lower it or raise sampling.timestep_fraction")
        if t.loss != "ppo_clip" or t.recompute_old_log_probs or cfg.engine.ratio_cap:
            e.append(f"algo.name={a.name} has its own objective: train.loss, train.recompute_old_log_probs and "
                     "engine.ratio_cap belong to flow_grpo; leave them at their defaults")
    from gerl.algo.policy_loss import POLICY_LOSSES

    if t.loss not in POLICY_LOSSES:
        e.append(f"train.loss={t.loss!r} is not a registered policy loss; choose one of {', '.join(sorted(POLICY_LOSSES))}")
    # A loss's option set while another loss is chosen would be ignored without a word (gerl/algo/policy_loss.py).
    for key, owner in (("is_cap", "tis"), ("cispo_eps_low", "cispo"), ("cispo_eps_high", "cispo"),
                       ("topr_split", "topr")):
        if getattr(t, key) != getattr(TrainConfig, key) and t.loss != owner:
            e.append(f"train.{key} applies to train.loss={owner} only (here {t.loss}): remove it or set train.loss={owner}")
    cap = cfg.engine.ratio_cap
    if cap and t.loss != "ppo_clip":
        e.append(f"engine.ratio_cap={cap} truncates ppo_clip's ratio only; train.loss={t.loss} bounds its own weight "
                 "(tis: train.is_cap): set engine.ratio_cap=0")
    elif 0 < cap < 1 + t.clip_range:
        e.append(f"engine.ratio_cap={cap} must be 0 (off) or ≥ 1 + train.clip_range ({1 + t.clip_range:g}): a lower cap "
                 "holds the ratio constant inside the clip range, so every sample whose ratio is above the cap gets no "
                 "gradient (below 1 − clip_range, no sample of an on-policy batch learns at all); dual-clip PPO uses 3")
    e += _dgpo_relations(cfg)
    if a.name == "nft" and s.guidance_scale > 1:
        e.append(f"algo.name=nft trains without classifier-free guidance, as DiffusionNFT does (its negative-aware loss "
                 f"takes guidance's place; NVlabs' configs sample and train at guidance 1): set sampling.guidance_scale=1 "
                 f"(here {s.guidance_scale:g}); sampling.eval_guidance_scale may stay > 1 to validate with guidance")
    if cfg.model.resolution % 16:
        e.append(f"model.resolution={cfg.model.resolution} must be a multiple of 16")
    g = cfg.engine
    from gerl.engine.launcher import world

    launched = world()  # torchrun / accelerate launch: N processes, each one colocated host (gerl/engine/launcher.py)
    if g.kind == "local" and (not g.hybrid or g.schedule != "sync" or g.actor_workers != g.rollout_workers
                              or g.actor_workers not in (1, launched)):
        e.append("engine.kind=local runs one colocated worker per process with schedule=sync (several with torchrun: "
                 f"actor_workers = rollout_workers = its process count, here {launched}); set engine.kind=ray for more "
                 "workers, hybrid=false or schedule=async")
    elif g.hybrid and g.schedule != "sync":
        e.append(f"engine.schedule={g.schedule} needs engine.hybrid=false (a colocated rollout cannot generate while "
                 "its device trains)")
    elif g.hybrid and g.actor_workers != g.rollout_workers:
        e.append(f"engine.hybrid=true colocates one actor and one rollout per device: actor_workers "
                 f"({g.actor_workers}) must equal rollout_workers ({g.rollout_workers})")
    if cfg.model.merge_lora and not cfg.model.lora:
        e.append("model.merge_lora=true merges a LoRA adapter, but model.lora=false trains every weight; drop "
                 "model.merge_lora or set model.lora=true")
    e += _speed_relations(cfg)
    if cfg.model.dtype == "fp16" and not cfg.model.lora:
        e.append("model.dtype=fp16 with model.lora=false: full fine-tuning in fp16 is not supported (its loss scaling "
                 "is proven for a LoRA only); use bf16 (fp32 master weights keep AdamW's small steps) or fp32, or a LoRA")
    if g.fsdp and g.kind == "ray" and g.schedule == "stream":
        e.append("engine.fsdp=true with engine.schedule=stream is not supported yet; use schedule=sync or async")
    if g.fsdp and cfg.model.merge_lora:
        e.append("model.merge_lora=true merges the adapter into base weights that engine.fsdp=true shards over the "
                 "actor ranks; drop one of them")
    if g.fsdp and cfg.model.compile:
        e.append("model.compile=true with engine.fsdp=true is not supported yet (FSDP2's per-block hooks around the "
                 "compiled blocks are untested here); drop one of them")
    import re

    bad = [k for k, v in g.env.items() if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k))
           or not isinstance(v, (str, int, float, bool)) or isinstance(v, bool)]
    if bad:
        e.append(f"engine.env: {', '.join(map(str, bad))}: each entry is NAME: value, a variable name (letters, digits, _) "
                 "and a string or number, e.g. engine.env={NCCL_SOCKET_IFNAME: eth0}")
    if g.rehearse and g.device == "cpu":
        e.append("engine.rehearse=true rehearses a GPU layout on CPU; it needs engine.device=cuda (or auto), "
                 "as the GPU launchers set it")
    if g.schedule == "stream" and g.weight_sync == "broadcast":
        e.append("engine.schedule=stream stages weights through the object store; set engine.weight_sync=auto or object_store")
    if d.prompts_per_step % g.rollout_workers:
        e.append(f"data.prompts_per_step={d.prompts_per_step} must be divisible by engine.rollout_workers "
                 f"({g.rollout_workers}): each rollout worker generates whole groups")
    if mini % g.actor_workers or (mini // g.actor_workers) % t.micro_batch_size:
        e.append(f"train.mini_batch_size ({mini}) must split evenly over engine.actor_workers ({g.actor_workers}) "
                 f"in multiples of train.micro_batch_size ({t.micro_batch_size})")
    return e


def _speed_relations(cfg: Config) -> list[str]:
    """model.compile and model.attention_backend where they cannot act (what needs the device is probed at build)."""
    m, g = cfg.model, cfg.engine
    e = []
    if m.compile and g.rehearse and m.dtype == "fp16":
        e.append("model.compile=true with an fp16 rehearsal: the rehearsal emulates the GPU's fp16 GEMMs with a "
                 "dispatch mode that compiled blocks bypass; set model.compile=false for the rehearsal")
    b = m.attention_backend
    if b != "sdpa":
        if m.dtype == "fp32":
            e.append(f"model.attention_backend={b} computes in bf16/fp16 only, and model.dtype=fp32; set "
                     "model.dtype=bf16 or model.attention_backend=sdpa")
        cpu = g.rehearse or g.device == "cpu" or m.device.split(":")[0] == "cpu"
        if cpu:
            e.append(f"model.attention_backend={b} needs a CUDA GPU, and this run computes on the CPU "
                     f"({'engine.rehearse' if g.rehearse else 'engine.device' if g.device == 'cpu' else 'model.device'}"
                     "); set model.attention_backend=sdpa")
    return e


def _dgpo_relations(cfg: Config) -> list[str]:
    """DGPO's options only where they act, and the layout its group margin needs."""
    a, d, g = cfg.algo, cfg.data, cfg.engine
    if a.name != "dgpo":
        return [f"algo.{f.name} applies to algo.name=dgpo only (here {a.name}): remove it or set algo.name=dgpo"
                for f in dataclasses.fields(AlgoConfig)
                if f.name.startswith("dgpo_") and getattr(a, f.name) != f.default]
    e = []
    images = d.prompts_per_step * d.group_size
    per_rank = (cfg.train.mini_batch_size or images) // g.actor_workers
    if per_rank % d.group_size:
        e.append(f"algo.name=dgpo compares a group's samples within one optimizer step: train.mini_batch_size / "
                 f"engine.actor_workers ({per_rank}) must be a multiple of data.group_size ({d.group_size})")
    if a.anchor_beta > 0:
        e.append("algo.anchor_beta is nft/awm's velocity penalty; dgpo regularises with train.beta (the KL to the base) "
                 "and its clip against the anchor: set algo.anchor_beta=0")
    if a.dgpo_reference == "anchor" and (a.anchor_decay_rate == 0 or a.anchor_decay_max == 0):
        e.append("algo.dgpo_reference=anchor with a still anchor (anchor_decay_rate or anchor_decay_max 0) compares the "
                 "policy with itself at every update's start, so every margin is 0: set algo.anchor_decay_rate=0.001 "
                 "algo.anchor_decay_max=0.3 (DGPO's ema_ref) or algo.dgpo_reference=base")
    if a.dgpo_reference_guidance > 1 and a.dgpo_reference == "anchor" and cfg.train.beta == 0:
        e.append(f"algo.dgpo_reference_guidance={a.dgpo_reference_guidance:g} guides the frozen base's velocity, which "
                 "neither the margin (dgpo_reference=anchor) nor a KL (train.beta=0) uses here: remove it")
    return e


def reward_components(r: RewardConfig) -> list[RewardComponent]:
    """The rewards to run: the components, or the single-reward shorthand as one component of weight 1."""
    return list(r.components) or [RewardComponent(name=r.name, kwargs=r.kwargs, pool=r.pool, workers=r.workers,
                                                  split=r.split)]


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
    """Denoising steps (flow_grpo) or noise levels (nft/awm/dgpo) each sample trains per update."""
    s = cfg.sampling
    if cfg.algo.name != "flow_grpo":
        return cfg.algo.train_timesteps or max(1, int(s.num_steps * s.timestep_fraction))
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
