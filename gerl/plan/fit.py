"""The smallest change that fits: when a role's peak does not fit the target card, which config change makes it fit.

Changes are tried from the cheapest in run time to the dearest, and every one that fits is listed, the first being
"the smallest change":
1. a smaller micro-batch — train.micro_batch_size, sampling.micro_batch_size, or both: the same samples in more,
   smaller forwards (gradients accumulate), no extra compute — the largest valid value that fits;
2. model.gradient_checkpointing=true: the backward recomputes each block's forward (about a third more training
   compute), alone, then with a smaller micro-batch;
3. decoupled roles (engine.hybrid=false; a local run becomes a Ray run on two devices): the actor holds the
   transformer and its training state, the rollout the text encoders, the VAE and its own copy of the transformer,
   each on its own devices — re-planned, then 1 and 2 on that plan. Only when no change on the configured
   placement fits, as it takes more devices.
4. sharded actors (engine.fsdp=true over N = 2, 4, 8 actor GPUs; a local run becomes a Ray run of N colocated
   hosts): each rank holds 1/N of the transformer's weights and training state (gerl/plan/shard.py) — re-planned at
   each N in turn, then 1 and 2 on that plan; the smallest N with a change that fits is given. Only when nothing
   above fits: it takes N devices, and all-gathers every block's weights in each forward.
A value is valid when the config with it passes gerl.config.validate (a micro-batch must divide its mini-batch or
the images per step). Every peak comes from the plan's own per-phase lines (RolePlan.peak_gib_with): only the
decoupled placement is counted again.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from gerl.config import Config, validate
from gerl.plan.work import SAMPLE, TRAIN

DEFAULT_CARD = "80 GB"


@dataclass
class Change:
    overrides: list[str]  # key=value, as `gerl train` takes them
    peaks: dict[str, float]  # role → predicted peak after the change, GiB
    headroom_gib: float  # the least headroom over the roles on the target card after the change


@dataclass
class Fit:
    card: str  # the target card, e.g. "80 GB"
    capacity_gib: float
    fits: bool  # every role fits as configured
    changes: list[Change] = field(default_factory=list)  # the changes that fit, the smallest first (when not fits)
    tried: list[str] = field(default_factory=list)  # what was tried, in words (for "nothing fits")


def need_gib(peak: float) -> float:
    from gerl.plan.planner import FRAGMENTATION, RESERVE_GIB

    return peak * (1 + FRAGMENTATION) + RESERVE_GIB


def _set(cfg: Config, values: dict[str, object]) -> Config:
    out = copy.deepcopy(cfg)
    for key, v in values.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, v)
    return out


def _text(values: dict[str, object]) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]


def _peaks(roles, checkpointing: bool | None, batches: dict[str, int]) -> dict[str, float]:
    return {r.role: r.peak_gib_with(checkpointing, batches) for r in roles}


def _knob_fits(roles, knob: str, checkpointing: bool | None, capacity: float, v: int) -> bool:
    """Whether the phases of `knob` at value v (and those independent of any micro-batch) fit in every role, the
    other knob's phases left out."""
    for r in roles:
        use = [p for p in r.phases_with(checkpointing) if p.knob in (knob, None)]
        if need_gib(r.resident_gib + max([p.at(v) for p in use], default=0.0)) > capacity:
            return False
    return True


def _largest(roles, knob: str, checkpointing: bool | None, capacity: float, cfg: Config, base: dict) -> int | None:
    """None when `knob`'s phases fit as configured (nothing to change); else the largest valid smaller value whose
    phases fit, or 0 when none does."""
    configured = cfg.train.micro_batch_size if knob == TRAIN else cfg.sampling.micro_batch_size
    if _knob_fits(roles, knob, checkpointing, capacity, configured):
        return None
    for v in range(configured - 1, 0, -1):
        if _knob_fits(roles, knob, checkpointing, capacity, v) and not validate(_set(cfg, {**base, knob: v})):
            return v
    return 0


