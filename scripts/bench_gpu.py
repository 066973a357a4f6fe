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
  max |ratio − 1|, flagged above 1e-3.
- memory: weights per component (parameters + buffers), optimizer state, and the peak allocated memory of each
  stage (encode, rollout, decode, train; rollout_ours and stock of the comparison; ratio_check), GiB of
  torch.cuda.max_memory_allocated, reset on entering each stage (n/a on a CPU, which reports its peak RSS).

The issue's run, one H100 (everything above, OCR reward off vs on, the text encoders resident):

    python scripts/bench_gpu.py --with-reward both --text-encoders --out bench_gpu.json

Estimated runtime on one H100 (an estimate reasoned from FLOPs, not a measurement): an SD3.5-M forward at 512 px
with 333 text tokens is ≈ 2.45 TFLOP per image, so a step is 64 × 10 rollout forwards (1.6 PFLOP) + 64 × 3 trained
steps × 3 (forward + backward: 1.4 PFLOP) ≈ 3.0 PFLOP, ≈ 8 s at 40 % of 989 TFLOP/s; VAE decoding (≈ 2 TFLOP per
512 px image: 0.12 PFLOP) and the text encoders (T5-XXL: 2 × 4.7 G × 64 × 256 tokens ≈ 0.15 PFLOP) add ≈ 1 s.
OCR adds ≈ 5–10 s of CPU per step when off (mostly hidden when on). 7 steps (1 warm-up + 3 per mode) ≈ 1.5–2 min;
the stock comparison (1 warm-up + 3 reps of both rollouts, 64 images, ≈ 4 s each) ≈ 0.5 min; the ratio check (two
replays of 64 × 3 steps with backward) ≈ 0.3 min; building on the GPU, imports, the OCR model ≈ 1 min.
Total ≈ 3.5–4 min; allow 6.

    python scripts/bench_gpu.py                         # pure GPU (random rewards), random embeddings
    python scripts/bench_gpu.py --tiny --with-reward both --text-encoders --steps 1   # same code path, CPU, < 60 s

--with-reward: none = random rewards (GPU work only); off = OCR after the whole batch is generated; on = each
decoded micro-batch's OCR submitted as a future while generation goes on; both = off and on, alternating steps.
Prints images/s/GPU, stage seconds (medians over the timed steps), MFU from gerl.logging.throughput, peak memory,
then the stock comparison, the ratio check and the memory attribution; `--out PATH` writes all of it as JSON
(also printed on the BENCH_JSON line).
"""

from __future__ import annotations

import argparse
import dataclasses
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
    flow_grpo_step_flops, mfu, peak_memory_gib, peak_tflops_for, text_seq_len,
)
from gerl.models.loader import add_lora  # noqa: E402
from gerl.models.sd35_arch import RandomTokenEmbedder, build_component, load_config  # noqa: E402
from gerl.sampling.loop import Embeds, Trajectory, denoise, make_schedule, sde_window  # noqa: E402
from gerl.workers.actor import ActorWorker  # noqa: E402
from gerl.workers.batch import RolloutBatch  # noqa: E402
from gerl.workers.rollout import decode, latent_noise, sample_seed  # noqa: E402

RATIO_BOUND = 1e-3  # max |ratio − 1| before any update that the ratio check accepts in bf16
STOCK_BAR = 0.95  # our rollout's images/s over the stock pipeline's that the issue asks for
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # CLIP-L, CLIP-G, T5-XXL


class RandomEmbedder:
    """Stands in for the text encoders: seeded random embeddings of the real shapes, one per distinct prompt."""

    def __init__(self, text_len: int, width: int, pooled: int, device, dtype):
        self.text_len, self.width, self.pooled, self.device, self.dtype = text_len, width, pooled, device, dtype

    def __call__(self, prompts: list[str], with_negative: bool = False) -> Embeds:
        def one(i: int):
            g = torch.Generator().manual_seed(zlib.crc32(prompts[i].encode()))
            return torch.randn(self.text_len, self.width, generator=g), torch.randn(self.pooled, generator=g)

        pairs = [one(i) for i in range(len(prompts))]
        to = lambda t: t.to(self.device, self.dtype)  # noqa: E731
        return Embeds(to(torch.stack([p for p, _ in pairs])), to(torch.stack([q for _, q in pairs])))


def build(args, device: torch.device):
    """(namespace with transformer/vae/scheduler/text encoders, embedder, text_len) for SD3.5-M or the tiny SD3."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    encoders: dict = {}
    if args.tiny:
        from gerl.models.tiny import T5_WIDTH, TOKEN_LENGTH, build_tiny_sd3

        pipe = build_tiny_sd3(0)
        transformer, vae, scheduler = pipe.transformer, pipe.vae, pipe.scheduler
        text_len = 2 * TOKEN_LENGTH  # padded CLIP tokens + T5 tokens, as the tiny pipeline encodes them
        dtype = torch.float32
        token_lengths = (TOKEN_LENGTH,) * 3
        if args.text_encoders:
            encoders = {name: getattr(pipe, name) for name in TEXT_ENCODERS}
        width = T5_WIDTH
    else:
        # SD3.5-Medium's published configs (assets/configs/sd3.5-medium), random weights
        dtype = torch.bfloat16
        torch.manual_seed(0)
        # initialise on the GPU: 2.5 B parameters initialise slowly on the CPU (and T5-XXL in fp32 is 19 GB)
        transformer = build_component("transformer", device, dtype)
        vae = build_component("vae", device, dtype)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(load_config("scheduler"))
        text_len = text_seq_len(256)
        token_lengths = (77, 77, 256)
        if args.text_encoders:
            encoders = {name: build_component(name, device, dtype) for name in TEXT_ENCODERS}
        width = transformer.config.joint_attention_dim
    for module in (transformer, vae, *encoders.values()):
        module.to(device).requires_grad_(False).eval()
    if encoders:
        embedder = RandomTokenEmbedder(list(encoders.values()), token_lengths, device)
    else:
        embedder = RandomEmbedder(text_len, width, transformer.config.pooled_projection_dim, device, dtype)
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
            emb = ctx.embedder(prompts[sl])
            tb = sync(dev)
        noise, gens = latent_noise([sample_seed(0, step, i) for i in range(sl.start, sl.stop)], ctx.latent_shape)
        with peaks.stage("rollout"):
            traj = denoise(ctx.pipe.transformer, emb, noise.to(dev), ctx.schedule, window, s.sampler, s.noise_level,
                           s.guidance_scale, gens)
            tc = sync(dev)
        with peaks.stage("decode"):
            mb_images = decode(ctx.pipe.vae, traj.final_latents)
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

