"""gpu_day's `fsdp` phase: FSDP2's code path on one GPU (issue 44's GPU proof).

SD3.5-M's transformer (random weights, the published architecture) fully fine-tuned in bf16 through the data-parallel
layer exactly as `engine.fsdp=true` builds it (gerl/engine/parallel.py: `fully_shard` per block then the root, fp32
sharded masters, bf16 forwards, fp32 gradient reduction) over a world-1 process group — NCCL on the GPU, gloo in the
CPU rehearsal. One world-1 rank holds every shard, so this measures the code path and its memory, not the
collectives (they need two GPUs: the CPU suite proves 2 ranks equal 1 with gloo, tests/engine/test_fsdp.py).

Recorded: the update's seconds for `images` images (micro-batch `micro`), its peak and the actor state it leaves
(fp32 masters, gradients, AdamW), the first update's max |ratio − 1| (the rollout ran the unsharded bf16 model:
FSDP2's bf16 cast of the fp32 masters holds the same values, so it must be ≈ 1e-7 or less — exactly what a
sharded hybrid host relies on), and `gerl plan`'s prediction for the same configuration (engine.fsdp=true, one actor
GPU) beside the measured peak.
"""

from __future__ import annotations

import dataclasses
import functools
import socket

RATIO_BOUND = 1e-5  # bf16 forwards on both sides, the same values: anything above is a wrong cast or a wrong shard


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp_step(ctx, bench_ctx, rollout_batch, phase_failed) -> None:
    import torch
    import torch.distributed as dist

    from gerl.config import ModelConfig
    from gerl.engine.dist import init_process_group
    from gerl.engine.parallel import parallelize
    from gerl.workers.actor import ActorWorker

    n = ctx.numbers
    images, micro = (2, 1) if ctx.rehearse else (4, 2)
    dtype = "bf16"  # the rehearsal too: the bf16 cast of the fp32 masters is what the ratio checks
    c, n["build_s"] = bench_ctx(ctx, "--prompts", "1", "--group-size", str(images), "--lora-rank", "0",
                                "--dtype", dtype, "--no-grad-check")
    embeds = ctx.bench.step_embeds(c, 0)
    trajs, _ = ctx.bench.our_rollout(c, embeds, 0, images_too=False)  # the unsharded model, as a rollout host's
    batch = rollout_batch(c, embeds, trajs)
    adv = torch.randn(images, generator=torch.Generator().manual_seed(0))
    backend = "cuda:nccl" if ctx.device.type == "cuda" else "cpu:gloo"
    init_process_group(backend, f"127.0.0.1:{_free_port()}", 0, 1, timeout_s=120)
    try:
        train = dataclasses.replace(c.train, mini_batch_size=images, micro_batch_size=micro, learning_rate=1e-5,
                                    beta=0.0)  # no frozen reference copy: the plan below counts none either
        before = ctx.reset_peak()
        parallel = functools.partial(parallelize, group=dist.group.WORLD, shard=True,
                                     dtype=c.pipe.transformer.dtype, lora=False)
        actor = ActorWorker(c.pipe.transformer, train, ModelConfig(lora=False), c.sampling, max_steps=1,
                            images_per_step=images, seed=0, parallel=parallel)
        n["sharded_state_gib"] = None if before is None else ctx.reset_peak() - before
        t = ctx.sync()
        m = actor.update(batch, adv, 0)
        n.update(update_s=ctx.sync() - t, images=images, micro_batch=micro, dtype=dtype, peak_gib=ctx.peak_gib(),
                 ratio_max_dev=m["ratio_max_dev_before_update"], grad_norm=float(m["grad_norm"]),
                 fp32_masters=all(p.dtype == torch.float32 for p in actor.params),
                 sharded=actor.dp is not None and actor.dp.sharded)
        ctx.save()
    finally:
        dist.destroy_process_group()
    try:  # `gerl plan` leans on torch internals: its failure must not lose the measurement above
        n["plan_actor_peak_gib"] = _plan(ctx, images, micro)
    except Exception as e:  # noqa: BLE001
        n["plan_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    ctx.save()
    if not n["sharded"] or not n["fp32_masters"]:
        raise phase_failed(f"the actor was not sharded with fp32 masters: sharded {n['sharded']}, "
                           f"fp32 masters {n['fp32_masters']}")
    if not n["ratio_max_dev"] <= RATIO_BOUND:  # NaN fails here too
        raise phase_failed(f"sharded replay against the unsharded rollout: max |ratio - 1| {n['ratio_max_dev']}")


def _plan(ctx, images: int, micro: int) -> float | None:
    """`gerl plan`'s actor peak (GiB) for this phase's configuration: one sharded actor GPU, full fine-tuning."""
    from _gpu_day_phases import plan_model

    from gerl.config import load_config
    from gerl.plan import plan_for_config

    cfg = load_config(None, plan_model(ctx, "bf16") + ["model.lora=false", "engine.kind=ray", "engine.hybrid=false", "engine.fsdp=true",
                                     "engine.device=cuda", f"data.group_size={images}", "data.prompts_per_step=1",
                                     f"train.mini_batch_size={images}", f"train.micro_batch_size={micro}",
                                     f"sampling.micro_batch_size={images}", "train.beta=0"])
    return plan_for_config(cfg).role("actor").peak_gib_with(checkpointing=False)