def _candidates(cfg: Config, roles, capacity: float) -> tuple[list[Change], list[str]]:
    """The changes on this placement that fit, in the order of the module docstring, and what was tried."""
    found, tried = [], []
    knobs = [k for k in (TRAIN, SAMPLE) if any(p.knob == k for r in roles for p in r.phases)]
    settings = [(None, {})]
    if TRAIN in knobs and not cfg.model.gradient_checkpointing:
        settings.append((True, {"model.gradient_checkpointing": True}))
    for ckpt, base in settings:
        best = {k: _largest(roles, k, ckpt, capacity, cfg, base) for k in knobs}
        for k, v in best.items():
            if v == 0:
                tried.append(" ".join(_text(base) + [f"{k} below {_get(cfg, k)}: no valid value fits"]))
        smaller = {k: v for k, v in best.items() if v}
        options = [base] if base else []
        options += [{**base, k: v} for k, v in smaller.items()]
        options += [{**base, **smaller}] if len(smaller) > 1 else []
        for values in options:
            batches = {k: v for k, v in values.items() if k in (TRAIN, SAMPLE)}
            peaks = _peaks(roles, ckpt, batches)
            room = min(capacity - need_gib(p) for p in peaks.values())
            tried.append(" ".join(_text(values)))
            if room >= 0 and not validate(_set(cfg, values)):
                found.append(Change(_text(values), peaks, round(room, 3)))
    return found, tried


def _get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def decoupled_overrides(cfg: Config) -> dict[str, object]:
    """The placement that puts actor and rollout on devices of their own, the worker counts kept."""
    g = cfg.engine
    if g.kind == "local":
        return {"engine.kind": "ray", "engine.device": "cuda", "engine.hybrid": False, "engine.actor_workers": 1,
                "engine.rollout_workers": 1}
    return {"engine.hybrid": False}


def smallest_changes(cfg: Config, roles, card: str, capacity: float, replan) -> Fit:
    """The Fit of `roles` (the plan of `cfg`) on `card`: whether it fits, else the changes that do, smallest first.
    replan(cfg) → the roles of another config (the decoupled placement), counted again."""
    fits = all(need_gib(r.peak_gib) <= capacity for r in roles)
    fit = Fit(card, capacity, fits)
    if fits:
        return fit
    fit.changes, fit.tried = _candidates(cfg, roles, capacity)
    hybrid = [r.role for r in roles] == ["hybrid"]
    if fit.changes:
        return fit
    if hybrid:
        _try_placement(fit, cfg, decoupled_overrides(cfg), capacity, replan)
    for n in (2, 4, 8):
        if fit.changes:
            break
        if n > cfg.engine.actor_workers or (not cfg.engine.fsdp and n == cfg.engine.actor_workers):
            _try_placement(fit, cfg, sharded_overrides(cfg, n), capacity, replan)
    return fit


def sharded_overrides(cfg: Config, n: int) -> dict[str, object]:
    """engine.fsdp=true over n actor ranks, the placement otherwise kept (a local run: n colocated Ray hosts)."""
    g = cfg.engine
    if g.kind == "local":
        return {"engine.kind": "ray", "engine.device": "cuda", "engine.fsdp": True, "engine.actor_workers": n,
                "engine.rollout_workers": n}
    out = {"engine.fsdp": True, "engine.actor_workers": n}
    return {**out, "engine.rollout_workers": n} if g.hybrid else out


def _try_placement(fit: Fit, cfg: Config, placement: dict, capacity: float, replan) -> None:
    """Re-plan `cfg` with `placement` and add to `fit` the changes that fit there: the placement as it is, then 1
    and 2 on its plan."""
    split_cfg = _set(cfg, placement)
    if validate(split_cfg):
        fit.tried.append(" ".join(_text(placement)) + " (not a valid config: " + validate(split_cfg)[0] + ")")
        return
    split = replan(split_cfg)
    as_is = _peaks(split, None, {})
    room = min(capacity - need_gib(p) for p in as_is.values())
    fit.tried.append(" ".join(_text(placement)))
    if room >= 0:
        fit.changes.append(Change(_text(placement), as_is, round(room, 3)))
    more, tried = _candidates(split_cfg, split, capacity)
    fit.changes += [Change(_text(placement) + c.overrides, c.peaks, c.headroom_gib) for c in more]
    fit.tried += [" ".join(_text(placement)) + " " + t for t in tried]
