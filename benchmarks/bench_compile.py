"""model.compile and model.attention_backend on one transformer: compile time, graphs, speed against eager, and the
first ratio's exactness (rollout log-probs against the training replay at the same weights).

    python -m benchmarks compile --out compile.json                          # the tiny SD3 on CPU (~3 min cold)
    python -m benchmarks compile --arch sd35m --dtype bf16 --resolution 512 --out compile.json   # a GPU

Phases (each writes the JSON again when it ends; `--deadline-s` skips what would start after it):
    env       torch, device; which attention backends run here (gerl.models.attention's probe on a small model)
    eager     the eager baseline: the rollout's denoising of `--batch` samples (no grad) and one training micro-batch's
              forward + backward (`--train-batch`), median of `--reps`; max |ratio − 1| of the replay on the rollout's
              batch (ratio_max_dev: the graphs alone) and in training micro-batches (…_train_split: + batch rounding)
    compiled  the same after `compile_transformer` (inductor, emulate_precision_casts): the warm-up's graphs and compile
              seconds, a second pass under error_on_recompile, then the timings and the ratio
    raw       compiled without emulate_precision_casts: the ratio inductor's default fusion gives in bf16/fp16
    cudnn     model.attention_backend=cudnn, compiled (CUDA only)
The model: the tiny SD3 (`--arch tiny`) or SD3.5-Medium's transformer at random weights (`--arch sd35m`), a rank
`--rank` LoRA on the family's default targets with lora_B drawn (so the adapter matters), SD3's CFG at `--guidance`.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch


def build(arch: str, device: torch.device, dtype: torch.dtype, rank: int, seed: int = 0):
    from gerl.models.loader import add_lora
    from gerl.models.sd3 import SD3

    if arch == "tiny":
        from diffusers import SD3Transformer2DModel

        from gerl.models.tiny import TRANSFORMER_KWARGS

        torch.manual_seed(seed)
        tr = SD3Transformer2DModel(**TRANSFORMER_KWARGS).to(device, dtype)
    else:
        from gerl.models.sd35_arch import build_component

        torch.manual_seed(seed)
        tr = build_component("transformer", device, dtype)
    add_lora(tr, rank, float(rank), list(SD3.lora_targets), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in tr.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    return tr.eval()


def inputs(tr, batch: int, resolution: int, text_len: int, device):
    """Random text embeddings (with the CFG negatives), per-sample noise and generators, the σ schedule."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from gerl.sampling.loop import Embeds, make_schedule
    from gerl.workers.rollout import latent_noise

    c = tr.config
    g = torch.Generator().manual_seed(7)
    emb = lambda: torch.randn(batch, text_len, c.joint_attention_dim, generator=g)  # noqa: E731
    pooled = lambda: torch.randn(batch, c.pooled_projection_dim, generator=g)  # noqa: E731
    embeds = Embeds(emb(), pooled(), emb(), pooled()).to(device)
    side = resolution // 8 if resolution >= 128 else resolution // 4  # SD3's VAE: 8×; the tiny one: 4×
    noise, gens = latent_noise(list(range(batch)), (c.in_channels, side, side))
    return embeds, noise.to(device), gens, make_schedule(FlowMatchEulerDiscreteScheduler(shift=3.0).config, 4)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(tr, args, device, reps: int) -> dict:
    """Rollout (no grad) and training (grad, forward + backward) times, and the replay's max |ratio − 1|."""
    from gerl.sampling.loop import denoise, replay_log_prob

    embeds, noise, gens, sched = inputs(tr, args.batch, args.resolution, args.text_len, device)
    sde = [0, 1, 2]  # every step but the last: recorded
    out = {"rollout_s": [], "train_s": []}
    for rep in range(reps):
        g = [torch.Generator().manual_seed(100 + i) for i in range(args.batch)]
        sync(device)
        t0 = time.perf_counter()
        traj = denoise(tr, embeds, noise, sched, sde, "cps", 0.7, args.guidance, g)
        sync(device)
        out["rollout_s"].append(time.perf_counter() - t0)
    def replay(idx, k, backward: bool):
        kk = torch.full((len(idx),), k)
        o = replay_log_prob(tr, traj.latents[idx, kk], traj.next_latents[idx, kk], traj.steps_of(idx, kk),
                            embeds.index(idx.to(device)), sched, "cps", 0.7, args.guidance)
        if backward:
            o.log_prob.float().sum().backward()
        return (torch.exp(o.log_prob.detach().float().cpu() - traj.log_probs[idx, k].cpu()) - 1).abs().max()

    # The ratio: the training graph (grad on) on the rollout's own batch, so that only the two graphs differ — a
    # replay in other micro-batches adds the GEMMs' batch-size rounding, which a random-weight SD3.5-M in bf16
    # amplifies to |ratio − 1| ≈ 0.38 eager or compiled alike (H200, micro-batch 2 against 8).
    whole = torch.arange(args.batch)
    dev = max(float(replay(whole, k, backward=False)) for k in range(len(sde)))
    split = 0.0
    for s0 in range(0, args.batch, args.train_batch):
        idx = torch.arange(s0, min(s0 + args.train_batch, args.batch))
        for k in range(len(sde)):
            sync(device)
            t0 = time.perf_counter()
            split = max(split, float(replay(idx, k, backward=True)))
            sync(device)
            out["train_s"].append(time.perf_counter() - t0)
    tr.zero_grad(set_to_none=True)
    return {"ratio_max_dev": dev, "ratio_max_dev_train_split": split,
            "rollout_s_median": statistics.median(out["rollout_s"][1:] or out["rollout_s"]),
            "train_s_median": statistics.median(out["train_s"][1:] or out["train_s"]), **out}


