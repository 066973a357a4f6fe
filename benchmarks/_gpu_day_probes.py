"""gpu_day's probes: where the GPU's time goes (`profile`), the OCR reward on text it can read (`ocr`), the text
encoders' cost (`t5`) and one validation pass (`validation`). Each fills ctx.numbers with its `settings` and `reps`
beside its readings, saved part by part (benchmarks/_gpu_day_phases.py registers them).

On a GPU: SD3.5-M's architecture with random weights at 512 px (bf16), GeRL's recipe where a recipe applies. With
--rehearse: the tiny SD3 on CPU at 64 px, the same code path.
"""

from __future__ import annotations

import statistics
import time

# kernel-name fragments → the category a profile reports (the first match wins; lower-case)
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("gemm_fp32", ("sgemm", "f32f32", "tf32", "gemm_f32", "_f32_")),  # fp32 matmuls: the LoRA adapter's, the SDE math
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "matmul", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::linear")),
    ("conv", ("conv", "cudnn", "implicit")),
    ("norm", ("norm",)),
    ("copy", ("copy", "memcpy", "memset", "cat", "contiguous")),
)


def classify(name: str) -> str:
    low = name.lower()
    for label, parts in KERNEL_CLASSES:
        if any(p in low for p in parts):
            return label
    return "elementwise_other"


