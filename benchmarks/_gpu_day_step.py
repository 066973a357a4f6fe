"""gpu_day's whole-step phases: one training step of a recipe through gerl's own local engine (the rollout role with
its OCR reward futures, advantages, the actor role's update), on SD3.5-M's architecture with random weights, built
exactly as `gerl train` builds a run (gerl.engine.roles.prepare_pipeline: TF32, the adapter, every speed lever the
config names).

GeRL's row at its recipe's batch (8 prompts × 8 images, fp16, window 3, micro-batch 8, mini-batch 32) is what one
GPU of a 1-GPU run does; GeRL spread the same 64 images over 8 GPUs, 8 per GPU (its 1.0 images/s/GPU on an H800),
so the like-for-like row is one group of 8 images with GeRL's per-GPU mini-batch of 4 (two optimizer steps).
Each row as shipped and with every exact lever (LEVERS). DiffusionNFT's, AWM's and DGPO's recipes run one GPU's
share of their settings in bf16 (their recipes are fp32 on TF32), so that the algorithms' GPU cost per image
compares with Flow-GRPO's. Prompt embeddings are random tensors of the real shapes, cached per prompt as gerl's
embedding cache keeps them (the text encoders: the `t5` phase). Every variant gets its own warm-up step (compile,
kernel choice, the OCR model) before its timed steps; the warm-up's time is reported as `first_step_s`.
"""

from __future__ import annotations

import contextlib
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GERL = "recipes/gerl_sd3_fast_ocr.yaml"
GERL_REHEARSE = ["data.group_size=4", "train.mini_batch_size=4", "train.micro_batch_size=4",
                 "sampling.micro_batch_size=4", "sampling.num_steps=6"]
# one GPU's share of GeRL's 8-GPU run: one group of 8; ppo_mini_batch_size 4 prompts × 8 / 8 GPUs = 4 per GPU
PER_GPU_8 = ["data.prompts_per_step=1", "train.mini_batch_size=4", "train.micro_batch_size=4"]
PER_GPU_8_REHEARSE = ["data.group_size=4", "train.mini_batch_size=2", "train.micro_batch_size=2",
                      "sampling.micro_batch_size=4", "sampling.num_steps=6"]
# every lever that keeps the ratio exact (docs/architecture.md, "Speed levers"), and reward.workers=0 (a worker per
# CPU of the host, each micro-batch split over them); attention stays sdpa (cudnn was no faster compiled on an H200)
LEVERS = ["model.merge_lora=true", "model.compile=true", "model.vae_dtype=bf16", "reward.workers=0"]
BF16 = ["model.dtype=bf16"]
# name: (recipe, overrides, overrides added under --rehearse, timed steps)
VARIANTS = {
    "gerl8": (GERL, PER_GPU_8, PER_GPU_8_REHEARSE, 3),
    "gerl8_levers": (GERL, PER_GPU_8 + LEVERS, PER_GPU_8_REHEARSE, 3),
    "gerl": (GERL, [], GERL_REHEARSE, 2),
    "gerl_levers": (GERL, LEVERS, GERL_REHEARSE, 2),
    "nft": ("recipes/nft_sd3_ocr.yaml", BF16 + ["data.prompts_per_step=2", "data.group_size=9",
                                               "train.mini_batch_size=18"],
            ["data.group_size=3", "train.mini_batch_size=6", "train.micro_batch_size=3", "sampling.micro_batch_size=3",
             "algo.train_timesteps=2", "sampling.num_steps=4"], 2),
    "awm": ("recipes/awm_sd3_ocr.yaml", BF16 + ["data.prompts_per_step=2", "data.group_size=6",
                                               "train.mini_batch_size=12"],
            ["data.group_size=3", "train.mini_batch_size=6", "sampling.micro_batch_size=3", "algo.train_timesteps=2",
             "sampling.num_steps=4"], 2),
    "dgpo": ("recipes/dgpo_sd3_ocr.yaml", BF16 + ["data.prompts_per_step=1", "train.mini_batch_size=16"],
             ["data.group_size=4", "train.mini_batch_size=4", "train.micro_batch_size=4", "sampling.micro_batch_size=4",
              "algo.train_timesteps=2", "sampling.num_steps=4"], 2),
}
# --rehearse: the tiny SD3 at 64 px, small groups, fewer denoising steps, 2 trained noise levels (nft, awm, dgpo);
# each recipe's algorithm, dtype, sampler, window and schedule kept
REHEARSE = ["model.path=tiny", "model.resolution=64", "data.prompts_per_step=2", "log.progress_bar=false"]
REHEARSE_TIMED = 1  # timed steps of each variant on a CPU rehearsal


