"""The measuring parts of the third GPU day's phases, checked on CPU against hand-worked expectations: the order
and warm-ups of side-by-side timing, the GPU-busy fraction, the embedding cache that keeps CPU normals out of timed
generation, every step variant's config, and the OCR phase's premise (rendered target text is read)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from tests.scripts import REPO, load_script

sys.path.insert(0, str(REPO / "benchmarks"))  # the phase modules import each other by name, as gpu_day runs them
rollout_mod = load_script("_gpu_day_rollout")
probes = load_script("_gpu_day_probes")
step_mod = load_script("_gpu_day_step")
bench = load_script("bench_gpu")


class FakeCtx:
    device = torch.device("cpu")

    def sync(self) -> float:
        import time

        return time.perf_counter()


def test_time_sides_warms_every_side_first_then_rotates_the_order():
    calls = []
    sides = {name: (lambda n=name: calls.append(n)) for name in ("a", "b", "c")}
    got = rollout_mod.time_sides(FakeCtx(), sides, reps=3, warmup=1)
    assert calls == ["a", "b", "c",  # the warm-ups, untimed
                     "a", "b", "c", "b", "c", "a", "c", "a", "b"]  # round r starts at side r mod 3
    assert all(len(v["times_s"]) == 3 and v["min_s"] <= v["median_s"] for v in got.values())


def test_compare_stock_alternates_which_side_runs_first(monkeypatch):
    order = []
    ctx = SimpleNamespace(device=torch.device("cpu"), images=2,
                          peaks=SimpleNamespace(stage=lambda name: __import__("contextlib").nullcontext()))
    ours = lambda c, e, s: (order.append("ours"), ([], [0, 0]))[1]  # noqa: E731
    stock = lambda c, p, e, s: (order.append("stock"), [0, 0])[1]  # noqa: E731
    res, _ = bench.compare_stock(ctx, [], reps=4, warmup=1, stock=object(), run_stock=stock, ours=ours)
    assert order == ["ours", "stock", "ours", "stock", "stock", "ours", "ours", "stock", "stock", "ours"]
    assert len(res["ours_times_s"]) == len(res["stock_times_s"]) == 4 and res["order"] == "alternating"
    med = __import__("statistics").median
    assert res["ratio"] == pytest.approx(med(res["stock_times_s"]) / med(res["ours_times_s"]))


def test_busy_fraction_is_the_union_of_the_kernels_over_the_wall():
    # [0, 100] wall; kernels 10–30, 20–40 (overlap), 50–60, 95–120 (past the wall): 30 + 10 + 5 = 45 µs
    assert probes.busy_fraction([(20, 40), (10, 30), (95, 120), (50, 60)], 0, 100) == pytest.approx(0.45)
    assert probes.busy_fraction([], 0, 100) == 0.0
    assert probes.classify("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert probes.classify("flash_fwd_kernel") == "attention"
    assert probes.classify("ampere_sgemm_128x64_tn") == "gemm_fp32"
    assert probes.classify("vectorized_elementwise_kernel") == "elementwise_other"


def test_the_random_embedder_draws_each_prompt_once():
    emb = bench.RandomEmbedder(5, 4, 3, torch.device("cpu"), torch.float32)
    first = emb(["a", "b", "a"], with_negative=True)
    drawn = []
    real = torch.randn
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "randn", lambda *a, **k: (drawn.append(a), real(*a, **k))[1])
        again = emb(["b", "a"], with_negative=True)
    assert drawn == []  # cached: a timed generation draws no CPU normals for a prompt it has seen
    assert torch.equal(again.prompt[1], first.prompt[0]) and torch.equal(again.pooled[0], first.pooled[1])
    assert torch.equal(again.neg_prompt[0], first.neg_prompt[2])
    assert not torch.equal(first.prompt[0], first.prompt[1])
    # the same values the uncached embedder drew: a prompt's generator, seeded by its text, prompt then pooled
    g = torch.Generator().manual_seed(__import__("zlib").crc32(b"a"))
    assert torch.equal(first.prompt[0], torch.randn(5, 4, generator=g))


@pytest.mark.parametrize("name", list(step_mod.VARIANTS))
@pytest.mark.parametrize("rehearse", [False, True])
def test_every_step_variant_is_a_valid_config(name, rehearse):
    cfg = step_mod.step_config(name, rehearse)
    images = cfg.data.prompts_per_step * cfg.data.group_size
    if name.startswith("gerl8"):  # one GPU's share of GeRL's 8-GPU run: one group, GeRL's per-GPU mini-batch
        assert cfg.data.prompts_per_step == 1 and cfg.train.mini_batch_size < images
    if name.endswith("_levers"):
        assert cfg.model.merge_lora and cfg.model.compile and cfg.model.vae_dtype == "bf16"
    if name in ("nft", "awm", "dgpo"):
        assert cfg.model.dtype == "bf16" if not rehearse else True
    assert cfg.model.path == ("tiny" if rehearse else "stabilityai/stable-diffusion-3.5-medium")


def test_prepare_pipeline_sets_tf32_as_a_run_does(monkeypatch, tiny_pipe):
    """The step benchmark builds through roles.prepare_pipeline: on a CUDA device it sets TF32 from model.tf32 (the
    NFT/AWM rows of the first two GPU days ran without it)."""
    import copy

    from gerl.config import load_config
    from gerl.engine import roles

    monkeypatch.setattr(roles, "resolve_device", lambda d: torch.device("cuda"))
    saved = torch.backends.cuda.matmul.allow_tf32
    pipe = SimpleNamespace(transformer=copy.deepcopy(tiny_pipe.transformer), vae=tiny_pipe.vae)
    try:
        for tf32 in (True, False):
            roles.prepare_pipeline(pipe, load_config(None, [f"model.tf32={str(tf32).lower()}", "model.lora=false"]))
            assert torch.backends.cuda.matmul.allow_tf32 is tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_rendered_target_text_is_read_by_the_ocr_reward():
    """The ocr phase's premise: PIL-rendered target text at 256 px scores near 1 with the real OCR (random-weight
    images score 0: detection finds nothing and recognition never runs)."""
    from gerl.data.prompts import load_prompts
    from rewards.registry import build_reward

    prompts = load_prompts(REPO / "assets/ocr/train.txt")[:6]
    images = probes.rendered_targets(prompts, 256)
    scores, _ = build_reward("ocr", {})(images, [p.text for p in prompts], [dict(p.metadata) for p in prompts])
    assert min(scores) > 0.5 and sum(scores) / len(scores) > 0.8, scores


def test_the_step_benchmark_builds_through_prepare_pipeline(monkeypatch, tmp_path):
    """What the step phase times is built as `gerl train` builds it: roles.prepare_pipeline with the run's config
    (TF32, the adapter, the levers), the VAE handed to it in fp32 as gerl's loader loads it."""
    from gerl.engine import roles

    import _gpu_day_phases as phases
    seen = []
    real = roles.prepare_pipeline
    monkeypatch.setattr(roles, "prepare_pipeline",
                        lambda pipe, cfg, device=None: (seen.append((cfg, pipe.vae.dtype)), real(pipe, cfg, device))[1])
    ctx = phases.Ctx(True, tmp_path, {}, lambda: None, device=torch.device("cpu"), bench=bench)
    cfg = step_mod.step_config("gerl8", True)
    engine, build_s, _ = step_mod.build_engine(ctx, cfg)
    engine.close()
    assert len(seen) == 1 and seen[0][0] is cfg and seen[0][1] == torch.float32 and build_s > 0
    assert any("lora_A" in n for n, _ in engine.actor.worker.named_params)  # the adapter came from the config


