"""gerl plan per algorithm and dtype against the CPU allocator: the actor's whole update (flow_grpo, nft, awm in fp16
with a LoRA and in bf16 with full fine-tuning), and the rollout's denoising with and without recorded SDE steps.

The model: SD3.5-Medium's transformer cut to two blocks (one dual-attention) and narrowed to 2 heads, its text
width 256, at 128 px — small enough that the trained tensors (full fine-tuning) weigh as much as the activations,
so that each resident line the algorithm adds (anchor, EMA, reference copy) and the swap backup moves the peak by
several percent, five times the bound.

The measure: the running sum of the CPU allocator's [memory] events (torch.profiler), less the scratch a kernel
allocates and frees inside one call (`_scratch_free_peak`): the CPU's fp16 GEMM converts its operands to fp32 (a
(64 × 512) @ (512 × 128) product: 406 KiB of scratch for a 16 KiB output) where cuBLAS works in a workspace
allocated once, and neither is what the plan counts (fake tensors see each op's outputs; docs/plan.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gerl.config import load_config
from gerl.models import sd35_arch
from gerl.models.loader import DTYPES, add_lora
from gerl.plan import plan_for_config
from gerl.plan.arch import module_from_config
from gerl.sampling.loop import Embeds, Schedule, Trajectory, denoise
from gerl.workers.actor import ActorWorker
from gerl.workers.batch import RolloutBatch
from tests.plan_allocator import existing_bytes as _existing_bytes
from tests.plan_allocator import scratch_free_peak as _scratch_free_peak

REPO = Path(__file__).resolve().parents[1]
RECIPES = {a: str(REPO / "recipes" / f"{a}_sd3_ocr.yaml") for a in ("flow_grpo", "nft", "awm")}
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")
RES, CLIP, T5, WIDTH = 128, 16, 8, 256  # px; CLIP and T5 tokens; text width
LATENT = (16, RES // 8, RES // 8)
B = 2  # images per step: one optimizer step of two training micro-batches
BOUND = 0.02  # |planned − measured| / measured (measured: within 0.5 %, docs/plan.md)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """SD3.5-Medium's configs, shrunk (see the module docstring); the text encoders and VAE shrunk too, which only
    the rollout's phases read."""
    path = tmp_path_factory.mktemp("sd35_narrow")
    text = dict(num_hidden_layers=1, max_position_embeddings=CLIP, vocab_size=256, hidden_size=64,
                intermediate_size=128, num_attention_heads=2, projection_dim=WIDTH // 2)
    changes = {"transformer": dict(num_layers=2, dual_attention_layers=[0], num_attention_heads=2,
                                   caption_projection_dim=128, pos_embed_max_size=RES // 16,
                                   joint_attention_dim=WIDTH, pooled_projection_dim=WIDTH),
               "vae": dict(block_out_channels=[32, 32, 32, 32], layers_per_block=1, norm_num_groups=8),
               "text_encoder": text, "text_encoder_2": text,
               "text_encoder_3": dict(num_layers=1, vocab_size=256, d_model=WIDTH, d_ff=512, num_heads=4, d_kv=64)}
    for c, change in changes.items():
        (path / c).mkdir()
        (path / c / "config.json").write_text(json.dumps(dict(sd35_arch.load_config(c), **change)))
    return path


def _config(algo: str, dtype: str, lora: bool, checkpointing: bool, model_dir: Path, *extra: str):
    over = ["engine.kind=ray", "engine.device=cuda", "engine.hybrid=false", "engine.actor_workers=1",
            "engine.rollout_workers=1", f"model.path={model_dir}", f"model.dtype={dtype}", f"model.lora={lora}",
            f"model.gradient_checkpointing={checkpointing}", f"model.resolution={RES}",
            f"model.max_sequence_length={T5}", "data.prompts_per_step=1", f"data.group_size={B}",
            f"sampling.micro_batch_size={B}", "train.micro_batch_size=1", f"train.mini_batch_size={B}", *extra]
    if algo != "flow_grpo":
        over.append("algo.train_timesteps=1")
    return load_config(RECIPES[algo], over)


def _transformer(model_dir: Path, cfg) -> torch.nn.Module:
    """The real transformer of the shrunk config on the CPU, seeded, in model.dtype, with the recipe's adapter."""
    torch.manual_seed(0)
    tf = module_from_config("transformer", json.loads((model_dir / "transformer" / "config.json").read_text()))
    with torch.no_grad():
        for t in [*tf.parameters(), *tf.buffers()]:
            t.normal_(0, 0.02)
    tf.requires_grad_(False).to(DTYPES[cfg.model.dtype])
    if cfg.model.lora:
        add_lora(tf, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_targets, seed=0)
    return tf


def _embeds(b: int, dtype: torch.dtype, guided: bool, g: torch.Generator) -> Embeds:
    def pair():  # cached text embeddings, in the dtype the text encoders produce them
        return torch.randn(b, CLIP + T5, WIDTH, generator=g).to(dtype), torch.randn(b, WIDTH, generator=g).to(dtype)
    return Embeds(*pair(), *(pair() if guided else ()))


def _batch(cfg) -> RolloutBatch:
    """What a rollout hands the actor: flow_grpo one recorded SDE step per sample, nft/awm the clean latents."""
    g = torch.Generator().manual_seed(1)
    n = cfg.sampling.num_steps
    sigmas = torch.linspace(1, 0, n + 1)
    x0 = torch.randn(B, *LATENT, generator=g)
    if cfg.algo.name == "flow_grpo":
        x = torch.randn(B, 1, *LATENT, generator=g)
        traj = Trajectory(x, x + 0.01 * torch.randn(x.shape, generator=g), torch.zeros(B, 1), torch.tensor([2]), x0)
    else:
        none = torch.zeros(B, 0, *LATENT)
        traj = Trajectory(none, none, torch.zeros(B, 0), torch.zeros(0, dtype=torch.long), x0)
    return RolloutBatch(prompts=["a"] * B, metadata=[{}] * B, group_ids=torch.zeros(B, dtype=torch.long),
                        embeds=_embeds(B, DTYPES[cfg.model.dtype], cfg.sampling.guidance_scale > 1, g),
                        schedule=Schedule(sigmas, sigmas[:-1] * 1000), traj=traj, images=[None] * B, policy_version=0)


# (algo, dtype, LoRA, checkpointing, the phase that makes the actor's peak) — the last shows what each case checks:
# full fine-tuning in bf16 steps fp32 masters (gerl/workers/masters.py), whose foreach AdamW step (a copy of the
# fp32 state's size) is the tiny model's peak; the anchor forward's backup is checked on its own below.
CASES = [("flow_grpo", "fp16", True, False, "training"), ("flow_grpo", "bf16", False, False, "clip + AdamW"),
         ("nft", "fp16", True, False, "training"), ("nft", "bf16", False, False, "clip + AdamW"),
         ("awm", "fp16", True, True, "training"), ("awm", "bf16", False, True, "clip + AdamW")]


@pytest.mark.parametrize("algo,dtype,lora,checkpointing,peak_phase", CASES)
def test_actor_peak_matches_the_cpu_allocator(algo, dtype, lora, checkpointing, peak_phase, model_dir):
    """The actor's planned peak, less the weights and adapter that exist before it starts, against a real
    ActorWorker built and run for two updates (the second in the steady state: AdamW state, the gradients of the
    first micro-batch, the anchor, the EMA and the reference copy all alive) under the recipe's own settings
    (train.beta > 0, train.ema_decay > 0, awm's algo.anchor_beta = 1; flow_grpo with CFG)."""
    cfg = _config(algo, dtype, lora, checkpointing, model_dir)
    actor = plan_for_config(cfg).role("actor")
    assert actor.peak_phase.name.startswith(peak_phase)
    tf = _transformer(model_dir, cfg)
    existing = _existing_bytes(tf)  # the weights and the adapter: the plan's first resident lines
    assert existing == pytest.approx(sum(i.gib for i in actor.resident[:2 if lora else 1]) * 2**30, rel=1e-6)
    batch, metrics = _batch(cfg), []

    def run():
        worker = ActorWorker(tf, cfg.train, cfg.model, cfg.sampling, max_steps=2, images_per_step=B, seed=0,
                             conventions=cfg.conventions, algo=cfg.algo)
        metrics.extend(worker.update(batch, torch.tensor([1.0, -1.0]), step=s) for s in range(2))

    # AdamW as it runs on a GPU, the plan's device: foreach (torch's default on CUDA; on a CPU it loops per tensor,
    # whose temporaries are one tensor's, not the state's — the peak of a full fine-tuning's step on fp32 masters)
    real_adamw = torch.optim.AdamW
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.optim, "AdamW", lambda *a, **k: real_adamw(*a, **{**k, "foreach": True}))
        measured, raw = _scratch_free_peak(run)
    assert [m["optimizer_steps"] for m in metrics] == [1, 1]  # no step skipped: the AdamW state exists in the second
    # nft/awm draw the step's re-noising noise (B, train_timesteps, latent) fp32 on the host, whose allocator a CPU
    # run shares: added by hand (gerl.workers.matching.training_points; a GPU run moves one micro-batch's slice)
    host = B * cfg.algo.train_timesteps * torch.Size(LATENT).numel() * 4 if algo != "flow_grpo" else 0
    cuda_only = sum(i.gib for i in actor.resident if i.name.startswith("cuBLAS workspace")) * 2**30  # no CPU twin
    predicted = actor.peak_gib * 2**30 - existing + host - cuda_only
    assert abs(predicted - measured) / measured < BOUND, (predicted / 2**20, measured / 2**20, raw / 2**20)


