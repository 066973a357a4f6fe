"""Throughput, GPU-hour and MFU accounting: pure functions over metrics rows; the FLOPs model is gerl/logging/flops.py.

Definitions (GeRL's):
    images/s/device     = images generated in the step / (step wall time × devices in use)
    GPU-hours           = devices × wall time, cumulative; wall time = Σ over rows of step_s + validate_s (the time
                          the run spent inside steps and validations: model loading, checkpoint writes and any gap
                          between a run and its resumption are not counted, so resumed runs add up correctly)
    GPU-hours to target = GPU-hours at the first validation whose val_reward_mean ≥ target and stays ≥ target for
                          the next hold − 1 validations too
    MFU                 = model FLOPs of the step (the transformer's matmuls in rollout and training, LoRA training
                          without the frozen weights' gradients, and the VAE decode: gerl/logging/flops.py) /
                          (step_s × devices × peak dense FLOP/s in model.dtype)

A metrics row is one line of RUN_DIR/metrics.jsonl: a dict with "step" and, depending on the step, "images",
"step_s", "validate_s", "val_reward_mean" (seconds are wall seconds). Rows are taken in file (= step) order.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gerl.logging.flops import (  # noqa: F401 (the FLOPs model, re-exported for the benchmarks)
    CLIP_TOKENS, Lora, flow_grpo_step_flops, image_tokens, text_seq_len, transformer_flops_breakdown,
    transformer_forward_flops, vae_decode_flops,
)
from gerl.models.family import TINY_MODELS


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
    lora: Lora | None = None  # the trained adapter; None: full fine-tuning
    merged_rollout: bool = False  # model.merge_lora: the rollout runs merged weights, no adapter matmuls
    decode_flops_per_image: int = 0  # the VAE decode of one image (`vae_decode_flops`)

    def step_flops(self, images: int, trained_images: int, trained_steps: int, text_len: int,
                   cond_tokens: int = 0) -> int:
        return flow_grpo_step_flops(
            self.transformer_config, resolution=self.resolution, text_len=text_len, images=images,
            num_steps=self.num_steps, guidance_scale=self.guidance_scale, trained_steps=trained_steps,
            inner_epochs=self.inner_epochs, beta=self.beta, recompute_old_log_probs=self.recompute_old_log_probs,
            trained_images=trained_images, vae_scale_factor=self.vae_scale_factor, lora=self.lora,
            merged_rollout=self.merged_rollout, decode_flops_per_image=self.decode_flops_per_image,
            cond_tokens=cond_tokens)["total"]


def reference_tokens(embeds) -> list[int] | None:
    """Each sample's reference-image tokens for an editing model ((h/2)·(w/2) of its `Embeds.cond_hw` grid), or None
    for a text-to-image batch."""
    hw = getattr(embeds, "cond_hw", None)
    return None if hw is None else [(h // 2) * (w // 2) for h, w in hw.tolist()]


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

    def update(self, row: Mapping, text_len: int | None = None, trained_images: int | None = None,
               cond_tokens: list[int] | None = None) -> dict:
        """The keys to merge into `row`, which holds the step's images, step_s, trained_steps_per_sample (when an
        update ran) and validate_s / val_reward_mean on validation steps. text_len: joint-attention text tokens
        of the batch (embeds.prompt.shape[1]); trained_images: samples trained on (after dropped rewards);
        cond_tokens: an editing model's reference tokens, one per generated image (`reference_tokens`): the step's
        FLOPs are each size's share of the batch at that size (the trained images taken in the same shares)."""
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
                steps = int(row.get("trained_steps_per_sample") or 0)
                sizes = Counter(cond_tokens or [0])
                flops = sum(n / sum(sizes.values()) * self.flops.step_flops(images, trained, steps, text_len, k)
                            for k, n in sizes.items())
            out["mfu"] = mfu(flops, step_s, self.devices, self.peak_tflops) if flops else None
        if "peak_mem_gib" not in row:  # an engine whose roles run elsewhere reports their peak itself
            out["peak_mem_gib"] = peak_memory_gib(self.device)
        return out


@dataclass
class ModelConfigs:
    """The configs the FLOPs model reads: the transformer's, the VAE's (a dict, or the loaded VAE module), the VAE's
    pixels per latent side, and the model family's name (gerl.models.family: FLUX.1-Kontext's is its own, though its
    transformer is FLUX.1's class; its LoRA targets differ)."""

    transformer: dict
    vae: object
    vae_scale_factor: int
    family: str


def vae_scale_factor(vae_config) -> int:
    """Pixels per latent side: AutoencoderKL 2^(len(block_out_channels) − 1) (8 for SD3's and FLUX.1's), Qwen-Image's
    video VAE 2^len(temperal_downsample) (8), as the stock pipelines compute it."""
    get = vae_config.get if isinstance(vae_config, Mapping) else lambda k: getattr(vae_config, k, None)
    if get("temperal_downsample") is not None:
        return 2 ** len(get("temperal_downsample"))
    return 2 ** (len(get("block_out_channels")) - 1)


