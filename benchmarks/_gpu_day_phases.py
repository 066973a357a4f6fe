"""gpu_day's phases (benchmarks/gpu_day.py runs them): a registry in the order of value, one function each.

A phase fills `ctx.numbers` (JSON-able) and calls `ctx.save()` after each part it has measured, so a timeout
keeps those parts; it raises PhaseFailed when a check fails (its numbers stand) and any other exception on an
error. On a GPU: SD3.5-Medium's architecture with random weights (gerl.models.sd35_arch), 512 px, bf16 unless said
(flux_rollout: FLUX.1-dev's, benchmarks/_gpu_day_flux.py). With --rehearse: the tiny SD3 (tiny-flux) on CPU at
64 px (fp32 unless said), the same code path.

To add a phase, decorate one function here with @phase(...); its place in this file is its place in the run.
`call` says which prepared device call runs it (`--call 1` or `--call 2`; docs/offline_install.md); call=0 runs
only when --phases names it. env runs in every call. The rehearsal runs the phases of every call.
The measuring code is benchmarks/bench_gpu.py's, _gpu_day_rollout.py's, _gpu_day_step.py's, _gpu_day_probes.py's
and bench_gpu_launchers.py's, called, not copied.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
RATIO_BOUND = 1e-3  # max |ratio − 1| before any update that smoke and fp16 accept (bench_gpu's)


class PhaseFailed(Exception):
    """A phase's check failed; the numbers it measured stand."""


@dataclass(frozen=True)
class Phase:
    name: str
    fn: Callable
    cap_s: int  # wall-clock cap on a GPU, seconds (cut to what is left of the run's deadline)
    rehearse_cap_s: int  # the same with --rehearse on 2 CPU cores
    h100_estimate_s: int  # the estimate reasoned from FLOPs (docs/benchmarks.md, "gpu_day"), process start included
    what: str  # one line for the log
    needs: tuple[str, ...] = ("torch", "diffusers")  # modules without which the phase is skipped, not failed
    missing_hint: str = ""
    call: int = 0  # the prepared device call that runs it (1, 2; 0: only when --phases names it)


PHASES: dict[str, Phase] = {}


def phase(name: str, *, cap_s: int, rehearse_cap_s: int, h100_estimate_s: int, what: str,
          needs: tuple[str, ...] = ("torch", "diffusers"), missing_hint: str = "", call: int = 0):
    def register(fn):
        PHASES[name] = Phase(name, fn, cap_s, rehearse_cap_s, h100_estimate_s, what, needs, missing_hint, call)
        return fn
    return register


@dataclass
class Ctx:
    rehearse: bool
    out: Path
    numbers: dict
    save: Callable[[], None]
    device: object = None
    bench: object = None  # benchmarks/bench_gpu.py
    t0: float = field(default_factory=time.perf_counter)

    def args(self, *extra: str):
        """bench_gpu's arguments for this mode: SD3.5-M at its defaults on the GPU, --tiny on CPU, plus `extra`."""
        args, error = self.bench.parse_args((["--tiny"] if self.rehearse else []) + list(extra))
        if error:
            raise ValueError(error)
        args.out, args.emulated = None, False
        return args

    def sync(self) -> float:
        return self.bench.sync(self.device)

    def peak_gib(self) -> float | None:
        import torch

        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None

    def reset_peak(self) -> float | None:
        """Reset the allocator's peak; GiB allocated now (None on a CPU)."""
        import torch

        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device) / 2**30


def run_phase(name: str, rehearse: bool, out: Path, numbers: dict, partial: Callable[[], None]) -> None:
    import torch

    import bench_gpu

    ctx = Ctx(rehearse, out, numbers, partial, bench=bench_gpu)
    if not rehearse and not torch.cuda.is_available():
        raise PhaseFailed("no CUDA device here; run with --rehearse on a CPU machine")
    ctx.device = torch.device("cpu" if rehearse else "cuda")
    PHASES[name].fn(ctx)


def check_finite(what: str, values: dict) -> None:
    """PhaseFailed naming every entry of `values` (floats or tensors) that is NaN or inf."""
    import math

    import torch

    bad = [k for k, v in values.items()
           if (isinstance(v, torch.Tensor) and not bool(torch.isfinite(v).all()))
           or (isinstance(v, float) and not math.isfinite(v))]
    if bad:
        raise PhaseFailed(f"{what}: non-finite {', '.join(bad)}")


