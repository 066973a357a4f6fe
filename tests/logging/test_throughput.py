"""Throughput arithmetic, GPU-hours (to target), the MMDiT FLOPs model against torch's FLOP counter, MFU, peaks."""

import json

import pytest
import torch

from gerl.logging.throughput import (
    ThroughputTracker, flow_grpo_step_flops, gpu_hours, gpu_hours_to_target, images_per_s_per_device, mfu,
    peak_memory_gib, peak_tflops_for, text_seq_len, transformer_flops_breakdown, transformer_forward_flops,
)


def rows_with(vals, step_s=360.0, validate_s=0.0, step0=None):
    """Metrics rows: step 0 (validation only, if step0 is given) then one training step per value in `vals`
    (None = no validation that step). Each training step takes step_s + validate_s seconds on each device."""
    rows = []
    if step0 is not None:
        rows.append({"step": 0, "val_reward_mean": step0, "validate_s": validate_s})
    for i, v in enumerate(vals, start=1):
        row = {"step": i, "images": 64, "step_s": step_s}
        if v is not None:
            row.update(val_reward_mean=v, validate_s=validate_s)
        rows.append(row)
    return rows


# ------------------------------------------------------------------ arithmetic on rows

def test_images_per_s_per_device():
    assert images_per_s_per_device(64, 8.0, 1) == 8.0
    assert images_per_s_per_device(64, 8.0, 4) == 2.0
    assert images_per_s_per_device(64, 0.0, 1) is None


def test_gpu_hours_is_cumulative_devices_times_step_and_validation_time():
    rows = [{"step": 0, "validate_s": 36.0}, {"step": 1, "step_s": 360.0}, {"step": 2, "step_s": 324.0, "validate_s": 36.0},
            {"step": 3, "step_s": None}]  # a null (non-finite) time counts as 0
    assert gpu_hours(rows, 2) == pytest.approx([0.02, 0.22, 0.42, 0.42])


def test_to_target_never_reached():
    assert gpu_hours_to_target(rows_with([0.1, 0.5, 0.79]), 1, 0.8, 1) is None


def test_to_target_reached_at_step_0():
    rows = rows_with([0.9, 0.9], validate_s=36.0, step0=0.85)
    assert gpu_hours_to_target(rows, 1, 0.8, 1) == pytest.approx(0.01)  # the step-0 validation's own 36 s
    assert gpu_hours_to_target(rows, 1, 0.8, 3) == pytest.approx(0.01)


def test_to_target_hold_1_takes_first_reach_even_if_lost_later():
    rows = rows_with([0.5, 0.81, 0.2, 0.9])
    assert gpu_hours_to_target(rows, 1, 0.8, 1) == pytest.approx(0.2)  # 2 steps × 360 s


def test_to_target_reached_then_lost_is_not_counted():
    rows = rows_with([0.85, 0.7, 0.82, 0.81, 0.9])
    # step 1 reaches but step 2 loses it; steps 3 and 4 hold it → counted at step 3
    assert gpu_hours_to_target(rows, 1, 0.8, 2) == pytest.approx(0.3)
    assert gpu_hours_to_target(rows, 4, 0.8, 2) == pytest.approx(1.2)  # 4 devices


def test_to_target_hold_larger_than_remaining_validations():
    rows = rows_with([0.1, 0.9, 0.95])
    assert gpu_hours_to_target(rows, 1, 0.8, 3) is None  # two validations at target, three needed
    assert gpu_hours_to_target(rows, 1, 0.8, 2) == pytest.approx(0.2)


def test_to_target_skips_non_validation_rows_and_counts_their_time():
    rows = rows_with([None, None, 0.9, None, 0.95])
    assert gpu_hours_to_target(rows, 1, 0.8, 2) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        gpu_hours_to_target(rows, 1, 0.8, 0)