def our_rollout(ctx, embeds: list[Embeds], step: int) -> tuple[list[Trajectory], list]:
    """Our rollout of one step on precomputed per-micro-batch embeddings: `denoise` (SDE window recorded) + `decode`."""
    s, dev = ctx.sampling, ctx.device
    window = step_window(ctx, step)
    trajs, images = [], []
    for sl, emb in zip(micro_batches(ctx.images, s.micro_batch_size), embeds):
        noise, gens = latent_noise([sample_seed(0, step, i) for i in range(sl.start, sl.stop)], ctx.latent_shape)
        traj = denoise(ctx.pipe.transformer, emb, noise.to(dev), ctx.schedule, window, s.sampler, s.noise_level,
                       s.guidance_scale, gens)
        trajs.append(traj)
        images += decode(ctx.pipe.vae, traj.final_latents)
    return trajs, images


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
    """The stock pipeline on the same embeddings, steps, resolution, micro-batches and per-sample noise generators."""
    images = []
    for sl, emb in zip(micro_batches(ctx.images, ctx.sampling.micro_batch_size), embeds):
        # the generators latent_noise seeds for our rollout, fresh: the pipeline draws the same initial noise
        gens = [torch.Generator("cpu").manual_seed(sample_seed(0, step, i)) for i in range(sl.start, sl.stop)]
        images += stock(prompt_embeds=emb.prompt, pooled_prompt_embeds=emb.pooled, guidance_scale=1.0,
                        num_inference_steps=ctx.sampling.num_steps, height=ctx.args.resolution,
                        width=ctx.args.resolution, generator=gens, output_type="pil").images
    return images


def step_embeds(ctx, step: int) -> list[Embeds]:
    """Step `step`'s prompt embeddings, one Embeds per rollout micro-batch."""
    prompts, _, _ = step_prompts(ctx, step)
    return [ctx.embedder(prompts[sl]) for sl in micro_batches(ctx.images, ctx.sampling.micro_batch_size)]


