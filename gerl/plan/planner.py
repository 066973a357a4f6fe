"""plan_for_config: each role's predicted peak GPU memory, what fits which card, and the largest micro-batches.

A role's peak = its resident tensors (weights, adapter, gradients, optimizer state: counted from shapes) + the
largest transient peak among its phases (counted by running each phase on fake tensors, gerl/plan/count.py). The
phases run one after another on a device, so their transients never add up; the resident part is there throughout.
Transients are linear in the micro-batch: each phase is counted at the configured micro-batch and at twice it,
which gives the per-sample slope used to find the largest micro-batch that fits a card. What each role holds and
runs follows algo.name (gerl/plan/work.py); the model's architecture enters through its family (gerl/plan/family.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from gerl.config import Config
from gerl.models.loader import DTYPES, add_lora
from gerl.plan import phases, shard, work
from gerl.plan.count import fake_mode, fakeify, peak_bytes
from gerl.plan.family import family_for
from gerl.plan.fit import DEFAULT_CARD, Fit, smallest_changes
from gerl.plan.work import GIB, TRAIN, Item, State

# Cards by their marketed size, with the capacity CUDA reports for a typical one (torch's total_memory, the "total
# capacity" of an out-of-memory message), GiB.
CARDS = (("24 GB", 23.6, "RTX 4090"), ("40 GB", 39.4, "A100 40GB"), ("48 GB", 44.4, "L40S"),
         ("80 GB", 79.1, "H100 / A100 80GB"), ("141 GB", 139.7, "H200"))
# What the count leaves out, held back from every card: the CUDA context and the cuBLAS/cuDNN/NCCL workspaces
# (a fixed ~1 GiB), and the caching allocator's fragmentation (reserved beyond allocated: 5 % of the peak).
RESERVE_GIB = 1.0
FRAGMENTATION = 0.05


@dataclass
class Phase:
    name: str  # e.g. "training fwd+bwd, gradient checkpointing off"
    knob: str | None  # the config key whose value is this phase's micro-batch (None: independent of it)
    batch: int  # the configured value of `knob`
    base_gib: float  # transient peak at micro-batch b = base_gib + per_sample_gib × b (exact at `batch`)
    per_sample_gib: float
    in_peak: bool = True  # False: shown for comparison (the checkpointing setting the config does not use)
    checkpointing: bool | None = None  # training phases: with gradient checkpointing or without

    @property
    def gib(self) -> float:
        return self.at(self.batch)

    def at(self, b: int) -> float:
        return self.base_gib + self.per_sample_gib * b


@dataclass
class CardFit:
    card: str  # "80 GB"
    capacity_gib: float
    fits: bool  # peak × (1 + FRAGMENTATION) + RESERVE_GIB ≤ capacity
    headroom_gib: float  # capacity − that; negative when it does not fit
    max_micro_batch: dict[str, int]  # knob (+ " (gradient checkpointing on|off)") → largest value that fits; 0 = none


@dataclass
class RolePlan:
    role: str  # actor | rollout | hybrid
    resident: list[Item]
    phases: list[Phase]
    cards: list[CardFit] = field(default_factory=list)

    @property
    def resident_gib(self) -> float:
        return sum(i.gib for i in self.resident)

    def phases_with(self, checkpointing: bool | None = None) -> list[Phase]:
        """The phases that make the peak: the config's own (None), or with the training phase of that setting."""
        if checkpointing is None:
            return [p for p in self.phases if p.in_peak]
        return [p for p in self.phases if p.checkpointing in (None, checkpointing)]

    def peak_gib_with(self, checkpointing: bool | None = None, batches: dict[str, int] | None = None) -> float:
        """Resident + the largest transient, at the configured micro-batches unless `batches` overrides a knob;
        `checkpointing` swaps in the other training phase (None: the config's own)."""
        batches = batches or {}
        use = self.phases_with(checkpointing)
        return self.resident_gib + max([p.at(batches.get(p.knob, p.batch)) for p in use], default=0.0)

    @property
    def peak_gib(self) -> float:
        return self.peak_gib_with()

    @property
    def peak_phase(self) -> Phase | None:
        return max(self.phases_with(), key=lambda p: p.gib, default=None)


