"""`torchrun` and `accelerate launch`: the local engine on N processes, for users without a Ray cluster.

    torchrun --nproc_per_node 8 -m gerl.cli train CONFIG [key=value ...]
    accelerate launch --multi_gpu --num_processes 8 -m gerl.cli train CONFIG [key=value ...]

Both start N copies of `gerl train` and tell each who it is through the environment: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT (several nodes: each node's launcher with --nnodes, --node_rank and the same master). Each
process is one colocated (hybrid) host of the Ray engine's layout, on GPU LOCAL_RANK: engine.actor_workers =
engine.rollout_workers = WORLD_SIZE, schedule sync. Every process draws the same prompts, generates its own slice of
the step's groups (noise seeded by the sample's index in the step, as on one process), all-gathers the slices, and
runs the trainer's driver logic (failure policy, advantages) on the same whole batch; each trains on its slice,
through the data-parallel layer of gerl/engine/parallel.py (DDP through FSDP2's replicate, or engine.fsdp=true).
Rank 0 alone writes the run directory (config, metrics, timeline, samples, checkpoints; each rank its own shard of a
sharded checkpoint).
"""

from __future__ import annotations

import os

from gerl.errors import UserError


def world() -> int:
    """WORLD_SIZE as a launcher set it (1 when not launched by one)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    except ValueError:
        raise UserError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number; it is torchrun's to set") from None


def rank() -> int:
    """RANK as a launcher set it (0 when not launched by one)."""
    return int(os.environ.get("RANK", "0") or 0) if world() > 1 else 0


def adapt(cfg):
    """Under a launcher of N > 1 processes: the config with engine.actor_workers = rollout_workers = N (said once on
    stderr), after checking that the config can run that way; otherwise cfg itself."""
    import copy
    import sys

    from gerl.config import validate

    n, g = world(), cfg.engine
    if n == 1:
        return cfg
    if g.kind != "local":
        raise UserError(f"this `gerl train` was started {n} times (WORLD_SIZE={n}: torchrun or accelerate launch), "
                        "but engine.kind=ray places its own hosts: run one `gerl train` without the launcher, or set "
                        "engine.kind=local")
    for key in ("actor_workers", "rollout_workers"):
        if getattr(g, key) not in (1, n):
            raise UserError(f"engine.{key}={getattr(g, key)} but the launcher started {n} processes (WORLD_SIZE): "
                            f"set engine.{key}={n}, or leave it out (the launcher's process count is used)")
    if g.actor_workers == g.rollout_workers == n:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.engine.actor_workers = cfg.engine.rollout_workers = n
    errors = validate(cfg)
    if errors:
        raise UserError(f"invalid config for {n} processes (WORLD_SIZE): " + "; ".join(errors))
    if rank() == 0:
        print(f"gerl: {n} processes (WORLD_SIZE): engine.actor_workers=rollout_workers={n}, each a colocated host",
              file=sys.stderr)
    return cfg


def start(cfg) -> None:
    """Set engine.env in this process; under a launcher, pick GPU LOCAL_RANK and join the process group its
    environment describes (env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), with gerl's backend map."""
    os.environ.update({str(k): str(v) for k, v in cfg.engine.env.items()})  # before NCCL reads them
    if world() == 1:
        return
    import torch
    import torch.distributed as dist

    from gerl.engine import dist as gdist
    from gerl.models.loader import resolve_device

    if dist.is_initialized():
        return
    cuda = resolve_device(cfg.model.device).type == "cuda"
    if cuda:  # "cuda" then means this process's GPU wherever a model or tensor goes
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    gdist.init_process_group(gdist.backend_map(gpu=cuda), None, rank(), world())