def rollout_batch(c, embeds, trajs, rewards=None):
    """A RolloutBatch of step 0's prompts from recorded `trajs` (bench_gpu's context `c`)."""
    from gerl.sampling.loop import Embeds, Trajectory
    from gerl.workers.batch import RolloutBatch

    prompts, metadata, group_ids = c.bench_step_prompts(c, 0)
    n = c.images
    return RolloutBatch(prompts=prompts[:n], metadata=metadata[:n], group_ids=group_ids[:n],
                        embeds=Embeds.cat(embeds), schedule=c.schedule, traj=Trajectory.cat(trajs), images=[],
                        policy_version=0, rewards=rewards)


def bench_ctx(ctx: Ctx, *extra: str, sampling_changes: dict | None = None):
    """bench_gpu.make_ctx for this mode, timed: (its namespace, build seconds)."""
    t = ctx.sync()
    c = ctx.bench.make_ctx(ctx.args(*extra), ctx.device, sampling_changes)
    c.bench_step_prompts = ctx.bench.step_prompts
    return c, ctx.sync() - t


# ------------------------------------------------------------------ the phases, in the order of value

@phase("env", cap_s=60, rehearse_cap_s=60, h100_estimate_s=15, needs=("torch",), call=1,
       what="GPU, driver, CUDA, NCCL, versions, bf16 matmul TFLOP/s, cuBLAS workspaces, disk, /dev/shm (every call)")