def step_config(name: str, rehearse: bool, extra: list[str] = ()):
    from gerl.config import load_config

    path, gpu, cpu, _ = VARIANTS[name]
    rehearse_keys = REHEARSE + cpu if rehearse else []
    if rehearse and "data.prompts_per_step=1" in gpu:
        rehearse_keys = [k for k in rehearse_keys if not k.startswith("data.prompts_per_step")]
    return load_config(path, [*gpu, *rehearse_keys, *extra, "engine.kind=local"])


def step_flops(cfg, config: dict, text_len: int, images: int, trained_steps: int, decode_per_image: int,
               vae_factor: int = 8) -> int:
    """Model FLOPs of one step of recipe `cfg` (gerl/logging/flops.py): the rollout's forwards (the unmerged
    adapter's matmuls included), one VAE decode per image, and per trained point the policy's LoRA forward + backward
    (no weight gradient for frozen weights: ≈ 2.2 forwards, where this bench counted 3 until issue 45) plus the
    no-grad forwards the algorithm adds: the reference's for the KL (base weights), nft's anchor velocity (or any
    anchor_beta > 0), awm's old log-prob pass (both with an adapter). flow_grpo: `flow_grpo_step_flops`."""
    from gerl.logging.flops import Lora, backward_flops, flow_grpo_step_flops, forward_flops, transformer_ops
    from gerl.models.family import families

    m, a, t, s = cfg.model, cfg.algo, cfg.train, cfg.sampling
    lora = Lora(tuple(m.lora_targets or families()["sd3"].lora_targets), m.lora_rank) if m.lora else None
    if a.name == "flow_grpo":
        return flow_grpo_step_flops(config, resolution=m.resolution, text_len=text_len, images=images,
                                    num_steps=s.num_steps, guidance_scale=s.guidance_scale, trained_steps=trained_steps,
                                    inner_epochs=t.inner_epochs, beta=t.beta, lora=lora, merged_rollout=m.merge_lora,
                                    decode_flops_per_image=decode_per_image, vae_scale_factor=vae_factor)["total"]
    ops = transformer_ops(config, m.resolution, text_len, vae_factor)
    cfg_mult = 2 if s.guidance_scale > 1 else 1
    base, policy = forward_flops(ops), forward_flops(ops, lora)
    rollout = images * s.num_steps * cfg_mult * (base if m.merge_lora else policy)
    per_point = policy + backward_flops(ops, lora) + (base if t.beta > 0 else 0)
    per_point += policy * ((a.name == "nft" or a.anchor_beta > 0) + (a.name == "awm"))
    return rollout + images * decode_per_image + images * a.train_timesteps * t.inner_epochs * per_point


def build_engine(ctx, cfg):
    """A LocalEngine on SD3.5-M's architecture (random weights; the tiny SD3 on a rehearsal) built as `gerl train`
    builds one: the VAE in fp32 as the loader loads it, then roles.prepare_pipeline (TF32, the adapter, the
    levers), random cached embeddings of the real shapes. (engine, build seconds, text tokens)."""
    import torch

    from gerl.engine.local import LocalEngine
    from gerl.engine.roles import prepare_pipeline

    m = cfg.model
    extra = ["--lora-rank", "0", "--dtype", m.dtype, "--prompts", "1", "--group-size", "1"]
    args = ctx.args(*extra, *([] if ctx.rehearse else ["--t5-tokens", str(m.max_sequence_length)]))
    t = ctx.sync()
    pipe, embedder, text_len = ctx.bench.build(args, ctx.device)
    pipe.vae.to(torch.float32)  # gerl's loader loads the VAE in fp32; model.vae_dtype decides from there
    prepare_pipeline(pipe, cfg, ctx.device)
    engine = LocalEngine(cfg, None, pipe)
    engine.rollout.worker.embedder = embedder  # random embeddings of the real shapes (no tokenizers here)
    return engine, ctx.sync() - t, text_len


