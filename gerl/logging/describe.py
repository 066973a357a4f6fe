"""What a run's config.yaml says it trained, in the report's words: the algorithm, its loss, the schedule, and which
training curves can carry information for it.

A run directory's config.yaml is the resolved config tree (`gerl train` writes every key). A key it lacks — a run
logged before that key existed — reads as the typed config's default (gerl/config.py, the one place defaults live):
each key was added with a default that keeps the behaviour runs had before it.
"""

from __future__ import annotations

import functools

from gerl.config import Config

# flow_grpo reads Flow-GRPO or Flow-GRPO-Fast (the SDE window)
ALGORITHMS = {"nft": "DiffusionNFT", "awm": "AWM", "dgpo": "DGPO"}
# metric key → panel title; which of them apply to a run is `curves_that_apply`
TRAIN_CURVES = {"kl": "KL to the reference", "clipfrac": "clip fraction", "grad_norm": "gradient norm (pre-clip)"}


@functools.lru_cache(maxsize=1)
def _defaults() -> Config:
    return Config()


def setting(cfg: dict, dotted: str):
    """The run's value of a dotted key (e.g. "engine.schedule"), or the typed config's default when config.yaml
    lacks it."""
    node = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            node = _defaults()
            for k in dotted.split("."):
                node = getattr(node, k)
            return node
        node = node[key]
    return node


def algorithm(cfg: dict) -> str:
    """Flow-GRPO-Fast (an SDE window of sampling.sde_window_size > 0 steps), Flow-GRPO (window 0: every step but the
    last is stochastic and trained), DiffusionNFT, AWM or DGPO (algo.name)."""
    name = setting(cfg, "algo.name")
    if name == "flow_grpo":
        return "Flow-GRPO-Fast" if setting(cfg, "sampling.sde_window_size") > 0 else "Flow-GRPO"
    return ALGORITHMS.get(name, str(name))


def loss(cfg: dict) -> str:
    """The objective and the knobs that define it: train.loss for flow_grpo (ppo_clip with its ε and dual clip,
    tis, topr, cispo), nft's implicit ± velocities with β, awm's clipped ratio of its flow-matching surrogate,
    dgpo's group preference with β, its reference and its clip; then the velocity or KL penalties that are on
    (train.beta; algo.anchor_beta for nft/awm)."""
    g = functools.partial(setting, cfg)
    name, eps = g("algo.name"), g("train.clip_range")
    if name == "nft":
        text = f"nft ± velocities (β {g('algo.nft_beta'):g})"
    elif name == "awm":
        text = f"awm clipped ratio (ε {eps:g}, {g('algo.awm_weighting')} weighting)"
    elif name == "dgpo":
        text = f"dgpo group preference (β {g('algo.dgpo_beta'):g}, vs the {g('algo.dgpo_reference')}, clip ε {eps:g})"
    else:
        policy = g("train.loss")
        if policy == "ppo_clip":
            cap = g("engine.ratio_cap")
            text = f"ppo_clip (ε {eps:g}" + (f", dual clip at {cap:g})" if cap else ")")
        elif policy == "tis":
            text = f"tis (weight cap {g('train.is_cap'):g})"
        elif policy == "topr":
            text = f"topr (negatives by {g('train.topr_split')})"
        elif policy == "cispo":
            low, high = g("train.cispo_eps_low") or eps, g("train.cispo_eps_high") or eps  # 0 = train.clip_range
            text = f"cispo (weight in [1 − {low:g}, 1 + {high:g}])"
        else:
            text = str(policy)
    if g("train.beta") > 0:
        text += f" + KL β {g('train.beta'):g}"
    if name != "flow_grpo" and g("algo.anchor_beta") > 0:
        text += f" + anchor β {g('algo.anchor_beta'):g}"
    return text


def schedule(cfg: dict) -> str:
    """with_reward (reward futures per micro-batch) and/or the schedule: one-step-off (async, staleness 1), k-stale
    (async, staleness k), stream (≤ k versions stale, stale groups dropped or down-weighted); "sync" when neither."""
    parts = ["with_reward"] if setting(cfg, "reward.with_reward") is True else []
    name, k = setting(cfg, "engine.schedule"), setting(cfg, "engine.max_staleness")
    if name == "async":
        parts.append("one-step-off" if k == 1 else f"{k}-stale")
    elif name == "stream":
        stale = setting(cfg, "engine.stale")
        if stale == "downweight":
            stale = f"downweight ×{setting(cfg, 'engine.stale_decay'):g}"
        parts.append(f"stream (≤ {k} stale, {stale})")
    return " + ".join(parts) or "sync"


def speed(cfg: dict) -> str:
    """The speed levers that keep the ratio exact (both sides use them): the attention kernel (model.attention_backend)
    and whether the transformer's blocks are compiled (model.compile)."""
    compiled = "compiled blocks" if setting(cfg, "model.compile") is True else "eager"
    return f"attention {setting(cfg, 'model.attention_backend')}, {compiled}"


def optimizer_steps_per_update(cfg: dict) -> int:
    """inner_epochs × mini-batches per step (train.mini_batch_size 0 = the whole step's images: one)."""
    images = setting(cfg, "data.prompts_per_step") * setting(cfg, "data.group_size")
    mini = setting(cfg, "train.mini_batch_size") or images
    return setting(cfg, "train.inner_epochs") * max(1, images // mini)


def curves_that_apply(cfg: dict) -> list[str]:
    """The TRAIN_CURVES keys that can vary for this run (all of them when there is no config.yaml to tell):
    - kl: only when train.beta > 0; otherwise no reference term is computed and every algorithm logs 0 or nothing;
    - clipfrac: flow_grpo always (its ratio is to the rollout's log-probs: staleness, rollout/trainer numerics and
      later optimizer steps all move it); awm only when an update takes more than one optimizer step (its ratio is to
      the weights the update started from, exactly 1 until the first step); dgpo when it does or its anchor lags
      (a decay > 0: its ratio is to the anchor); never nft (no ratio, nothing clipped);
    - grad_norm: always."""
    if not cfg:
        return list(TRAIN_CURVES)
    name = setting(cfg, "algo.name")
    lags = setting(cfg, "algo.anchor_decay_rate") > 0 and setting(cfg, "algo.anchor_decay_max") > 0
    keep = {"kl": setting(cfg, "train.beta") > 0,
            "clipfrac": name == "flow_grpo" or name in ("awm", "dgpo") and optimizer_steps_per_update(cfg) > 1
            or name == "dgpo" and lags,
            "grad_norm": True}
    return [k for k in TRAIN_CURVES if keep[k]]
