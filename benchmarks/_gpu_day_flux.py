"""gpu_day's `flux_rollout` phase: FLUX.1-dev's architecture with random weights, gerl's rollout next to the stock
`FluxPipeline.__call__` with the same transformer, VAE, embeddings, noise, steps, micro-batch and guidance.

Settings: Flow-GRPO-Fast's FLUX recipe (recipes/flow_grpo_flux_fast_ocr.yaml): 6 steps, CPS noise 0.8 on a window of
3 steps in [0, 3] (ours records it; the stock pipeline is the plain ODE), dev's guidance embedding at 3.5, 128 T5
tokens, micro-batch 3. On a GPU: the published configs (assets/configs/flux.1-dev, gerl.models.arch), bf16, at 512
and 1024 px; the 12 B transformer is built by `arch.random_module` (meta, then uninitialised bf16 storage on the
GPU, then one normal draw per tensor), timed. With --rehearse: tiny-flux's transformer and VAE configs
(gerl.models.tiny) through the same builder, fp32 on CPU, at 64 and 128 px, 32 text tokens.

Prompt embeddings are random tensors of the real shapes (the text encoders run once per distinct prompt in a real
run: gerl's embedding cache). Both sides run the one transformer module, so the same attention kernel (diffusers'
default processor, torch SDPA). Per resolution: one warm-up of each side on the same shapes with 2 denoising steps
(kernel choice and the allocator's pool are per shape, not per step count), then one timed run of each,
CUDA-synchronised (bench_gpu.compare_stock). FLOPs per image-forward are counted by torch's FlopCounterMode on the
meta device (matmuls and attention of this very module at this shape); `ours_tflops` / `stock_tflops` are the
transformer's FLOPs over each side's whole time (VAE decode and PIL conversion included), comparable with the env
phase's matmul TFLOP/s. `ours_latents_finite` says whether the random bf16 model stayed finite (a speed number
either way).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

# recipes/flow_grpo_flux_fast_ocr.yaml's sampling: gerl's FLUX rollout as Flow-GRPO-Fast trains it
RECIPE = dict(sampler="cps", num_steps=6, noise_level=0.8, sde_window_size=3, sde_window_range=[0, 3],
              guidance_scale=3.5, micro_batch_size=3)
WARMUP = dict(num_steps=2, sde_window_size=1, sde_window_range=[0, 1])  # same shapes, fewer steps
GPU = dict(resolutions=(512, 1024), text_tokens=128, dtype="bf16")
REHEARSE = dict(resolutions=(64, 128), text_tokens=32, dtype="fp32")


def configs(rehearse: bool) -> dict[str, dict]:
    """The transformer's, the VAE's and the scheduler's configs: FLUX.1-dev's published ones, or tiny-flux's."""
    from gerl.models import arch

    if not rehearse:
        return {c: arch.load_config("flux.1-dev", c) for c in ("transformer", "vae", "scheduler")}
    from gerl.models.tiny import FLUX_SCHEDULERS, FLUX_TRANSFORMER_KWARGS, FLUX_VAE_KWARGS

    transformer = {"_class_name": "FluxTransformer2DModel", **FLUX_TRANSFORMER_KWARGS, "guidance_embeds": True}
    return {"transformer": transformer,
            "vae": {"_class_name": "AutoencoderKL", **FLUX_VAE_KWARGS},
            "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", **FLUX_SCHEDULERS["dev"]}}


def build(ctx) -> SimpleNamespace:
    """transformer, vae and scheduler of this mode on ctx.device, random weights; ctx.numbers gets the build time."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from gerl.models import arch

    mode = REHEARSE if ctx.rehearse else GPU
    dtype = ctx.bench.DTYPES[mode["dtype"]]
    cfg = configs(ctx.rehearse)
    t = ctx.sync()
    transformer = arch.random_module(cfg["transformer"], ctx.device, dtype, seed=0).requires_grad_(False)
    ctx.numbers["build_transformer_s"] = ctx.sync() - t
    vae = arch.random_module(cfg["vae"], ctx.device, dtype, seed=1).requires_grad_(False)
    ctx.numbers["build_s"] = ctx.sync() - t
    ctx.numbers.update(transformer_params=sum(p.numel() for p in transformer.parameters()), dtype=mode["dtype"],
                       attention=type(transformer.transformer_blocks[0].attn.processor).__name__,
                       build_peak_gib=ctx.peak_gib(), weights_gib=ctx.reset_peak())
    return SimpleNamespace(transformer=transformer, vae=vae,
                           scheduler=FlowMatchEulerDiscreteScheduler.from_config(cfg["scheduler"]))


def stock_pipeline(pipe):
    """diffusers' FluxPipeline around our transformer and VAE, text encoders and tokenizers None (it takes
    prompt_embeds directly), with its own scheduler (set_timesteps and step() keep state)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    stock = FluxPipeline(transformer=pipe.transformer, vae=pipe.vae,
                         scheduler=FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config),
                         **dict.fromkeys(["text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"]))
    stock.set_progress_bar_config(disable=True)
    return stock