@dataclass
class MemoryPlan:
    model: str
    source: str  # where the architecture came from
    dtype: str
    resolution: int
    latent: tuple[int, ...]
    inputs: str  # the conditioning in words ("text 77 CLIP + 256 T5 tokens")
    placement: str
    algo: str  # algo.name
    training_forwards: list[str]  # the transformer forwards per trained point, in order
    awm_old_forward: bool | None  # awm: whether an extra no-grad forward computes old log-probs (None: not awm)
    gradient_checkpointing: bool
    roles: list[RolePlan]
    notes: list[str]
    elapsed_s: float
    fit: Fit | None = None  # the target card: whether every role fits, else the smallest changes that do (fit.py)
    reserve_gib: float = RESERVE_GIB
    fragmentation: float = FRAGMENTATION

    def role(self, name: str) -> RolePlan:
        for r in self.roles:
            if r.role == name:
                return r
        raise KeyError(f"no role {name!r} in this plan; roles: {', '.join(r.role for r in self.roles)}")

    def peak_gib(self, role: str) -> float:
        """The predicted peak GPU memory of one host of `role` (actor, rollout or hybrid), GiB."""
        return self.role(role).peak_gib

    def metrics(self) -> dict[str, float]:
        """{"plan_peak_gib/<role>": GiB} for the trainer to log beside the measured per-host peaks."""
        return {f"plan_peak_gib/{r.role}": round(r.peak_gib, 3) for r in self.roles}

    def to_dict(self) -> dict:
        out = asdict(self)
        for r, d in zip(self.roles, out["roles"]):
            d.update(resident_gib=r.resident_gib, peak_gib=r.peak_gib,
                     peak_phase=r.peak_phase.name if r.peak_phase else None)
            for p, dp in zip(r.phases, d["phases"]):
                dp["gib"] = p.gib
        return out


def role_names(cfg: Config) -> list[str]:
    """engine.kind=local or engine.hybrid=true: one "hybrid" role holding everything; else actor and rollout."""
    return ["hybrid"] if cfg.engine.kind == "local" or cfg.engine.hybrid else ["actor", "rollout"]


def _usable(capacity: float) -> float:
    return (capacity - RESERVE_GIB) / (1 + FRAGMENTATION)


def _max_batch(role: RolePlan, knob: str, checkpointing: bool | None, limit: float) -> int:
    """Largest value of `knob` whose peak stays within `limit` GiB, the other knobs as configured."""
    use = role.phases_with(checkpointing)
    room = limit - role.resident_gib
    best = 10**6  # "any": no phase grows with this knob
    for p in use:
        if p.knob != knob:
            if p.gib > room:
                return 0
        elif p.per_sample_gib > 0:
            best = min(best, math.floor((room - p.base_gib) / p.per_sample_gib + 1e-9))
    return max(best, 0)


def card_fits(role: RolePlan, gradient_checkpointing: bool) -> list[CardFit]:
    knobs = list(dict.fromkeys(p.knob for p in role.phases if p.knob))
    out = []
    for card, capacity, _ in CARDS:
        limit = _usable(capacity)
        need = role.peak_gib * (1 + FRAGMENTATION) + RESERVE_GIB
        best = {}
        for knob in knobs:
            best[knob] = _max_batch(role, knob, None, limit)
            if knob == TRAIN:
                other = not gradient_checkpointing
                label = f"{knob} (gradient checkpointing {'on' if other else 'off'})"
                best[label] = _max_batch(role, knob, other, limit)
        out.append(CardFit(card, capacity, need <= capacity, round(capacity - need, 3), best))
    return out


