"""What each role holds and runs, by algorithm: the resident lines and the phases of `gerl plan`.

Resident (counted from shapes): the model's parts, the adapter, and the training state the actor keeps between
micro-batches — gradients, AdamW state, the frozen reference (full fine-tuning), the EMA, and for nft/awm the
anchor θ_old (gerl.workers.actor: a slow copy of the trained tensors, kept by both whatever algo.anchor_beta).

Phases (counted by running them, gerl/plan/phases.py), per algorithm, as gerl/workers/actor.py and
gerl/workers/matching.py run them at train.micro_batch_size:
- flow_grpo replays recorded SDE steps: the policy forward with grad (+ the reference's under no_grad while the
  graph is held, train.beta > 0), backward; a no-grad replay first with train.recompute_old_log_probs.
- nft, per micro-batch: the anchor's velocity under no_grad with the trained tensors swapped out (a backup copy of
  them alive meanwhile, `swapped_in`), then the policy forward with grad, the reference's, backward.
- awm: the same, the anchor forward only with algo.anchor_beta > 0; an old-log-prob forward under no_grad only
  where the policy has moved before a point is trained (`awm_old_forward`).
The rollout of nft/awm samples a plain ODE and records nothing but the clean final latents; Flow-GRPO's holds the
recorded steps' latents on the device until the micro-batch ends. A hybrid host generates nft's batches with the
anchor swapped into the shared transformer (the backup alive through text encoding, denoising and decoding), and a
local run validates the EMA the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gerl.config import Config
from gerl.models.loader import DTYPES
from gerl.plan import phases, shard
from gerl.plan.count import tensor_bytes

GIB = 2**30
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
TRAIN = "train.micro_batch_size"
SAMPLE = "sampling.micro_batch_size"


@dataclass
class Item:
    name: str  # what is resident, e.g. "transformer weights (fp16)"
    gib: float
    detail: str = ""  # sizes in words


@dataclass
class State:
    """The fake tensors the phases swap in and step: the trained parameters (what the anchor and the EMA are swapped
    into), the anchor (nft/awm), the EMA shadow, the optimizer (None without an actor) and the tensors it steps (the
    trained parameters, or their fp32 masters, or a rank's fp32 shards of them)."""
    trained: list
    anchor: list | None
    shadow: list | None
    optimizer: torch.optim.Optimizer | None
    optimized: list | None = None

    @property
    def stepped(self) -> list:
        return self.optimized if self.optimized is not None else self.trained


def _gib(n: int) -> float:
    return n / GIB


def _count(n: int) -> str:
    scales = ((1e9, "B", 2), (1e6, "M", 1), (1e3, "k", 1), (1, "", 0))
    return next(f"{n / d:.{p}f} {u}" for d, u, p in scales if n >= d or d == 1)


def optimizer_steps_per_update(cfg: Config) -> int:
    """Optimizer steps one actor rank takes per update: inner epochs × its mini-batches (ActorWorker.mini)."""
    images = cfg.data.prompts_per_step * cfg.data.group_size
    world = 1 if cfg.engine.kind == "local" else cfg.engine.actor_workers
    mini = (cfg.train.mini_batch_size or images) // world
    return cfg.train.inner_epochs * math.ceil(images // world / mini)


def awm_old_forward(cfg: Config) -> bool:
    """Whether AWM runs a no-grad old-log-prob forward: only where the policy has moved before a point is trained,
    i.e. when an update takes more than one optimizer step. With one (the AWM recipe: one step per epoch) the ratio's
    denominator is the training forward's own detached log-prob and no extra forward runs."""
    return cfg.algo.name == "awm" and optimizer_steps_per_update(cfg) > 1


def anchor_forward_in_training(cfg: Config) -> bool:
    """nft regresses against the anchor's velocity; awm computes it for its anchor penalty only."""
    return cfg.algo.name == "nft" or (cfg.algo.name == "awm" and cfg.algo.anchor_beta > 0)


def recorded_steps(cfg: Config) -> int:
    """SDE steps the rollout records per sample: Flow-GRPO's window (or every step but the last); none for
    nft/awm, which learn from the clean final latents."""
    s = cfg.sampling
    if cfg.algo.name != "flow_grpo":
        return 0
    return s.sde_window_size if s.sde_window_size > 0 else s.num_steps - 1


def training_forwards(cfg: Config, old_forward: bool) -> list[str]:
    """The transformer forwards per trained point, in order."""
    a, t = cfg.algo, cfg.train
    out = []
    if a.name == "flow_grpo" and t.recompute_old_log_probs or a.name == "awm" and old_forward:
        out.append("old log-prob (no grad)")
    if anchor_forward_in_training(cfg):
        out.append("anchor (no grad, swapped in)")
    out.append("policy (grad)")
    if t.beta > 0:
        out.append("reference (no grad)")
    return out


def resident_items(cfg: Config, fam, modules: dict, trained: list, graded: list) -> dict[str, list[Item]]:
    """Resident lines by owner: each component's weights (the transformer's with its LoRA adapter), and the
    training state ("actor") and staging buffer ("rollout") of the roles. Gradients and AdamW state exist for the
    `graded` parameters, those a training step gives a gradient; the EMA, the anchor and the staged weights copy
    every trained one. The trained state is fp32 whatever the model dtype: a LoRA's adapter is, and full fine-tuning
    in bf16/fp16 keeps fp32 masters (gerl/workers/masters.py). Under engine.fsdp the actor ranks hold 1/N of the
    transformer and of that state (gerl/plan/shard.py): "transformer@actor" is then what an actor or hybrid host holds
    of it, "transformer" a decoupled rollout's whole copy."""
    m, t, a = cfg.model, cfg.train, cfg.algo
    kind = shard.layout(cfg)
    n = shard.ranks(cfg) if kind == "shards" else 1
    part = f", FSDP2 shard 1/{n}" if kind == "shards" else ""
    out = {}
    for c, mod in modules.items():
        # the merged LoRA weights (model.merge_lora) are buffers with a line of their own below
        frozen = [x for x in mod.parameters() if not (m.lora and x.requires_grad)] + [
            b for n_, b in mod.named_buffers() if not n_.endswith("merged_weight")]
        dt = DTYPE_NAMES.get(next(mod.parameters()).dtype, "?")
        vals = sum(x.numel() for x in {id(x): x for x in frozen}.values())
        out[c] = [Item(f"{fam.label(c)} weights ({dt})", _gib(tensor_bytes(frozen)), f"{_count(vals)} values")]
    tr = modules["transformer"]
    adapter = tensor_bytes(trained)
    if m.lora:
        count = sum(p.numel() for p in trained)
        out["transformer"].append(Item(f"LoRA adapter r{m.lora_rank} (fp32)", _gib(adapter), f"{_count(count)} params"))
    if m.merge_lora and m.lora:  # gerl/models/lora_merge.py: W0 + s·B·A beside W0, wherever the transformer is
        from gerl.models.lora_merge import lora_layers

        w0 = [x.get_base_layer().weight for x in lora_layers(tr)]
        wdt = DTYPE_NAMES.get(w0[0].dtype, "?")
        out["transformer"].append(Item(f"merged LoRA weights (model.merge_lora, {wdt})", _gib(tensor_bytes(w0)),
                                       f"{len(w0)} adapted linears"))
    masters = not m.lora and trained[0].dtype in (torch.bfloat16, torch.float16)
    if kind == "shards":  # what an actor rank keeps of the transformer: 1/N of every parameter, buffers whole
        params = [x for x in tr.parameters() if not (m.lora and x.requires_grad)]
        buffers = tensor_bytes([b for _, b in tr.named_buffers()])
        dt = "fp32 masters" if not m.lora else cfg.model.dtype
        lines = [Item(f"transformer weights ({dt}{part})", _gib(shard.held_bytes(params, n, 4 if not m.lora else None)
                                                               + buffers), "buffers whole")]
        if m.lora:
            lines.append(Item(f"LoRA adapter r{m.lora_rank} (fp32{part})", _gib(shard.held_bytes(trained, n))))
        out["transformer@actor"] = lines
    what = "fp32 LoRA" if m.lora else ("fp32 masters, full fine-tuning" if masters or kind == "shards"
                                       else "fp32, full fine-tuning")
    grads = shard.held_bytes(graded, n, 4)
    unused = "" if len(graded) == len(trained) else f"{len(trained) - len(graded)} tensors get none"
    copies = shard.held_bytes(trained, n, 4)  # EMA, anchor: fp32 copies of the trained tensors (the masters)
    actor = []
    if masters and kind != "shards":  # sharded, the parameters themselves are the fp32 masters
        actor.append(Item("fp32 master weights (AdamW steps them; the model's weights are cast from them)",
                          _gib(copies)))
    actor += [Item(f"gradients ({what}{part})", _gib(grads), unused),
              Item(f"AdamW exp_avg + exp_avg_sq ({what}{part})", _gib(2 * grads))]
    if t.beta > 0 and not m.lora:
        ref = [x for x in tr.parameters()]
        actor.append(Item(f"frozen reference copy (train.beta={t.beta:g}{part})",
                          _gib(shard.held_bytes(ref, n, DTYPES[cfg.model.dtype].itemsize)
                               + tensor_bytes([b for _, b in tr.named_buffers()]))))
    if t.ema_decay > 0:
        actor.append(Item(f"EMA weights (train.ema_decay={t.ema_decay:g}, fp32{part})", _gib(copies)))
    if a.name != "flow_grpo":
        actor.append(Item(f"anchor θ_old (algo.name={a.name}, fp32{part})", _gib(copies)))
    rollout = []
    if cfg.engine.schedule == "stream" and not (cfg.engine.hybrid or cfg.engine.kind == "local"):
        rollout.append(Item("staged weights (engine.schedule=stream)", _gib(adapter)))
    return {**out, "actor": actor, "rollout": rollout}


CUBLAS_WORKSPACE_MIB = 32  # per thread that issues GEMMs: read on an H200 (2026-11-28, gpu_day env) for the main
# thread, autograd's backward thread and a second Python thread alike — torch's default cuBLAS workspace on Hopper,
# held by the caching allocator from a thread's first GEMM on


def cublas_workspace(role: str) -> Item:
    """cuBLAS's workspace on a host of `role`: one for the thread running the forwards, one more for autograd's
    backward thread where the host trains (the launchers' unplanned 64–69 MiB on training hosts and 37 MiB on a
    rollout-only host, second GPU day)."""
    threads = 2 if role in ("actor", "hybrid") else 1
    what = "forward + autograd backward threads" if threads == 2 else "the forward thread"
    return Item(f"cuBLAS workspace ({CUBLAS_WORKSPACE_MIB} MiB × {threads}: {what})",
                _gib(threads * CUBLAS_WORKSPACE_MIB * 2**20))


def swaps(cfg: Config, role: str) -> dict[str, str]:
    """When a host of `role` holds a backup of the trained tensors (gerl.workers.actor.swapped_in), in words."""
    out = {}
    if anchor_forward_in_training(cfg) and role in ("actor", "hybrid"):
        out["training"] = "the anchor forward of each training micro-batch"
    if cfg.algo.name == "nft" and role == "hybrid":
        out["generation"] = "generation (nft samples with the anchor, swapped into the shared transformer)"
    if cfg.train.ema_decay > 0 and role == "hybrid" and cfg.engine.kind == "local" and cfg.validation.every != -1:
        out["validation"] = "validation (the EMA swapped in)"
    return out


def role_phases(role: str, cfg: Config, modules: dict, w: phases.Work, st: State, old_forward: bool) -> list:
    """(name, knob, program(b) — or a fixed program when knob is None —, checkpointing) of each phase of a host of
    `role`: the actor's, the rollout's, or both (hybrid)."""
    out = []
    if role in ("actor", "hybrid"):
        out += _actor_phases(cfg, modules["transformer"], w, st, old_forward)
    if role in ("rollout", "hybrid"):
        out += _rollout_phases(cfg, role, modules, w, st)
    return out


def _actor_phases(cfg: Config, tr, w: phases.Work, st: State, old_forward: bool) -> list:
    a, t, ckpt = cfg.algo, cfg.train, cfg.model.gradient_checkpointing
    out = []
    if a.name == "flow_grpo" and t.recompute_old_log_probs:
        out.append(("old log-prob recompute (no grad)", TRAIN, lambda b: phases.flow_grpo_recompute(tr, b, w), None))
    if a.name == "awm" and old_forward:
        out.append(("awm old log-prob forward (no grad)", TRAIN, lambda b: phases.awm_old_forward(tr, b, w), None))
    if anchor_forward_in_training(cfg):
        out.append(("anchor forward (no grad, swapped in: backup held)", TRAIN,
                    lambda b: phases.anchor_forward(tr, b, w, (st.trained, st.anchor)), None))
    train = phases.flow_grpo_train if a.name == "flow_grpo" else phases.matching_train
    out += [(f"training fwd+bwd, gradient checkpointing {'on' if c else 'off'}", TRAIN,
             lambda b: train(tr, b, w), c) for c in (ckpt, not ckpt)]
    scaled = w.dtype == torch.float16 and t.fp16_loss_scale > 0 and cfg.model.lora
    step = phases.optimizer_step(st.optimizer, st.stepped, cfg, scaled)
    out.append(("clip + AdamW step (foreach)", None, step, None))
    return out


def _rollout_phases(cfg: Config, role: str, modules: dict, w: phases.Work, st: State) -> list:
    smp, where = cfg.sampling, swaps(cfg, role)
    tr, vae = modules["transformer"], modules["vae"]
    encoders = {c: m for c, m in modules.items() if c not in ("transformer", "vae")}
    vae_dt = DTYPE_NAMES.get(next(vae.parameters()).dtype, "?")
    gen = (st.trained, st.anchor) if "generation" in where else None
    val = (st.trained, st.shadow) if "validation" in where else None
    held = ", anchor swapped in" if gen else ""
    fam = w.fam
    guide = "CFG, " if fam.uses_negative(smp.guidance_scale) else ""
    recorded = recorded_steps(cfg)
    # model.text_cache: the embeddings come from disk (gerl prepare), no encoder runs on the host
    out = [(f"text encoders{' (anchor swapped in)' if gen else ''}", SAMPLE,
            lambda b: phases.text_encode(encoders, b, w, gen), None)] if encoders else []
    out += [(f"denoising forward ({guide}no grad{held})", SAMPLE,
            lambda b: phases.denoise_step(tr, b, w, smp.guidance_scale, recorded, gen), None),
           (f"VAE decode ({vae_dt}{held})", SAMPLE,
            lambda b: phases.vae_decode(vae, b, w, smp.guidance_scale, recorded, gen), None)]
    if cfg.validation.every == -1:
        return out
    eval_cfg = fam.uses_negative(smp.eval_guidance_scale) and not fam.uses_negative(smp.guidance_scale)
    if val or eval_cfg:  # otherwise validation runs what generation runs, without its recorded steps
        ema = ", EMA swapped in" if val else ""
        guide = "CFG, " if fam.uses_negative(smp.eval_guidance_scale) else ""
        out.append((f"validation denoising forward ({guide}no grad{ema})", SAMPLE,
                    lambda b: phases.denoise_step(tr, b, w, smp.eval_guidance_scale, 0, val), None))
    if val:
        out += [("validation text encoders (EMA swapped in)", SAMPLE,
                 lambda b: phases.text_encode(encoders, b, w, val), None)] if encoders else []
        out += [(f"validation VAE decode ({vae_dt}, EMA swapped in)", SAMPLE,
                 lambda b: phases.vae_decode(vae, b, w, smp.eval_guidance_scale, 0, val), None)]
    return out