def model_configs(model_path: str, pipe=None) -> ModelConfigs | None:
    """The FLOPs model's configs from a loaded pipeline, else from model_path's transformer/ and vae/ config.json (a
    local directory or the local Hugging Face cache; nothing is downloaded). None when neither is available (e.g.
    model.path=tiny without a pipeline) or the transformer is of a class the FLOPs model does not count."""
    from gerl.logging.flops import family_of_config
    from gerl.models.family import family_of

    if pipe is not None and getattr(pipe, "vae", None) is not None:
        t = dict(pipe.transformer.config, _class_name=type(pipe.transformer).__name__)
        try:
            family_of_config(t)
        except ValueError:  # a transformer the FLOPs model does not count: no mfu
            return None
        return ModelConfigs(t, pipe.vae, vae_scale_factor(pipe.vae.config), family_of(pipe).name)
    if model_path in TINY_MODELS:  # built in code, no configs on disk (and no ~4 s diffusers import to find that out)
        return None
    local = Path(model_path)
    if (local / "transformer" / "config.json").is_file() and (local / "vae" / "config.json").is_file():
        t, v = (json.loads((local / c / "config.json").read_text()) for c in ("transformer", "vae"))
    else:
        try:  # a hub id: its configs in the local Hugging Face cache (load_config reads any class's config)
            from diffusers import AutoencoderKL

            t = dict(AutoencoderKL.load_config(model_path, subfolder="transformer", local_files_only=True))
            v = dict(AutoencoderKL.load_config(model_path, subfolder="vae", local_files_only=True))
        except (OSError, ValueError):
            return None
    try:
        return ModelConfigs(t, v, vae_scale_factor(v), _family_name(model_path, family_of_config(t)))
    except (ValueError, KeyError, TypeError):
        return None


def _family_name(model_path: str, builder: str) -> str:
    """The model family of model_path (its model_index.json names it: FLUX.1-Kontext's transformer is FLUX.1's class),
    else the FLOPs model's builder for its transformer class, which is the text-to-image family's name."""
    from gerl.models.loader import model_family

    try:
        family = model_family(model_path)
    except Exception:  # noqa: BLE001 — not a family gerl knows: the transformer's class decides
        return builder
    return builder if family is None else family.name


def model_config_for(model_path: str, pipe=None) -> tuple[dict, int] | None:
    """(transformer config, VAE scale factor) of `model_configs`, or None."""
    found = model_configs(model_path, pipe)
    return None if found is None else (found.transformer, found.vae_scale_factor)


def flops_model_for(cfg, found: ModelConfigs) -> StepFlopsModel:
    """The step's FLOPs model for a run of `cfg`: its adapter (model.lora_targets, else the family's default targets,
    at model.lora_rank), whether the rollout merges it, and one image's VAE decode counted on the meta device."""
    from types import SimpleNamespace

    from gerl.models.family import families

    family = families()[found.family]
    m, s, t = cfg.model, cfg.sampling, cfg.train
    lora = Lora(tuple(m.lora_targets or family.lora_targets), m.lora_rank) if m.lora else None
    vae_config = found.vae.config if hasattr(found.vae, "config") else SimpleNamespace(**found.vae)
    view = SimpleNamespace(transformer=SimpleNamespace(config=SimpleNamespace(**found.transformer)),
                           vae=SimpleNamespace(config=vae_config))
    latent = family.latent_shape(view, m.resolution)
    try:
        decode = vae_decode_flops(found.vae, family, latent)
    except Exception as e:  # noqa: BLE001 — a VAE the meta device cannot run: MFU without it, said once
        print(f"gerl: warning: the VAE decode's FLOPs could not be counted ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:160] if str(e) else ''}); mfu leaves it out", file=sys.stderr)
        decode = 0
    return StepFlopsModel(found.transformer, found.vae_scale_factor, m.resolution, s.num_steps, s.guidance_scale,
                          t.inner_epochs, t.beta, t.recompute_old_log_probs, lora, cfg.model.merge_lora, decode)


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

    found = model_configs(resolve_model_path(cfg.model.path), pipe)
    flops = flops_model_for(cfg, found) if found is not None else None
    # A CPU device is a Ray worker's pinned cores, or this process's torch threads with the local engine.
    from gerl.config import host_cpus

    cores = host_cpus(cfg) if cfg.engine.kind == "ray" else torch.get_num_threads()
    return ThroughputTracker(devices, cfg.metrics.target_val_reward, cfg.metrics.target_hold, peak, device, flops,
                             cores if device.type == "cpu" else None)