def vae_dtype(cfg: Config) -> torch.dtype:
    """The VAE's dtype in the run the plan sizes: model.vae_dtype, with auto resolved for a GPU (bf16) unless the
    run is set to a CPU (model.device=cpu, or engine.device=cpu for Ray hosts)."""
    from gerl.models.vae import vae_dtype_for

    g = cfg.engine
    cpu = cfg.model.device == "cpu" or (g.kind == "ray" and g.device == "cpu")
    return vae_dtype_for(cfg.model.vae_dtype, "cpu" if cpu else "cuda")


def plan_for_config(cfg: Config, awm_old_forward: bool | None = None, card: str | None = DEFAULT_CARD) -> MemoryPlan:
    """The memory plan of a validated config (gerl.config.load_config). Builds nothing on a device: seconds on a CPU.

    awm_old_forward: whether AWM runs its no-grad old-log-prob forward; None = as the trainer decides
    (gerl.plan.work.awm_old_forward: only when an update takes more than one optimizer step).
    card: the card (a CARDS name, "80 GB") for which a configuration that does not fit gets the smallest changes
    that do (gerl/plan/fit.py; the decoupled placement is planned again when nothing else fits); None: no search."""
    t0 = time.perf_counter()
    m = cfg.model
    fam = family_for(m)
    roles = role_names(cfg)
    dtype = DTYPES[m.dtype]
    parts = tuple(dict.fromkeys(c for r in roles for c in _loaded(cfg, fam, r)))
    modules = {c: fam.build(c, vae_dtype(cfg) if c == "vae" else dtype) for c in parts}
    tr = modules["transformer"]
    if m.lora:
        add_lora(tr, m.lora_rank, m.lora_alpha, m.lora_targets)  # the real adapter: fp32, on the meta device
        if m.merge_lora:  # the merged forward and backward are what the phases below measure
            from gerl.models.lora_merge import use_merged_lora

            use_merged_lora(tr)
    else:
        tr.requires_grad_(True)
    latent = fam.latent(m.resolution, tr)

    mode = fake_mode()
    for mod in modules.values():
        fakeify(mod, mode)
    trained = [p for p in tr.parameters() if p.requires_grad]
    training = bool({"actor", "hybrid"} & set(roles))
    w = phases.Work(fam, latent, dtype, cfg)
    graded = _receiving_gradients(tr, trained, w, mode) if training else trained
    residents = work.resident_items(cfg, fam, modules, trained, graded)
    state = _training_state(cfg, trained, graded, mode, training)
    old_forward = work.awm_old_forward(cfg) if awm_old_forward is None else awm_old_forward
    measurer = _Measurer(cfg, mode, tr)
    role_plans = []
    for r in roles:
        kinds = {"actor": ("actor",), "rollout": ("rollout",), "hybrid": ("actor", "rollout")}[r]
        plan_phases = measurer.phases(work.role_phases(r, cfg, modules, w, state, old_forward))
        comps = _loaded(cfg, fam, r)
        if r != "rollout":  # the data-parallel layer's gathers on top of the phases that run it (gerl/plan/shard.py)
            shard.add_gather(plan_phases, *shard.gather(tr, cfg, dtype))
        own = {"transformer": residents.get("transformer@actor", residents["transformer"])} if r != "rollout" else {}
        resident = [i for c in comps for i in own.get(c, residents[c])] + [i for k in kinds for i in residents[k]]
        resident.append(work.cublas_workspace(r))
        rp = RolePlan(r, resident, plan_phases)
        rp.cards = card_fits(rp, m.gradient_checkpointing)
        role_plans.append(rp)
    fit = None
    if card is not None:
        capacity = dict((c, cap) for c, cap, _ in CARDS)[card]
        fit = smallest_changes(cfg, role_plans, card, capacity,
                               lambda other: plan_for_config(other, awm_old_forward, card=None).roles)
    return MemoryPlan(
        model=m.path, source=fam.source, dtype=m.dtype, resolution=m.resolution, latent=tuple(latent),
        inputs=fam.describe(), placement=_placement(cfg, roles), algo=cfg.algo.name,
        training_forwards=work.training_forwards(cfg, old_forward) if training else [],
        awm_old_forward=old_forward if cfg.algo.name == "awm" else None,
        gradient_checkpointing=m.gradient_checkpointing, roles=role_plans, notes=_notes(cfg, roles, state),
        elapsed_s=round(time.perf_counter() - t0, 2), fit=fit)


