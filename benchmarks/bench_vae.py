"""VAE decode seconds, TFLOP/s and PSNR in fp32, bf16 and bf16 channels_last (model.vae_dtype; gerl/models/vae.py).

    python -m benchmarks vae --out vae.json                                   # a GPU: 512², micro-batch 8
    python -m benchmarks vae --resolution 128 --batch 1 --reps 2 --threads 1  # a CPU

The published VAE architectures of SD3.5-Medium, FLUX.1-dev and Qwen-Image (assets/configs, random weights: the speed
of the architecture, not of trained weights) decode the same N(0, 1) canonical latents through their model family's
`decode`, as the rollout does: fp32 (on a GPU with TF32 convolutions, torch's default there), bf16 as gerl prepares
it (`prepare_vae`), bf16 with contiguous and with channels-last weights, fp32 channels-last. Per variant: a warm-up,
then `reps` timed decodes (min and median seconds); FLOPs per image from `vae_decode_flops` (FlopCounterMode on the
meta device); PSNR of the images against fp32's (uint8). The JSON is rewritten after each VAE. The H200 numbers of
docs/benchmarks.md ("The VAE decode") were taken by an inline copy of this loop (the device ran the main checkout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

MODELS = {"sd3": "sd3.5-medium", "flux": "flux.1-dev", "qwenimage": "qwen-image"}


def timed(fn, reps: int, device: torch.device) -> list[float]:
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def one_vae(family_name: str, args, device: torch.device) -> dict:
    from gerl.logging.flops import vae_decode_flops
    from gerl.models import arch
    from gerl.models.family import families
    from gerl.models.vae import decode_psnr, prepare_vae, to_channels_last, to_uint8

    family, model = families()[family_name], MODELS[family_name]
    vae_cfg, tr_cfg = arch.load_config(model, "vae"), arch.load_config(model, "transformer")
    view = SimpleNamespace(transformer=SimpleNamespace(config=SimpleNamespace(**tr_cfg)),
                           vae=SimpleNamespace(config=SimpleNamespace(**vae_cfg)))
    latent = family.latent_shape(view, args.resolution)
    flops = vae_decode_flops(vae_cfg, family, latent)
    latents = torch.randn(args.batch, *latent, generator=torch.Generator().manual_seed(0)).to(device)
    def build():
        return arch.random_module(vae_cfg, device, torch.float32, seed=0)

    fp32 = build()
    variants = {"fp32": fp32, "bf16 (gerl)": prepare_vae(build(), torch.bfloat16),
                "bf16_contiguous": build().to(torch.bfloat16),
                "bf16_channels_last": to_channels_last(build().to(torch.bfloat16))}
    if not args.skip_fp32_channels_last:
        variants["fp32_channels_last"] = to_channels_last(build())
    out = {"model": model, "latent": list(latent), "batch": args.batch, "resolution": args.resolution,
           "tflop_per_image": flops / 1e12, "variants": {}}
    with torch.no_grad():
        for name, vae in variants.items():
            run = lambda vae=vae: to_uint8(family.decode(vae, latents)).cpu()  # noqa: E731 — as the rollout, host copy
            run()  # warm-up: cuDNN picks its kernels
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            ts = timed(run, args.reps, device)
            row = {"min_s": min(ts), "median_s": statistics.median(ts), "reps": len(ts),
                   "tflops": flops * args.batch / min(ts) / 1e12}
            if device.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if name != "fp32":
                row["psnr_db_vs_fp32"] = decode_psnr(vae, fp32, latents, family)
            out["variants"][name] = row
            print(f"{model} {args.resolution}² ×{args.batch} {name:>18}: {row['min_s']:.4f} s min, "
                  f"{row['median_s']:.4f} median, {row['tflops']:.1f} TFLOP/s"
                  + (f", PSNR {row['psnr_db_vs_fp32']:.1f} dB" if "psnr_db_vs_fp32" in row else ""), flush=True)
            del vae
    base = out["variants"]["fp32"]["min_s"]
    out["speedup_vs_fp32"] = {k: base / v["min_s"] for k, v in out["variants"].items()}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m benchmarks vae", description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="sd3,flux,qwenimage", help="comma-separated: sd3, flux, qwenimage")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="images per decode (the rollout's micro-batch)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--skip-fp32-channels-last", action="store_true")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    from gerl.models.loader import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
              "settings": vars(args), "vaes": {}}
    for name in args.families.split(","):
        try:
            result["vaes"][name] = one_vae(name, args, device)
        except Exception as e:  # noqa: BLE001 — one VAE failing (memory) leaves the others' numbers
            result["vaes"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name}: {result['vaes'][name]['error']}", file=sys.stderr)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
