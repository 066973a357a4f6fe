"""gpu_day's `step` phase: one whole training step of a recipe, through gerl's own local engine (the rollout role
with its OCR reward futures, advantages, the actor role's update) on SD3.5-M's architecture with random weights.

GeRL's row runs at its recipe's batch (8 prompts × 8 images, fp16, window 3, micro-batch 8, mini-batch 32).
DiffusionNFT's and AWM's recipes are per step 1152 and 1728 images over 8 GPUs; here one GPU runs one prompt
pair of their settings (18 and 12 images: micro-batches that divide, one optimizer step), so their number is
images/s on one GPU, not their step time. Prompt embeddings are random tensors of the real shapes (77 + the
recipe's T5 tokens): the text encoders run once per distinct prompt in a real run (gerl's embedding cache).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GERL = "recipes/gerl_sd3_fast_ocr.yaml"
GERL_REHEARSE = ["data.group_size=4", "train.mini_batch_size=4", "train.micro_batch_size=4",
                 "sampling.micro_batch_size=4", "sampling.num_steps=6"]
# GeRL's row with the rollout on the merged adapter (sampling.merge_lora): the step_merged phase, paired with "gerl";
# and with the OCR in worker processes instead of threads: does the OCR's Python share the GIL with the thread that
# launches the generation's kernels (the merged step generated at 6.4 images/s, the rollout table reads 8.3)?
MERGED = ["sampling.merge_lora=true"]
MERGED_PROCS = MERGED + ["reward.pool=process"]
# (recipe, overrides always applied, overrides added under --rehearse)
REPO_RECIPES = {
    "gerl": (GERL, [], GERL_REHEARSE),
    "gerl_merged": (GERL, MERGED, GERL_REHEARSE),
    "gerl_merged_procs": (GERL, MERGED_PROCS, GERL_REHEARSE),
    "nft": ("recipes/nft_sd3_ocr.yaml", ["data.prompts_per_step=2", "data.group_size=9", "train.mini_batch_size=18"],
            ["data.group_size=3", "train.mini_batch_size=6", "train.micro_batch_size=3", "sampling.micro_batch_size=3",
             "algo.train_timesteps=2", "sampling.num_steps=4"]),
    "awm": ("recipes/awm_sd3_ocr.yaml", ["data.prompts_per_step=2", "data.group_size=6", "train.mini_batch_size=12"],
            ["data.group_size=3", "train.mini_batch_size=6", "sampling.micro_batch_size=3", "algo.train_timesteps=2",
             "sampling.num_steps=4"]),
}
# --rehearse: the tiny SD3 at 64 px, 2 prompts, small groups, fewer denoising steps, 2 trained noise levels (nft,
# awm); each recipe's algorithm, dtype, sampler, window and schedule kept
REHEARSE = ["model.path=tiny", "model.resolution=64", "data.prompts_per_step=2", "log.progress_bar=false"]


def step_config(name: str, rehearse: bool):
    from gerl.config import load_config

    path, gpu, cpu = REPO_RECIPES[name]
    return load_config(path, gpu + (REHEARSE + cpu if rehearse else []) + ["engine.kind=local"])


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
                                    inner_epochs=t.inner_epochs, beta=t.beta, lora=lora, merged_rollout=s.merge_lora,
                                    decode_flops_per_image=decode_per_image, vae_scale_factor=vae_factor)["total"]
    ops = transformer_ops(config, m.resolution, text_len, vae_factor)
    cfg_mult = 2 if s.guidance_scale > 1 else 1
    base, policy = forward_flops(ops), forward_flops(ops, lora)
    rollout = images * s.num_steps * cfg_mult * (base if s.merge_lora else policy)
    per_point = policy + backward_flops(ops, lora) + (base if t.beta > 0 else 0)
    per_point += policy * ((a.name == "nft" or a.anchor_beta > 0) + (a.name == "awm"))
    return rollout + images * decode_per_image + images * a.train_timesteps * t.inner_epochs * per_point


def whole_step(ctx, name: str) -> dict:
    """Warm-up step, then one timed step of recipe `name`: images/s/GPU, seconds per stage, MFU, peak memory."""
    import torch

    from gerl.algo.advantages import compute_advantages
    from gerl.data.prompts import load_prompts
    from gerl.engine.local import LocalEngine
    from gerl.logging.throughput import mfu, peak_tflops_for, vae_decode_flops, vae_scale_factor
    from gerl.models.family import families
    from gerl.models.loader import add_lora
    from gerl.numerics import Fp16GemmEmulation

    cfg = step_config(name, ctx.rehearse)
    m = cfg.model
    extra = ["--lora-rank", "0", "--dtype", m.dtype, "--prompts", "1", "--group-size", "1"]
    args = ctx.args(*extra, *([] if ctx.rehearse else ["--t5-tokens", str(m.max_sequence_length)]))
    t = ctx.sync()
    pipe, embedder, text_len = ctx.bench.build(args, ctx.device)
    add_lora(pipe.transformer, m.lora_rank, m.lora_alpha, m.lora_targets, m.lora_init, seed=cfg.seed)
    engine = LocalEngine(cfg, None, pipe)
    engine.rollout.worker.embedder = embedder  # random embeddings of the real shapes (no tokenizers here)
    build_s = ctx.sync() - t
    chosen = load_prompts(REPO / cfg.data.train_prompts)[: cfg.data.prompts_per_step]
    prompts = [p.text for p in chosen for _ in range(cfg.data.group_size)]
    metadata = [dict(p.metadata) for p in chosen for _ in range(cfg.data.group_size)]
    group_ids = torch.arange(len(chosen)).repeat_interleave(cfg.data.group_size)
    emulate = ctx.device.type == "cpu" and m.dtype == "fp16"  # a GPU's fp16 GEMMs at fp32 speed on the CPU
    rows = []
    try:
        with Fp16GemmEmulation() if emulate else contextlib.nullcontext():
            # GeRL's row first: its step 0 is the warm-up (CUDA context, kernels, the OCR model), step 1 is timed;
            # nft and awm come after it in the same process and are timed on their first step
            for s in range(0 if name.startswith("gerl") and not ctx.rehearse else 1, 2):
                ctx.reset_peak()
                t0 = ctx.sync()
                batch, res = engine.submit(s, prompts, metadata, group_ids)
                t1 = ctx.sync()
                rewards = torch.nan_to_num(batch.rewards.float(), nan=0.0)
                adv = compute_advantages(cfg.train.advantage, rewards, batch.group_ids, cfg.train.adv_clip_max)
                metrics = engine.update(batch, adv, s)
                engine.sync()
                t2 = ctx.sync()
                rows.append((t0, t1, t2, batch.timings, metrics, ctx.peak_gib()))
    finally:
        engine.rollout.close()
    t0, t1, t2, timings, metrics, peak = rows[-1]
    images = len(prompts)
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    tflops = peak_tflops_for(device_name, m.dtype, tf32=m.tf32)  # fp32 recipes run on TF32 cores (engine/roles.py)
    config = dict(pipe.transformer.config, _class_name=type(pipe.transformer).__name__)
    sd3 = families()["sd3"]
    decode = vae_decode_flops(pipe.vae, sd3, sd3.latent_shape(pipe, m.resolution))
    flops = step_flops(cfg, config, text_len, images, metrics["trained_steps_per_sample"], decode,
                       vae_scale_factor(pipe.vae.config))
    out = {"recipe": REPO_RECIPES[name][0], "merge_lora": cfg.sampling.merge_lora, "reward_pool": cfg.reward.pool,
           "algo": cfg.algo.name,
           "dtype": m.dtype, "images": images, "resolution": m.resolution, "text_len": text_len, "build_s": build_s,
           "step_s": t2 - t0,
           "rollout_s": t1 - t0, "train_s": t2 - t1, **{k: timings.get(k) for k in
                                                        ("generate_s", "decode_s", "reward_wait_s", "reward_compute_s")},
           "images_per_s_per_gpu": images / (t2 - t0), "step_tflop": flops / 1e12,
           "mfu": mfu(flops, t2 - t0, 1, tflops), "peak_tflops": tflops, "peak_gib": peak, "grad_norm": metrics.get("grad_norm"),
           "optimizer_steps": metrics.get("optimizer_steps"), "grad_zero_frac": metrics.get("grad_zero_frac"),
           "loss_scale": metrics.get("loss_scale"), "reward_mean": float(rewards.mean())}
    from _gpu_day_phases import check_finite

    check_finite(f"{name} step", {k: v for k, v in metrics.items() if isinstance(v, float)
                                  and k != "ratio_max_dev_before_update"})
    return out