def stock_rollout(c, stock, embeds, step: int) -> list:
    """The stock call on the same embeddings, guidance (dev's embedding), steps, resolution, micro-batches and
    per-sample noise generators as ours (bench_gpu.compare_stock's `run_stock`)."""
    import torch

    from gerl.workers.rollout import sample_seed

    images = []
    for sl, emb in zip(c.bench.micro_batches(c.images, c.sampling.micro_batch_size), embeds):
        gens = [torch.Generator("cpu").manual_seed(sample_seed(0, step, i)) for i in range(sl.start, sl.stop)]
        images += stock(prompt_embeds=emb.prompt, pooled_prompt_embeds=emb.pooled,
                        guidance_scale=c.sampling.guidance_scale, num_inference_steps=c.sampling.num_steps,
                        height=c.resolution, width=c.resolution, generator=gens, output_type="pil",
                        max_sequence_length=emb.prompt.shape[1]).images
    return images


def forward_tflop(transformer, latent_shape: tuple[int, ...], text_tokens: int) -> float:
    """TFLOP of one image-forward of `transformer` at this latent and text length: FlopCounterMode over a copy of
    its structure on the meta device (no memory, no compute)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from gerl.models.flux import image_ids, pack

    cfg, (_, h, w) = transformer.config, latent_shape
    with torch.device("meta"):
        meta = type(transformer).from_config(cfg)
        with FlopCounterMode(display=False) as counter:
            meta(hidden_states=pack(torch.zeros(1, *latent_shape)), timestep=torch.ones(1),
                 guidance=torch.ones(1) if cfg.guidance_embeds else None,
                 pooled_projections=torch.zeros(1, cfg.pooled_projection_dim),
                 encoder_hidden_states=torch.zeros(1, text_tokens, cfg.joint_attention_dim),
                 txt_ids=torch.zeros(text_tokens, 3), img_ids=image_ids(h, w, "meta", torch.float32),
                 return_dict=False)
    return counter.get_total_flops() / 1e12


def flux_rollout(ctx) -> None:
    """The phase: per resolution, images/s of ours and of the stock call, their ratio, FLOPs and peak memory."""
    from gerl.config import SamplingConfig
    from gerl.logging.memory import StagePeaks
    from gerl.models.family import families

    mode, n = REHEARSE if ctx.rehearse else GPU, ctx.numbers
    pipe = build(ctx)
    ctx.save()
    flux, b = families()["flux"], ctx.bench
    sampling = SamplingConfig(**RECIPE)
    embedder = b.RandomEmbedder(mode["text_tokens"], pipe.transformer.config.joint_attention_dim,
                                pipe.transformer.config.pooled_projection_dim, ctx.device, pipe.transformer.dtype)
    stock = stock_pipeline(pipe)
    n.update(settings={**RECIPE, "text_tokens": mode["text_tokens"], "warmup": WARMUP}, rows=[])
    for res in mode["resolutions"]:
        mb = sampling.micro_batch_size
        latent = flux.latent_shape(pipe, res)
        c = SimpleNamespace(device=ctx.device, pipe=pipe, bench=b, images=mb, resolution=res, latent_shape=latent,
                            peaks=StagePeaks(ctx.device))
        embeds = [embedder([f"flux rollout prompt {i}" for i in range(mb)])]
        wall = {}
        for part, changes in (("warmup", WARMUP), ("timed", {})):
            c.sampling = dataclasses.replace(sampling, **changes)
            c.schedule = flux.schedule(pipe.scheduler.config, c.sampling.num_steps, latent)
            t = ctx.sync()
            got, trajs = b.compare_stock(c, embeds, reps=1, warmup=0, stock=stock, run_stock=stock_rollout)
            wall[f"{part}_wall_s"] = ctx.sync() - t
        tflop = forward_tflop(pipe.transformer, latent, mode["text_tokens"])
        forwards = mb * sampling.num_steps
        n["rows"].append({
            "resolution": res, "micro_batch": mb, "steps": sampling.num_steps,
            "image_tokens": latent[1] * latent[2] // 4,
            **{k: got[k] for k in ("ours_images_per_s", "stock_images_per_s", "ratio", "ours_s", "stock_s")},
            "tflop_per_image_forward": tflop, "ours_tflops": forwards * tflop / got["ours_s"],
            "stock_tflops": forwards * tflop / got["stock_s"], **wall,
            "ours_latents_finite": bool(trajs[0].final_latents.isfinite().all()),
            "peak_gib": dict(c.peaks.peaks) if ctx.device.type == "cuda" else None})
        ctx.save()
    n["min_ratio"] = min(r["ratio"] for r in n["rows"])
    n["bar"] = b.STOCK_BAR
