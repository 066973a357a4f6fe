"""scripts/bench_gpu.py's issue parts on the tiny SD3 (CPU, fp32), through the script's own main(argv): our rollout
against diffusers' StableDiffusion3Pipeline, the pre-update ratio check at training micro-batch 4 and 8, the tiny
text encoders on random token ids, memory attribution, --out; and its one-line errors (exit 2)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

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
