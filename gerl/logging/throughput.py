"""Throughput, GPU-hour and MFU accounting: pure functions over metrics rows, plus a FLOPs model of the SD3 MMDiT.

Definitions (GeRL's):
    images/s/device     = images generated in the step / (step wall time × devices in use)
    GPU-hours           = devices × wall time, cumulative; wall time = Σ over rows of step_s + validate_s (the time
                          the run spent inside steps and validations: model loading, checkpoint writes and any gap
                          between a run and its resumption are not counted, so resumed runs add up correctly)
    GPU-hours to target = GPU-hours at the first validation whose val_reward_mean ≥ target and stays ≥ target for
                          the next hold − 1 validations too
    MFU                 = transformer matmul FLOPs of the step / (step_s × devices × peak dense FLOP/s)

A metrics row is one line of RUN_DIR/metrics.jsonl: a dict with "step" and, depending on the step, "images",
"step_s", "validate_s", "val_reward_mean" (seconds are wall seconds). Rows are taken in file (= step) order.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gerl.models.family import TINY_MODELS

CLIP_TOKENS = 77  # SD3 pads the CLIP-L/G hidden states to 77 tokens before concatenating T5's


# ------------------------------------------------------------------ rows → throughput and GPU-hours

def _num(row: Mapping, key: str) -> float:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


def images_per_s_per_device(images: int, step_s: float, devices: float) -> float | None:
    """Images generated in a step / (step wall seconds × devices in use); None when step_s or devices is 0."""
    if step_s <= 0 or devices <= 0:
        return None
    return images / (step_s * devices)


def row_wall_s(row: Mapping) -> float:
    """Wall seconds a metrics row accounts for: step_s + validate_s (either may be absent, e.g. step 0)."""
    return _num(row, "step_s") + _num(row, "validate_s")


def gpu_hours(rows: Sequence[Mapping], devices: float) -> list[float]:
    """Cumulative GPU-hours after each row: devices × Σ (step_s + validate_s) / 3600. Returns len(rows) floats."""
    out, total = [], 0.0
    for row in rows:
        total += devices * row_wall_s(row) / 3600.0
        out.append(total)
    return out


def gpu_hours_to_target(rows: Sequence[Mapping], devices: float, target: float, hold: int = 1) -> float | None:
    """GPU-hours at the first validation that reaches `target` and holds it.

    A validation row is one whose val_reward_mean is a number. Validation i counts when val_reward_mean ≥ target
    for it and for the hold − 1 validations after it; a reach that is lost sooner is not counted and the search
    goes on from the next validation. The hours are those elapsed up to the end of validation i (its row's
    step_s + validate_s included). Returns None if never reached, or if fewer than `hold` validations remain to
    confirm the last reach.
    """
    if hold < 1:
        raise ValueError(f"hold must be ≥ 1, got {hold}")
    hours = gpu_hours(rows, devices)
    vals = [(hours[i], float(r["val_reward_mean"])) for i, r in enumerate(rows)
            if isinstance(r.get("val_reward_mean"), (int, float)) and math.isfinite(r["val_reward_mean"])]
    for i in range(len(vals) - hold + 1):
        if all(v >= target for _, v in vals[i:i + hold]):
            return vals[i][0]
    return None


# ------------------------------------------------------------------ FLOPs model of the SD3 / SD3.5 MMDiT

@dataclass(frozen=True)
class MMDiTShape:
    """The sizes of a diffusers SD3Transformer2DModel that set its FLOPs (read from its config)."""

    num_layers: int
    heads: int
    head_dim: int
    joint_attention_dim: int  # width of the text-encoder states fed to the context embedder (T5: 4096)
    caption_projection_dim: int  # context stream width after the context embedder (= heads × head_dim)
    pooled_projection_dim: int  # CLIP-L + CLIP-G pooled width (2048)
    patch_size: int
    in_channels: int
    out_channels: int
    dual_attention_layers: tuple[int, ...]  # SD3.5: blocks with a second, image-only self-attention

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    @staticmethod
    def from_config(config: Mapping) -> "MMDiTShape":
        c = dict(config)
        return MMDiTShape(
            num_layers=int(c["num_layers"]), heads=int(c["num_attention_heads"]), head_dim=int(c["attention_head_dim"]),
            joint_attention_dim=int(c["joint_attention_dim"]), caption_projection_dim=int(c["caption_projection_dim"]),
            pooled_projection_dim=int(c["pooled_projection_dim"]), patch_size=int(c["patch_size"]),
            in_channels=int(c["in_channels"]), out_channels=int(c.get("out_channels") or c["in_channels"]),
            dual_attention_layers=tuple(c.get("dual_attention_layers") or ()),
        )


def text_seq_len(max_sequence_length: int, clip_tokens: int = CLIP_TOKENS) -> int:
    """Joint-attention text tokens of SD3: CLIP (77, padded) + T5 (max_sequence_length, e.g. 256) = 333."""
    return clip_tokens + max_sequence_length


def image_tokens(shape: MMDiTShape, resolution: int, vae_scale_factor: int = 8) -> int:
    """Image tokens: (resolution / VAE factor / patch)², e.g. 512 px → 64² latents → 32² = 1024 tokens."""
    side = resolution // vae_scale_factor // shape.patch_size
    return side * side


def transformer_flops_breakdown(config: Mapping, resolution: int, text_len: int, batch: int = 1,
                                vae_scale_factor: int = 8) -> dict[str, int]:
    """Matmul FLOPs (2·m·n·k per matmul) of one forward pass, by component.

    Args:
        config: the transformer's config (diffusers `transformer.config`, or a plain dict of the same keys).
        resolution: image side in pixels. text_len: joint-attention text tokens (see `text_seq_len`).
        batch: samples in the forward (a CFG forward is 2 × images).
    Counted: patch embedding (a strided conv = a matmul per patch), context embedder, timestep and pooled-text
    MLPs, per block the adaLN modulation linears, Q/K/V and output projections of both streams, attention
    scores and attention × V over the joint sequence, both streams' MLPs (4× hidden), the SD3.5 second
    image-only attention where present; the final adaLN and output projection. Not counted: norms, GELU/SiLU,
    softmax, residual adds and gating (elementwise, < 1 % here). The last block has no context output
    projection, context MLP or context adaLN-Zero (diffusers' `context_pre_only`).
    """
    s = MMDiTShape.from_config(config)
    D, N, L = s.dim, image_tokens(s, resolution, vae_scale_factor), text_len
    S = N + L
    dual = set(s.dual_attention_layers)
    f = dict.fromkeys(["embed", "adaln", "qkv", "attention", "attn_out", "mlp", "dual_attention", "final"], 0)
    f["embed"] = (2 * N * s.in_channels * s.patch_size**2 * D  # patch embedding
                  + 2 * L * s.joint_attention_dim * s.caption_projection_dim  # context embedder
                  + 2 * (256 * D + D * D)  # timestep MLP (256 sinusoidal channels)
                  + 2 * (s.pooled_projection_dim * D + D * D))  # pooled-text MLP
    for i in range(s.num_layers):
        last = i == s.num_layers - 1
        f["adaln"] += 2 * D * (9 if i in dual else 6) * D + 2 * D * (2 if last else 6) * D
        f["qkv"] += 2 * S * D * 3 * D
        f["attention"] += 2 * 2 * S * S * D  # QKᵀ and (softmax)·V, all heads: H × head_dim = D
        f["attn_out"] += 2 * (N if last else S) * D * D
        f["mlp"] += 2 * 2 * (N if last else S) * D * 4 * D
        if i in dual:
            f["dual_attention"] += 2 * N * D * 3 * D + 2 * 2 * N * N * D + 2 * N * D * D
    f["final"] = 2 * D * 2 * D + 2 * N * D * s.patch_size**2 * s.out_channels
    return {k: v * batch for k, v in f.items()}


def transformer_forward_flops(config: Mapping, resolution: int, text_len: int, batch: int = 1,
                              vae_scale_factor: int = 8) -> int:
    """Matmul FLOPs of one transformer forward on `batch` samples (see `transformer_flops_breakdown`).

    SD3.5-Medium at 512 px with 333 text tokens: ≈ 2.5 TFLOP per sample.
    """
    return sum(transformer_flops_breakdown(config, resolution, text_len, batch, vae_scale_factor).values())


def flow_grpo_step_flops(config: Mapping, *, resolution: int, text_len: int, images: int, num_steps: int,
                         guidance_scale: float, trained_steps: int, inner_epochs: int = 1, beta: float = 0.0,
                         recompute_old_log_probs: bool = False, trained_images: int | None = None,
                         vae_scale_factor: int = 8) -> dict[str, int]:
    """Transformer FLOPs of one Flow-GRPO(-Fast) step.

    rollout  = images × num_steps forwards (× 2 with CFG: guidance_scale > 1)
    training = trained_images × trained_steps × inner_epochs × (forward + backward), backward = 2 × forward
               + trained_images × trained_steps × inner_epochs × forward of the reference when beta > 0
               + trained_images × trained_steps × forward when recompute_old_log_probs (once, before the epochs)
    Training replays use CFG too when guidance_scale > 1 (the same `predict_velocity` as the rollout). VAE decoding
    and text encoders are not counted (text embeddings are cached), so MFU slightly understates the device's work.
    The 2× backward is the dense-training convention; with LoRA the frozen weights get no weight gradients, so the
    true backward is closer to 1× and MFU computed from these numbers is an upper-bound convention, comparable
    across runs, not an exact count.

    Args:
        trained_steps: denoising steps trained per sample (Flow-GRPO-Fast: the window size).
        trained_images: samples that were trained on (default: images; fewer when failed rewards were dropped).
    Returns:
        {"forward_per_image": F, "rollout": ..., "train": ..., "total": ...}
    """
    cfg_mult = 2 if guidance_scale > 1.0 else 1
    fwd = transformer_forward_flops(config, resolution, text_len, 1, vae_scale_factor) * cfg_mult
    trained = images if trained_images is None else trained_images
    rollout = images * num_steps * fwd
    per_pass = trained * trained_steps * fwd
    train = per_pass * inner_epochs * 3
    if beta > 0:
        train += per_pass * inner_epochs
    if recompute_old_log_probs:
        train += per_pass
    return {"forward_per_image": fwd, "rollout": rollout, "train": train, "total": rollout + train}


# ------------------------------------------------------------------ MFU and device peaks

# Dense (no sparsity) peak TFLOP/s from the vendors' data sheets: bf16/fp16 tensor cores, tf32 tensor cores, and
# plain fp32 (CUDA cores). fp32 models use the plain-fp32 peak unless TF32 matmuls are enabled
# (torch.set_float32_matmul_precision("high")), because PyTorch's default fp32 matmul does not use tensor cores.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H100 PCIE": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0},  # SXM (and names without a form factor)
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6},
}


def peak_tflops_for(device_name: str, dtype: str, tf32: bool = False) -> float:
    """Peak dense TFLOP/s of `device_name` (e.g. torch.cuda.get_device_name()) in `dtype` ("bf16", "fp16",
    "fp32"). fp32 means TF32 tensor cores when tf32=True, else CUDA cores. 0.0 for CPUs and unknown devices
    (MFU is then reported as null)."""
    name = device_name.upper().replace("-", " ")
    for key, peaks in PEAK_TFLOPS.items():  # ordered: "H100 PCIE" is tried before "H100"
        if all(part in name for part in key.split()):
            if dtype in ("bf16", "fp16"):
                return peaks["bf16"]
            return peaks["tf32"] if tf32 else peaks["fp32"]
    return 0.0


def mfu(flops: float, seconds: float, devices: float, peak_tflops: float) -> float | None:
    """Model FLOPs utilisation = flops / (seconds × devices × peak_tflops·1e12), in [0, 1]; None when the peak
    is unknown (0) or seconds/devices are 0."""
    if peak_tflops <= 0 or seconds <= 0 or devices <= 0:
        return None
    return flops / (seconds * devices * peak_tflops * 1e12)


def peak_memory_gib(device=None) -> float:
    """Peak memory since the process started, GiB: torch.cuda.max_memory_allocated on a CUDA device, else the
    process's peak resident set size (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


# ------------------------------------------------------------------ per-run accountant used by the trainer

@dataclass
class StepFlopsModel:
    """What `flow_grpo_step_flops` needs besides the per-step counts (images, trained samples, text length)."""

    transformer_config: dict
    vae_scale_factor: int
    resolution: int
    num_steps: int
    guidance_scale: float
    inner_epochs: int
    beta: float
    recompute_old_log_probs: bool

    def step_flops(self, images: int, trained_images: int, trained_steps: int, text_len: int) -> int:
        return flow_grpo_step_flops(
            self.transformer_config, resolution=self.resolution, text_len=text_len, images=images,
            num_steps=self.num_steps, guidance_scale=self.guidance_scale, trained_steps=trained_steps,
            inner_epochs=self.inner_epochs, beta=self.beta, recompute_old_log_probs=self.recompute_old_log_probs,
            trained_images=trained_images, vae_scale_factor=self.vae_scale_factor)["total"]


class ThroughputTracker:
    """Adds the throughput keys to each metrics row; keeps the cumulative GPU-hours and the validation history.

    Keys added by `update`: devices, images_per_s_per_device, gpu_hours (cumulative), mfu (null without a FLOPs
    model or a known device peak), peak_mem_gib, and gpu_hours_to_target on the one row where the target is
    first confirmed (with hold > 1 that is the hold-th validation in a row at or above target; the value is the
    hours at the first of them, as `gpu_hours_to_target` computes it from the rows).
    """

    def __init__(self, devices: float, target: float, hold: int, peak_tflops: float = 0.0, device=None,
                 flops: StepFlopsModel | None = None, cores_per_device: int | None = None):
        self.devices, self.target, self.hold = devices, target, hold
        self.cores_per_device = cores_per_device  # CPU runs: cores each device uses (the report's core-hours)
        self.peak_tflops, self.device, self.flops = peak_tflops, device, flops
        self.hours = 0.0
        self.vals: list[tuple[float, float]] = []  # (cumulative hours at the validation, val_reward_mean)
        self.reached: float | None = None

    def restore(self, metrics_path) -> None:
        """Replay the rows already in metrics.jsonl (a resumed run, after the logger dropped the lines past the
        checkpoint) so cumulative GPU-hours and the target search carry on. A missing/empty file: nothing."""
        import json
        from pathlib import Path

        p = Path(metrics_path)
        if p.is_file():
            for line in p.read_text().splitlines():
                if line.strip():
                    self._advance(json.loads(line))

    def _advance(self, row: Mapping) -> float | None:
        """Account one row; return the hours-to-target if this row confirms it for the first time."""
        self.hours += self.devices * row_wall_s(row) / 3600.0
        v = row.get("val_reward_mean")
        if not (isinstance(v, (int, float)) and math.isfinite(v)) or self.reached is not None:
            return None
        self.vals.append((self.hours, float(v)))
        tail = self.vals[-self.hold:]
        if len(tail) == self.hold and all(x >= self.target for _, x in tail):
            self.reached = tail[0][0]
            return self.reached
        return None

    def update(self, row: Mapping, text_len: int | None = None, trained_images: int | None = None) -> dict:
        """The keys to merge into `row`, which holds the step's images, step_s, trained_steps_per_sample (when an
        update ran) and validate_s / val_reward_mean on validation steps. text_len: joint-attention text tokens
        of the batch (embeds.prompt.shape[1]); trained_images: samples trained on (after dropped rewards)."""
        out: dict = {"devices": self.devices}
        if self.device is not None:
            out["device_type"] = getattr(self.device, "type", str(self.device))
            if out["device_type"] == "cpu" and self.cores_per_device:
                out["cores_per_device"] = self.cores_per_device
        step_s = _num(row, "step_s")
        images = int(row.get("images") or 0)
        if images and step_s > 0:
            out["images_per_s_per_device"] = images_per_s_per_device(images, step_s, self.devices)
        reached = self._advance(row)
        out["gpu_hours"] = self.hours
        if reached is not None:
            out["gpu_hours_to_target"] = reached
        if step_s > 0:
            flops = None
            if self.flops is not None and images and text_len:
                trained = images if trained_images is None else trained_images
                flops = self.flops.step_flops(images, trained, int(row.get("trained_steps_per_sample") or 0), text_len)
            out["mfu"] = mfu(flops, step_s, self.devices, self.peak_tflops) if flops else None
        if "peak_mem_gib" not in row:  # an engine whose roles run elsewhere reports their peak itself
            out["peak_mem_gib"] = peak_memory_gib(self.device)
        return out


MMDIT_CLASS = "SD3Transformer2DModel"


def model_config_for(model_path: str, pipe=None) -> tuple[dict, int] | None:
    """(transformer config, VAE scale factor) from a loaded pipeline, else from model_path's transformer/ and vae/
    config.json (a local directory or the local Hugging Face cache; nothing is downloaded). None when neither is
    available (e.g. model.path=tiny without a pipeline), and for a transformer that is not SD3's MMDiT (the FLOPs
    model counts that architecture only: a FLUX.1 run logs mfu null)."""
    if pipe is not None:
        if type(pipe.transformer).__name__ != MMDIT_CLASS:
            return None
        return dict(pipe.transformer.config), 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    if model_path in TINY_MODELS:  # built in code, no configs on disk (and no ~4 s diffusers import to find that out)
        return None
    local = Path(model_path)
    if (local / "transformer" / "config.json").is_file() and (local / "vae" / "config.json").is_file():
        t, v = (json.loads((local / c / "config.json").read_text()) for c in ("transformer", "vae"))
        if t.get("_class_name", MMDIT_CLASS) != MMDIT_CLASS:
            return None
        return t, 2 ** (len(v["block_out_channels"]) - 1)
    try:  # a hub id: its configs in the local Hugging Face cache
        from diffusers import AutoencoderKL, SD3Transformer2DModel

        t = SD3Transformer2DModel.load_config(model_path, subfolder="transformer", local_files_only=True)
        v = AutoencoderKL.load_config(model_path, subfolder="vae", local_files_only=True)
    except (OSError, ValueError):
        return None
    if t.get("_class_name", MMDIT_CLASS) != MMDIT_CLASS:
        return None
    return dict(t), 2 ** (len(v["block_out_channels"]) - 1)


def tracker_for(cfg, devices: float = 1, pipe=None, device_name: str | None = None) -> ThroughputTracker:
    """The trainer's ThroughputTracker for a run of `cfg` (a gerl Config) on `devices` devices.

    The MFU peak is cfg.metrics.peak_tflops, or guessed from the CUDA device's name in cfg.model.dtype (given by
    the Ray engine's hosts as `device_name`, so that the driver never opens a CUDA context); 0 (→ mfu null) on CPU. The FLOPs model comes from `pipe` (local engine) or model.path's configs.
    """
    import torch

    from gerl.models.loader import resolve_device

    device = resolve_device(cfg.model.device)
    peak = cfg.metrics.peak_tflops
    if peak <= 0 and device.type == "cuda" and device_name != "cpu":
        peak = peak_tflops_for(device_name or torch.cuda.get_device_name(device), cfg.model.dtype,
                               tf32=torch.get_float32_matmul_precision() != "highest")
    from gerl.models.loader import resolve_model_path

    found = model_config_for(resolve_model_path(cfg.model.path), pipe)
    flops = None
    if found is not None:
        s, t = cfg.sampling, cfg.train
        flops = StepFlopsModel(found[0], found[1], cfg.model.resolution, s.num_steps, s.guidance_scale,
                               t.inner_epochs, t.beta, t.recompute_old_log_probs)
    # A CPU device is a Ray worker's pinned cores, or this process's torch threads with the local engine.
    from gerl.config import host_cpus

    cores = host_cpus(cfg) if cfg.engine.kind == "ray" else torch.get_num_threads()
    return ThroughputTracker(devices, cfg.metrics.target_val_reward, cfg.metrics.target_hold, peak, device, flops,
                             cores if device.type == "cpu" else None)
