"""benchmarks/bench_gpu.py's issue parts on the tiny SD3 (CPU, fp32), through the script's own main(argv): our rollout
against diffusers' StableDiffusion3Pipeline, the pre-update ratio check at training micro-batch 4 and 8, the tiny
text encoders on random token ids, memory attribution, --out; its one-line errors (exit 2); the gradient check at
SD3.5-M's real width (2 blocks, 512 px) in fp16 with and without loss scaling and in bf16; and the CPU fp16 GEMM
emulation (gerl/numerics.py) against real fp16 ops."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re

import pytest
import torch
import torch.nn.functional as F

from gerl.numerics import Fp16GemmEmulation
from tests.scripts import load_script

bench = load_script("bench_gpu")


def test_tiny_run_compares_with_stock_checks_ratios_and_attributes_memory(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # 2 prompts × 4 images = 8: rollout micro-batch 8, so the ratio check covers training micro-batch 4 and 8
    argv = ["--tiny", "--steps", "1", "--warmup", "0", "--stock-reps", "1", "--text-encoders", "--out", str(out)]
    with torch.random.fork_rng():  # the script seeds torch's global RNG; leave the other tests' state alone
        assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    summary = json.loads(out.read_text())
    line = next(ln for ln in printed.splitlines() if ln.startswith("BENCH_JSON "))
    assert json.loads(line.split(" ", 1)[1]) == summary

    m = summary["modes"]["none"]  # the GPU benchmark's own step (denoise, decode, ActorWorker.update, FLOPs/MFU)
    assert summary["images_per_step"] == 8 and summary["step_tflop"] > 0
    assert m["images_per_s_per_gpu"] > 0 and m["generate_s"] > 0 and m["train_s"] > 0
    assert m["mfu"] is None  # CPU: no known peak
    assert summary["text_encoders"] and m["encode_s"] > 0
    c = summary["stock"]
    assert c["ours_images_per_s"] > 0 and c["stock_images_per_s"] > 0 and c["output_type"] == "pil"
    assert c["ratio"] == pytest.approx(c["ours_images_per_s"] / c["stock_images_per_s"], rel=1e-12)
    shown = re.search(r"ours ([\d.]+) images/s, stock ([\d.]+) images/s, ours/stock ([\d.]+)", printed)
    ours, stock, ratio = map(float, shown.groups())
    assert ratio == pytest.approx(c["ratio"], abs=5e-4) and ours == pytest.approx(c["ours_images_per_s"], abs=5e-4)
    assert ratio == pytest.approx(ours / stock, rel=2e-3)  # the printed ratio is the printed ours / stock

    r = summary["ratio_check"]
    assert r["rollout_micro_batch"] == 8 and r["bound"] == 1e-3
    devs = r["max_abs_ratio_minus_1"]
    assert set(devs) == {"4", "8"}
    # fp32 on CPU: the replay reproduces the rollout (measured 1.2e-7 and 4.1e-6: grad vs no-grad kernels round
    # differently); the bound only has to separate rounding from a replay at other weights, steps or noise
    assert all(0 <= d < 1e-4 for d in devs.values()), devs
    assert len(re.findall(r"ratio check: .* max \|ratio - 1\| = .* \(within bound 0.001\)", printed)) == 2

    m = summary["memory"]
    weights = m["weights_gib"]
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "optimizer_state"):
        assert weights[name] > 0, name
    assert set(m["stage_peak_gib"]) >= {"encode", "rollout", "decode", "train", "stock", "ratio_check"}
    assert all(v is None for v in m["stage_peak_gib"].values())  # CPU: no allocator peaks, only the process RSS
    assert m["run_peak_gib"] > 0 and summary["peak_mem_gib"] == m["run_peak_gib"]
    assert "memory stage peaks GiB: encode n/a" in printed


def test_missing_rapidocr_is_a_one_line_error(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rapidocr" else real(name, *a))
    assert bench.main(["--tiny", "--with-reward", "both"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "rapidocr" in err and "bash scripts/setup.sh --wheelhouse DIR" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_no_cuda_without_tiny_is_a_one_line_error(capsys):
    assert bench.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--tiny" in err


def test_bad_numerics_flags_are_one_line_errors(capsys):
    assert bench.main(["--tiny", "--no-loss-scale", "--layers", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--no-loss-scale needs --dtype fp16" in err and "--layers is for SD3.5-M" in err


# ------------------------------------------------------------------ fp16 gradients at SD3.5-M's real width

# One 512 px image (latents 16 × 64 × 64), 2 blocks at SD3.5-M's width (block 0 with dual attention), LoRA r32,
# 77 + 32 text tokens instead of 333, a 3-step schedule whose one trained step is step 0 (σ 1 → 0.751): its
# per-element gradient is ~2× that of any step of GeRL's 10-step window, so underflow here holds there a fortiori.
# The loss averages over the mini-batch and the trained steps: GeRL's 32 images × 3 steps weigh each image's step
# by 1/96, which advantages × 1/96 reproduce exactly for one image (a micro-batch of 8 computes the same
# per-sample gradients). Each run ≈ 30 s on one core: build (once), 3 rollout forwards, the update, the fp32 copy.
REAL_WIDTH = ["--device", "cpu", "--layers", "2", "--steps", "0", "--warmup", "0", "--no-stock", "--prompts", "1",
              "--group-size", "1", "--resolution", "512", "--num-steps", "3", "--sde-window", "1",
              "--sde-window-range", "0", "1", "--t5-tokens", "32", "--advantage-scale", str(1 / 96)]


@pytest.fixture
def one_thread():
    """One torch thread, as the rest of the suite (tests/conftest.py), and the 2-block build freed after. Two threads
    (this fixture's former setting) beside the suite's other processes on 2 cores made the test 5× slower than alone
    (202 s in a fresh-clone suite, 39 s alone; OpenMP threads spin while the other processes hold the cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    bench._cpu_transformer.cache_clear()  # the cached 2-block fp32 build holds ~1.6 GB


def real_width_run(extra: list[str], capsys) -> tuple[dict, str]:
    with torch.random.fork_rng():
        assert bench.main(REAL_WIDTH + extra) == 0
    printed = capsys.readouterr().out
    line = next(ln for ln in printed.splitlines() if ln.startswith("BENCH_JSON "))
    return json.loads(line.split(" ", 1)[1]), printed


def test_fp16_gradients_need_loss_scaling_at_real_width(one_thread, capsys):
    runs = {name: real_width_run(extra, capsys) for name, extra in [("fp16", ["--dtype", "fp16"]),
                                                                    ("bf16", ["--dtype", "bf16"])]}
    for name, (s, printed) in runs.items():
        assert s["layers"] == 2 and s["resolution"] == 512 and s["text_len"] == 77 + 32, name
        r = s["ratio_check"]
        assert r["max_abs_ratio_minus_1"]["1"] < r["bound"], name  # the replay reproduces the rollout
        g = r["grad_check"]
        assert g["micro_batch"] == 1 and g["trained_steps"] == 1 and g["finite"], name
        assert g["clipfrac"] == 0 and g["reference_clipfrac"] == 0, name  # no sample silenced by the clip
        assert g["entries"] > 2_000_000 and g["reference_zero_fraction"] < 0.1, name  # the fp32 gradient is dense
        assert "gradient check: LoRA gradient of ActorWorker.update in " + s["dtype"] in printed, name
        # fp16 on the CPU: GEMMs emulated (and said so); bf16 runs for real
        emulated = s["dtype"] == "fp16"
        assert s["fp16_gemm_emulation"] is emulated and (s["fp16_gemm_emulated_calls"] > 0) is emulated, name
        assert ("fp16 GEMM emulation ON" in printed) is emulated, name
        assert ("emulated in fp32 on the CPU" in printed) is emulated, name
        assert ("control" in g) is emulated, name  # only a loss-scaled run has an unscaled control
    g16, gbf = (runs[n][0]["ratio_check"]["grad_check"] for n in ("fp16", "bf16"))
    control = g16["control"]  # the same fp16 update without loss scaling: same rollout, same fp32 reference
    # measured: fp16 scaled 1.00000 (zeros 6.4 % vs fp32 4.3 %), bf16 0.99987, fp16 unscaled 0 (zeros 100 %)
    assert g16["cosine"] >= 0.99 and gbf["cosine"] >= 0.99, (g16, gbf)
    assert g16["loss_scale"] == 65536 and gbf["loss_scale"] is None and control["loss_scale"] is None
    # unscaled before anything reads them: the same size as fp32's (a missing unscale would leave them 65536×)
    assert 0.95 < g16["norm_ratio"] < 1.05 and 0.95 < gbf["norm_ratio"] < 1.05, (g16, gbf)
    # the control: without loss scaling every gradient underflows in fp16 and the LoRA learns nothing
    assert control["finite"] and control["ratio_dev"] < 1e-3 and control["clipfrac"] == 0, control
    assert control["cosine"] < 0.99 and control["zero_fraction"] > 0.99, control
    assert control["reference_zero_fraction"] == g16["reference_zero_fraction"]  # one fp32 reference for both
    printed = runs["fp16"][1]
    assert "gradient check, the control: the same update in fp16 with loss scaling OFF" in printed
    assert re.search(r"the control: .* cosine [\d.]+ \(FAILS, bar 0.99\)", printed), printed


def test_no_loss_scale_runs_everything_unscaled(capsys):
    """--no-loss-scale on the tiny model: the update has no scaler, so there is nothing to pair a control with."""
    with torch.random.fork_rng():
        assert bench.main(["--tiny", "--dtype", "fp16", "--no-loss-scale", "--steps", "0", "--warmup", "0",
                           "--no-stock", "--prompts", "1", "--group-size", "2"]) == 0
    printed = capsys.readouterr().out
    s = json.loads(next(ln for ln in printed.splitlines() if ln.startswith("BENCH_JSON ")).split(" ", 1)[1])
    g = s["ratio_check"]["grad_check"]
    assert g["loss_scale"] is None and "control" not in g and "loss scaling OFF (the control)" in printed


# ------------------------------------------------------------------ the emulation against real fp16 ops

def test_fp16_gemm_emulation_matches_real_fp16_ops():
    """On small shapes (where the CPU's own fp16 kernels are quick) the emulated products agree with the real ones
    to within one fp16 rounding, stay fp16, and flush a sub-subnormal gradient to zero exactly as real fp16 does."""
    def h(*shape):
        return torch.randn(*shape).half()

    def ops():
        torch.manual_seed(1)
        a, b, c = h(33, 70), h(70, 45), h(45)
        x, y, z = h(3, 33, 70), h(3, 70, 45), h(3, 33, 45)
        return {"mm": a @ b, "addmm": torch.addmm(c, a, b, beta=0.5, alpha=2.0), "bmm": torch.bmm(x, y),
                "baddbmm": torch.baddbmm(z, x, y), "linear": F.linear(h(2, 5, 70), b.t(), c),
                "matmul_4d": h(2, 4, 33, 70) @ h(2, 4, 70, 45), "mv": a @ h(70), "dot": h(70) @ h(70)}

    real = ops()
    mode = Fp16GemmEmulation()
    with mode:
        emulated = ops()
    assert mode.calls == len(real)
    for name, r in real.items():
        e = emulated[name]
        assert e.dtype == torch.float16 and e.shape == r.shape, name
        # one fp16 rounding of (almost) the same fp32 sum: equal, or one ulp apart where the sums straddle a tie
        torch.testing.assert_close(e.float(), r.float(), rtol=2 * 2.0**-10, atol=2.0**-14, msg=name)
        assert (e == r).float().mean() > 0.99, name

    def attention_grads():
        torch.manual_seed(2)
        q, k, v = (h(1, 2, 16, 8).requires_grad_() for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v)
        (out.float() * torch.linspace(-1, 1, 8)).sum().backward()
        return out.detach(), [t.grad for t in (q, k, v)]

    out_real, grads_real = attention_grads()
    with Fp16GemmEmulation() as mode:
        out_emulated, grads_emulated = attention_grads()
    assert mode.calls >= 1 and torch.equal(out_emulated, out_real)  # the forward is not emulated
    for gr, ge in zip(grads_real, grads_emulated):
        assert ge.dtype == torch.float16
        torch.testing.assert_close(ge.float(), gr.float(), rtol=4 * 2.0**-10, atol=1e-3)

    # underflow stays real: 1e-9 per element through a frozen fp16 linear, as at the end of predict_velocity
    def input_grad(scale: float) -> torch.Tensor:
        torch.manual_seed(3)
        w, x = h(64, 64), h(4, 64).requires_grad_()
        (F.linear(x, w).float() * 1e-9 * scale).sum().backward()
        return x.grad

    for mode in (contextlib.nullcontext(), Fp16GemmEmulation()):
        with mode:
            assert not input_grad(1.0).any()  # the gradient reaching the fp16 output is 0 in fp16
            assert input_grad(2.0**16).all()  # × the loss scale it survives


def test_launchers_mode_runs_a_launcher_and_reports_its_checks(tmp_path, capsys):
    """--launchers on a CPU machine: the GPU-day launcher check, rehearsed, as a user runs it (bash, its own Ray
    declaring the 3 GPUs), one launcher to keep it short (tests/engine/test_rehearsal.py rehearses all five)."""
    out = tmp_path / "launchers.json"
    assert bench.main(["--launchers", "3p_a1_r2", "--device", "cpu", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["launchers"][0]
    assert row["exit"] == 0 and row["ok"] and row["hosts"] == 3
    assert row["grad_norm"] > 0 and row["ratio_dev"] <= 1e-3 and row["loss_scale"] == 2.0**24
    assert not row["driver_cuda"] and "engine.rehearse=true" in row["command"]
    mem = row["memory"]
    assert mem["actor"]["measured_gib"] > 0 and mem["rollout"]["measured_gib"] > 0
    assert mem["actor"]["plan_gib"] is None  # a rehearsal is no GPU run: no plan
    assert "launcher 3p_a1_r2" in capsys.readouterr().out
    assert bench.main(["--launchers", "9p", "--device", "cpu"]) == 2