def compiled_phase(tr, args, device, options=None) -> dict:
    from gerl.models.compile import CompileWatch, compile_transformer

    torch._dynamo.reset()
    info = compile_transformer(tr, variants=16, options=options)
    with CompileWatch() as warm:
        first = measure(tr, args, device, reps=1)
    with torch._dynamo.config.patch(error_on_recompile=True), CompileWatch() as again:
        timed = measure(tr, args, device, reps=args.reps)
    return {"compile": info, "warmup": warm.counts, "first_ratio_max_dev": first["ratio_max_dev"],
            "after_warmup": again.counts, **timed}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks compile", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--out", default="compile.json")
    p.add_argument("--arch", choices=["tiny", "sd35m"], default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--text-len", type=int, default=109, help="text tokens: 77 CLIP + T5's (SD3.5: 77 + 256)")
    p.add_argument("--batch", type=int, default=4, help="rollout samples (CFG doubles the rows)")
    p.add_argument("--train-batch", type=int, default=2)
    p.add_argument("--guidance", type=float, default=4.5)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--phases", default="env,eager,compiled,raw,cudnn")
    p.add_argument("--deadline-s", type=float, default=1e9)
    args = p.parse_args(argv)
    t_start = time.time()
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    result = {"settings": vars(args), "phases": {}}
    path = Path(args.out)

    def save():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str) + "\n")

    base = None
    for phase in args.phases.split(","):
        if time.time() - t_start > args.deadline_s:
            result["phases"][phase] = {"skipped": "deadline"}
            save()
            continue
        t0 = time.time()
        try:
            if phase == "env":
                from gerl.models.attention import BACKENDS, set_attention_backend

                probes = {}
                for name in BACKENDS:
                    try:
                        set_attention_backend(build("tiny", device, dtype, 4), name)
                        probes[name] = "ok"
                    except Exception as e:  # noqa: BLE001 — the message is the result
                        probes[name] = str(e)[:300]
                r = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device)
                     if device.type == "cuda" else "cpu", "attention_backends": probes}
            else:
                if base is None:
                    base = build(args.arch, device, dtype, args.rank)
                tr = copy.deepcopy(base)  # a deep copy is never compiled (Module.__getstate__)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                if phase == "eager":
                    r = measure(tr, args, device, args.reps)
                elif phase == "compiled":
                    r = compiled_phase(tr, args, device)
                elif phase == "raw":
                    r = compiled_phase(tr, args, device, options={"emulate_precision_casts": False})
                elif phase == "cudnn":
                    from gerl.models.attention import set_attention_backend

                    set_attention_backend(tr, "cudnn")
                    r = compiled_phase(tr, args, device)
                else:
                    raise ValueError(f"unknown phase {phase}")
                if device.type == "cuda":
                    r["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                del tr
        except Exception as e:  # noqa: BLE001 — record it and go on with the next phase
            r = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        r["phase_s"] = time.time() - t0
        result["phases"][phase] = r
        save()
        print(phase, json.dumps({k: v for k, v in r.items() if not isinstance(v, list)}, default=str), flush=True)
    eager, comp = result["phases"].get("eager", {}), result["phases"].get("compiled", {})
    if "rollout_s_median" in eager and "rollout_s_median" in comp:
        result["speedup"] = {k: eager[k] / comp[k] for k in ("rollout_s_median", "train_s_median")}
        save()
    return result


if __name__ == "__main__":
    main()