def _loaded(cfg: Config, fam, role: str) -> tuple[str, ...]:
    """The weighted parts a host of `role` loads: with model.text_cache (gerl prepare) no text encoder."""
    from gerl.models.loader import TEXT_ENCODERS

    comps = fam.components("rollout" if role == "hybrid" else role)
    return tuple(c for c in comps if c not in TEXT_ENCODERS) if cfg.model.text_cache else comps


def _training_state(cfg: Config, trained: list, graded: list, mode, training: bool) -> State:
    """The fake state the actor keeps between micro-batches (it exists before each phase: never counted in one), as
    gerl/workers/actor.py holds it: accumulated gradients (during every micro-batch but a mini-batch's first), AdamW's
    moments, the EMA and the anchor. bf16/fp16 full fine-tuning steps fp32 masters, and each backward's low-precision
    gradient lives only until it is added into its master's (gerl/workers/masters.py); under engine.fsdp a rank steps
    fp32 shards of 1/N of each tensor (gerl/plan/shard.py), and its whole gradients are the gather's."""
    kind, lora = shard.layout(cfg), cfg.model.lora
    n = shard.ranks(cfg) if kind == "shards" else 1
    masters = not lora and trained[0].dtype in (torch.bfloat16, torch.float16)
    with mode:
        if kind == "shards":
            optimized = [torch.nn.Parameter(torch.empty(shard.held(p, n), dtype=torch.float32)) for p in trained]
        elif masters:
            optimized = [torch.nn.Parameter(torch.empty_like(p, dtype=torch.float32)) for p in trained]
        else:
            optimized = trained
        has_grad = {id(p) for p in graded}
        for p, q in zip(trained, optimized):
            if id(p) in has_grad:
                q.grad = torch.zeros_like(q)
        if optimized is not trained:  # the model's own gradient is handed on as soon as autograd has it
            for p in trained:
                p.register_post_accumulate_grad_hook(_hand_on)
        swap = optimized if kind == "shards" else trained  # a rank swaps into its shards
        copies = lambda: [torch.empty_like(p, dtype=torch.float32) for p in optimized]  # noqa: E731
        return State(swap, copies() if cfg.algo.name != "flow_grpo" else None,
                     copies() if cfg.train.ema_decay > 0 else None,
                     phases.make_optimizer(optimized, cfg) if training else None,
                     optimized if optimized is not trained else None)


def _hand_on(p: torch.Tensor) -> None:
    p.grad = None


def _receiving_gradients(tr, trained: list, w: phases.Work, mode) -> list:
    """The trained parameters that a training step gives a gradient, found by running the actor's training program
    once on fake tensors (micro-batch 1). Not every one gets one: Qwen-Image's last block computes a text stream
    that nothing reads, so its adapter (or, fully fine-tuned, its weights) gets none, and the actor's AdamW keeps no
    state for a parameter without a gradient."""
    train = phases.flow_grpo_train if w.cfg.algo.name == "flow_grpo" else phases.matching_train
    tr.train()
    with mode:
        train(tr, 1, w)()
    graded = [p for p in trained if p.grad is not None]
    for p in trained:
        p.grad = None
    return graded


