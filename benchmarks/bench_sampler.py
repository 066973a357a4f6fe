"""Our denoising loop (SDE window with log-probs) vs the stock diffusers SD3 pipeline: wall-time ratio.

Same tiny model, same prompts (embeddings precomputed for both), same step count and batch, latents out (no
decode), interleaved repeats so machine noise hits both alike. Target: ratio ≤ 1.05.

    python -m benchmarks sampler [--steps 10] [--batch 8] [--repeats 15]
"""

import argparse
import statistics
import time

import torch

from gerl.models.loader import TextEmbedder, load_pipeline
from gerl.sampling.loop import denoise, make_schedule, sde_window
from gerl.workers.rollout import latent_noise


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--sampler", default="cps")
    ap.add_argument("--window", type=int, default=3, help="SDE window size (0 = every step stochastic)")
    args = ap.parse_args()

    pipe = load_pipeline("tiny")
    emb = TextEmbedder(pipe, 32)([f'a sign that says "bench {i}"' for i in range(args.batch)])
    sched = make_schedule(pipe.scheduler.config, args.steps)
    sde = sde_window(args.steps, args.window, (0, min(5, args.steps - 1)), torch.Generator().manual_seed(0))
    h = args.resolution // 4
    seeds = list(range(args.batch))

    def ours():
        noise, gens = latent_noise(seeds, (16, h, h))
        return denoise(pipe.transformer, emb, noise, sched, sde, args.sampler, 0.8, 1.0, gens).final_latents

    def stock():
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return pipe(prompt_embeds=emb.prompt, pooled_prompt_embeds=emb.pooled, num_inference_steps=args.steps,
                    guidance_scale=1.0, height=args.resolution, width=args.resolution, generator=gens,
                    output_type="latent").images

    for fn in (ours, stock):  # warm-up
        fn()
    t_ours, t_stock = [], []
    for _ in range(args.repeats):
        for fn, acc in ((ours, t_ours), (stock, t_stock)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    mo, ms = statistics.median(t_ours), statistics.median(t_stock)
    print(f"steps={args.steps} batch={args.batch} res={args.resolution} sampler={args.sampler} window={args.window} "
          f"threads={torch.get_num_threads()}")
    print(f"gerl denoise (with log-probs): median {mo * 1000:.1f} ms")
    print(f"diffusers StableDiffusion3Pipeline: median {ms * 1000:.1f} ms")
    print(f"ratio gerl/stock = {mo / ms:.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main()