def test_the_fsdp_phase_trains_through_fully_shard_and_replays_the_rollout(tmp_path):
    """The fsdp phase (benchmarks/_gpu_day_fsdp.py) rehearsed on the CPU, in bf16 as on the GPU: the actor's
    transformer went through FSDP2 with fp32 masters over a world-1 gloo group, its first replay gives the unsharded
    rollout's log-probs (bf16 on the CPU: 2.5e-6, the unsharded actor's own figure), and the plan's peak is recorded.
    Broken on purpose (by hand, 2026-11-28): an actor built without the data-parallel layer failed the phase by name
    ("the actor was not sharded"), with the same 2.5e-6."""
    import torch.distributed as dist

    import _gpu_day_fsdp as fsdp
    import _gpu_day_phases as phases

    n = {}
    ctx = phases.Ctx(True, tmp_path, n, lambda: None, device=torch.device("cpu"), bench=bench)
    fsdp.fsdp_step(ctx, phases.bench_ctx, phases.rollout_batch, phases.PhaseFailed)
    assert n["sharded"] and n["fp32_masters"] and n["dtype"] == "bf16" and n["images"] == 2
    assert n["ratio_max_dev"] <= fsdp.RATIO_BOUND and n["grad_norm"] > 0 and n["plan_actor_peak_gib"] > 0
    assert not dist.is_initialized()  # the phase's group is gone: nothing leaks into the next phase or test

