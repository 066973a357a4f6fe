"""gpu_day's `rollout` and `ratio` phases: the exact speed levers against stock diffusers, and what they cost the
ratio.

`rollout`: images/s of three sides on the same embeddings, noise, steps and micro-batch — diffusers'
`StableDiffusion3Pipeline.__call__` as a PEFT user runs it (bf16 pipeline, the adapter unmerged, eager), gerl's
rollout as shipped (the config's defaults), and gerl's rollout with every exact lever (LEVERS: the exact merged
LoRA, one compiled graph, the fastest attention backend measured here, the VAE in bf16 channels_last) on a copy of
the same weights. Cells: no adapter and PEFT's r32/α64 adapter (B ≠ 0), micro-batch 16 and 8 without guidance,
micro-batch 8 with guidance 4.5 (a doubled batch of 16). Every cell warms each side up on its own shapes first (the
warm-up is keyed by adapter, micro-batch, guidance and side), then ≥ 3 timed repetitions whose order rotates
(bench_gpu.time_sides); min and median of each.

`ratio`: the first update's max |ratio − 1| after the adapter has moved (one update with random advantages, so
B ≠ 0), in bf16 and fp16, as shipped, with the exact merged LoRA, and with it compiled: the levers' price in
exactness (the target: within 1e-5 of 1 in fp16).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time

CELLS_GPU = ((16, 1.0), (8, 1.0), (8, 4.5))  # (micro-batch, guidance)
CELLS_REHEARSE = ((2, 1.0), (1, 4.5))
REPS_GPU, REPS_REHEARSE = 3, 3
ATTENTION = ("sdpa", "cudnn", "flash", "flash3")  # model.attention_backend's names, in the order tried


def time_sides(ctx, sides: dict, reps: int, warmup: int = 1) -> dict:
    """Each side (name → a call that runs it once) warmed up `warmup` times, then `reps` rounds whose order
    rotates (round r starts at side r mod n), CUDA-synchronised: {name: {"min_s", "median_s", "times_s"}}."""
    names = list(sides)
    times = {n: [] for n in names}
    for _ in range(warmup):
        for n in names:
            sides[n]()
    ctx.sync()
    for r in range(reps):
        for n in names[r % len(names):] + names[: r % len(names)]:
            t = ctx.sync()
            sides[n]()
            times[n].append(ctx.sync() - t)
    return {n: {"min_s": min(v), "median_s": statistics.median(v), "times_s": v} for n, v in times.items()}


def fastest_attention(ctx, transformer, embeds, latent_shape) -> dict:
    """One no-grad transformer forward per available backend (model.attention_backend's check says which are),
    3 timed after 1 warm-up: {"backends": {name: median s or the reason it is unavailable}, "best": name}."""
    import torch

    from gerl.models.attention import set_attention_backend

    x = torch.randn(embeds.prompt.shape[0], *latent_shape, device=ctx.device, dtype=embeds.prompt.dtype)
    t = torch.full((x.shape[0],), 500.0, device=ctx.device)
    out: dict = {}
    for name in ATTENTION:
        try:
            set_attention_backend(transformer, name, ctx.device)
        except Exception as e:  # noqa: BLE001 - unavailable here: recorded, the next one is tried
            out[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            continue
        try:
            with torch.no_grad():
                run = lambda: transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds.prompt,  # noqa: E731
                                          pooled_projections=embeds.pooled, return_dict=False)
                out[name] = time_sides(ctx, {name: run}, 3)[name]["median_s"]
        except Exception as e:  # noqa: BLE001 - accepted by the check but failed to run: recorded
            out[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    set_attention_backend(transformer, "sdpa", ctx.device)
    timed = {k: v for k, v in out.items() if isinstance(v, float)}
    return {"backends": out, "best": min(timed, key=timed.get) if timed else "sdpa"}


def levers_copy(ctx, c, attention: str):
    """A copy of c's transformer and VAE with every exact lever applied as `gerl train` applies them
    (gerl.engine.roles.apply_levers), the original left as it is (the stock pipeline and the shipped rollout run it)."""
    from types import SimpleNamespace

    from gerl.config import ModelConfig
    from gerl.engine.roles import apply_levers

    fast = SimpleNamespace(transformer=copy.deepcopy(c.pipe.transformer), vae=copy.deepcopy(c.pipe.vae),
                           scheduler=c.pipe.scheduler, encoders=c.pipe.encoders)
    m = ModelConfig(merge_lora=bool(lora_layers(fast.transformer)), compile=True, vae_dtype="bf16",
                    attention_backend=attention)
    t = ctx.sync()
    info = apply_levers(fast, m, ctx.device)
    return fast, {"apply_s": ctx.sync() - t, **(info or {})}


def lora_layers(transformer) -> list:
    from gerl.models.lora_merge import lora_layers as layers

    return layers(transformer)


def rollout(ctx) -> None:
    from _gpu_day_phases import bench_ctx
    from _gpu_day_probes import settings_of

    from gerl.models.loader import add_lora
    from gerl.numerics import perturb_fresh_lora

    n = ctx.numbers
    cells = CELLS_REHEARSE if ctx.rehearse else CELLS_GPU
    reps = REPS_REHEARSE if ctx.rehearse else REPS_GPU
    fewer = ["--num-steps", "4", "--sde-window", "1", "--sde-window-range", "0", "2"] if ctx.rehearse else []
    biggest = max(mb for mb, _ in cells)

    c, n["build_s"] = bench_ctx(ctx, "--prompts", "1", "--group-size", str(biggest), "--lora-rank", "0", *fewer)
    n["settings"] = settings_of(c, cells=[list(x) for x in cells], reps=reps, warmup_per_cell_and_side=1,
                                order="rotating", stock="StableDiffusion3Pipeline.__call__, eager, PEFT unmerged, "
                                "bf16 VAE, output_type=pil")
    c.images = cells[0][0]
    c.sampling = dataclasses.replace(c.sampling, micro_batch_size=cells[0][0], guidance_scale=1.0)
    n["attention"] = fastest_attention(ctx, c.pipe.transformer, ctx.bench.step_embeds(c, 0)[0], c.latent_shape)
    ctx.save()
    stock = ctx.bench.stock_pipeline(c.pipe)
    n["rows"] = []
    for adapter in ("none", "lora"):
        if adapter == "lora":  # gerl's adapter (r32/α64, its default targets), moved off B = 0 so merging matters
            from gerl.config import ModelConfig

            add_lora(c.pipe.transformer, 32, 64.0, ModelConfig().lora_targets)
            perturb_fresh_lora(c.pipe.transformer)
        fast, info = levers_copy(ctx, c, n["attention"]["best"])
        n.setdefault("levers", {})[adapter] = info
        for mb, g in cells:
            c.images = mb
            c.sampling = dataclasses.replace(c.sampling, micro_batch_size=mb, guidance_scale=g)
            embeds = ctx.bench.step_embeds(c, 0)
            t0 = time.perf_counter()
            sides = {"stock": lambda: ctx.bench.stock_rollout(c, stock, embeds, 0),
                     "ours": lambda: ctx.bench.our_rollout(c, embeds, 0),
                     "ours_levers": lambda: ctx.bench.our_rollout(c, embeds, 0, pipe=fast)}
            got = time_sides(ctx, sides, reps)
            row = {"adapter": adapter, "micro_batch": mb, "guidance": g, "seconds": time.perf_counter() - t0,
                   **{f"{k}_images_per_s": mb / v["median_s"] for k, v in got.items()},
                   "times_s": {k: v["times_s"] for k, v in got.items()}}
            row["ours_vs_stock"] = got["stock"]["median_s"] / got["ours"]["median_s"]
            row["levers_vs_stock"] = got["stock"]["median_s"] / got["ours_levers"]["median_s"]
            row["levers_vs_stock_of_mins"] = got["stock"]["min_s"] / got["ours_levers"]["min_s"]
            n["rows"].append(row)
            ctx.save()
        del fast
    n["min_ours_vs_stock"] = min(r["ours_vs_stock"] for r in n["rows"])


def ratio(ctx) -> None:
    """The first update's max |ratio − 1| after the adapter moved, per dtype: as shipped (eager, PEFT unmerged), with
    the exact merged LoRA, and merged + compiled — each a fresh rollout at the same weights replayed by the actor."""
    import contextlib

    import torch
    from _gpu_day_phases import bench_ctx, check_finite, rollout_batch

    from gerl.config import ModelConfig
    from gerl.engine.roles import apply_levers
    from gerl.numerics import Fp16GemmEmulation

    images = 4 if ctx.rehearse else 8
    dtypes = ("bf16", "fp16")
    ctx.numbers["settings"] = {"images": images, "dtypes": list(dtypes), "lora_rank": 32,
                               "moved_by": "one update with seeded random advantages (lr 1e-4)",
                               "variants": ["shipped", "merged", "merged_compiled"]}
    for dtype in dtypes:
        emulate = ctx.rehearse and dtype == "fp16"
        with Fp16GemmEmulation() if emulate else contextlib.nullcontext():
            c, build_s = bench_ctx(ctx, "--prompts", "1", "--group-size", str(images), "--no-grad-check",
                                   "--dtype", dtype)
            embeds = ctx.bench.step_embeds(c, 0)
            adv = torch.randn(images, generator=torch.Generator().manual_seed(0))
            trajs, _ = ctx.bench.our_rollout(c, embeds, 0, images_too=False)
            c.actor.update(rollout_batch(c, embeds, trajs, adv), adv, 0)  # the adapter moves off B = 0
            row = {"build_s": build_s}
            for step, variant in enumerate(("shipped", "merged", "merged_compiled"), start=1):
                if variant != "shipped":
                    m = ModelConfig(merge_lora=True, compile=variant == "merged_compiled")
                    apply_levers(c.pipe, m, ctx.device)
                trajs, _ = ctx.bench.our_rollout(c, embeds, 0, images_too=False)
                metrics = c.actor.update(rollout_batch(c, embeds, trajs, adv), adv, step)
                row[variant] = metrics["ratio_max_dev_before_update"]
                ctx.numbers[dtype] = row
                ctx.save()
            check_finite(f"ratio {dtype}", {k: v for k, v in row.items() if isinstance(v, float)})
        del c
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