def compare_stock(ctx, embeds: list[Embeds], reps: int, warmup: int = 1) -> tuple[dict, list[Trajectory]]:
    """Images/s of our rollout and of the stock pipeline on step 0's `embeds`, alternating (ours then stock) over
    warm-up + `reps` repetitions; medians of the timed ones. Also returns our last rollout's trajectories."""
    stock = stock_pipeline(ctx.pipe)
    ours_s, stock_s = [], []
    for r in range(warmup + reps):
        t0 = sync(ctx.device)
        with ctx.peaks.stage("rollout_ours"):
            trajs, images = our_rollout(ctx, embeds, 0)
            t1 = sync(ctx.device)
        with ctx.peaks.stage("stock"):
            stock_images = stock_rollout(ctx, stock, embeds, 0)
            t2 = sync(ctx.device)
        assert len(images) == len(stock_images) == ctx.images
        if r >= warmup:
            ours_s.append(t1 - t0)
            stock_s.append(t2 - t1)
    ours = ctx.images / statistics.median(ours_s)
    theirs = ctx.images / statistics.median(stock_s)
    return {"ours_images_per_s": ours, "stock_images_per_s": theirs, "ratio": ours / theirs,
            "ours_s": statistics.median(ours_s), "stock_s": statistics.median(stock_s), "reps": reps,
            "output_type": "pil"}, trajs


# ------------------------------------------------------------------ bf16 ratio check

def ratio_check(ctx, embeds: list[Embeds], trajs: list[Trajectory], micro_sizes: tuple[int, ...]) -> dict[int, float]:
    """{training micro-batch: max |ratio − 1|} of `ActorWorker.update` replaying the recorded SDE window of step 0's
    rollout (`trajs`, from `embeds`) at the rollout's weights. Mini-batch = the whole batch, so every replay happens
    before the one optimizer step; the trained weights are restored after each size."""
    prompts, metadata, group_ids = step_prompts(ctx, 0)
    batch = RolloutBatch(prompts=prompts, metadata=metadata, group_ids=group_ids, embeds=Embeds.cat(embeds),
                         schedule=ctx.schedule, traj=Trajectory.cat(trajs), images=[], policy_version=0)
    advantages = torch.randn(ctx.images, generator=torch.Generator().manual_seed(0))
    state = ctx.actor.trainable_state()
    out = {}
    for mb in micro_sizes:
        train = dataclasses.replace(ctx.train, micro_batch_size=mb, mini_batch_size=ctx.images,
                                    recompute_old_log_probs=False)
        probe = ActorWorker(ctx.pipe.transformer, train, ModelConfig(lora=True, lora_rank=ctx.args.lora_rank),
                            ctx.sampling, max_steps=1, images_per_step=ctx.images, seed=0)
        with ctx.peaks.stage("ratio_check"):
            out[mb] = probe.update(batch, advantages, 0)["ratio_max_dev_before_update"]
        ctx.actor.load_trainable_state(state)
    return out


# ------------------------------------------------------------------ report

def memory_report(ctx) -> dict:
    """Resident GiB per component and optimizer state, and each stage's peak (None on a CPU device)."""
    modules = {"transformer": ctx.pipe.transformer, "vae": ctx.pipe.vae, **ctx.pipe.encoders}
    weights = {name: module_gib(m) for name, m in modules.items()}
    weights["lora_in_transformer"] = sum(p.numel() * p.element_size() for p in ctx.actor.params) / 2**30
    weights["optimizer_state"] = optimizer_state_gib(ctx.actor.optimizer)
    return {"weights_gib": weights, "stage_peak_gib": dict(ctx.peaks.peaks),
            "run_peak_gib": ctx.peaks.overall if ctx.peaks.cuda else peak_memory_gib(ctx.device),
            "peak_kind": "cuda max_memory_allocated" if ctx.peaks.cuda else "process peak RSS (CPU)"}


