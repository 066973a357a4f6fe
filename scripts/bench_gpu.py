"""Flow-GRPO-Fast throughput of SD3.5-Medium's architecture (random weights, nothing downloaded) on one GPU.

GeRL's recipe batch shape: 8 prompts × 8 images at 512 px, rollout micro-batch 8, 10 denoising steps with a CPS
window of 3 steps in [0, 5], LoRA r32/α64, training mini-batch 32 / micro-batch 8, bf16 weights with fp32 SDE
math. Text encoders are skipped: prompt embeddings are random tensors of the real shapes, (B, 77 + 256, 4096) and
pooled (B, 2048). The step is the project's own machinery — `denoise` (recording the SDE window), `decode`,
rewards through `RewardSet`, group advantages, `ActorWorker.update` — timed stage by stage with CUDA syncs.

    python scripts/bench_gpu.py                         # one H100: ~2–4 min; pure GPU (random rewards)
    python scripts/bench_gpu.py --with-reward both      # + OCR reward (rapidocr, CPU threads): off vs on
    python scripts/bench_gpu.py --tiny --steps 1        # the same code path on CPU with the tiny model (< 60 s)

--with-reward: none = random rewards (GPU work only); off = OCR after the whole batch is generated; on = each
decoded micro-batch's OCR submitted as a future while generation goes on; both = off and on, alternating steps.
Prints images/s/GPU, stage seconds (medians over the timed steps), MFU from gerl.logging.throughput, peak memory.
"""

from __future__ import annotations