class _Measurer:
    """Counts each phase at the configured micro-batch b and at 2b. Not at 1: a tensor of a few bytes per sample is
    rounded up to a 512-byte block there, which tilts the line (the tiny model's largest train micro-batch on a 24 GB
    card came out 0.4 % too large from 8 and 1)."""

    def __init__(self, cfg: Config, mode, transformer):
        self.cfg, self.mode, self.tr = cfg, mode, transformer

    def phases(self, programs) -> list[Phase]:
        out = []
        for name, knob, prog, ckpt in programs:
            in_peak = ckpt is None or ckpt == self.cfg.model.gradient_checkpointing
            if knob is None:
                out.append(Phase(name, None, 0, self.count(prog, ckpt) / GIB, 0.0, in_peak, ckpt))
                continue
            b = self.cfg.train.micro_batch_size if knob == TRAIN else self.cfg.sampling.micro_batch_size
            other = 2 * b
            p_b, p_o = (self.count(prog(x), ckpt) / GIB for x in (b, other))
            slope = (p_b - p_o) / (b - other)
            out.append(Phase(name, knob, b, p_b - slope * b, slope, in_peak, ckpt))
        return out

    def count(self, program, ckpt: bool | None) -> int:
        if ckpt is not None:  # the actor trains in train mode, with or without checkpointing
            self.tr.train()
            (self.tr.enable_gradient_checkpointing if ckpt else self.tr.disable_gradient_checkpointing)()
        else:
            self.tr.eval()
        return peak_bytes(program, self.mode)


def _placement(cfg: Config, roles: list[str]) -> str:
    g = cfg.engine
    if g.kind == "local":
        return "engine.kind=local: one process, actor and rollout on one device (hybrid)"
    if g.hybrid:
        return f"engine.kind=ray, hybrid: {g.actor_workers} device(s), each holding actor and rollout"
    return f"engine.kind=ray, decoupled: {g.actor_workers} actor device(s) + {g.rollout_workers} rollout device(s)"


def _notes(cfg: Config, roles: list[str], state: State) -> list[str]:
    g, m = cfg.engine, cfg.model
    backup = sum(p.numel() * p.element_size() for p in state.trained) / GIB
    notes = [f"fits = peak × {1 + FRAGMENTATION:g} + {RESERVE_GIB:g} GiB ≤ the card's capacity: the reserve is the "
             "CUDA context and cuBLAS/NCCL workspaces, the 5 % the caching allocator's fragmentation (neither is "
             "counted)"]
    for r in roles:
        for when in work.swaps(cfg, r).values():
            notes.append(f"{r}: a backup of the trained tensors ({backup:.3g} GiB) is held during {when}; the phases "
                         "that say 'swapped' count it")
    if cfg.algo.name != "flow_grpo" and {"rollout", "hybrid"} & set(roles):
        notes.append(f"algo.name={cfg.algo.name}: the rollout samples an ODE and records no SDE step, only the clean "
                     "final latents")
    if g.kind == "ray" and not g.hybrid and g.gpus_per_worker < 1:
        notes.append(f"engine.gpus_per_worker={g.gpus_per_worker:g}: hosts share a card, so their peaks add up")
    kind = shard.layout(cfg)
    if kind == "shards":
        notes.append(f"engine.fsdp: each of the {g.actor_workers} actor ranks holds 1/{g.actor_workers} of every "
                     "transformer weight (rows rounded up), its gradient, AdamW moments, EMA and anchor; whole weights "
                     "only while they compute, in the compute dtype: the root's through a forward and two blocks at a "
                     "time (the next one's all-gather is issued ahead), plus a block's gradients and their fp32 "
                     "reduce-scatter input in a backward (docs/plan.md)")
    elif kind == "replicas":
        notes.append("data parallel (replicas): every actor rank holds the same; each block's gradients are "
                     "all-reduced through an fp32 buffer as its backward ends")
    if not m.lora and m.dtype == "fp16" and cfg.train.fp16_loss_scale > 0:
        notes.append("model.lora=false with model.dtype=fp16: the loss scaler refuses fp16 gradients at the first "
                     "step; train in bf16, or keep a LoRA")
    return notes