def test_tracker_agrees_with_the_row_functions_and_logs_target_once(tmp_path):
    rows = rows_with([0.85, 0.7, 0.82, 0.81, 0.9], validate_s=18.0, step0=0.1)
    tracker = ThroughputTracker(devices=2, target=0.8, hold=2)
    logged = [dict(r, **tracker.update(r)) for r in rows]
    assert [r["gpu_hours"] for r in logged] == pytest.approx(gpu_hours(rows, 2))
    hit = [r for r in logged if "gpu_hours_to_target" in r]
    assert [r["step"] for r in hit] == [4]  # confirmed by the second validation in a row at target
    assert hit[0]["gpu_hours_to_target"] == pytest.approx(gpu_hours_to_target(rows, 2, 0.8, 2))
    assert logged[1]["images_per_s_per_device"] == pytest.approx(64 / (360 * 2))
    assert all(r["mfu"] is None for r in logged[1:])  # no FLOPs model, no peak: null
    assert logged[1]["peak_mem_gib"] > 0
    # resume: a fresh tracker replays metrics.jsonl and carries on where the first left off
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged[:3]))
    resumed = ThroughputTracker(devices=2, target=0.8, hold=2)
    resumed.restore(tmp_path / "metrics.jsonl")
    assert [resumed.update(r).get("gpu_hours_to_target") for r in rows[3:]] == [None, hit[0]["gpu_hours_to_target"], None]
    assert resumed.hours == pytest.approx(logged[-1]["gpu_hours"])


# ------------------------------------------------------------------ FLOPs model vs a direct count

def counted_forward_flops(transformer, batch: int, text_len: int, latent: int) -> int:
    """FLOPs that torch's FlopCounterMode sees in one forward (the math SDPA backend, whose bmm's it counts)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    c = transformer.config
    g = torch.Generator().manual_seed(0)
    args = dict(hidden_states=torch.randn(batch, c.in_channels, latent, latent, generator=g),
                encoder_hidden_states=torch.randn(batch, text_len, c.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(batch, c.pooled_projection_dim, generator=g),
                timestep=torch.full((batch,), 500.0))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        transformer(**args)
    return counter.get_total_flops()


def test_flops_model_matches_flop_counter_on_the_tiny_sd3(tiny_pipe):
    from gerl.models.tiny import RESOLUTION, TOKEN_LENGTH

    text_len = 2 * TOKEN_LENGTH
    counted = counted_forward_flops(tiny_pipe.transformer, 3, text_len, RESOLUTION // 4)
    modelled = transformer_forward_flops(tiny_pipe.transformer.config, RESOLUTION, text_len, 3, vae_scale_factor=4)
    assert modelled == pytest.approx(counted, rel=0.02)


def test_flops_model_matches_flop_counter_with_sd35_dual_attention_and_qk_norm():
    from diffusers import SD3Transformer2DModel

    # SD3.5's block types at toy size: dual attention on the first two of three blocks, RMS qk-norm.
    tr = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=3,
                               attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                               caption_projection_dim=32, pooled_projection_dim=40, pos_embed_max_size=32,
                               dual_attention_layers=(0, 1), qk_norm="rms_norm").eval()
    counted = counted_forward_flops(tr, 2, 24, 16)
    f = transformer_flops_breakdown(tr.config, 64, 24, 2, vae_scale_factor=4)
    assert f["dual_attention"] > 0
    assert sum(f.values()) == pytest.approx(counted, rel=0.02)


def test_sd35_medium_forward_flops_and_text_length():
    sd35m = dict(num_layers=24, num_attention_heads=24, attention_head_dim=64, joint_attention_dim=4096,
                 caption_projection_dim=1536, pooled_projection_dim=2048, patch_size=2, in_channels=16,
                 out_channels=16, dual_attention_layers=list(range(13)), qk_norm="rms_norm")
    assert text_seq_len(256) == 333
    f = transformer_forward_flops(sd35m, 512, 333)
    assert 2.3e12 < f < 2.6e12  # ≈ 24 layers × 24·S·D² (S = 1024 + 333, D = 1536) + attention + dual attention
    assert transformer_forward_flops(sd35m, 512, 333, batch=8) == 8 * f


def test_step_flops_arithmetic():
    """How a step composes the per-sample counts (each held against FlopCounterMode in tests/logging/test_flops.py):
    rollout forwards, training passes (forward + backward), the reference's and the recompute's forwards, decode."""
    from gerl.logging.flops import Lora, backward_flops, forward_flops, transformer_ops

    cfg = dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=64,
               caption_projection_dim=32, pooled_projection_dim=64, patch_size=2, in_channels=16)
    ops = transformer_ops(cfg, 64, 64, vae_scale_factor=4)
    F = transformer_forward_flops(cfg, 64, 64, vae_scale_factor=4)
    assert F == forward_flops(ops)
    kw = dict(resolution=64, text_len=64, images=8, num_steps=10, trained_steps=3, vae_scale_factor=4)
    full = F + backward_flops(ops)  # fully fine-tuned: ≈ 3 F
    assert 2.9 * F < full <= 3 * F
    base = flow_grpo_step_flops(cfg, guidance_scale=1.0, **kw)
    assert base["rollout"] == 8 * 10 * F and base["decode"] == 0
    assert base["train"] == 8 * 3 * full
    assert base["total"] == base["rollout"] + base["train"]
    cfg_guided = flow_grpo_step_flops(cfg, guidance_scale=4.5, **kw)
    assert cfg_guided["total"] == 2 * base["total"]
    extra = flow_grpo_step_flops(cfg, guidance_scale=1.0, inner_epochs=2, beta=0.04, recompute_old_log_probs=True,
                                 trained_images=6, **kw)
    assert extra["train"] == 6 * 3 * (2 * full + 2 * F + F)  # epochs × (fwd+bwd) + epochs × ref fwd + one recompute
    lora = Lora(("to_q", "to_k", "to_v"), 4)
    policy = forward_flops(ops, lora)  # the unmerged adapter's matmuls too
    adapted = flow_grpo_step_flops(cfg, guidance_scale=1.0, lora=lora, decode_flops_per_image=1000, **kw)
    assert adapted["rollout"] == 8 * 10 * policy and adapted["decode"] == 8 * 1000
    assert adapted["train"] == 8 * 3 * (policy + backward_flops(ops, lora)) < base["train"]
    merged = flow_grpo_step_flops(cfg, guidance_scale=1.0, lora=lora, merged_rollout=True, **kw)
    assert merged["rollout"] == base["rollout"] and merged["train"] == adapted["train"]


def test_mfu_and_peaks():
    assert mfu(989e12 * 2 * 0.5, 2.0, 1, 989.0) == pytest.approx(0.5)
    assert mfu(1e15, 1.0, 4, 250.0) == pytest.approx(1.0)
    assert mfu(1e15, 1.0, 1, 0.0) is None
    assert peak_tflops_for("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops_for("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops_for("NVIDIA H200", "bf16") == 989.0
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB", "fp16") == 312.0
    assert peak_tflops_for("NVIDIA L40S", "bf16") == 362.0
    assert peak_tflops_for("NVIDIA H100 80GB HBM3", "fp32") == 67.0
    assert peak_tflops_for("NVIDIA H100 80GB HBM3", "fp32", tf32=True) == 494.0
    assert peak_tflops_for("cpu", "fp32") == 0.0
    assert peak_tflops_for("Some Future GPU", "bf16") == 0.0


def _proc_status_gib(key: str) -> float:
    """A /proc/self/status line such as "VmHWM:  123456 kB", in GiB: the kernel's own count, read without getrusage."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(f"{key}:"))
    return kib / 2**20


