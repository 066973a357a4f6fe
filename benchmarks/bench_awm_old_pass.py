"""AWM's old log-probs, before and after: a no-grad pass over every trained point vs the training forward's own value
until the first optimizer step (gerl/workers/matching.py). Forwards per step and s/step on ocr-mini side by side in
one process, and the transformer FLOPs the pass costs on the SD3.5 recipe (analytic, gerl/logging/throughput.py).

Each batch is one step generated with the recipe's rollout and OCR reward (the same for both, so timed once); on
it the update runs in pairs from the same starting state (deep copies of the actor), before = every old log-prob
from the pass (`reuse_training_forward=False`), after = the default, the order alternating between pairs so machine
noise hits both alike. s/step = the rollout's seconds + the update's; wall and process CPU time are both given (the
CPU time is the steadier on a shared machine). Forwards are counted by a hook on the transformer (samples through
it, and calls) and checked against the analytic count used for the FLOPs.

    python -m benchmarks awm_old_pass [--batches 2] [--repeats 3] [--threads N] [--recipe RECIPE] [key=value ...]
    python -m benchmarks awm_old_pass --flops-only [--flops-recipe recipes/awm_sd3_ocr.yaml]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def step_forwards(cfg, reuse: bool) -> dict[str, int]:
    """Transformer forwards per training step of an awm config, counted in samples (a CFG forward counts 2): the
    rollout, the policy's training forwards (each followed by a backward of ~2 forwards), the anchor's and the
    reference's no-grad forwards, and the old-log-prob pass — every trained point before, all but those of the
    first mini-batch of the first epoch after (the global mini-batch: each rank skips its own share of it)."""
    from gerl.config import trained_steps_per_sample

    s, t = cfg.sampling, cfg.train
    images = cfg.data.prompts_per_step * cfg.data.group_size
    mini = t.mini_batch_size or images
    k, e = trained_steps_per_sample(cfg), t.inner_epochs
    cfg_mult = 2 if s.guidance_scale > 1 else 1
    points = images * k * e * cfg_mult
    return {"rollout": images * s.num_steps * cfg_mult, "policy": points,
            "anchor": points if cfg.algo.anchor_beta > 0 else 0, "reference": points if t.beta > 0 else 0,
            "old_pass": points if not reuse else (images * e - mini) * k * cfg_mult}


def step_flops(cfg, reuse: bool) -> dict[str, float]:
    """Transformer matmul FLOPs per step: each forward of `step_forwards` × one sample's forward FLOPs, the policy's
    × its LoRA training factor (forward + backward without the frozen weights' gradients: ≈ 2.2 here, where the
    dense convention counted 3; gerl/logging/flops.py). The VAE decode is not part of this comparison."""
    from gerl.logging.flops import Lora, training_factor
    from gerl.logging.throughput import model_config_for, text_seq_len, transformer_forward_flops
    from gerl.models.family import families
    from gerl.models.loader import resolve_model_path

    # SD3.5-Medium's published configs ship in assets/ (no weights needed to count FLOPs)
    path = (REPO / "assets/configs/sd3.5-medium" if "stable-diffusion-3.5-medium" in cfg.model.path
            else resolve_model_path(cfg.model.path))
    found = model_config_for(str(path))
    if found is None:
        raise SystemExit(f"no transformer config found for model.path={cfg.model.path}")
    config, vae_factor = found
    m = cfg.model
    text_len = text_seq_len(m.max_sequence_length)
    f = transformer_forward_flops(config, m.resolution, text_len, 1, vae_factor)
    lora = Lora(tuple(m.lora_targets or families()["sd3"].lora_targets), m.lora_rank) if m.lora else None
    train = training_factor(config, m.resolution, text_len, lora, vae_factor)
    fw = step_forwards(cfg, reuse)
    out = {k: float(v * f * (train if k == "policy" else 1)) for k, v in fw.items()}
    out["total"] = sum(out.values())
    return out


def flops_report(recipe: str) -> None:
    from gerl.config import load_config

    cfg = load_config(recipe, [])
    before, after = step_flops(cfg, reuse=False), step_flops(cfg, reuse=True)
    fb, fa = step_forwards(cfg, False), step_forwards(cfg, True)
    print(f"{recipe}: {cfg.data.prompts_per_step}×{cfg.data.group_size} images, {cfg.sampling.num_steps} rollout steps, "
          f"K={cfg.algo.train_timesteps}, inner_epochs={cfg.train.inner_epochs}, mini-batch "
          f"{cfg.train.mini_batch_size or 'all'}, {cfg.model.resolution}px, text {cfg.model.max_sequence_length}+77 tokens")
    print(f"{'part':<10}{'forwards before':>16}{'after':>8}{'PFLOP before':>14}{'after':>8}")
    for k in fb:
        print(f"{k:<10}{fb[k]:>16}{fa[k]:>8}{before[k] / 1e15:>14.1f}{after[k] / 1e15:>8.1f}")
    saved = before["total"] - after["total"]
    print(f"{'total':<10}{sum(fb.values()):>16}{sum(fa.values()):>8}"
          f"{before['total'] / 1e15:>14.1f}{after['total'] / 1e15:>8.1f}")
    print(f"the old-log-prob pass: {before['old_pass'] / before['total']:.1%} of the step's transformer FLOPs before "
          f"({before['old_pass'] / after['total']:.1%} of what is left after); saved: {saved / before['total']:.1%}")


def measure(recipe: str, batches: int, repeats: int, threads: int, overrides: list[str]) -> None:
    import torch

    from gerl.config import load_config
    from gerl.logging.quiet import quiet_libraries
    from gerl.trainer import Trainer, prepare
    from gerl.workers.matching import matching_update

    quiet_libraries()
    if threads:
        torch.set_num_threads(threads)
    cfg = load_config(recipe, ["output_dir=runs/bench_awm_old_pass", "overwrite=true", "log.tensorboard=false",
                               "log.progress_bar=false", "validation.every=-1", *overrides])
    if cfg.algo.name != "awm":
        raise SystemExit(f"{recipe} trains algo.name={cfg.algo.name}; this benchmark needs awm")
    trainer = Trainer(cfg, prepare(cfg))
    rollout, actor = trainer.engine.rollout, trainer.engine.actor.worker

    def counting(transformer, into: list):
        return transformer.register_forward_pre_hook(
            lambda m, a, kw: into.append(kw["hidden_states"].shape[0]), with_kwargs=True)

    def timed(fn) -> tuple[float, float]:
        w, c = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - w, time.process_time() - c

    rollout.generate(*trainer.next_prompts(0), 0)  # warm-up: the OCR models load on the first call
    rows: dict[bool, list[dict]] = {False: [], True: []}
    gen, gen_fw = [], []
    for step in range(1, batches + 1):
        fw: list[int] = []
        hook = counting(rollout.pipe.transformer, fw)
        out = []
        gen.append(timed(lambda: out.append(rollout.generate(*trainer.next_prompts(step), step))))
        hook.remove()
        gen_fw.append(sum(fw))
        batch, _ = out[0]
        adv = trainer.advantages(batch)
        for r in range(repeats):  # A/B pairs on this batch, the order alternating
            for reuse in ((False, True) if r % 2 == 0 else (True, False)):
                trial = copy.deepcopy(actor)  # the same starting weights, optimizer and anchor for both
                fw = []
                counting(trial.transformer, fw)
                wall, cpu = timed(lambda: matching_update(trial, batch, adv, step, reuse_training_forward=reuse))
                rows[reuse].append({"wall": wall, "cpu": cpu, "samples": sum(fw), "calls": len(fw)})
            print(f"batch {step} pair {r + 1}: update wall before {rows[False][-1]['wall']:.2f} s, after "
                  f"{rows[True][-1]['wall']:.2f} s", flush=True)
    trainer.engine.close()

    med = statistics.median
    g_wall, g_cpu = med(w for w, _ in gen), med(c for _, c in gen)
    print(f"{recipe} {' '.join(overrides)}: {len(batch)} images/step, torch threads {torch.get_num_threads()}, "
          f"{batches} batches × {repeats} update pairs (medians); rollout incl. OCR reward {g_wall:.2f} s wall, "
          f"{g_cpu:.2f} s CPU, {gen_fw[0]} samples through the transformer")
    print(f"{'old log-probs':<26}{'update fwd samples':>19}{'calls':>7}{'update wall s':>14}{'CPU s':>8}"
          f"{'s/step wall':>12}{'CPU':>8}")
    for reuse, name in ((False, "before: no-grad pass"), (True, "after: training forward")):
        r = rows[reuse]
        uw, uc = med(x["wall"] for x in r), med(x["cpu"] for x in r)
        print(f"{name:<26}{r[0]['samples']:>19}{r[0]['calls']:>7}{uw:>14.3f}{uc:>8.3f}"
              f"{g_wall + uw:>12.3f}{g_cpu + uc:>8.3f}")
    for key in ("wall", "cpu"):
        pairs = list(zip(rows[True], rows[False]))
        u = med(a[key] / b[key] for a, b in pairs)
        g = g_wall if key == "wall" else g_cpu
        st = med((g + a[key]) / (g + b[key]) for a, b in pairs)
        print(f"after/before, {key} time (median of paired ratios): update {u:.3f}, step {st:.3f}")
    want_b, want_a = step_forwards(cfg, False), step_forwards(cfg, True)
    for reuse, want in ((False, want_b), (True, want_a)):
        counted = rows[reuse][0]["samples"] + gen_fw[0]
        print(f"{'after' if reuse else 'before'}: counted {counted} samples/step, the analytic count says "
              f"{sum(want.values())} ({'agree' if counted == sum(want.values()) else 'DIFFER'})")


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--recipe", default="recipes/ocr_mini_awm.yaml", help="the awm recipe measured (ocr-mini on CPU)")
    ap.add_argument("--batches", type=int, default=2, help="rollout batches generated (each a new step)")
    ap.add_argument("--repeats", type=int, default=3, help="before/after update pairs per batch")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--flops-recipe", default="recipes/awm_sd3_ocr.yaml", help="the recipe whose FLOPs are counted")
    ap.add_argument("--flops-only", action="store_true", help="only the analytic FLOPs (no model runs)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of --recipe")
    args = ap.parse_args()
    flops_report(args.flops_recipe)
    if not args.flops_only:
        print()
        measure(args.recipe, args.batches, args.repeats, args.threads, args.overrides)


if __name__ == "__main__":
    main()