def test_the_anchor_forward_holds_a_backup_of_the_trained_tensors(model_dir):
    """nft's anchor forward, full fine-tuning in bf16, at micro-batch 1: the plan's phase against the worker's own
    code for it (matching_update's `_point` and `anchor_swapped`, the velocity under no_grad) on a real ActorWorker
    whose anchor already exists. Nine tenths of the phase is the backup of the trained tensors (2.42 MiB); the
    whole-update test above cannot see it alone, as the plan's foreach AdamW step (one copy of them too) stands in
    for it there when it is missing."""
    from gerl.sampling.loop import predict_velocity
    from gerl.workers.matching import _point, training_points

    cfg = _config("nft", "bf16", False, False, model_dir)
    (phase,) = [p for p in plan_for_config(cfg).role("actor").phases if p.name.startswith("anchor forward")]
    tf = _transformer(model_dir, cfg)
    worker = ActorWorker(tf, cfg.train, cfg.model, cfg.sampling, max_steps=1, images_per_step=B, seed=0,
                         conventions=cfg.conventions, algo=cfg.algo)
    batch = _batch(cfg)
    plan_idx, noise = training_points(worker, batch, 0, 0)
    idx = torch.tensor([0])

    def run():
        _, _, _, x_t, t, embeds = _point(batch, idx, plan_idx[idx, 0], noise[idx, 0], "cpu")
        with torch.no_grad(), worker.anchor_swapped():
            predict_velocity(tf, x_t, t, embeds, cfg.sampling.guidance_scale).float()

    measured, raw = _scratch_free_peak(run)
    trained = sum(p.numel() * p.element_size() for p in worker.params)
    assert trained > 0.8 * measured  # the backup is most of it
    assert abs(phase.at(1) * 2**30 - measured) / measured < BOUND, (phase.at(1) * 2**30, measured, raw)


