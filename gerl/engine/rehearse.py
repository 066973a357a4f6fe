"""engine.rehearse=true: run a GPU launcher's exact layout on CPU before renting the GPUs.

What stays the launcher's: the engine (local or Ray), hybrid or decoupled placement, the number of actor and
rollout hosts, the GPU share each asks Ray for (Ray declares that many GPUs and gives each host its own
CUDA_VISIBLE_DEVICES), the schedule and staleness, the model dtype (fp16 runs as fp16, with its loss scaling), the
process groups' per-device backend map (NCCL replaced by gloo, nothing else: a CPU tensor sent on a group with
no CPU entry fails as it would on the GPUs), weight sync, the reward and its placement, and the conventions.

What changes: every host computes on the CPU (model.device=cpu). On the small offline models (tiny, tiny-flux,
tiny-flux-schnell, tiny-qwenimage, ocr-mini) the batch and the resolution shrink to what a 2-core machine runs in a minute, keeping
every divisibility the layout needs (whole groups per rollout host, equal slices per actor rank, two optimizer steps
per step); each change is printed on stderr.
"""

from __future__ import annotations

import dataclasses
import math
import sys

from gerl.config import Config, validate
from gerl.errors import UserError
from gerl.models.family import TINY_MODELS

# built offline (every tiny family model) / shipped: their native resolution is 64 px, 32 T5 tokens
SMALL_MODELS = (*TINY_MODELS, "ocr-mini")


def _shrunk_sizes(cfg: Config) -> dict[str, dict]:
    """Section → {field: value} for a small model: 64 px, 32 T5 tokens, 4 images per group, as few prompts per
    step as the layout allows, two optimizer steps per step, short validation."""
    g = cfg.engine
    ranks = g.actor_workers
    # prompts: a multiple of the rollout hosts (whole groups each), of 2 (two optimizer steps), and enough images
    # that each actor rank gets at least one micro-batch of each mini-batch
    group = 4
    step = math.lcm(g.rollout_workers, 2)
    prompts = step * math.ceil(ranks / step)
    images = prompts * group
    mini = images // 2
    micro = math.gcd(mini // ranks, 4)
    return {
        "model": {"resolution": 64, "max_sequence_length": 32},
        "data": {"prompts_per_step": prompts, "group_size": group},
        "sampling": {"micro_batch_size": math.gcd(images // g.rollout_workers, 8), "eval_num_steps": 10},
        "train": {"mini_batch_size": mini, "micro_batch_size": micro},
        "validation": {"num_prompts": min(cfg.validation.num_prompts, 4), "images_per_prompt": 1},
    }


def adapt(cfg: Config) -> Config:
    """The config a rehearsal runs (unchanged unless engine.rehearse), with what changed said on stderr."""
    if not cfg.engine.rehearse:
        return cfg
    notes, sections = [], {"model": {"device": "cpu"}}
    if cfg.model.path in SMALL_MODELS:
        for sec, values in _shrunk_sizes(cfg).items():
            sections.setdefault(sec, {}).update(values)
    changed = {}
    for sec, values in sections.items():
        old = getattr(cfg, sec)
        diff = {k: v for k, v in values.items() if getattr(old, k) != v}
        notes += [f"{sec}.{k}={getattr(old, k)}→{v}" for k, v in diff.items()]
        changed[sec] = dataclasses.replace(old, **diff)
    out = dataclasses.replace(cfg, **changed)
    errors = validate(out)
    if errors:  # a shrink that broke a divisibility: a bug here, but say it plainly rather than run something else
        raise UserError("engine.rehearse could not shrink this layout: " + "; ".join(errors))
    g = out.engine
    where = ("one process (engine.kind=local)" if g.kind == "local" else
             f"{'hybrid' if g.hybrid else 'decoupled'} Ray hosts ({g.actor_workers} actor, {g.rollout_workers} rollout)")
    print(f"gerl: rehearsal of the GPU layout on CPU: {where}, schedule {g.schedule}, model {out.model.dtype}; "
          f"changed: {', '.join(notes) or 'nothing'}", file=sys.stderr)
    return out