def test_peak_memory_is_the_process_peak_rss_in_gib(monkeypatch):
    """On CPU: the peak resident set size, which the kernel also reports as VmHWM — so a wrong unit (KiB read as
    bytes or MiB) or a factor of 2 fails; it is at least what the process holds now. On CUDA: the allocator's peak."""
    import resource

    import gerl.logging.throughput as tp

    gib = peak_memory_gib(None)
    assert gib == pytest.approx(_proc_status_gib("VmHWM"), rel=0.05) and gib >= _proc_status_gib("VmRSS") * 0.95
    assert peak_memory_gib("cpu") == pytest.approx(gib, rel=0.05)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30 + 2**29)  # bytes
    assert peak_memory_gib("cuda:0") == 3.5
    # macOS reports ru_maxrss in bytes, Linux in KiB
    usage = lambda maxrss: lambda who: type("Usage", (), {"ru_maxrss": maxrss})  # noqa: E731
    monkeypatch.setattr(tp.sys, "platform", "darwin")
    monkeypatch.setattr(resource, "getrusage", usage(3 * 2**30))
    assert peak_memory_gib(None) == 3.0
    monkeypatch.setattr(tp.sys, "platform", "linux")
    monkeypatch.setattr(resource, "getrusage", usage(3 * 2**20))
    assert peak_memory_gib(None) == 3.0