@pytest.mark.parametrize("algo", ["flow_grpo", "nft"])
def test_denoising_holds_the_recorded_steps_only_for_flow_grpo(algo, model_dir):
    """The rollout's denoising phase against gerl.sampling.loop.denoise run for real over a 4-step schedule on a
    micro-batch of 2 (flow_grpo: 3 recorded SDE steps and CFG, as its recipe; nft: an ODE, nothing recorded), the
    conditioning and the initial noise made inside as the rollout makes them on the device. The SDE noise of the
    recorded steps is drawn on the host (per-sample CPU generators): on a CPU it is in the allocator's count, so it
    is added to the plan by hand. In fp32: what is held does not depend on the dtype, and the CPU's bf16 and fp16
    elementwise kernels take scratch of their own (~60 KiB here: 9 % of this small phase)."""
    cfg = _config(algo, "fp32", True, False, model_dir, "sampling.num_steps=4")
    (phase,) = [p for p in plan_for_config(cfg).role("rollout").phases if p.name.startswith("denoising forward")]
    tf = _transformer(model_dir, cfg).eval()
    smp = cfg.sampling
    recorded = list(range(smp.num_steps - 1)) if algo == "flow_grpo" else []
    sigmas = torch.linspace(1, 0, smp.num_steps + 1)
    schedule = Schedule(sigmas, sigmas[:-1] * 1000)

    def run():
        g = torch.Generator().manual_seed(2)
        noise = torch.randn(B, *LATENT, generator=g)
        embeds = _embeds(B, torch.float32, smp.guidance_scale > 1, g)
        gens = [torch.Generator().manual_seed(i) for i in range(B)]
        denoise(tf, embeds, noise, schedule, recorded, smp.sampler, smp.noise_level, smp.guidance_scale, gens)

    measured, raw = _scratch_free_peak(run)
    host_noise = B * len(recorded) * torch.Size(LATENT).numel() * 4
    predicted = phase.gib * 2**30 + host_noise
    assert abs(predicted - measured) / measured < BOUND, (predicted / 2**20, measured / 2**20, raw / 2**20)