def env(ctx: Ctx) -> None:
    import importlib.metadata as md
    import os
    import shutil
    import subprocess

    import torch

    n = ctx.numbers
    for pkg in ("torch", "diffusers", "transformers", "peft", "accelerate", "numpy", "ray", "rapidocr", "onnxruntime"):
        try:
            n[f"{pkg}_version"] = md.version(pkg)
        except md.PackageNotFoundError:
            n[f"{pkg}_version"] = None
    n.update(cuda=torch.version.cuda, cpus=os.cpu_count(),
             disk_free_gib=shutil.disk_usage(REPO).free / 2**30,
             dev_shm_gib=shutil.disk_usage("/dev/shm").total / 2**30 if os.path.isdir("/dev/shm") else None)
    if ctx.device.type == "cuda":
        p = torch.cuda.get_device_properties(ctx.device)
        n.update(gpu=p.name, gpu_memory_gib=p.total_memory / 2**30, sms=p.multi_processor_count,
                 nccl=".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None)
        try:
            n["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            n["driver"] = None
    ctx.save()
    if ctx.device.type == "cuda":  # before any other GEMM of this process: each thread's first one sizes its workspace
        try:
            n["cublas_workspace_mib"] = cublas_workspaces(ctx.device)
        except Exception as e:  # noqa: BLE001 - a reading beside the phase's own: the matmul peak still gets measured
            n["cublas_workspace_mib"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        ctx.save()
    # the MFU denominator: a large dense matmul (bf16 on the GPU; a small fp32 one on CPU only exercises the code)
    size, dtype = (8192, torch.bfloat16) if ctx.device.type == "cuda" else (512, torch.float32)
    a = torch.randn(size, size, device=ctx.device, dtype=dtype)
    b = torch.randn(size, size, device=ctx.device, dtype=dtype)
    for _ in range(3):
        a @ b
    reps, t = 10, ctx.sync()
    for _ in range(reps):
        a @ b
    seconds = ctx.sync() - t
    n["matmul_tflops"] = 2 * size**3 * reps / seconds / 1e12
    n["matmul"] = f"{size}x{size}x{size} {str(dtype).removeprefix('torch.')}, {reps} reps after 3 warm-up"
    check_finite("env", {"matmul_tflops": n["matmul_tflops"]})


def cublas_workspaces(device) -> dict:
    """MiB the caching allocator gains at the first GEMM of (a) this thread, (b) autograd's backward thread, (c) a
    second Python thread — cuBLAS's per-handle workspace, which `gerl plan` does not count yet (docs/benchmarks.md,
    gpu_day, the H200's launchers: the plan's gap there is 64–69 MiB on a host that trains, 37 on a rollout host)."""
    import threading

    import torch

    def grown(fn) -> float:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.memory_allocated(device) - before - out.numel() * out.element_size()) / 2**20

    a = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = {"main_thread": grown(lambda: a @ a)}
    y = (a @ w).float().sum()  # the forward's GEMM runs here, on the main thread (its workspace exists now)
    out["autograd_backward"] = grown(lambda: (y.backward(), w.grad)[1])  # the GEMMs of backward: autograd's thread
    box = {}
    t = threading.Thread(target=lambda: box.update(mib=grown(lambda: a @ a)))
    t.start()
    t.join()
    out["second_thread"] = box.get("mib")
    return out


@phase("smoke", cap_s=120, rehearse_cap_s=90, h100_estimate_s=34,
       what="build (timed), one rollout micro-batch, one Flow-GRPO-Fast update; ratio before it; no NaN/inf")
def smoke(ctx: Ctx) -> None:
    import torch

    n, images = ctx.numbers, 4 if ctx.rehearse else 8
    c, n["build_s"] = bench_ctx(ctx, "--prompts", "1", "--group-size", str(images), "--no-grad-check")
    ctx.save()
    embeds = ctx.bench.step_embeds(c, 0)
    t = ctx.sync()
    trajs, pil = ctx.bench.our_rollout(c, embeds, 0)
    n["rollout_s"] = ctx.sync() - t
    traj = trajs[0]
    check_finite("rollout", {"latents": traj.latents, "next_latents": traj.next_latents, "log_probs": traj.log_probs,
                             "final_latents": traj.final_latents})
    rewards = torch.randn(images, generator=torch.Generator().manual_seed(0))
    adv = (rewards - rewards.mean()) / rewards.std()
    t = ctx.sync()
    m = c.actor.update(rollout_batch(c, embeds, trajs, rewards), adv, 0)
    n["update_s"] = ctx.sync() - t
    n.update(images=images, decoded=len(pil), ratio_max_dev=m["ratio_max_dev_before_update"], grad_norm=m["grad_norm"],
             grad_zero_frac=m.get("grad_zero_frac"), optimizer_steps=m["optimizer_steps"], peak_gib=ctx.peak_gib())
    ctx.save()
    check_finite("update", {k: v for k, v in m.items() if isinstance(v, float)})
    check_finite("weights after the update", {name: p for name, p in c.actor.named_params})
    if not n["ratio_max_dev"] <= RATIO_BOUND:
        raise PhaseFailed(f"max |ratio - 1| before the update {n['ratio_max_dev']:.3g} > {RATIO_BOUND:g}")
    if not (m["optimizer_steps"] == 1 and m["grad_norm"] > 0):
        raise PhaseFailed(f"the update took {m['optimizer_steps']} optimizer step(s), grad_norm {m['grad_norm']}")


@phase("train", cap_s=90, rehearse_cap_s=90, h100_estimate_s=54,
       what="one actor update at GeRL's settings: seconds and peak memory, checkpointing off and on, vs gerl plan")
def train(ctx: Ctx) -> None:
    import torch

    from gerl.config import ModelConfig
    from gerl.workers.actor import ActorWorker

    n, images = ctx.numbers, 4 if ctx.rehearse else 8
    c, n["build_s"] = bench_ctx(ctx, "--prompts", "1", "--group-size", str(images), "--no-grad-check")
    embeds = ctx.bench.step_embeds(c, 0)
    trajs, _ = ctx.bench.our_rollout(c, embeds, 0, images_too=False)
    batch = rollout_batch(c, embeds, trajs)
    adv = torch.randn(images, generator=torch.Generator().manual_seed(0))
    tr = c.pipe.transformer
    saved = [p.detach().clone() for p in c.actor.params]
    for ckpt in (False, True):
        train_cfg = dataclasses.replace(c.train, mini_batch_size=images, micro_batch_size=min(8, images))
        actor = ActorWorker(tr, train_cfg, ModelConfig(lora=True, lora_rank=32, gradient_checkpointing=ckpt),
                            c.sampling, max_steps=1, images_per_step=images, seed=0)
        on_entry = ctx.reset_peak()
        t = ctx.sync()
        m = actor.update(batch, adv, 0)
        seconds = ctx.sync() - t
        peak = ctx.peak_gib()
        key = "checkpointing_on" if ckpt else "checkpointing_off"
        n[key] = {"update_s": seconds, "peak_gib": peak, "transient_gib": None if peak is None else peak - on_entry,
                  "trained_steps": m["trained_steps_per_sample"], "images": images, "ratio_max_dev": m["ratio_max_dev_before_update"]}
        with torch.no_grad():
            for p, s in zip(actor.params, saved):
                p.copy_(s)
        if ckpt:
            tr.disable_gradient_checkpointing()
        ctx.save()
    try:  # `gerl plan` leans on torch internals: its failure must not lose the measurement above
        n["plan"] = train_plan(ctx, images)
    except Exception as e:  # noqa: BLE001
        n["plan_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]


def plan_model(ctx: Ctx, tiny_dtype: str) -> list[str]:
    """The model overrides `gerl plan` is asked about: the tiny SD3 in `tiny_dtype` when rehearsing, else SD3.5-M."""
    return ["model.path=tiny", "model.resolution=64", f"model.dtype={tiny_dtype}"] if ctx.rehearse else [
        "model.path=stabilityai/stable-diffusion-3.5-medium", "model.dtype=bf16", "model.resolution=512",
        "model.max_sequence_length=256"]


def train_plan(ctx: Ctx, images: int) -> dict:
    """`gerl plan`'s actor peak and training-phase transient for this configuration, checkpointing off and on."""
    from gerl.config import load_config
    from gerl.plan import plan_for_config

    cfg = load_config(None, plan_model(ctx, "fp32") + ["model.lora_rank=32", "model.lora_alpha=64", "engine.kind=ray",
                                     "engine.hybrid=false", "engine.device=cuda", f"data.group_size={images}",
                                     "data.prompts_per_step=1", f"train.mini_batch_size={images}",
                                     f"train.micro_batch_size={min(8, images)}", f"sampling.micro_batch_size={images}"])
    role = plan_for_config(cfg).role("actor")
    out = {}
    for ckpt in (False, True):
        phase_ = next((p for p in role.phases if p.name.startswith("training") and
                       ("checkpointing on" in p.name) == ckpt), None)
        out["checkpointing_on" if ckpt else "checkpointing_off"] = {
            "peak_gib": role.peak_gib_with(checkpointing=ckpt),
            "transient_gib": None if phase_ is None else phase_.gib, "phase": None if phase_ is None else phase_.name}
    return out


def variants(ctx: Ctx, names: tuple[str, ...]) -> None:
    """Whole steps of each named variant (benchmarks/_gpu_day_step.py), saved as each ends."""
    from _gpu_day_step import whole_step

    for name in names:
        ctx.numbers[name] = whole_step(ctx, name)
        ctx.save()


@phase("step8", cap_s=200, rehearse_cap_s=150, h100_estimate_s=110, needs=("torch", "diffusers", "rapidocr"), call=1,
       what="GeRL's row at 8 images per GPU (one group, mini-batch 4: one GPU's share of GeRL's 8-GPU run), as "
            "shipped and with every exact lever; OCR reward on CPU threads")
def step8(ctx: Ctx) -> None:
    variants(ctx, ("gerl8", "gerl8_levers"))


@phase("rollout", cap_s=240, rehearse_cap_s=150, h100_estimate_s=170, call=1,
       what="images/s: stock StableDiffusion3Pipeline vs gerl's rollout as shipped vs with every exact lever, no "
            "adapter and r32 LoRA, micro-batch 16/8, guidance 1/4.5; warm-ups per cell and side, 3 rotating reps")
def rollout(ctx: Ctx) -> None:
    from _gpu_day_rollout import rollout as measure

    measure(ctx)


@phase("ratio", cap_s=150, rehearse_cap_s=120, h100_estimate_s=90, call=1,
       what="max |ratio - 1| of the first update after the adapter moved, bf16 and fp16: shipped, exact merged LoRA, "
            "merged + compiled")
def ratio(ctx: Ctx) -> None:
    from _gpu_day_rollout import ratio as measure

    measure(ctx)
    for dtype in ("bf16", "fp16"):
        row = ctx.numbers.get(dtype, {})
        bad = [k for k in ("shipped", "merged", "merged_compiled") if not row.get(k, float("nan")) <= RATIO_BOUND]
        if bad:
            raise PhaseFailed(f"{dtype}: max |ratio - 1| above {RATIO_BOUND:g} (or not measured) for {', '.join(bad)}")


@phase("step", cap_s=240, rehearse_cap_s=150, h100_estimate_s=170, needs=("torch", "diffusers", "rapidocr"), call=2,
       what="GeRL's row at 64 images on one GPU (8 prompts x 8), as shipped and with every exact lever")
def step(ctx: Ctx) -> None:
    variants(ctx, ("gerl", "gerl_levers"))


@phase("algos", cap_s=150, rehearse_cap_s=150, h100_estimate_s=90, needs=("torch", "diffusers", "rapidocr"), call=2,
       what="DiffusionNFT's, AWM's and DGPO's steps in bf16 with TF32 (one GPU's share of their recipes)")
def algos(ctx: Ctx) -> None:
    variants(ctx, ("nft", "awm", "dgpo"))


@phase("fsdp", cap_s=120, rehearse_cap_s=120, h100_estimate_s=60, call=2,
       what="engine.fsdp's code path on one GPU: SD3.5-M full fine-tuning in bf16 through fully_shard (fp32 sharded "
            "masters, world 1, NCCL), one update of 4 images: seconds, peak vs gerl plan, the ratio against the "
            "unsharded rollout")
def fsdp(ctx: Ctx) -> None:
    from _gpu_day_fsdp import fsdp_step

    fsdp_step(ctx, bench_ctx, rollout_batch, PhaseFailed)


@phase("profile", cap_s=90, rehearse_cap_s=90, h100_estimate_s=40, call=2,
       what="torch.profiler over one rollout and one training micro-batch: GPU-busy fraction, kernel-class shares")
def profile(ctx: Ctx) -> None:
    from _gpu_day_probes import profile as measure

    measure(ctx)


@phase("ocr", cap_s=90, rehearse_cap_s=90, h100_estimate_s=30, needs=("torch", "rapidocr"), call=2,
       what="the OCR reward on each prompt's target text rendered with PIL at 512 px, 2/4/8 worker threads")
def ocr(ctx: Ctx) -> None:
    from _gpu_day_probes import ocr as measure

    measure(ctx)


@phase("t5", cap_s=60, rehearse_cap_s=60, h100_estimate_s=25, needs=("torch", "transformers"), call=2,
       what="text-encoder cost per prompt (CLIP-L, CLIP-G, T5-XXL, bf16) at 256 and 512 T5 tokens")
def t5(ctx: Ctx) -> None:
    from _gpu_day_probes import t5 as measure

    measure(ctx)


@phase("validation", cap_s=90, rehearse_cap_s=90, h100_estimate_s=40, needs=("torch", "diffusers", "rapidocr"),
       call=2, what="one validation pass of GeRL's recipe (32 prompts, 40 ODE steps, OCR)")
def validation(ctx: Ctx) -> None:
    from _gpu_day_probes import validation as measure

    measure(ctx)


@phase("fp16", cap_s=120, rehearse_cap_s=90, h100_estimate_s=84,
       what="fp16 with loss scaling at full depth: ratio, LoRA-gradient cosine and zero fraction vs fp32")
def fp16(ctx: Ctx) -> None:
    import contextlib

    from gerl.numerics import Fp16GemmEmulation

    images = 4 if ctx.rehearse else 8
    args = ctx.args("--dtype", "fp16", "--steps", "0", "--warmup", "0", "--no-stock", "--prompts", "1",
                    "--group-size", str(images))
    emulate = ctx.device.type == "cpu"  # a GPU's fp16 GEMM numerics at fp32 speed (gerl/numerics.py)
    args.emulated = emulate
    with Fp16GemmEmulation() if emulate else contextlib.nullcontext():
        s = ctx.bench.run(args, ctx.device)
    r, n = s["ratio_check"], ctx.numbers
    g = r["grad_check"]
    n.update(layers=s["layers"], images=images, fp16_gemm_emulated=emulate, ratio_max_dev=r["max_abs_ratio_minus_1"],
             loss_scale=g["loss_scale"], cosine=g["cosine"], zero_fraction=g["zero_fraction"],
             fp32_zero_fraction=g["reference_zero_fraction"], norm_ratio=g["norm_ratio"], finite=g["finite"],
             unscaled_control={k: g["control"][k] for k in ("cosine", "zero_fraction", "norm_ratio")},
             peak_mem_gib=s["peak_mem_gib"])
    ctx.save()
    devs = list(r["max_abs_ratio_minus_1"].values())
    if not (g["finite"] and all(d <= RATIO_BOUND for d in devs)):  # NaN fails here: NaN <= bound is False
        raise PhaseFailed(f"fp16 ratio check: finite {g['finite']}, max |ratio - 1| {devs}")
    if not g["cosine"] >= g["bar"]:
        raise PhaseFailed(f"fp16 LoRA gradient cosine to fp32 {g['cosine']:.5f} < {g['bar']}")


# In no prepared call of the third GPU day (its uncompiled numbers are the first two days'): name it with --phases.
@phase("flux_rollout", cap_s=90, rehearse_cap_s=60, h100_estimate_s=41,
       what="FLUX.1-dev architecture, bf16: images/s of our rollout vs stock FluxPipeline.__call__ at 512 and 1024 px",
       missing_hint="the second call runs on the first call's .site/: make it at once, while the machine is warm")
def flux_rollout(ctx: Ctx) -> None:
    from _gpu_day_flux import flux_rollout as measure

    measure(ctx)


@phase("launcher", cap_s=180, rehearse_cap_s=200, h100_estimate_s=69, needs=("torch", "diffusers", "rapidocr", "ray"),
       what="recipes/run_sd3_fast_3p_a1_r2.sh for 2 steps on this one GPU (fractional gpus_per_worker)",
       missing_hint="carry .whl/ray in a second call while the machine is warm: docs/offline_install.md")
def launcher(ctx: Ctx) -> None:
    import tempfile

    import bench_gpu_launchers as bl

    left = PHASES["launcher"].rehearse_cap_s if ctx.rehearse else PHASES["launcher"].cap_s
    with tempfile.TemporaryDirectory(prefix="gpu_day_launcher_") as tmp:
        row = bl.run_launcher("3p_a1_r2", Path(tmp) / "3p_a1_r2", cuda=ctx.device.type == "cuda",
                              timeout_s=max(30, left - 15))
    ctx.numbers.update(row)
    ctx.save()
    if not row.get("ok"):
        raise PhaseFailed(row.get("error") or bl.format_row(row))



@phase("launchers", cap_s=290, rehearse_cap_s=400, h100_estimate_s=260,
       needs=("torch", "diffusers", "rapidocr", "ray"),
       what="the other four GPU launchers for 2 steps each on this one GPU: 3p_a2_r1, 3p_hybrid, 1p_with_reward, 8p",
       missing_hint="carry .whl/ray in a call right after one that carried .whl/gpu: docs/offline_install.md")
def launchers(ctx: Ctx) -> None:
    """The launchers the first GPU day could not fit (issue 33), one row each, saved as each ends; the phase fails
    naming every launcher whose checks failed. Each gets the time the cap has left, less 5 s."""
    import tempfile
    import time

    import bench_gpu_launchers as bl

    cap = PHASES["launchers"].rehearse_cap_s if ctx.rehearse else PHASES["launchers"].cap_s
    t0, rows, bad = time.monotonic(), {}, []
    for name in ("3p_a2_r1", "3p_hybrid", "1p_with_reward", "8p_hybrid_with_reward"):
        left = cap - (time.monotonic() - t0) - 5
        with tempfile.TemporaryDirectory(prefix=f"gpu_day_{name}_") as tmp:
            rows[name] = bl.run_launcher(name, Path(tmp) / name, cuda=ctx.device.type == "cuda",
                                         timeout_s=max(30, int(left)))
        ctx.numbers["rows"] = rows
        ctx.save()
        bad += [] if rows[name].get("ok") else [f"{name}: {rows[name].get('error') or bl.format_row(rows[name])}"]
    if bad:
        raise PhaseFailed("; ".join(bad))