import argparse
import zlib
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gerl.algo.advantages import compute_advantages  # noqa: E402
from gerl.config import ModelConfig, RewardConfig, SamplingConfig, TrainConfig, reward_components  # noqa: E402
from gerl.data.prompts import load_prompts  # noqa: E402
from gerl.logging.throughput import (  # noqa: E402
    flow_grpo_step_flops, mfu, peak_memory_gib, peak_tflops_for, text_seq_len,
)
from gerl.models.loader import add_lora  # noqa: E402
from gerl.models.sd35_arch import build_component, load_config  # noqa: E402
from gerl.sampling.loop import Embeds, Trajectory, denoise, make_schedule, sde_window  # noqa: E402
from gerl.workers.actor import ActorWorker  # noqa: E402
from gerl.workers.batch import RolloutBatch  # noqa: E402
from gerl.workers.rollout import decode, latent_noise, sample_seed  # noqa: E402


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
    """(pipe-like namespace with transformer/vae/scheduler, embedder, text_len) for SD3.5-M or the tiny SD3."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if args.tiny:
        from gerl.models.tiny import T5_WIDTH, TOKEN_LENGTH, build_tiny_sd3

        pipe = build_tiny_sd3(0)
        transformer, vae, scheduler = pipe.transformer, pipe.vae, pipe.scheduler
        text_len = 2 * TOKEN_LENGTH  # padded CLIP tokens + T5 tokens, as the tiny pipeline encodes them
        dtype = torch.float32
        embedder = RandomEmbedder(text_len, T5_WIDTH, transformer.config.pooled_projection_dim, device, dtype)
    else:
        # SD3.5-Medium's published configs (assets/configs/sd3.5-medium), random weights
        dtype = torch.bfloat16
        torch.manual_seed(0)
        # initialise on the GPU: 2.5 B parameters initialise slowly on the CPU
        transformer = build_component("transformer", device, dtype)
        vae = build_component("vae", device, dtype)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(load_config("scheduler"))
        text_len = text_seq_len(256)
        cfg = transformer.config
        embedder = RandomEmbedder(text_len, cfg.joint_attention_dim, cfg.pooled_projection_dim, device, dtype)
    transformer.to(device).requires_grad_(False).eval()
    vae.to(device).requires_grad_(False).eval()
    add_lora(transformer, args.lora_rank, 2.0 * args.lora_rank, ModelConfig().lora_targets)
    return SimpleNamespace(transformer=transformer, vae=vae, scheduler=scheduler), embedder, text_len


def sync(device: torch.device) -> float:
    """Wait for the device's queued work (CUDA runs asynchronously), then read the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def run_step(step: int, mode: str, ctx) -> dict:
    """One timed Flow-GRPO-Fast step: generate + decode micro-batch by micro-batch (reward futures when
    mode=on), rewards, group advantages, the actor's update."""
    a, dev, s = ctx.args, ctx.device, ctx.sampling
    n_prompts = a.prompts
    chosen = [ctx.prompts[(step * n_prompts + i) % len(ctx.prompts)] for i in range(n_prompts)]
    prompts = [p.text for p in chosen for _ in range(a.group_size)]
    metadata = [dict(p.metadata) for p in chosen for _ in range(a.group_size)]
    group_ids = torch.arange(n_prompts).repeat_interleave(a.group_size)
    window = sde_window(s.num_steps, s.sde_window_size, tuple(s.sde_window_range),
                        torch.Generator().manual_seed(sample_seed(0, step, -1)))
    t: dict[str, float] = {"generate_s": 0.0, "decode_s": 0.0}
    trajs, images, embeds, futures = [], [], [], []
    t0 = sync(dev)
    for start in range(0, len(prompts), s.micro_batch_size):
        sl = slice(start, start + s.micro_batch_size)
        ta = time.perf_counter()
        emb = ctx.embedder(prompts[sl])
        noise, gens = latent_noise([sample_seed(0, step, i) for i in range(sl.start, sl.stop)], ctx.latent_shape)
        traj = denoise(ctx.pipe.transformer, emb, noise.to(dev), ctx.schedule, window, s.sampler, s.noise_level,
                       s.guidance_scale, gens)
        tb = sync(dev)
        mb_images = decode(ctx.pipe.vae, traj.final_latents)
        tc = sync(dev)
        t["generate_s"] += tb - ta
        t["decode_s"] += tc - tb
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
    stats = ctx.actor.update(batch, adv, step)
    t3 = sync(dev)
    t.update(train_s=t3 - t2, step_s=t3 - t0, rollout_s=t1 - t0, images=len(prompts),
             trained_steps=stats["trained_steps_per_sample"])
    return t


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
    args = ap.parse_args(argv)
    args.prompts = args.prompts or (2 if args.tiny else 8)
    args.group_size = args.group_size or (4 if args.tiny else 8)
    args.resolution = args.resolution or (64 if args.tiny else 512)
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; run with --tiny on a CPU machine", file=sys.stderr)
        return 2
    images = args.prompts * args.group_size
    micro = min(8, images)
    pipe, embedder, text_len = build(args, device)
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
                          prompts=load_prompts(REPO / "assets/ocr/train.txt"))
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

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops_for(name, "fp32" if args.tiny else "bf16")
    flops = flow_grpo_step_flops(dict(pipe.transformer.config), resolution=args.resolution, text_len=text_len,
                                 images=images, num_steps=sampling.num_steps, guidance_scale=sampling.guidance_scale,
                                 trained_steps=rows[modes[0]][0]["trained_steps"], inner_epochs=train.inner_epochs,
                                 vae_scale_factor=vae_factor)
    print(f"{'tiny SD3' if args.tiny else 'SD3.5-M architecture (random weights)'} on {name}: {args.prompts}×"
          f"{args.group_size} images at {args.resolution}px, micro-batch {micro}, {sampling.num_steps} steps, "
          f"CPS window {sampling.sde_window_size} in {sampling.sde_window_range}, LoRA r{args.lora_rank}; "
          f"{args.steps} timed step(s) per mode after {args.warmup} warm-up; medians")
    print(f"transformer FLOPs per step: rollout {flops['rollout'] / 1e12:.4g} T, train {flops['train'] / 1e12:.4g} T; "
          f"device peak {peak:g} TFLOP/s")
    keys = ["step_s", "generate_s", "decode_s", "reward_wait_s", "reward_compute_s", "train_s"]
    print(f"{'reward':<8}" + "".join(f"{k:>17}" for k in keys) + f"{'images/s/GPU':>14}{'MFU':>7}{'gen MFU':>9}{'train MFU':>10}")
    summary = {"device": name, "images_per_step": images, "resolution": args.resolution, "peak_tflops": peak,
               "step_tflop": flops["total"] / 1e12, "peak_mem_gib": peak_memory_gib(device), "modes": {}}
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
    print(f"peak memory {summary['peak_mem_gib']:.1f} GiB; total wall {time.perf_counter() - t_start:.0f} s")
    print("BENCH_JSON " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
