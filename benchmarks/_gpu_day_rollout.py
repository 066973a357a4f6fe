"""gpu_day's `rollout` and `ratio` phases: the exact speed levers against stock diffusers, and what they cost the
ratio.

`rollout`: images/s of three sides on the same embeddings, noise, steps and micro-batch — diffusers'
`StableDiffusion3Pipeline.__call__` as a PEFT user runs it (bf16 pipeline, the adapter unmerged, eager), gerl's
rollout as shipped (the config's defaults), and gerl's rollout with every exact lever (the exact merged LoRA, the
compiled blocks, the VAE in bf16; attention stays sdpa: cudnn was no faster in the compiled rollout on an H200,
docs/tables/compile/) on a copy of the same weights. Cells (CELLS_GPU, in the order of value): PEFT's r32/α64
adapter (B ≠ 0) and no adapter, micro-batch 16 and 8 without guidance, micro-batch 8 with guidance 4.5 (a doubled
batch of 16). Every cell warms each side up on its own shapes first (the warm-up is keyed by adapter,
micro-batch, guidance and side), then ≥ 3 timed repetitions whose order rotates (time_sides); min and median.

`ratio`: the first update's max |ratio − 1| after the adapter has moved (one update with random advantages, so
B ≠ 0), in bf16 and fp16, as shipped, with the exact merged LoRA, and with it compiled: the levers' price in
exactness (the target: within 1e-5 of 1 in fp16).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time

# (adapter, micro-batch, guidance), in the order of value: the targets first (the unmerged adapter at 16,
# no adapter at 16), then the smallest forward (the "0.90 cell" of the first two days), then guidance
CELLS_GPU = (("lora", 16, 1.0), ("none", 16, 1.0), ("lora", 8, 1.0), ("lora", 8, 4.5), ("none", 8, 4.5))
CELLS_REHEARSE = (("lora", 2, 1.0), ("none", 1, 4.5))
REPS_GPU, REPS_REHEARSE = 3, 3


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


def levers_copy(ctx, transformer, vae):
    """A copy of `transformer` and `vae` with every exact lever applied as `gerl train` applies them
    (gerl.engine.roles.apply_levers: the VAE in bf16, the exact merged LoRA when there is an adapter, the compiled
    blocks), the originals left as they are (the stock pipeline and the shipped rollout run them)."""
    from types import SimpleNamespace

    from gerl.config import load_config
    from gerl.engine.roles import apply_levers
    from gerl.models.lora_merge import lora_layers

    fast = SimpleNamespace(transformer=copy.deepcopy(transformer), vae=copy.deepcopy(vae))
    merge = bool(lora_layers(fast.transformer))
    cfg = load_config(None, ["model.compile=true", "model.vae_dtype=bf16", f"model.merge_lora={str(merge).lower()}",
                             "model.lora=true"])
    t = ctx.sync()
    info = apply_levers(fast, cfg)
    return fast, {"apply_s": ctx.sync() - t, "merge_lora": merge, "vae_dtype": "bf16", "attention_backend": "sdpa",
                  **info}


def rollout(ctx) -> None:
    """The cells in the order of value (the phase's cap may cut the last ones; each row is saved as it ends)."""
    from types import SimpleNamespace

    from _gpu_day_phases import bench_ctx
    from _gpu_day_probes import settings_of

    from gerl.config import ModelConfig
    from gerl.models.loader import add_lora
    from gerl.numerics import perturb_fresh_lora

    n = ctx.numbers
    cells = CELLS_REHEARSE if ctx.rehearse else CELLS_GPU
    reps = REPS_REHEARSE if ctx.rehearse else REPS_GPU
    fewer = ["--num-steps", "4", "--sde-window", "1", "--sde-window-range", "0", "2"] if ctx.rehearse else []
    biggest = max(mb for _, mb, _ in cells)
    c, n["build_s"] = bench_ctx(ctx, "--prompts", "1", "--group-size", str(biggest), "--lora-rank", "0", *fewer)
    n["settings"] = settings_of(c, cells=[list(x) for x in cells], reps=reps, warmup_per_cell_and_side=1,
                                order="rotating", stock="StableDiffusion3Pipeline.__call__, eager, PEFT unmerged, "
                                "output_type=pil, the bench's VAE (bf16 with a bf16 transformer)")
    # four transformers of the same weights: without and with gerl's adapter (r32/α64 on its default targets,
    # moved off B = 0 so that merging matters), each as a stock user and gerl's shipped rollout run it, and a copy
    # with every lever
    base = c.pipe.transformer
    plain = {"none": copy.deepcopy(base)}
    fast = {}
    fast["none"], n.setdefault("levers", {})["none"] = levers_copy(ctx, plain["none"], c.pipe.vae)
    add_lora(base, 32, 64.0, ModelConfig().lora_targets)
    perturb_fresh_lora(base)
    plain["lora"] = base
    fast["lora"], n["levers"]["lora"] = levers_copy(ctx, base, c.pipe.vae)
    stock = {k: ctx.bench.stock_pipeline(SimpleNamespace(transformer=t, vae=c.pipe.vae, scheduler=c.pipe.scheduler))
             for k, t in plain.items()}
    ctx.save()
    n["rows"] = []
    for adapter, mb, g in cells:
        c.images = mb
        c.sampling = dataclasses.replace(c.sampling, micro_batch_size=mb, guidance_scale=g)
        c.pipe.transformer = plain[adapter]
        embeds = ctx.bench.step_embeds(c, 0)
        t0 = time.perf_counter()
        sides = {"stock": lambda: ctx.bench.stock_rollout(c, stock[adapter], embeds, 0),
                 "ours": lambda: ctx.bench.our_rollout(c, embeds, 0),
                 "ours_levers": lambda: ctx.bench.our_rollout(c, embeds, 0, pipe=fast[adapter])}
        got = time_sides(ctx, sides, reps)
        row = {"adapter": adapter, "micro_batch": mb, "guidance": g, "seconds": time.perf_counter() - t0,
               **{f"{k}_images_per_s": mb / v["median_s"] for k, v in got.items()},
               "times_s": {k: v["times_s"] for k, v in got.items()}}
        row["ours_vs_stock"] = got["stock"]["median_s"] / got["ours"]["median_s"]
        row["levers_vs_stock"] = got["stock"]["median_s"] / got["ours_levers"]["median_s"]
        row["levers_vs_stock_of_mins"] = got["stock"]["min_s"] / got["ours_levers"]["min_s"]
        n["rows"].append(row)
        ctx.save()
    c.pipe.transformer = base
    n["min_ours_vs_stock"] = min(r["ours_vs_stock"] for r in n["rows"])


def ratio(ctx) -> None:
    """The first update's max |ratio − 1| after the adapter moved, per dtype: as shipped (eager, PEFT unmerged), with
    the exact merged LoRA, and merged + compiled — each a fresh rollout at the same weights replayed by the actor."""
    import contextlib

    import torch
    from _gpu_day_phases import bench_ctx, check_finite, rollout_batch

    from gerl.config import load_config
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
                    apply_levers(c.pipe, load_config(None, ["model.merge_lora=true", "model.vae_dtype=fp32",
                                                            f"model.compile={str(variant == 'merged_compiled').lower()}"]))
                trajs, _ = ctx.bench.our_rollout(c, embeds, 0, images_too=False)
                metrics = c.actor.update(rollout_batch(c, embeds, trajs, adv), adv, step)
                row[variant] = metrics["ratio_max_dev_before_update"]
                ctx.numbers[dtype] = row
                ctx.save()
            check_finite(f"ratio {dtype}", {k: v for k, v in row.items() if isinstance(v, float)})
        del c
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