def busy_fraction(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """The fraction of [start, end] covered by the union of `intervals` (µs): how busy the GPU's queue was."""
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered / max(end - start, 1e-9)


def profile_region(ctx, name: str, fn) -> dict:
    """torch.profiler over one call of `fn`: wall seconds, the device's busy fraction (kernels' union over the
    wall), and each kernel class's share of device time (CPU ops on a CPU rehearsal)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = ctx.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    ctx.sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        wall = time.perf_counter() - t0
    events = [e for e in prof.events() if (e.device_type == torch.autograd.DeviceType.CUDA) == cuda
              and (cuda or e.name.startswith("aten::"))]
    if not cuda:  # CPU ops nest (aten::linear calls aten::addmm): count only the leaves' own time
        events = [e for e in events if not e.cpu_children]
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    total = sum(b - a for a, b in spans) or 1e-9
    shares: dict[str, float] = {}
    for e, (a, b) in zip(events, spans):
        shares[classify(e.name)] = shares.get(classify(e.name), 0.0) + (b - a) / total
    top = statistics.median([b - a for a, b in spans]) if spans else None
    start = min((a for a, _ in spans), default=0.0)
    out = {"wall_s": wall, "kernel_s": total / 1e6, "kernels": len(spans), "median_kernel_us": top,
           "shares": dict(sorted(shares.items(), key=lambda kv: -kv[1]))}
    if cuda and spans:
        # busy over the profiled wall: the first kernel's start to it plus the wall (kernel clocks are the GPU's)
        out["gpu_busy_fraction"] = busy_fraction(spans, start, start + wall * 1e6)
    ctx.numbers.setdefault("regions", {})[name] = out
    ctx.save()
    return out


def profile(ctx) -> None:
    """One rollout micro-batch (10 steps, CPS window recorded, decode) and one training micro-batch (the actor's
    update of it) of GeRL's settings, as shipped, each after a warm-up of the same shapes."""
    import torch

    from _gpu_day_phases import bench_ctx, rollout_batch

    images = 4 if ctx.rehearse else 8
    c, build_s = bench_ctx(ctx, "--prompts", "1", "--group-size", str(images), "--no-grad-check")
    ctx.numbers["settings"] = settings_of(c, images=images)
    ctx.numbers["build_s"] = build_s
    embeds = ctx.bench.step_embeds(c, 0)
    adv = torch.randn(images, generator=torch.Generator().manual_seed(0))
    state = {}

    def rollout():
        state["trajs"], _ = ctx.bench.our_rollout(c, embeds, 0)

    def train():
        c.actor.update(rollout_batch(c, embeds, state["trajs"]), adv, 0)

    rollout()  # warm-up of both, the same shapes
    train()
    profile_region(ctx, "rollout_micro_batch", rollout)
    profile_region(ctx, "train_micro_batch", train)


def settings_of(c, **extra) -> dict:
    """A bench context's settings, recorded beside its numbers (a reader must not have to guess them)."""
    import torch

    s, a = c.sampling, c.args
    return {"model": "tiny SD3" if a.tiny else "SD3.5-M architecture, random weights", "dtype": a.dtype,
            "resolution": a.resolution, "steps": s.num_steps, "guidance": s.guidance_scale, "sampler": s.sampler,
            "window": s.sde_window_size, "window_range": list(s.sde_window_range),
            "rollout_micro_batch": s.micro_batch_size, "train_micro_batch": c.train.micro_batch_size,
            "mini_batch": c.train.mini_batch_size, "lora_rank": a.lora_rank, "text_tokens": c.text_len,
            "tf32": torch.backends.cuda.matmul.allow_tf32, "vae_dtype": str(c.pipe.vae.dtype).removeprefix("torch."),
            **extra}


def rendered_targets(prompts, size: int):
    """Each prompt's target text drawn black on white with PIL's own font, centred, at size × size: images OCR can
    read, unlike a random model's (where detection finds no text and recognition never runs)."""
    from PIL import Image, ImageDraw, ImageFont

    from rewards.ocr import target_for

    font = ImageFont.load_default(size=max(10, size // 12))
    out = []
    for p in prompts:
        img = Image.new("RGB", (size, size), "white")
        draw = ImageDraw.Draw(img)
        text = target_for(p.text, p.metadata) or ""
        box = draw.textbbox((0, 0), text, font=font)
        draw.text(((size - (box[2] - box[0])) / 2, (size - (box[3] - box[1])) / 2), text, fill="black", font=font)
        out.append(img)
    return out


def ocr(ctx) -> None:
    """The OCR reward (rapidocr, PP-OCR ONNX, on the CPU) on 64 prompts' target text rendered at 512² (16 at 256 px on
    a rehearsal), scored by RewardSet as a step scores them: one submit per micro-batch of 8, with 2, 4, 8 and 15
    worker threads (1 and 2 on a rehearsal), each micro-batch split over the workers (reward.split) or not; images/s,
    one micro-batch's wait alone (what the GPU idles on after the last one) and the mean reward (≈ 1 when the OCR
    reads what was drawn)."""
    from pathlib import Path

    from gerl.config import RewardConfig, reward_components
    from gerl.data.prompts import load_prompts
    from gerl.workers.reward import RewardSet
    from rewards.registry import build_reward

    repo = Path(__file__).resolve().parents[1]
    n, size = (16, 256) if ctx.rehearse else (64, 512)
    prompts = load_prompts(repo / "assets/ocr/train.txt")[:n]
    images = rendered_targets(prompts, size)
    texts, meta = [p.text for p in prompts], [dict(p.metadata) for p in prompts]
    ctx.numbers["settings"] = {"images": n, "size": size, "micro_batch": 8, "pool": "thread",
                               "render": "PIL default font, black on white, centred", "reps": 2,
                               "split": "reward.split: each micro-batch over the workers, or one call per micro-batch"}
    rows = []
    for workers, split in [(w, s) for w in ((1, 2) if ctx.rehearse else (2, 4, 8, 15)) for s in (False, True)]:
        comps = reward_components(RewardConfig(name="ocr", workers=workers, split=split))
        rs = RewardSet(comps, [build_reward(c.name, c.kwargs) for c in comps], 300.0, 0, 0.5)
        try:
            rs.gather([rs.submit(images[:8], texts[:8], meta[:8])])  # warm-up: the models load in each worker
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                res = rs.gather([rs.submit(images[i:i + 8], texts[i:i + 8], meta[i:i + 8]) for i in range(0, n, 8)])
                times.append(time.perf_counter() - t0)
            # what a step waits on its last micro-batch: one micro-batch alone in an idle pool
            last = time.perf_counter()
            rs.gather([rs.submit(images[8:16], texts[8:16], meta[8:16])])
            last = time.perf_counter() - last
        finally:
            rs.close()
        rows.append({"workers": workers, "split": split, "images_per_s": n / statistics.median(times),
                     "times_s": times, "one_micro_batch_s": last,
                     "reward_mean": float(res.total.nan_to_num(0.0).mean())})
        ctx.numbers["rows"] = rows
        ctx.save()


def t5(ctx) -> None:
    """The text encoders' cost per prompt (CLIP-L, CLIP-G, T5-XXL: random weights, bf16 on the GPU; the tiny ones on
    a rehearsal) on random token ids of the real lengths, at 256 and 512 T5 tokens (SD3.5's default, GeRL's), 8
    prompts a call: what gerl's embedding cache saves after a prompt's first use."""
    import torch

    from gerl.models.sd35_arch import RandomTokenEmbedder, build_component

    if ctx.rehearse:
        from gerl.models.tiny import TOKEN_LENGTH, build_tiny_sd3

        pipe = build_tiny_sd3(0)
        encoders = [pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
        lengths = (TOKEN_LENGTH,)
    else:
        t = ctx.sync()
        encoders = [build_component(n, ctx.device, torch.bfloat16)
                    for n in ("text_encoder", "text_encoder_2", "text_encoder_3")]
        ctx.numbers["build_s"] = ctx.sync() - t
        lengths = (256, 512)
    for e in encoders:
        e.requires_grad_(False).eval()
    ctx.numbers["settings"] = {"prompts_per_call": 8, "dtype": "fp32" if ctx.rehearse else "bf16", "reps": 3,
                               "params_b": [sum(p.numel() for p in e.parameters()) / 1e9 for e in encoders]}
    rows = []
    for n_t5 in lengths:
        emb = RandomTokenEmbedder(encoders, (77, 77, n_t5) if not ctx.rehearse else (n_t5,) * 3, ctx.device)
        prompts = [f"prompt {i}" for i in range(8)]
        emb(prompts)  # warm-up
        times = []
        for r in range(3):
            t = ctx.sync()
            emb([f"{p} {r}" for p in prompts])
            times.append(ctx.sync() - t)
        rows.append({"t5_tokens": n_t5, "ms_per_prompt": 1e3 * statistics.median(times) / 8, "times_s": times})
        ctx.numbers["rows"] = rows
        ctx.save()


def validation(ctx) -> None:
    """One validation pass of GeRL's recipe as `gerl train` runs it (its validation.num_prompts prompts, the ODE at
    sampling.eval_num_steps, decoded, scored by the OCR reward), through the local engine on SD3.5-M's architecture:
    seconds, images/s, the reward's wait. After a warm-up on the first micro-batch's prompts."""
    from pathlib import Path

    from _gpu_day_step import build_engine, step_config

    from gerl.data.prompts import load_prompts

    cfg = step_config("gerl", ctx.rehearse)
    engine, build_s, _ = build_engine(ctx, cfg)
    repo = Path(__file__).resolve().parents[1]
    chosen = load_prompts(repo / cfg.data.test_prompts)[: cfg.validation.num_prompts]
    prompts, meta = [p.text for p in chosen], [dict(p.metadata) for p in chosen]
    mb = cfg.sampling.micro_batch_size
    ctx.numbers["settings"] = {"recipe": "recipes/gerl_sd3_fast_ocr.yaml", "prompts": len(prompts),
                               "eval_num_steps": cfg.sampling.eval_num_steps, "dtype": cfg.model.dtype,
                               "micro_batch": mb, "resolution": cfg.model.resolution, "reps": 1}
    ctx.numbers["build_s"] = build_s
    try:
        engine.validate(prompts[:mb], meta[:mb])  # warm-up
        t = ctx.sync()
        images, res = engine.validate(prompts, meta)
        seconds = ctx.sync() - t
    finally:
        engine.close()
    ctx.numbers.update(seconds=seconds, images_per_s=len(images) / seconds, reward_wait_s=res.wait_s,
                       reward_compute_s=res.compute_s)
    ctx.save()