def whole_step(ctx, name: str, extra: list[str] = ()) -> dict:
    """A warm-up step, then the variant's timed steps of recipe `name`: images/s/GPU (median and best), seconds per
    stage, MFU, peak memory, the settings."""
    import torch

    from gerl.algo.advantages import compute_advantages
    from gerl.data.prompts import load_prompts
    from gerl.numerics import Fp16GemmEmulation

    cfg = step_config(name, ctx.rehearse, list(extra))
    engine, build_s, text_len = build_engine(ctx, cfg)
    chosen = load_prompts(REPO / cfg.data.train_prompts)[: cfg.data.prompts_per_step]
    prompts = [p.text for p in chosen for _ in range(cfg.data.group_size)]
    metadata = [dict(p.metadata) for p in chosen for _ in range(cfg.data.group_size)]
    group_ids = torch.arange(len(chosen)).repeat_interleave(cfg.data.group_size)
    emulate = fp16_emulated(ctx, cfg)
    timed = REHEARSE_TIMED if ctx.rehearse else VARIANTS[name][3]
    rows = []
    try:
        with Fp16GemmEmulation() if emulate else contextlib.nullcontext():
            for s in range(1 + timed):  # step 0 warms up (compile, kernels, the OCR model); the rest are timed
                ctx.reset_peak()
                t0 = ctx.sync()
                batch, res = engine.submit(s, prompts, metadata, group_ids)
                t1 = ctx.sync()
                rewards = torch.nan_to_num(batch.rewards.float(), nan=0.0)
                adv = compute_advantages(cfg.train.advantage, rewards, batch.group_ids, cfg.train.adv_clip_max)
                metrics = engine.update(batch, adv, s)
                engine.sync()
                t2 = ctx.sync()
                rows.append({"step_s": t2 - t0, "rollout_s": t1 - t0, "train_s": t2 - t1, "timings": batch.timings,
                             "metrics": metrics, "peak": ctx.peak_gib(), "rewards": rewards})
        if cfg.algo.name == "flow_grpo":
            ratio_after_move = moved_ratio(ctx, engine, cfg, prompts, metadata, group_ids, 1 + timed)
    finally:
        engine.close()
    out = summarize(ctx, cfg, name, rows, text_len, engine)
    if cfg.algo.name == "flow_grpo":
        out["ratio_max_dev_after_move"] = ratio_after_move
    out.update(build_s=build_s, first_step_s=rows[0]["step_s"])
    from _gpu_day_phases import check_finite

    check_finite(f"{name} step", {k: v for k, v in rows[-1]["metrics"].items() if isinstance(v, float)
                                  and k != "ratio_max_dev_before_update"})
    del engine
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def fp16_emulated(ctx, cfg) -> bool:
    """A CPU rehearsal of an fp16 recipe runs a GPU's fp16 GEMMs emulated (gerl/numerics.py), at fp32 speed — except
    with model.compile: the emulation is a dispatch mode that compiled blocks cannot run under (the CPU's own fp16
    GEMMs then run, slower; on a GPU nothing is emulated)."""
    return ctx.device.type == "cpu" and cfg.model.dtype == "fp16" and not cfg.model.compile