# ------------------------------------------------------------------ what each algorithm runs, by hand

def test_awm_old_forward_only_when_the_policy_moves_within_an_update():
    """AWM's recipe: 72 × 24 = 1728 images, mini-batch 1728, one inner epoch → one optimizer step per update, so its
    old log-probs are the training forward's own (no extra forward); two epochs, half mini-batches, or 8 ranks with
    a mini-batch of 216 each change that by hand-counted steps."""
    from gerl.plan.work import awm_old_forward, optimizer_steps_per_update, training_forwards

    def steps(*over):
        cfg = load_config(RECIPES["awm"], list(over))
        return optimizer_steps_per_update(cfg), awm_old_forward(cfg)

    assert steps() == (1, False)
    assert steps("train.inner_epochs=2") == (2, True)
    assert steps("train.mini_batch_size=864") == (2, True)
    ray8 = ["engine.kind=ray", "engine.hybrid=false", "engine.actor_workers=8", "engine.rollout_workers=8"]
    assert steps(*ray8) == (1, False)  # 1728 / 8 = 216 per rank, a mini-batch of 1728 / 8 each
    assert steps(*ray8, "train.mini_batch_size=432") == (4, True)  # 216 per rank in mini-batches of 54
    # the forwards per trained point, as gerl/workers/matching.py runs them (the recipes: train.beta > 0)
    assert training_forwards(load_config(RECIPES["awm"], []), False) == [
        "anchor (no grad, swapped in)", "policy (grad)", "reference (no grad)"]
    assert training_forwards(load_config(RECIPES["awm"], ["algo.anchor_beta=0", "train.beta=0"]), True) == [
        "old log-prob (no grad)", "policy (grad)"]
    assert training_forwards(load_config(RECIPES["nft"], []), False)[0] == "anchor (no grad, swapped in)"
    assert training_forwards(load_config(RECIPES["flow_grpo"], []), False) == ["policy (grad)", "reference (no grad)"]


def test_the_swap_backup_is_held_where_the_weights_are_swapped():
    """nft, full fine-tuning of the tiny model in bf16: the hybrid host generates with the anchor swapped into the
    shared transformer and validates the EMA the same way (engine.kind=local), so each of those phases exceeds the
    decoupled rollout's same phase by a backup of the trained tensors — by hand: each tensor's bytes rounded up to
    the 512-byte blocks the count uses; the actor holds the anchor, an fp32 copy of them (of their masters)."""
    from gerl.models.tiny import build_tiny_sd3

    over = ["algo.name=nft", "model.lora=false", "model.dtype=bf16", "train.ema_decay=0.9", "validation.every=5"]
    local = plan_for_config(load_config(TINY, over)).role("hybrid")
    split = plan_for_config(load_config(TINY, [*over, "engine.kind=ray", "engine.hybrid=false"]))
    params = list(build_tiny_sd3(0).transformer.parameters())
    masters = sum(p.numel() * 4 for p in params)  # the anchor copies the fp32 masters of the bf16 weights
    backup = sum(-(-p.numel() * 2 // 512) * 512 for p in params)  # the swap backs up the model's bf16 weights
    anchor = [i for i in split.role("actor").resident if i.name.startswith("anchor")]
    assert [i.gib * 2**30 for i in anchor] == [masters]  # fp32
    rollout = {p.name.split(" (")[0]: p.gib for p in split.role("rollout").phases}
    swapped = {p.name: p.gib for p in local.phases if "swapped in" in p.name and p.knob == "sampling.micro_batch_size"}
    assert len(swapped) == 6  # text encoders, denoising, VAE decode: under the anchor, and in validation the EMA
    for name, gib in swapped.items():
        plain = rollout[name.removeprefix("validation ").split(" (")[0]]
        assert (gib - plain) * 2**30 == pytest.approx(backup, abs=1024), name
    assert not any("swapped" in p.name for p in split.role("rollout").phases)

