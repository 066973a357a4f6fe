"""The GPU days' step MFU and TFLOP/s recomputed with today's FLOPs model, from each JSON's own seconds.

    python -m benchmarks gpu_day_mfu docs/tables/gpu_day/*.json

The GPU-day JSON (benchmarks/gpu_day.py) records each step's seconds and the FLOPs that day's model counted: the
policy's LoRA training as 3 forwards and no VAE. This prints, per step row (GeRL's, NFT's, AWM's, merged) and per
rollout table, the old count next to the new one (gerl/logging/flops.py: LoRA training without frozen weights'
gradients, the unmerged adapter's matmuls, one VAE decode per image, counted on the meta device) and the MFU or
TFLOP/s each gives over the same seconds. The recipes are read as the step phase reads them (`step_config`), with
the JSON's images and text length; trained steps per sample are the recipe's (the old count is rebuilt from them
and must equal the JSON's own `step_tflop`, which checks the reconstruction).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def sd3_configs():
    from types import SimpleNamespace

    from gerl.models import arch
    from gerl.models.family import families

    t, v = dict(arch.load_config("sd3.5-medium", "transformer")), arch.load_config("sd3.5-medium", "vae")
    return t, v, families()["sd3"], SimpleNamespace(transformer=SimpleNamespace(config=SimpleNamespace(**t)),
                                                    vae=SimpleNamespace(config=SimpleNamespace(**v)))


def old_step_tflop(cfg, config: dict, text_len: int, images: int, trained_steps: int) -> float:
    """The count the GPU days logged: rollout forwards + per trained point 3 forwards for the policy (+ 1 each for the
    reference, the anchor, awm's old pass); no adapter matmuls, no VAE."""
    from gerl.logging.flops import forward_flops, transformer_ops

    a, t, s = cfg.algo, cfg.train, cfg.sampling
    f = forward_flops(transformer_ops(config, cfg.model.resolution, text_len)) * (2 if s.guidance_scale > 1 else 1)
    if a.name == "flow_grpo":
        per_point, points = 3 + (t.beta > 0), images * trained_steps * t.inner_epochs
    else:
        per_point = 3 + (t.beta > 0) + (a.name == "nft" or a.anchor_beta > 0) + (a.name == "awm")
        points = images * a.train_timesteps * t.inner_epochs
    return (images * s.num_steps * f + points * per_point * f) / 1e12


def steps(data: dict) -> list[dict]:
    from _gpu_day_step import step_config, step_flops

    from gerl.config import trained_steps_per_sample
    from gerl.logging.flops import vae_decode_flops

    config, vae, sd3, view = sd3_configs()
    out = []
    for phase in ("step", "step_merged"):
        for name, row in (data.get("phases", {}).get(phase) or {}).items():
            if not isinstance(row, dict) or "step_s" not in row:
                continue
            cfg = step_config(name, rehearse=False)
            images, text_len, trained = row["images"], row["text_len"], trained_steps_per_sample(cfg)
            decode = vae_decode_flops(vae, sd3, sd3.latent_shape(view, cfg.model.resolution))
            new = step_flops(cfg, config, text_len, images, trained, decode) / 1e12
            # the H100 day's nft row divided by the fp32 CUDA-core peak (67, since fixed): TF32's, as the docs read it
            peak = row.get("peak_tflops") or (989.0 if row["dtype"] in ("bf16", "fp16") else 494.0)
            out.append({"phase": phase, "row": name, "step_s": row["step_s"], "peak_tflops": peak,
                        "old_tflop": old_step_tflop(cfg, config, text_len, images, trained),
                        "json_tflop": row["step_tflop"], "new_tflop": new,
                        "old_mfu": row["step_tflop"] / row["step_s"] / peak, "new_mfu": new / row["step_s"] / peak})
    return out


def rollouts(data: dict) -> list[dict]:
    """The rollout tables' TFLOP/s: ours at micro-batch 32, guidance 1, no adapter (the docs' figure), with one VAE
    decode per image added (the timed rollout decodes to PIL); FLUX.1's rows likewise."""
    from gerl.logging.flops import transformer_forward_flops, vae_decode_flops
    from gerl.models import arch
    from gerl.models.family import families

    out = []
    config, vae, sd3, view = sd3_configs()
    for row in (data.get("phases", {}).get("rollout") or {}).get("rows", []):
        if row["lora"] is False and row["guidance"] == 1.0:
            f = transformer_forward_flops(config, 512, 333)
            d = vae_decode_flops(vae, sd3, sd3.latent_shape(view, 512))
            ips = row["ours_images_per_s"]
            out.append({"what": f"sd3.5-m rollout mb {row['micro_batch']}", "old_tflops": ips * 10 * f / 1e12,
                        "new_tflops": ips * (10 * f + d) / 1e12})
    flux = families()["flux"]
    fv = arch.load_config("flux.1-dev", "vae")
    for row in (data.get("phases", {}).get("flux_rollout") or {}).get("rows", []):
        latent = (16, row["resolution"] // 8, row["resolution"] // 8)
        forwards = row["micro_batch"] * row["steps"]
        d = vae_decode_flops(fv, flux, latent) / 1e12
        out.append({"what": f"flux.1-dev rollout {row['resolution']}²", "old_tflops": row["ours_tflops"],
                    "new_tflops": (forwards * row["tflop_per_image_forward"] + row["micro_batch"] * d)
                    / row["ours_s"]})
    return out


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:]) or sorted(
        str(p) for p in (Path(__file__).resolve().parents[1] / "docs/tables/gpu_day").glob("*.json"))
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows, rolls = steps(data), rollouts(data)
        if not rows and not rolls:
            continue
        print(f"== {Path(path).name}")
        for r in rows:
            print(f"  {r['phase']:<12} {r['row']:<12} {r['step_s']:6.1f} s  TFLOP {r['json_tflop']:8.1f} (rebuilt "
                  f"{r['old_tflop']:8.1f}) → {r['new_tflop']:8.1f}   MFU of {r['peak_tflops']:.0f}: "
                  f"{100 * r['old_mfu']:5.2f} % → {100 * r['new_mfu']:5.2f} %   (of 800: {100 * r['old_mfu'] * r['peak_tflops'] / 800:5.2f} % → {100 * r['new_mfu'] * r['peak_tflops'] / 800:5.2f} %)")
        for r in rolls:
            print(f"  {r['what']:<28} TFLOP/s {r['old_tflops']:6.1f} → {r['new_tflops']:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
