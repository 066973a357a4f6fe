"""Flow-GRPO-Fast throughput of SD3.5-Medium's architecture (random weights, nothing downloaded) on one GPU.

GeRL's recipe batch shape: 8 prompts × 8 images at 512 px, rollout micro-batch 8, 10 denoising steps with a CPS
window of 3 steps in [0, 5], LoRA r32/α64, training mini-batch 32 / micro-batch 8, bf16 weights with fp32 SDE
math. Prompt embeddings of the real shapes, (B, 77 + 256, 4096) and pooled (B, 2048): random tensors, or with
--text-encoders the real CLIP-L, CLIP-G and T5-XXL (random weights, bf16, on the GPU) run on random token ids of
the real lengths (77, 77, 256) every micro-batch. The step is the project's own machinery — `denoise` (recording
the SDE window), `decode`, rewards through `RewardSet`, group advantages, `ActorWorker.update` — timed stage by
stage with CUDA syncs. After the timed steps, at the final weights:

- stock: diffusers' `StableDiffusion3Pipeline.__call__` (same transformer with its LoRA, same VAE, bf16, text
  encoders None, the same prompt_embeds / pooled_prompt_embeds, guidance_scale=1.0, same steps, resolution,
  micro-batch and per-sample noise generators, output_type="pil" because our rollout decodes to PIL images)
  against our rollout (`denoise` + `decode`) on the same embeddings; warm-up excluded, CUDA-synced; images/s of
  both and ours/stock (the issue's bar: ≥ 0.95).
- ratio check: one rollout at micro-batch 8, then `ActorWorker.update` replays its recorded SDE window at the same
  weights with training micro-batch 4 and 8 (mini-batch = the whole batch, so every sample is replayed before
  the one optimizer step; the weights are restored afterwards) and reports its `ratio_max_dev_before_update`,
  max |ratio − 1|, flagged above 1e-3. In bf16/fp16 (on unless --no-grad-check) it also compares the LoRA gradient
  of that update (unscaled, caught by its grad_sync hook before clipping) with the gradient of the same update on
  an fp32 copy (the same weights upcast, the same recorded batch and advantages; old log-probs recomputed in fp32
  so that its ratio is 1 too): cosine (bar 0.99) and the fraction of exactly-zero entries. An adapter still at
  PEFT's init (B = 0, so grad A ≡ 0) first gets a seeded random B (std 1e-3). fp16 trains with dynamic loss
  scaling (train.fp16_loss_scale), and its gradient check also runs the control: the same update with scaling
  off, on the same rollout against the same fp32 copy (its gradients underflow to zero). --no-loss-scale runs
  everything unscaled.
- memory: weights per component (parameters + buffers), optimizer state, and the peak allocated memory of each
  stage (encode, rollout, decode, train; rollout_ours and stock of the comparison; ratio_check), GiB of
  torch.cuda.max_memory_allocated, reset on entering each stage (n/a on a CPU, which reports its peak RSS); on
  the whole model each stage's transient (peak − allocated on entry) beside `gerl plan`'s prediction for it.

The day a GPU is lent, one prepared call runs this benchmark's parts phase by phase, each guarded and saved as it
ends: `bash scripts/gpu_day.sh "$OUT"` (benchmarks/gpu_day.py; the device call is in docs/offline_install.md).
Run alone, this file prints each part as soon as it is measured and, with --out, rewrites the JSON after each:

    python -m benchmarks gpu --with-reward both --text-encoders --out bench_gpu.json
    python -m benchmarks gpu --launchers --out bench_launchers.json

--launchers runs each of the five run_sd3_fast_*.sh launchers for 2 steps on this one GPU, each host on a share of it
(engine.gpus_per_worker = 1/hosts), on ocr-mini at 64 px (benchmarks/bench_gpu_launchers.py): grad_norm > 0 and
max |ratio − 1| ≤ 1e-3 at step 1, no CUDA context in the driver, each host's peak beside `gerl plan`'s. Add the
fp16/bf16 gradient cosine on CUDA with `--dtype fp16 --steps 0 --no-stock` (which also runs the unscaled control).

Estimated runtime on one H100 (an estimate reasoned from FLOPs, not a measurement): an SD3.5-M forward at 512 px
with 333 text tokens is ≈ 2.45 TFLOP per image, so a step is 64 × 10 rollout forwards (1.6 PFLOP) + 64 × 3 trained
steps × 3 (forward + backward: 1.4 PFLOP) ≈ 3.0 PFLOP, ≈ 8 s at 40 % of 989 TFLOP/s; VAE decoding (≈ 2 TFLOP per
512 px image: 0.12 PFLOP) and the text encoders (T5-XXL: 2 × 4.7 G × 64 × 256 tokens ≈ 0.15 PFLOP) add ≈ 1 s.
OCR adds ≈ 5–10 s of CPU per step when off (mostly hidden when on). 7 steps (1 warm-up + 3 per mode) ≈ 1.5–2 min;
the stock comparison (1 warm-up + 3 reps of both rollouts, 64 images, ≈ 4 s each) ≈ 0.5 min; the ratio check (two
replays of 64 × 3 steps with backward) ≈ 0.3 min; its gradient check's fp32 copy (a recompute and a replay of
64 × 3 steps in fp32 without TF32: ≈ 1.9 PFLOP at ≈ 40 of 67 TFLOP/s) ≈ 0.8 min; building on the GPU, imports,
the OCR model ≈ 1 min. Total ≈ 4.5–5 min; allow 7.

    python -m benchmarks gpu                         # pure GPU (random rewards), random embeddings
    python -m benchmarks gpu --tiny --with-reward both --text-encoders --steps 1   # same code path, CPU, < 60 s

fp16 gradient underflow at SD3.5-M's real width on a CPU (IEEE fp16 casts and subnormals equal a GPU's): N blocks
(--layers; dual attention kept on the blocks < N that have it), no timed steps, only the ratio and gradient checks,
on one 512 px image with a 3-step schedule whose 1 trained step is step 0 (σ 1 → 0.751) and 77 + 32 text tokens.
--advantage-scale 1/96 gives that image the per-element gradient of GeRL's mini-batch of 32 images × 3 trained
steps (the loss averages over both). fp16 GEMMs and the CPU flash-attention backward are emulated in fp32 with one
rounding to fp16 per output (gerl/numerics.py: a GPU's fp16 numerics, ~100× faster than a CPU's fp16 GEMMs); the
run says so. ≈ 15–30 s each on 2 cores, plus 5–20 s to build the first. Measured at 2 blocks: cosine with fp32
1.00000 in fp16 (loss scale 2¹⁶), 0.99987 in bf16, 0 in fp16 without loss scaling (the control: every entry exactly
zero; at advantage scale 1, 96× larger gradients, still 68 % zero and cosine 0.70):

    python -m benchmarks gpu --device cpu --layers 2 --dtype fp16 --steps 0 --warmup 0 --no-stock --prompts 1 \
        --group-size 1 --num-steps 3 --sde-window 1 --sde-window-range 0 1 --t5-tokens 32 --advantage-scale 0.0104167
    # the fp16 run prints the unscaled control too; the same with --dtype bf16

--with-reward: none = random rewards (GPU work only); off = OCR after the whole batch is generated; on = each
decoded micro-batch's OCR submitted as a future while generation goes on; both = off and on, alternating steps.
Prints images/s/GPU, stage seconds (medians over the timed steps), MFU from gerl.logging.throughput, peak memory,
then the stock comparison, the ratio check and the memory attribution; `--out PATH` writes all of it as JSON
(also printed on the BENCH_JSON line).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import importlib.util
import json
import statistics
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gerl.algo.advantages import compute_advantages  # noqa: E402
from gerl.config import ModelConfig, RewardConfig, SamplingConfig, TrainConfig, reward_components  # noqa: E402
from gerl.data.prompts import load_prompts  # noqa: E402
from gerl.logging.memory import StagePeaks, module_gib, optimizer_state_gib  # noqa: E402
from gerl.logging.throughput import (  # noqa: E402
    flow_grpo_step_flops, mfu, peak_memory_gib, peak_tflops_for, text_seq_len, vae_decode_flops,
)
from gerl.models.family import family_of  # noqa: E402
from gerl.models.loader import add_lora  # noqa: E402
from gerl.models.sd35_arch import RandomTokenEmbedder, build_component, load_config  # noqa: E402
from gerl.numerics import Fp16GemmEmulation, perturb_fresh_lora, replay_check  # noqa: E402
from gerl.sampling.loop import Embeds, Trajectory, denoise, make_schedule, sde_window  # noqa: E402
from gerl.workers.actor import ActorWorker  # noqa: E402
from gerl.workers.batch import RolloutBatch  # noqa: E402
from gerl.workers.rollout import decode, latent_noise, sample_seed  # noqa: E402

RATIO_BOUND = 1e-3  # max |ratio − 1| before any update that the ratio check accepts in bf16 / fp16
STOCK_BAR = 0.95  # our rollout's images/s over the stock pipeline's that the issue asks for
GRAD_COSINE_BAR = 0.99  # cos(LoRA gradient in bf16/fp16, in fp32) that the gradient check accepts
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # CLIP-L, CLIP-G, T5-XXL


class RandomEmbedder:
    """Stands in for the text encoders: seeded random embeddings of the real shapes, one per distinct prompt, kept
    on the device once drawn — as gerl's TextEmbedder caches each prompt's embeddings, so that no CPU normals are
    drawn (nor copied to the device) inside a timed generation after a prompt's first use."""

    def __init__(self, text_len: int, width: int, pooled: int, device, dtype):
        self.text_len, self.width, self.pooled, self.device, self.dtype = text_len, width, pooled, device, dtype
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _one(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        if text not in self._cache:
            g = torch.Generator().manual_seed(zlib.crc32(text.encode()))
            prompt, pooled = torch.randn(self.text_len, self.width, generator=g), torch.randn(self.pooled, generator=g)
            self._cache[text] = prompt.to(self.device, self.dtype), pooled.to(self.device, self.dtype)
        return self._cache[text]

    def __call__(self, prompts: list[str], with_negative: bool = False) -> Embeds:
        pairs = [self._one(p) for p in prompts]
        emb = Embeds(torch.stack([p for p, _ in pairs]), torch.stack([q for _, q in pairs]))
        if not with_negative:
            return emb
        # classifier-free guidance: the empty prompt's embeddings (the same for every sample) as the negative pair
        neg_p, neg_q = self._one("")
        n = len(prompts)
        return Embeds(emb.prompt, emb.pooled, neg_p.expand(n, -1, -1), neg_q.expand(n, -1))


def sd35_transformer(layers: int | None, device: torch.device, dtype: torch.dtype):
    """SD3.5-M's transformer at its real width (seed 0, random weights) with its first `layers` blocks (None: all
    24); dual attention stays on the kept blocks that have it. On a CPU, built once per process and copied."""
    if device.type == "cpu":
        return copy.deepcopy(_cpu_transformer(layers)).to(dtype)
    return _new_transformer(layers, device).to(dtype)


@functools.lru_cache(maxsize=1)
def _cpu_transformer(layers: int | None):
    # its 384² sin-cos position table alone takes ~10 s on 2 cores: repeated runs in one process (tests) reuse it
    return _new_transformer(layers, torch.device("cpu"))


def _new_transformer(layers: int | None, device: torch.device):
    import diffusers

    cfg = load_config("transformer")
    if layers is not None:
        cfg.update(num_layers=layers, dual_attention_layers=[i for i in cfg["dual_attention_layers"] if i < layers])
    torch.manual_seed(0)
    with torch.device(device):
        return getattr(diffusers, cfg["_class_name"]).from_config(cfg)


def build(args, device: torch.device):
    """(namespace with transformer/vae/scheduler/text encoders, embedder, text_len) for SD3.5-M or the tiny SD3."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    encoders: dict = {}
    dtype = DTYPES[args.dtype]
    if args.tiny:
        from gerl.models.tiny import T5_WIDTH, TOKEN_LENGTH, build_tiny_sd3

        pipe = build_tiny_sd3(0)
        transformer, vae, scheduler = pipe.transformer.to(dtype), pipe.vae, pipe.scheduler
        text_len = 2 * TOKEN_LENGTH  # padded CLIP tokens + T5 tokens, as the tiny pipeline encodes them
        token_lengths = (TOKEN_LENGTH,) * 3
        if args.text_encoders:
            encoders = {name: getattr(pipe, name) for name in TEXT_ENCODERS}
        width = T5_WIDTH
    else:
        # SD3.5-Medium's published configs (assets/configs/sd3.5-medium), random weights
        # initialise on the GPU: 2.5 B parameters initialise slowly on the CPU (and T5-XXL in fp32 is 19 GB)
        transformer = sd35_transformer(args.layers, device, dtype)
        torch.manual_seed(1)
        # an fp16 VAE's decoder overflows to NaN (gerl.workers.rollout.decode): fp32 beside an fp16 transformer
        vae = build_component("vae", device, torch.float32 if dtype == torch.float16 else dtype)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(load_config("scheduler"))
        text_len = text_seq_len(args.t5_tokens)
        token_lengths = (77, 77, args.t5_tokens)
        if args.text_encoders:
            encoders = {name: build_component(name, device, torch.bfloat16) for name in TEXT_ENCODERS}
        width = transformer.config.joint_attention_dim
    for module in (transformer, vae, *encoders.values()):
        module.to(device).requires_grad_(False).eval()
    if encoders:
        embedder = RandomTokenEmbedder(list(encoders.values()), token_lengths, device)
    else:
        embedder = RandomEmbedder(text_len, width, transformer.config.pooled_projection_dim, device, dtype)
    if args.lora_rank > 0:  # 0: no adapter at all (gpu_day's rollout phase measures both)
        add_lora(transformer, args.lora_rank, 2.0 * args.lora_rank, ModelConfig().lora_targets)
    return SimpleNamespace(transformer=transformer, vae=vae, scheduler=scheduler, encoders=encoders), embedder, text_len


def sync(device: torch.device) -> float:
    """Wait for the device's queued work (CUDA runs asynchronously), then read the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def step_prompts(ctx, step: int) -> tuple[list[str], list[dict], torch.Tensor]:
    """The step's prompts (each repeated group_size times), their metadata and group ids (B,)."""
    a = ctx.args
    chosen = [ctx.prompts[(step * a.prompts + i) % len(ctx.prompts)] for i in range(a.prompts)]
    prompts = [p.text for p in chosen for _ in range(a.group_size)]
    metadata = [dict(p.metadata) for p in chosen for _ in range(a.group_size)]
    return prompts, metadata, torch.arange(a.prompts).repeat_interleave(a.group_size)


def step_window(ctx, step: int) -> list[int]:
    s = ctx.sampling
    return sde_window(s.num_steps, s.sde_window_size, tuple(s.sde_window_range),
                      torch.Generator().manual_seed(sample_seed(0, step, -1)))


def micro_batches(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def run_step(step: int, mode: str, ctx) -> dict:
    """One timed Flow-GRPO-Fast step: encode, generate + decode micro-batch by micro-batch (reward futures when
    mode=on), rewards, group advantages, the actor's update."""
    dev, s, peaks = ctx.device, ctx.sampling, ctx.peaks
    prompts, metadata, group_ids = step_prompts(ctx, step)
    window = step_window(ctx, step)
    t: dict[str, float] = {"encode_s": 0.0, "generate_s": 0.0, "decode_s": 0.0}
    trajs, images, embeds, futures = [], [], [], []
    t0 = sync(dev)
    for sl in micro_batches(len(prompts), s.micro_batch_size):
        ta = time.perf_counter()
        with peaks.stage("encode"):
            emb = ctx.embedder(prompts[sl], with_negative=s.guidance_scale > 1.0)
            tb = sync(dev)
        noise, gens = latent_noise([sample_seed(0, step, i) for i in range(sl.start, sl.stop)], ctx.latent_shape)
        with peaks.stage("rollout"):
            traj = denoise(ctx.pipe.transformer, emb, noise.to(dev), ctx.schedule, window, s.sampler, s.noise_level,
                           s.guidance_scale, gens)
            tc = sync(dev)
        with peaks.stage("decode"):
            mb_images = decode(ctx.pipe.vae, traj.final_latents, family_of(ctx.pipe))
            td = sync(dev)
        t["encode_s"] += tb - ta
        t["generate_s"] += tc - tb
        t["decode_s"] += td - tc
        if mode == "on":
            futures.append(ctx.rewards.submit(mb_images, prompts[sl], metadata[sl]))
        trajs.append(traj)
        images += mb_images
        embeds.append(emb)
    t1 = time.perf_counter()
    if mode == "none":
        rewards = torch.randn(len(prompts), generator=torch.Generator().manual_seed(step))
        t["reward_wait_s"] = t["reward_compute_s"] = 0.0
    else:
        res = ctx.rewards.gather(futures) if mode == "on" else ctx.rewards.score_now(images, prompts, metadata, s.micro_batch_size)
        rewards = torch.nan_to_num(res.total, nan=0.0)
        t["reward_wait_s"], t["reward_compute_s"] = res.wait_s, res.compute_s
    t2 = time.perf_counter()
    batch = RolloutBatch(prompts=prompts, metadata=metadata, group_ids=group_ids, embeds=Embeds.cat(embeds),
                         schedule=ctx.schedule, traj=Trajectory.cat(trajs), images=images, policy_version=0,
                         rewards=rewards)
    adv = compute_advantages("group", rewards, group_ids, ctx.train.adv_clip_max)
    with peaks.stage("train"):
        stats = ctx.actor.update(batch, adv, step)
        t3 = sync(dev)
    t.update(train_s=t3 - t2, step_s=t3 - t0, rollout_s=t1 - t0, images=len(prompts),
             trained_steps=stats["trained_steps_per_sample"])
    return t


# ------------------------------------------------------------------ our rollout vs the stock diffusers pipeline

def our_rollout(ctx, embeds: list[Embeds], step: int, images_too: bool = True, pipe=None
                ) -> tuple[list[Trajectory], list]:
    """Our rollout of one step on precomputed per-micro-batch embeddings: `denoise` (SDE window recorded) + `decode`
    (unless not `images_too`), with ctx's pipeline or `pipe` (its transformer and VAE: another copy of the weights,
    e.g. with the speed levers applied)."""
    s, dev, pipe = ctx.sampling, ctx.device, pipe or ctx.pipe
    window = step_window(ctx, step)
    trajs, images = [], []
    with merged_lora(ctx):
        for sl, emb in zip(micro_batches(ctx.images, s.micro_batch_size), embeds):
            noise, gens = latent_noise([sample_seed(0, step, i) for i in range(sl.start, sl.stop)], ctx.latent_shape)
            traj = denoise(pipe.transformer, emb, noise.to(dev), ctx.schedule, window, s.sampler, s.noise_level,
                           s.guidance_scale, gens)
            trajs.append(traj)
            images += decode(pipe.vae, traj.final_latents, family_of(ctx.pipe)) if images_too else []
    return trajs, images


def merged_lora(ctx):
    """With ctx.merge_lora (model.merge_lora): the block runs on the exact merged LoRA (gerl/models/lora_merge.py),
    rollout and training alike, and PEFT's unmerged forward is back after it (the stock pipeline shares the
    transformer); otherwise a block that does nothing."""
    if not getattr(ctx, "merge_lora", False):
        return contextlib.nullcontext()
    from gerl.models.lora_merge import merged_lora as merged

    return merged(ctx.pipe.transformer)


def stock_pipeline(pipe):
    """diffusers' StableDiffusion3Pipeline around our transformer and VAE, text encoders and tokenizers None (it
    takes prompt_embeds directly), with its own scheduler (set_timesteps and step() keep state)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    none = dict.fromkeys(["text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3",
                          "tokenizer_3"])
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    stock = StableDiffusion3Pipeline(transformer=pipe.transformer, vae=pipe.vae, scheduler=scheduler, **none)
    stock.set_progress_bar_config(disable=True)
    return stock


def stock_rollout(ctx, stock, embeds: list[Embeds], step: int) -> list:
    """The stock pipeline on the same embeddings (negative ones too when guided), guidance, steps, resolution,
    micro-batches and per-sample noise generators."""
    images, g = [], ctx.sampling.guidance_scale
    for sl, emb in zip(micro_batches(ctx.images, ctx.sampling.micro_batch_size), embeds):
        # the generators latent_noise seeds for our rollout, fresh: the pipeline draws the same initial noise
        gens = [torch.Generator("cpu").manual_seed(sample_seed(0, step, i)) for i in range(sl.start, sl.stop)]
        negative = ({"negative_prompt_embeds": emb.neg_prompt, "negative_pooled_prompt_embeds": emb.neg_pooled}
                    if g > 1.0 else {})
        images += stock(prompt_embeds=emb.prompt, pooled_prompt_embeds=emb.pooled, guidance_scale=g, **negative,
                        num_inference_steps=ctx.sampling.num_steps, height=ctx.args.resolution,
                        width=ctx.args.resolution, generator=gens, output_type="pil").images
    return images


def step_embeds(ctx, step: int) -> list[Embeds]:
    """Step `step`'s prompt embeddings, one Embeds per rollout micro-batch."""
    prompts, _, _ = step_prompts(ctx, step)
    guided = ctx.sampling.guidance_scale > 1.0
    return [ctx.embedder(prompts[sl], with_negative=guided)
            for sl in micro_batches(ctx.images, ctx.sampling.micro_batch_size)]


def compare_stock(ctx, embeds: list[Embeds], reps: int, warmup: int = 1, stock=None,
                  run_stock=None, ours=None) -> tuple[dict, list[Trajectory]]:
    """Images/s of our rollout and of the stock pipeline on step 0's `embeds`: `warmup` untimed runs of each, then
    `reps` timed repetitions whose order alternates (ours then stock, stock then ours, ...) so that neither side
    always runs on the other's warm caches or clocks; each side's min and median, and every time. Also returns our
    last rollout's trajectories. `stock` and `run_stock(ctx, stock, embeds, step)` default to
    StableDiffusion3Pipeline's (another family's benchmark passes its own: benchmarks/_gpu_day_flux.py); `ours(ctx,
    embeds, step)` defaults to `our_rollout`. The caller keys its warm-ups by everything that changes the kernels
    (adapter, micro-batch, guidance, compile): a cell measured right after another shape runs cold otherwise."""
    stock = stock if stock is not None else stock_pipeline(ctx.pipe)
    run_stock = run_stock or stock_rollout
    run_ours = ours or our_rollout
    times: dict[str, list[float]] = {"ours": [], "stock": []}
    trajs: list[Trajectory] = []

    def one(side: str, timed: bool) -> None:
        nonlocal trajs
        t0 = sync(ctx.device)
        with ctx.peaks.stage("rollout_ours" if side == "ours" else "stock"):
            if side == "ours":
                trajs, images = run_ours(ctx, embeds, 0)
            else:
                images = run_stock(ctx, stock, embeds, 0)
            t1 = sync(ctx.device)
        assert len(images) == ctx.images, (side, len(images), ctx.images)
        if timed:
            times[side].append(t1 - t0)

    for _ in range(warmup):
        one("ours", False)
        one("stock", False)
    for r in range(reps):
        for side in (("ours", "stock") if r % 2 == 0 else ("stock", "ours")):
            one(side, True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"ours_images_per_s": ctx.images / med["ours"], "stock_images_per_s": ctx.images / med["stock"],
            "ratio": med["stock"] / med["ours"], "ours_s": med["ours"], "stock_s": med["stock"],
            "ours_min_s": min(times["ours"]), "stock_min_s": min(times["stock"]),
            "ratio_of_mins": min(times["stock"]) / min(times["ours"]), "ours_times_s": times["ours"],
            "stock_times_s": times["stock"], "reps": reps, "warmup": warmup, "order": "alternating",
            "output_type": "pil"}, trajs


# ------------------------------------------------------------------ ratio check and gradient check

def ratio_check(ctx, embeds: list[Embeds], trajs: list[Trajectory], micro_sizes: tuple[int, ...],
                grad_check: bool) -> dict:
    """gerl.numerics.replay_check of step 0's rollout (`trajs`, from `embeds`): max |ratio − 1| of
    `ActorWorker.update` per training micro-batch, and with `grad_check` its LoRA gradient against an fp32 copy's."""
    prompts, metadata, group_ids = step_prompts(ctx, 0)
    batch = RolloutBatch(prompts=prompts, metadata=metadata, group_ids=group_ids, embeds=Embeds.cat(embeds),
                         schedule=ctx.schedule, traj=Trajectory.cat(trajs), images=[], policy_version=0)
    advantages = torch.randn(ctx.images, generator=torch.Generator().manual_seed(0)) * ctx.args.advantage_scale

    def make_actor(transformer, micro: int, grad_sync, recompute: bool, **train_changes) -> ActorWorker:
        train = dataclasses.replace(ctx.train, micro_batch_size=micro, mini_batch_size=ctx.images,
                                    recompute_old_log_probs=recompute, **train_changes)
        return ActorWorker(transformer, train, ModelConfig(lora=True, lora_rank=ctx.args.lora_rank), ctx.sampling,
                           max_steps=1, images_per_step=ctx.images, seed=0, grad_sync=grad_sync)

    # fp16 with loss scaling: the same update without it is the control, on this rollout and this fp32 reference
    scaled = ctx.args.dtype == "fp16" and ctx.train.fp16_loss_scale > 0
    control = functools.partial(make_actor, fp16_loss_scale=0.0) if scaled else None
    out = replay_check(make_actor, ctx.pipe.transformer, batch, advantages, micro_sizes, grad_check,
                       ctx.peaks.stage, GRAD_COSINE_BAR, control)
    if grad_check:
        out["grad_check"].update(dtype=ctx.args.dtype, advantage_scale=ctx.args.advantage_scale)
    return {"rollout_micro_batch": ctx.sampling.micro_batch_size, "bound": RATIO_BOUND, **out}


# ------------------------------------------------------------------ report

def memory_report(ctx) -> dict:
    """Resident GiB per component and optimizer state, and each stage's peak (None on a CPU device)."""
    modules = {"transformer": ctx.pipe.transformer, "vae": ctx.pipe.vae, **ctx.pipe.encoders}
    weights = {name: module_gib(m) for name, m in modules.items()}
    if ctx.actor is not None:
        weights["lora_in_transformer"] = sum(p.numel() * p.element_size() for p in ctx.actor.params) / 2**30
        weights["optimizer_state"] = optimizer_state_gib(ctx.actor.optimizer)
    return {"weights_gib": weights, "stage_peak_gib": dict(ctx.peaks.peaks),
            "stage_transient_gib": dict(ctx.peaks.transient), **guarded_plan(ctx),
            "run_peak_gib": ctx.peaks.overall if ctx.peaks.cuda else peak_memory_gib(ctx.device),
            "peak_kind": "cuda max_memory_allocated" if ctx.peaks.cuda else "process peak RSS (CPU)"}


def guarded_plan(ctx) -> dict:
    """{"planned_transient_gib": ...}, or {} plus "plan_error" (its last line) when `gerl plan` raises: the plan
    runs on fake tensors through torch internals, and its failure must not lose the measured numbers."""
    try:
        return {"planned_transient_gib": planned_transients(ctx)}
    except Exception as e:  # noqa: BLE001 — any failure of the prediction; the measurement stands without it
        return {"planned_transient_gib": {}, "plan_error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}


# bench stage → `gerl plan`'s phase (its transient: peak − allocated on entry, at the same micro-batch)
PLAN_PHASES = {"encode": "text encoders", "rollout": "denoising forward", "decode": "VAE decode",
               "train": "training fwd+bwd, gradient checkpointing off"}


def planned_transients(ctx) -> dict:
    """`gerl plan`'s prediction of each stage's transient memory for this run's SD3.5-M settings (on CUDA, whole
    model only; {} otherwise), to print beside the measured one. The VAE decode is compared only when the VAE is
    fp32, as gerl's loader keeps it and the plan assumes."""
    a = ctx.args
    if not ctx.peaks.cuda or a.tiny or a.layers is not None:
        return {}
    from gerl.config import load_config
    from gerl.plan import plan_for_config

    micro = ctx.sampling.micro_batch_size
    cfg = load_config(None, [
        "model.path=stabilityai/stable-diffusion-3.5-medium", f"model.dtype={a.dtype}", f"model.resolution={a.resolution}",
        f"model.max_sequence_length={a.t5_tokens}", f"model.lora_rank={a.lora_rank}", f"model.lora_alpha={2 * a.lora_rank}",
        f"sampling.micro_batch_size={micro}", f"train.micro_batch_size={ctx.train.micro_batch_size}",
        f"data.prompts_per_step={a.prompts}", f"data.group_size={a.group_size}",
        f"train.mini_batch_size={ctx.train.mini_batch_size}"])
    phases = {p.name.split(" (")[0]: p.gib for p in plan_for_config(cfg).role("hybrid").phases}
    out = {}
    for stage, phase in PLAN_PHASES.items():
        name = next((n for n in phases if n.startswith(phase)), None)
        if name is None or (stage == "decode" and ctx.pipe.vae.dtype != torch.float32):
            continue
        if stage == "encode" and not ctx.pipe.encoders:
            continue
        out[stage] = phases[name]
    return out


def grad_check_line(g: dict, emulated: bool) -> str:
    scaling = ("" if g["dtype"] != "fp16" else
               f", loss scale {g['loss_scale']:g}" if g["loss_scale"] else ", loss scaling OFF (the control)")
    emulation = ", fp16 GEMMs emulated in fp32 on the CPU (gerl/numerics.py)" if emulated else ""
    verdict = "ok" if g["cosine"] >= g["bar"] else "FAILS"
    return (f"gradient check: LoRA gradient of ActorWorker.update in {g['dtype']}{scaling}{emulation} vs an fp32 "
            f"copy (same weights, batch, advantages x {g['advantage_scale']:.4g}), training micro-batch "
            f"{g['micro_batch']} x {g['trained_steps']} step(s): cosine {g['cosine']:.5f} ({verdict}, bar {g['bar']}), "
            f"exactly-zero entries {g['zero_fraction']:.2%} (fp32 {g['reference_zero_fraction']:.2%}) of "
            f"{g['entries']}, |g|/|g_fp32| {g['norm_ratio']:.4g}, clipfrac {g['clipfrac']:.2f} "
            f"(fp32 {g['reference_clipfrac']:.2f})")


def control_line(g: dict) -> str:
    c = g["control"]
    verdict = "ok" if c["cosine"] >= g["bar"] else "FAILS"
    return (f"gradient check, the control: the same update in fp16 with loss scaling OFF, same rollout and fp32 copy: "
            f"cosine {c['cosine']:.5f} ({verdict}, bar {g['bar']}), exactly-zero entries {c['zero_fraction']:.2%} "
            f"(fp32 {c['reference_zero_fraction']:.2%}), |g|/|g_fp32| {c['norm_ratio']:.4g}")


def stock_line(c: dict) -> str:
    verdict = "ok" if c["ratio"] >= STOCK_BAR else f"BELOW {STOCK_BAR}"
    return (f"rollout vs stock StableDiffusion3Pipeline (output_type={c['output_type']}, same embeddings, "
            f"median of {c['reps']}): ours {c['ours_images_per_s']:.3f} images/s, stock "
            f"{c['stock_images_per_s']:.3f} images/s, ours/stock {c['ratio']:.3f} ({verdict}, bar {STOCK_BAR})")


def ratio_verdict(dev: float, bound: float) -> str:
    # NaN (every loss non-finite: the ratio was never measured) must not read as "within"
    return "within" if dev <= bound else "EXCEEDS" if dev > bound else "NOT MEASURED (NaN) for"


def ratio_lines(r: dict, emulated: bool) -> list[str]:
    lines = [f"ratio check: rollout micro-batch {r['rollout_micro_batch']}, training micro-batch {mb}: "
             f"max |ratio - 1| = {dev:.3e} ({ratio_verdict(dev, r['bound'])} bound {r['bound']:g})"
             for mb, dev in r["max_abs_ratio_minus_1"].items()]
    if "grad_check" in r:
        lines.append(grad_check_line(r["grad_check"], emulated))
        if "control" in r["grad_check"]:
            lines.append(control_line(r["grad_check"]))
    return lines


def memory_lines(m: dict) -> list[str]:
    gib = lambda v: "n/a" if v is None else f"{v:.3g}"  # noqa: E731
    lines = ["memory weights GiB: " + ", ".join(f"{k} {gib(v)}" for k, v in m["weights_gib"].items()),
             "memory stage peaks GiB: " + ", ".join(f"{k} {gib(v)}" for k, v in m["stage_peak_gib"].items())
             + f"; run peak {gib(m['run_peak_gib'])} ({m['peak_kind']})"]
    if m.get("plan_error"):
        lines.append(f"memory plan: `gerl plan` failed ({m['plan_error']}); the measured numbers above stand")
    return lines


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, str | None]:
    """(args with the defaults filled in, the reason they cannot run or None)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--tiny", action="store_true", help="the tiny offline SD3 on CPU (smoke test of the same code path)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per reward mode (0: only the checks)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (kernel selection, OCR model load)")
    ap.add_argument("--with-reward", choices=["none", "off", "on", "both"], default="none")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8; --tiny 2)")
    ap.add_argument("--group-size", type=int, default=None, help="images per prompt (default 8; --tiny 4)")
    ap.add_argument("--resolution", type=int, default=None, help="pixels (default 512; --tiny 64)")
    ap.add_argument("--lora-rank", type=int, default=32, help="LoRA r (alpha = 2r)")
    ap.add_argument("--reward-workers", type=int, default=2, help="OCR reward threads")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    ap.add_argument("--layers", type=int, default=None, help="SD3.5-M's first N of its 24 blocks, real width")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="the transformer's frozen weights (default bf16; --tiny fp32); the LoRA stays fp32")
    ap.add_argument("--no-loss-scale", action="store_true",
                    help="fp16: train.fp16_loss_scale=0, the control whose gradients underflow to zero")
    ap.add_argument("--num-steps", type=int, default=10, help="denoising steps per rollout")
    ap.add_argument("--sde-window", type=int, default=3, help="stochastic (and trained) steps per rollout")
    ap.add_argument("--sde-window-range", type=int, nargs=2, default=[0, 5], metavar=("LO", "HI"),
                    help="the window lies in steps [LO, HI)")
    ap.add_argument("--t5-tokens", type=int, default=None, help="T5 tokens after CLIP's 77 (default 256)")
    ap.add_argument("--text-encoders", action="store_true",
                    help="build CLIP-L, CLIP-G, T5-XXL (random weights, bf16, on the device; tiny ones with --tiny) "
                         "and encode random token ids every micro-batch instead of random embeddings")
    ap.add_argument("--stock", action=argparse.BooleanOptionalAction, default=True,
                    help="compare our rollout with diffusers' StableDiffusion3Pipeline.__call__")
    ap.add_argument("--stock-reps", type=int, default=3, help="timed repetitions of each rollout (after 1 warm-up)")
    ap.add_argument("--ratio-check", action=argparse.BooleanOptionalAction, default=True,
                    help="max |ratio - 1| before any update with training micro-batch 4 and 8")
    ap.add_argument("--grad-check", action=argparse.BooleanOptionalAction, default=None,
                    help="the ratio check's LoRA gradient against an fp32 copy's (default: on unless --dtype fp32)")
    ap.add_argument("--advantage-scale", type=float, default=1.0,
                    help="multiplies the ratio check's random advantages: the loss averages over the mini-batch and "
                         "the trained steps, so 1/96 gives each image the per-element gradient of GeRL's 32 × 3")
    ap.add_argument("--launchers", nargs="*", default=None, metavar="NAME",
                    help="run GPU launchers instead (default all five: 1p_with_reward 3p_a1_r2 3p_a2_r1 3p_hybrid "
                         "8p_hybrid_with_reward) for 2 steps on this one GPU, on ocr-mini; rehearsed with --device cpu "
                         "(benchmarks/bench_gpu_launchers.py)")
    ap.add_argument("--out", type=Path, default=None, help="write the summary as JSON to this file")
    args = ap.parse_args(argv)
    args.prompts = args.prompts or (2 if args.tiny else 8)
    args.group_size = args.group_size or (4 if args.tiny else 8)
    args.resolution = args.resolution or (64 if args.tiny else 512)
    args.dtype = args.dtype or ("fp32" if args.tiny else "bf16")
    args.grad_check = args.grad_check if args.grad_check is not None else args.dtype != "fp32"
    errors = [msg for bad, msg in [
        (args.tiny and args.layers is not None, "--layers is for SD3.5-M, not --tiny"),
        (args.tiny and args.t5_tokens is not None, "--t5-tokens is for SD3.5-M, not --tiny"),
        (args.layers is not None and not 1 <= args.layers <= 24, "--layers must be 1 to 24"),
        (args.no_loss_scale and args.dtype != "fp16", "--no-loss-scale needs --dtype fp16 (only fp16 scales)"),
        (not 0 <= args.sde_window < args.num_steps, "--sde-window must be in [0, --num-steps)"),
        (args.sde_window and not 0 <= args.sde_window_range[0] <= args.sde_window_range[1] - args.sde_window,
         "--sde-window-range LO HI must hold the window: 0 <= LO <= HI - window"),
    ] if bad]
    args.t5_tokens = args.t5_tokens or 256
    return args, "; ".join(errors) or None


def main(argv: list[str] | None = None) -> int:
    args, error = parse_args(argv)
    if error:
        print(f"bench_gpu: {error}", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; run with --tiny (or --device cpu --layers N) on a CPU machine",
              file=sys.stderr)
        return 2
    if args.launchers is not None:
        return launchers(args, device)
    if args.with_reward != "none" and importlib.util.find_spec("rapidocr") is None:
        print(f"bench_gpu: --with-reward {args.with_reward} needs the OCR reward's rapidocr, which is not installed; "
              "install it with `bash scripts/setup.sh --wheelhouse DIR`, or on a GPU machine that already has "
              "CUDA torch carry scripts/gpu_bundles.py's bundles and `. scripts/gpu_env.sh` (or run with "
              "--with-reward none)",
              file=sys.stderr)
        return 2
    emulate = args.emulated = device.type == "cpu" and args.dtype == "fp16"
    if emulate:
        print("bench_gpu: fp16 GEMM emulation ON (CPU): fp16 mm/addmm/bmm/baddbmm and the flash-attention backward "
              "run in fp32 and round each output to fp16 once, as a GPU's fp32-accumulating fp16 GEMM does "
              "(gerl/numerics.py); activations, inter-layer gradients and casts stay real fp16")
    with Fp16GemmEmulation() if emulate else contextlib.nullcontext() as emulation:
        summary = run(args, device)
    summary["fp16_gemm_emulated_calls"] = emulation.calls if emulate else 0
    print("\n".join(memory_lines(summary["memory"])))
    print(f"peak memory {summary['peak_mem_gib']:.1f} GiB; total wall {summary['wall_s']:.0f} s")
    print("BENCH_JSON " + json.dumps(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def launchers(args, device: torch.device) -> int:
    """--launchers: each named launcher for 2 steps on this GPU (or rehearsed on CPU); exit 1 if any check fails."""
    import importlib.util as iu
    import tempfile

    spec = iu.spec_from_file_location("bench_gpu_launchers", REPO / "benchmarks" / "bench_gpu_launchers.py")
    bl = iu.module_from_spec(spec)
    spec.loader.exec_module(bl)

    names = args.launchers or list(bl.LAUNCHERS)
    unknown = [n for n in names if n not in bl.LAUNCHERS]
    if unknown:
        print(f"bench_gpu: unknown launcher {unknown[0]!r}; choose from {', '.join(bl.LAUNCHERS)}", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    where = (f"on {torch.cuda.get_device_name(device)}, shares of one GPU" if cuda
             else "rehearsed on CPU (engine.rehearse=true)")
    print(f"launchers {', '.join(names)}: 2 steps each on ocr-mini at 64 px, {where}")
    with tempfile.TemporaryDirectory(prefix="bench_launchers_") as tmp:
        rows = bl.run_all(names, Path(tmp), cuda)
    summary = {"launchers": rows, "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    print("BENCH_JSON " + json.dumps(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if all(r.get("ok") for r in rows) else 1


def make_ctx(args, device: torch.device, sampling_changes: dict | None = None):
    """Build the model (bench_gpu.build) and everything a step needs: the namespace run_step, compare_stock and
    ratio_check read (gpu_day's phases build theirs with it too). `sampling_changes` override the sampling config
    (e.g. guidance_scale). With --lora-rank 0 there is no adapter and no actor."""
    images = args.prompts * args.group_size
    micro = min(8, images)
    pipe, embedder, text_len = build(args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # building T5-XXL peaks at its fp32 size; not a step's memory
    sampling = SamplingConfig(sampler="cps", num_steps=args.num_steps, noise_level=0.8, sde_window_size=args.sde_window,
                              sde_window_range=list(args.sde_window_range), micro_batch_size=micro, guidance_scale=1.0)
    sampling = dataclasses.replace(sampling, **(sampling_changes or {}))
    train = TrainConfig(learning_rate=1e-4, mini_batch_size=min(32, images), micro_batch_size=micro, clip_range=1e-4,
                        fp16_loss_scale=0.0 if args.no_loss_scale else TrainConfig.fp16_loss_scale)
    actor = (ActorWorker(pipe.transformer, train, ModelConfig(lora=True, lora_rank=args.lora_rank), sampling,
                         max_steps=1000, images_per_step=images, seed=0) if args.lora_rank > 0 else None)
    vae_factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    rewards = None
    if args.with_reward != "none":
        from gerl.workers.reward import RewardSet
        from rewards.registry import build_reward

        comps = reward_components(RewardConfig(name="ocr", workers=args.reward_workers))
        rewards = RewardSet(comps, [build_reward(c.name, c.kwargs) for c in comps], 120.0, 0, 0.5)
    return SimpleNamespace(args=args, device=device, pipe=pipe, embedder=embedder, sampling=sampling, train=train,
                           actor=actor, rewards=rewards, schedule=make_schedule(pipe.scheduler.config, sampling.num_steps),
                           latent_shape=(pipe.transformer.config.in_channels, args.resolution // vae_factor,
                                         args.resolution // vae_factor), text_len=text_len, vae_factor=vae_factor,
                           prompts=load_prompts(REPO / "assets/ocr/train.txt"), images=images, peaks=StagePeaks(device))


def run(args, device: torch.device) -> dict:
    """Build, the timed steps, the stock comparison, the ratio check, memory: the summary. Each part is printed as
    soon as it is measured and, with --out, the summary so far is written after each, so that a later failure
    (the last part runs `gerl plan`, which leans on torch internals; it is also guarded) loses nothing before it."""
    ctx = make_ctx(args, device)
    pipe, sampling, train, images, micro = ctx.pipe, ctx.sampling, ctx.train, ctx.images, ctx.sampling.micro_batch_size
    modes = ["off", "on"] if args.with_reward == "both" else [args.with_reward]
    t_start = time.perf_counter()
    for w in range(args.warmup):
        run_step(-1 - w, modes[0], ctx)
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    for i in range(args.steps * len(modes)):
        mode = modes[i % len(modes)]
        rows[mode].append(run_step(i, mode, ctx))
    if ctx.rewards is not None:
        ctx.rewards.close()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops_for(name, args.dtype)
    trained = rows[modes[0]][0]["trained_steps"] if args.steps else len(step_window(ctx, 0))
    from gerl.logging.flops import Lora
    from gerl.models.family import families

    sd3 = families()["sd3"]  # the LoRA as attached above: the family's default targets at --lora-rank
    flops = flow_grpo_step_flops(dict(pipe.transformer.config), resolution=args.resolution, text_len=ctx.text_len,
                                 images=images, num_steps=sampling.num_steps, guidance_scale=sampling.guidance_scale,
                                 trained_steps=trained, inner_epochs=train.inner_epochs, vae_scale_factor=ctx.vae_factor,
                                 lora=Lora(sd3.lora_targets, args.lora_rank) if args.lora_rank else None,
                                 merged_rollout=getattr(ctx, "merge_lora", False),
                                 decode_flops_per_image=vae_decode_flops(pipe.vae, sd3, ctx.latent_shape))
    model = "tiny SD3" if args.tiny else "SD3.5-M architecture (random weights)"
    if args.layers is not None:
        model += f", {args.layers} of 24 blocks"
    print(f"{model} in {args.dtype} on {name}: {args.prompts}×{args.group_size} images at {args.resolution}px, "
          f"micro-batch {micro}, {sampling.num_steps} steps, CPS window {sampling.sde_window_size} in "
          f"{sampling.sde_window_range}, LoRA r{args.lora_rank}, {ctx.text_len} text tokens, "
          f"{'text encoders on random token ids' if args.text_encoders else 'random embeddings'}; "
          f"{args.steps} timed step(s) per mode after {args.warmup} warm-up; medians")
    print(f"transformer FLOPs per step: rollout {flops['rollout'] / 1e12:.4g} T, train {flops['train'] / 1e12:.4g} T; "
          f"device peak {peak:g} TFLOP/s", flush=True)
    summary = {"device": name, "dtype": args.dtype, "layers": pipe.transformer.config.num_layers,
               "images_per_step": images, "resolution": args.resolution, "text_len": ctx.text_len, "peak_tflops": peak,
               "text_encoders": args.text_encoders, "step_tflop": flops["total"] / 1e12,
               "fp16_gemm_emulation": getattr(args, "emulated", False),
               "modes": step_table(rows, flops, peak, images) if args.steps else {}}
    save_partial(args, summary)

    if args.ratio_check and args.grad_check and perturb_fresh_lora(pipe.transformer):
        print("gradient check: the fresh adapter's lora_B drawn from N(0, 1e-3²), seed 0 (at B = 0, grad A = 0)")
    embeds = step_embeds(ctx, 0) if args.stock or args.ratio_check else None
    trajs = None
    if args.stock:
        summary["stock"], trajs = compare_stock(ctx, embeds, args.stock_reps)
        print(stock_line(summary["stock"]), flush=True)
        save_partial(args, summary)
    if args.ratio_check:
        trajs = trajs or our_rollout(ctx, embeds, 0, images_too=False)[0]
        summary["ratio_check"] = ratio_check(ctx, embeds, trajs, tuple(sorted({min(4, micro), micro})), args.grad_check)
        print("\n".join(ratio_lines(summary["ratio_check"], summary["fp16_gemm_emulation"])), flush=True)
        save_partial(args, summary)
    summary["memory"] = memory_report(ctx)
    summary["peak_mem_gib"] = summary["memory"]["run_peak_gib"]
    summary["wall_s"] = time.perf_counter() - t_start  # after building
    return summary


def save_partial(args, summary: dict) -> None:
    """With --out: the summary measured so far (a later exception then loses nothing already measured)."""
    if args.out is not None:
        args.out.write_text(json.dumps({**summary, "partial": True}, indent=1) + "\n")


def step_table(rows: dict[str, list[dict]], flops: dict, peak: float, images: int) -> dict:
    """Print the timed steps' medians per reward mode (and MFU); return them."""
    keys = ["step_s", "encode_s", "generate_s", "decode_s", "reward_wait_s", "reward_compute_s", "train_s"]
    print(f"{'reward':<8}" + "".join(f"{k:>17}" for k in keys) + f"{'images/s/GPU':>14}{'MFU':>7}{'gen MFU':>9}{'train MFU':>10}")
    fmt = lambda v: "n/a" if v is None else f"{v:.1%}"  # noqa: E731
    out = {}
    for mode, mode_rows in rows.items():
        med = {k: statistics.median(r[k] for r in mode_rows) for k in keys}
        ips = images / med["step_s"]
        m_all = mfu(flops["total"], med["step_s"], 1, peak)
        m_gen = mfu(flops["rollout"], med["generate_s"], 1, peak)
        m_train = mfu(flops["train"], med["train_s"], 1, peak)
        print(f"{mode:<8}" + "".join(f"{med[k]:>17.3f}" for k in keys) + f"{ips:>14.3f}{fmt(m_all):>7}{fmt(m_gen):>9}{fmt(m_train):>10}")
        out[mode] = {**med, "images_per_s_per_gpu": ips, "mfu": m_all, "generate_mfu": m_gen, "train_mfu": m_train}
    if len(out) == 2:
        print(f"with_reward on/off step time: {out['on']['step_s'] / out['off']['step_s']:.2f}x")
    return out


if __name__ == "__main__":
    sys.exit(main())