def test_model_config_for_reads_a_directory_as_diffusers_does(tiny_pipe, tiny_dir, tmp_path):
    """The FLOPs model's configs from disk: a saved directory gives what diffusers' own load_config gives (the
    reference) and the pipeline's VAE factor; tiny without a pipeline and a directory without configs give None."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    from gerl.logging.throughput import model_config_for

    MMDIT = "SD3Transformer2DModel"
    config, factor = model_config_for(str(tiny_dir))
    assert config == dict(SD3Transformer2DModel.load_config(str(tiny_dir), subfolder="transformer"))
    assert factor == 2 ** (len(AutoencoderKL.load_config(str(tiny_dir), subfolder="vae")["block_out_channels"]) - 1) == 4
    assert model_config_for("tiny", tiny_pipe) == (dict(tiny_pipe.transformer.config, _class_name=MMDIT), 4)
    assert model_config_for("tiny") is None and model_config_for(str(tmp_path)) is None


@pytest.mark.parametrize("path", ["tiny", "tiny-flux", "tiny-qwenimage", "tiny-flux2-klein", "tiny-zimage",
                                  "tiny-flux-kontext", "tiny-qwenimage-edit"])
def test_every_family_logs_mfu(path):
    """The trainer's tracker counts every family's steps (FLUX.1 and Qwen-Image logged mfu null before, then
    FLUX.2-klein, Z-Image and the editing families): the step's model FLOPs — LoRA training on the family's own
    targets (FLUX.1-Kontext's include proj_mlp), the unmerged adapter in the rollout, one VAE decode per image, an
    editing model's reference tokens — over the step's seconds and the peak. A batch of two reference sizes counts
    each at its share."""
    from gerl.config import load_config
    from gerl.logging.flops import Lora
    from gerl.logging.throughput import reference_tokens, tracker_for, vae_decode_flops
    from gerl.models.family import TINY_MODELS, families
    from gerl.sampling.loop import Embeds

    family = families()[TINY_MODELS[path][0]]
    pipe = family.build_tiny(0, TINY_MODELS[path][1])
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={path}", "metrics.peak_tflops=1e-3"])
    tracker = tracker_for(cfg, 1, pipe)
    flops = tracker.flops
    assert flops.lora == Lora(tuple(cfg.model.lora_targets or family.lora_targets), cfg.model.lora_rank)
    latent = family.latent_shape(pipe, cfg.model.resolution)
    assert flops.decode_flops_per_image == vae_decode_flops(pipe.vae, family, latent) > 0
    row = {"step": 1, "images": 16, "step_s": 2.0, "trained_steps_per_sample": 3}
    hw = torch.tensor([[8, 8]] * 12 + [[8, 12]] * 4) if family.conditioned else None  # 16 and 24 reference tokens
    refs = reference_tokens(Embeds(torch.zeros(16, 8, 4), None, cond_hw=hw))
    assert refs == (None if hw is None else [16] * 12 + [24] * 4)

    def expected(cond_tokens):
        return flow_grpo_step_flops(
            dict(pipe.transformer.config, _class_name=type(pipe.transformer).__name__),
            resolution=cfg.model.resolution, text_len=8, images=16, num_steps=cfg.sampling.num_steps,
            guidance_scale=cfg.sampling.guidance_scale, trained_steps=3, inner_epochs=cfg.train.inner_epochs,
            beta=cfg.train.beta, vae_scale_factor=flops.vae_scale_factor,
            recompute_old_log_probs=cfg.train.recompute_old_log_probs, lora=flops.lora,
            merged_rollout=cfg.model.merge_lora, decode_flops_per_image=flops.decode_flops_per_image,
            cond_tokens=cond_tokens)["total"]

    want = 0.75 * expected(16) + 0.25 * expected(24) if family.conditioned else expected(0)
    assert tracker.update(row, text_len=8, cond_tokens=refs)["mfu"] == pytest.approx(want / (2.0 * 1e9))
    if family.conditioned:  # the reference's tokens are a real share of the work
        assert want > 1.1 * expected(0)