def moved_ratio(ctx, engine, cfg, prompts, metadata, group_ids, step: int) -> float:
    """The first update's max |ratio − 1| once the adapter has moved: random weights score 0 under OCR, so every
    advantage of the timed steps was 0 and B is still 0, where merging changes nothing. One update with seeded
    random advantages moves it; then a fresh rollout is replayed by the actor at the same weights (the levers'
    price in exactness, in this recipe's dtype)."""
    import torch

    from gerl.numerics import Fp16GemmEmulation

    emulate = fp16_emulated(ctx, cfg)
    adv = torch.randn(len(prompts), generator=torch.Generator().manual_seed(step)).clamp(-2, 2)
    with Fp16GemmEmulation() if emulate else contextlib.nullcontext():
        batch, _ = engine.submit(step, prompts, metadata, group_ids)
        engine.update(batch, adv, step)
        engine.sync()
        batch, _ = engine.submit(step + 1, prompts, metadata, group_ids)
        m = engine.update(batch, adv, step + 1)
    return m["ratio_max_dev_before_update"]


def summarize(ctx, cfg, name: str, rows: list[dict], text_len: int, engine) -> dict:
    """The timed steps' medians (and the best step), MFU from the FLOPs model, the settings."""
    import torch

    from gerl.logging.throughput import mfu, peak_tflops_for, vae_decode_flops, vae_scale_factor
    from gerl.models.family import families

    m, timed = cfg.model, rows[1:]
    images = len(timed[-1]["rewards"])
    med = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    stage = lambda key: statistics.median(r["timings"].get(key) or 0.0 for r in timed)  # noqa: E731
    metrics = timed[-1]["metrics"]
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    tflops = peak_tflops_for(device_name, m.dtype, tf32=m.tf32)
    pipe = engine.rollout.pipe
    config = dict(pipe.transformer.config, _class_name=type(pipe.transformer).__name__)
    sd3 = families()["sd3"]
    decode = vae_decode_flops(pipe.vae, sd3, sd3.latent_shape(pipe, m.resolution))
    flops = step_flops(cfg, config, text_len, images, metrics["trained_steps_per_sample"], decode,
                       vae_scale_factor(pipe.vae.config))
    step_s = med("step_s")
    return {"recipe": VARIANTS[name][0], "algo": cfg.algo.name, "images": images, "text_len": text_len,
            "settings": step_settings(cfg), "reps": len(timed),
            "step_s": step_s, "step_times_s": [r["step_s"] for r in timed], "rollout_s": med("rollout_s"),
            "train_s": med("train_s"), **{k: stage(k) for k in ("generate_s", "decode_s", "reward_wait_s",
                                                              "reward_compute_s")},
            "images_per_s_per_gpu": images / step_s, "best_images_per_s_per_gpu": images / min(r["step_s"] for r in timed),
            "step_tflop": flops / 1e12, "mfu": mfu(flops, step_s, 1, tflops), "peak_tflops": tflops,
            "peak_gib": max((r["peak"] or 0.0) for r in timed) or None, "grad_norm": metrics.get("grad_norm"),
            "optimizer_steps": metrics.get("optimizer_steps"), "grad_zero_frac": metrics.get("grad_zero_frac"),
            "ratio_max_dev": metrics.get("ratio_max_dev_before_update"), "loss_scale": metrics.get("loss_scale"),
            "reward_mean": float(timed[-1]["rewards"].mean())}


def step_settings(cfg) -> dict:
    """What a reader needs to compare two rows: the model settings and levers, the batch arithmetic, the sampler."""
    import torch

    m, s, t, d = cfg.model, cfg.sampling, cfg.train, cfg.data
    levers = {k: getattr(m, k) for k in ("merge_lora", "compile", "vae_dtype", "attention_backend") if hasattr(m, k)}
    return {"dtype": m.dtype, "resolution": m.resolution, "text_tokens": m.max_sequence_length,
            "tf32": torch.backends.cuda.matmul.allow_tf32, **levers, "lora_rank": m.lora_rank,
            "prompts": d.prompts_per_step, "group_size": d.group_size, "steps": s.num_steps,
            "guidance": s.guidance_scale, "sampler": s.sampler, "window": s.sde_window_size,
            "rollout_micro_batch": s.micro_batch_size, "mini_batch": t.mini_batch_size,
            "train_micro_batch": t.micro_batch_size, "reward": cfg.reward.name, "reward_workers": cfg.reward.workers,
            "reward_pool": cfg.reward.pool, "with_reward": cfg.reward.with_reward}