def print_extras(summary: dict) -> None:
    gib = lambda v: "n/a" if v is None else f"{v:.3g}"  # noqa: E731
    if "stock" in summary:
        c = summary["stock"]
        verdict = "ok" if c["ratio"] >= STOCK_BAR else f"BELOW {STOCK_BAR}"
        print(f"rollout vs stock StableDiffusion3Pipeline (output_type={c['output_type']}, same embeddings, "
              f"median of {c['reps']}): ours {c['ours_images_per_s']:.3f} images/s, stock "
              f"{c['stock_images_per_s']:.3f} images/s, ours/stock {c['ratio']:.3f} ({verdict}, bar {STOCK_BAR})")
    if "ratio_check" in summary:
        r = summary["ratio_check"]
        for mb, dev in r["max_abs_ratio_minus_1"].items():
            flag = "EXCEEDS" if dev > r["bound"] else "within"
            print(f"ratio check: rollout micro-batch {r['rollout_micro_batch']}, training micro-batch {mb}: "
                  f"max |ratio - 1| = {dev:.3e} ({flag} bound {r['bound']:g})")
    m = summary["memory"]
    print("memory weights GiB: " + ", ".join(f"{k} {gib(v)}" for k, v in m["weights_gib"].items()))
    print("memory stage peaks GiB: " + ", ".join(f"{k} {gib(v)}" for k, v in m["stage_peak_gib"].items())
          + f"; run peak {gib(m['run_peak_gib'])} ({m['peak_kind']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny offline SD3 on CPU (smoke test of the same code path)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per reward mode")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (kernel selection, OCR model load)")
    ap.add_argument("--with-reward", choices=["none", "off", "on", "both"], default="none")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8; --tiny 2)")
    ap.add_argument("--group-size", type=int, default=None, help="images per prompt (default 8; --tiny 4)")
    ap.add_argument("--resolution", type=int, default=None, help="pixels (default 512; --tiny 64)")
    ap.add_argument("--lora-rank", type=int, default=32, help="LoRA r (alpha = 2r)")
    ap.add_argument("--reward-workers", type=int, default=2, help="OCR reward threads")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    ap.add_argument("--text-encoders", action="store_true",
                    help="build CLIP-L, CLIP-G, T5-XXL (random weights, bf16, on the device; tiny ones with --tiny) "
                         "and encode random token ids every micro-batch instead of random embeddings")
    ap.add_argument("--stock", action=argparse.BooleanOptionalAction, default=True,
                    help="compare our rollout with diffusers' StableDiffusion3Pipeline.__call__")
    ap.add_argument("--stock-reps", type=int, default=3, help="timed repetitions of each rollout (after 1 warm-up)")
    ap.add_argument("--ratio-check", action=argparse.BooleanOptionalAction, default=True,
                    help="max |ratio - 1| before any update with training micro-batch 4 and 8")
    ap.add_argument("--out", type=Path, default=None, help="write the summary as JSON to this file")
    args = ap.parse_args(argv)
    args.prompts = args.prompts or (2 if args.tiny else 8)
    args.group_size = args.group_size or (4 if args.tiny else 8)
    args.resolution = args.resolution or (64 if args.tiny else 512)
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; run with --tiny on a CPU machine", file=sys.stderr)
        return 2
    if args.with_reward != "none" and importlib.util.find_spec("rapidocr") is None:
        print(f"bench_gpu: --with-reward {args.with_reward} needs the OCR reward's rapidocr, which is not installed; "
              "install it with `bash scripts/setup.sh --wheelhouse DIR` (or run with --with-reward none)",
              file=sys.stderr)
        return 2
    images = args.prompts * args.group_size
    micro = min(8, images)
    pipe, embedder, text_len = build(args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # building T5-XXL peaks at its fp32 size; not a step's memory
    sampling = SamplingConfig(sampler="cps", num_steps=10, noise_level=0.8, sde_window_size=3, sde_window_range=[0, 5],
                              micro_batch_size=micro, guidance_scale=1.0)
    train = TrainConfig(learning_rate=1e-4, mini_batch_size=min(32, images), micro_batch_size=micro, clip_range=1e-4)
    actor = ActorWorker(pipe.transformer, train, ModelConfig(lora=True, lora_rank=args.lora_rank), sampling,
                        max_steps=1000, images_per_step=images, seed=0)
    vae_factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    rewards = None
    if args.with_reward != "none":
        from gerl.workers.reward import RewardSet
        from rewards.registry import build_reward

        comps = reward_components(RewardConfig(name="ocr", workers=args.reward_workers))
        rewards = RewardSet(comps, [build_reward(c.name, c.kwargs) for c in comps], 120.0, 0, 0.5)
    ctx = SimpleNamespace(args=args, device=device, pipe=pipe, embedder=embedder, sampling=sampling, train=train,
                          actor=actor, rewards=rewards, schedule=make_schedule(pipe.scheduler.config, sampling.num_steps),
                          latent_shape=(pipe.transformer.config.in_channels, args.resolution // vae_factor,
                                        args.resolution // vae_factor),
                          prompts=load_prompts(REPO / "assets/ocr/train.txt"), images=images, peaks=StagePeaks(device))
    modes = ["off", "on"] if args.with_reward == "both" else [args.with_reward]
    t_start = time.perf_counter()
    for w in range(args.warmup):
        run_step(-1 - w, modes[0], ctx)
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    for i in range(args.steps * len(modes)):
        mode = modes[i % len(modes)]
        rows[mode].append(run_step(i, mode, ctx))
    if rewards is not None:
        rewards.close()
    extras: dict = {}
    embeds = step_embeds(ctx, 0) if args.stock or args.ratio_check else None
    trajs = None
    if args.stock:
        extras["stock"], trajs = compare_stock(ctx, embeds, args.stock_reps)
    if args.ratio_check:
        trajs = trajs or our_rollout(ctx, embeds, 0)[0]
        sizes = tuple(sorted({min(4, micro), micro}))
        extras["ratio_check"] = {"rollout_micro_batch": micro, "bound": RATIO_BOUND,
                                 "max_abs_ratio_minus_1": ratio_check(ctx, embeds, trajs, sizes)}

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops_for(name, "fp32" if args.tiny else "bf16")
    flops = flow_grpo_step_flops(dict(pipe.transformer.config), resolution=args.resolution, text_len=text_len,
                                 images=images, num_steps=sampling.num_steps, guidance_scale=sampling.guidance_scale,
                                 trained_steps=rows[modes[0]][0]["trained_steps"], inner_epochs=train.inner_epochs,
                                 vae_scale_factor=vae_factor)
    print(f"{'tiny SD3' if args.tiny else 'SD3.5-M architecture (random weights)'} on {name}: {args.prompts}×"
          f"{args.group_size} images at {args.resolution}px, micro-batch {micro}, {sampling.num_steps} steps, "
          f"CPS window {sampling.sde_window_size} in {sampling.sde_window_range}, LoRA r{args.lora_rank}, "
          f"{'text encoders on random token ids' if args.text_encoders else 'random embeddings'}; "
          f"{args.steps} timed step(s) per mode after {args.warmup} warm-up; medians")
    print(f"transformer FLOPs per step: rollout {flops['rollout'] / 1e12:.4g} T, train {flops['train'] / 1e12:.4g} T; "
          f"device peak {peak:g} TFLOP/s")
    keys = ["step_s", "encode_s", "generate_s", "decode_s", "reward_wait_s", "reward_compute_s", "train_s"]
    print(f"{'reward':<8}" + "".join(f"{k:>17}" for k in keys) + f"{'images/s/GPU':>14}{'MFU':>7}{'gen MFU':>9}{'train MFU':>10}")
    summary = {"device": name, "images_per_step": images, "resolution": args.resolution, "peak_tflops": peak,
               "text_encoders": args.text_encoders, "step_tflop": flops["total"] / 1e12, "modes": {}}
    fmt = lambda v: "n/a" if v is None else f"{v:.1%}"  # noqa: E731
    for mode in modes:
        med = {k: statistics.median(r[k] for r in rows[mode]) for k in keys}
        ips = images / med["step_s"]
        m_all = mfu(flops["total"], med["step_s"], 1, peak)
        m_gen = mfu(flops["rollout"], med["generate_s"], 1, peak)
        m_train = mfu(flops["train"], med["train_s"], 1, peak)
        print(f"{mode:<8}" + "".join(f"{med[k]:>17.3f}" for k in keys) + f"{ips:>14.3f}{fmt(m_all):>7}{fmt(m_gen):>9}{fmt(m_train):>10}")
        summary["modes"][mode] = {**med, "images_per_s_per_gpu": ips, "mfu": m_all, "generate_mfu": m_gen, "train_mfu": m_train}
    if len(modes) == 2:
        print(f"with_reward on/off step time: {summary['modes']['on']['step_s'] / summary['modes']['off']['step_s']:.2f}x")
    summary.update(extras, memory=memory_report(ctx))
    summary["peak_mem_gib"] = summary["memory"]["run_peak_gib"]
    print_extras(summary)
    print(f"peak memory {summary['peak_mem_gib']:.1f} GiB; total wall {time.perf_counter() - t_start:.0f} s")
    print("BENCH_JSON " + json.dumps(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
