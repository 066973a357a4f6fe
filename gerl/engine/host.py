"""Host: one Ray actor process of the Ray engine, holding the roles it is given (the same classes the local engine
runs in-process) on one device, and the torch.distributed group it shares with the other hosts.

Everything a host returns crosses Ray as a pickle, and a pickled CUDA tensor is restored on the *receiver's*
cuda:0 (an extra CUDA context on another worker's GPU, or a crash in a CPU-only driver). So every return value is
checked to hold CPU tensors only (`assert_on_cpu`); the roles hand back CPU tensors by construction.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path

import torch

from gerl.engine import dist as gdist
from gerl.logging.throughput import peak_memory_gib


def assert_on_cpu(obj, what: str, _path: str = "") -> None:
    """Raise if any tensor inside `obj` (dataclasses, dicts, lists, tuples, nested) is not on the CPU."""
    where = f"{what}{_path}"
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise RuntimeError(f"{where} is on {obj.device}, but everything a Ray host returns must be on the CPU "
                               "(a CUDA tensor would be unpickled onto the receiver's GPU); move it with .cpu()")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            assert_on_cpu(getattr(obj, f.name), what, f"{_path}.{f.name}")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            assert_on_cpu(v, what, f"{_path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            assert_on_cpu(v, what, f"{_path}[{i}]")


def _cpu_only(what: str):
    """Decorator for Host methods: their return value is checked with assert_on_cpu."""
    def wrap(fn):
        def method(self, *args, **kwargs):
            out = fn(self, *args, **kwargs)
            assert_on_cpu(out, f"Host.{what}()")
            return out
        method.__name__, method.__doc__ = fn.__name__, fn.__doc__
        return method
    return wrap


class Host:
    """One Ray actor process: builds the roles it is given (the same classes the local engine uses)."""

    def __init__(self, cfg, roles: tuple[str, ...], rank: int, world: int, actor_world: int, cores,
                 sync_ranks: list[int] | None, name: str = "host", threads: int | None = None):
        # what a fresh process has, for reset() (a host kept for the next run: gerl/engine/pool.py)
        self._fresh = {"threads": torch.get_num_threads(), "seed": torch.initial_seed(),
                       "cpus": os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None}
        self.reinit(cfg, roles, rank, world, actor_world, cores, sync_ranks, name, threads)

    def reinit(self, cfg, roles: tuple[str, ...], rank: int, world: int, actor_world: int, cores,
               sync_ranks: list[int] | None, name: str = "host", threads: int | None = None) -> None:
        """What a new host does first; a pooled host does it again for its next run, after reset()."""
        from gerl import determinism
        from gerl.logging.quiet import quiet_libraries

        if cfg.train.deterministic:  # first thing in the process: cuBLAS reads its workspace setting when CUDA starts
            determinism.apply(cfg.seed, name)
        quiet_libraries()
        from gerl.engine.roles import pin_cpus

        pin_cpus(cores)
        if threads:  # a rehearsal: many hosts share a few real cores
            torch.set_num_threads(threads)
        self.cfg, self.roles, self.rank, self.world, self.name = cfg, roles, rank, world, name
        self.actor_world, self.sync_ranks = actor_world, sync_ranks
        self.dp_group = self.sync_group = self.rollout = self.actor = None
        self.device = "cpu"

    def reset(self) -> bool:
        """After close(): back to what a fresh host is, for the next run (gerl/engine/pool.py) — the process group
        left, the roles and their models dropped, torch's global generator, thread count and CPU affinity as the
        process started. True when done (the pool kills a host whose reset raised or did not answer)."""
        import gc

        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        from gerl.engine.parallel import forget_meshes

        forget_meshes()  # the next run may give this process another rank
        self.dp_group = self.sync_group = self.rollout = self.actor = None
        gc.collect()
        if torch.cuda.is_initialized():  # the next run's peak memory is its own, and its models' memory is free
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(self._fresh["seed"])
        torch.set_num_threads(self._fresh["threads"])
        if self._fresh["cpus"] is not None:
            os.sched_setaffinity(0, self._fresh["cpus"])
        return True

    def rendezvous(self) -> str:
        """This host's node address and a free port: rank 0 serves the torch.distributed store (any node)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return f"{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"

    def setup(self, dist_addr: str | None, backends: str, device: str) -> dict:
        """Join the process group (if any) with its per-device backend map, build the roles on one shared
        pipeline on `device`. Returns where this host runs (for the run's placement record)."""
        import ray

        from gerl import determinism
        from gerl.engine.roles import ActorRole, RolloutRole, build_pipeline

        self.device = device
        # sharding needs a group even for one actor rank (FSDP2 over a world of 1: the same code path and memory)
        shard_alone = self.cfg.engine.fsdp and "actor" in self.roles and self.actor_world == 1
        if self.world > 1 or shard_alone:
            gdist.init_process_group(backends, dist_addr, self.rank, self.world)
            # Every process creates every group, in the same order (a torch.distributed rule).
            dp = self.actor_world > 1 or self.cfg.engine.fsdp
            self.dp_group = gdist.new_group(list(range(self.actor_world)), backends) if dp else None
            self.sync_group = gdist.new_group(self.sync_ranks, backends) if self.sync_ranks else None
        pipe = build_pipeline(self.cfg, device, roles=self.roles)
        self.rollout = RolloutRole(self.cfg, pipe) if "rollout" in self.roles else None
        if "actor" in self.roles:  # the data-parallel engine over dp_group: gerl/engine/parallel.py
            self.actor = ActorRole(self.cfg, pipe, self.rank, self.actor_world, group=self.dp_group)
        ctx = ray.get_runtime_context()
        return {"host": self.name, "roles": list(self.roles), "pid": os.getpid(), "node": ctx.get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "device": device,
                "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
                "dtype": self.cfg.model.dtype, "backends": backends if self.world > 1 else None,
                "rank": self.rank if self.world > 1 else None, "torch_threads": torch.get_num_threads(),
                "nice": os.nice(0), "env": {k: os.environ.get(k) for k in self.cfg.engine.env},  # what engine.env set
                **determinism.state()}

    def pid(self) -> int:
        return os.getpid()

    def _peak(self) -> float:
        return peak_memory_gib(self.device)

    # rollout role
    @_cpu_only("generate")
    def generate(self, prompts, metadata, group_ids, step, offset):
        import contextlib

        # a hybrid host's rollout shares the actor's transformer: generate with the sampling weights (nft's anchor)
        policy = self.actor.worker.sampling_policy() if self.actor is not None else contextlib.nullcontext()
        with policy:
            batch, res = self.rollout.generate(prompts, metadata, group_ids, step, offset)
        batch.timings["rollout_peak_mem_gib"] = self._peak()
        return batch, res

    @_cpu_only("validate")
    def validate(self, prompts, metadata, weights=None):
        """Score `prompts` with the rollout's weights, or `weights` loaded for the call; weights="actor": a hybrid
        host under the data-parallel layer, whose shared weights are DTensors, swaps in the actor's own validation
        weights (the EMA) instead (under shards every host runs it: each forward all-gathers)."""
        if weights == "actor":
            with self.actor.validation_policy():
                return self.rollout.validate(prompts, metadata)
        if weights is None:
            return self.rollout.validate(prompts, metadata)
        # clone: on CPU in fp32, weights() hands back the live parameters, which the EMA load would overwrite
        current = {n: t.clone() for n, t in self.rollout.weights().items()}
        self.rollout.load_weights(weights, self.rollout.version)
        try:
            return self.rollout.validate(prompts, metadata)
        finally:
            self.rollout.load_weights(current, self.rollout.version)

    def start(self, prompts, metadata, group_ids, step, offset):
        return self.rollout.start(prompts, metadata, group_ids, step, offset)

    @_cpu_only("finish")
    def finish(self, key):
        batch, res = self.rollout.finish(key)
        batch.timings["rollout_peak_mem_gib"] = self._peak()
        return batch, res

    def stage_weights(self, state, version) -> float:
        return self.rollout.stage_weights(state, version)

    def load_weights(self, state, version) -> float:
        t0 = time.perf_counter()
        self.rollout.load_weights(state, version)
        return time.perf_counter() - t0

    @_cpu_only("rollout_weights")
    def rollout_weights(self, pending: bool = False):
        return self.rollout.weights(pending=True) if pending else self.rollout.weights()

    def _sync_dtype(self) -> torch.dtype:
        """The dtype weights travel to rollouts in: theirs (a LoRA adapter's fp32, else the model dtype)."""
        from gerl.models.loader import DTYPES

        return torch.float32 if self.cfg.model.lora else DTYPES[self.cfg.model.dtype]

    def recv_broadcast(self, version, bucket_mb) -> float:
        t0 = time.perf_counter()
        params = dict(self.rollout.pipe.transformer.named_parameters())
        broadcast(self.sync_group, [params[n] for n in self.rollout.names], bucket_mb, src=0, receive=True,
                  dtype=self._sync_dtype())
        self.rollout.worker.policy_version = version
        return time.perf_counter() - t0

    # actor role
    @_cpu_only("update")
    def update(self, batch, advantages, step):
        t0 = time.time()
        m = self.actor.update(batch, advantages, step)
        m["_span"] = {"name": "train", "start": t0, "end": time.time()}
        m["actor_peak_mem_gib"] = self._peak()
        if self.rollout is not None:  # hybrid: the colocated rollout uses these very weights
            self.rollout.worker.policy_version = self.actor.version
        return m

    @_cpu_only("actor_weights")
    def actor_weights(self, validation: bool = False, current: bool = False):
        """What rollouts generate with; with validation=True what validation scores instead (the EMA, or nft's
        trained tensors) — None when that is what the rollouts hold, unless current=True (then the tensors)."""
        if not validation:
            return self.actor.weights()
        w = self.actor.validation_weights()
        return w if w is not None or not current else self.actor.worker.trainable_state()

    def send_broadcast(self, bucket_mb) -> float:
        """Actor rank 0 broadcasts what rollouts generate with; under shards every actor rank calls it, and each
        bucket is first gathered whole over the actor ranks (the ranks other than 0 only gather)."""
        t0 = time.perf_counter()
        w = self.actor.worker
        broadcast(self.sync_group, w.sampling_tensors(), bucket_mb, src=0, receive=False, dtype=self._sync_dtype(),
                  full=w.dp.full if w.dp is not None else None, member=self.rank == 0)
        return time.perf_counter() - t0

    def actor_version(self) -> int:
        return self.actor.version

    @_cpu_only("older_versions")
    def older_versions(self):
        return self.actor.older_versions()

    def save(self, run_dir, step, extra, keep_last):
        self.actor.save(run_dir, step, extra, keep_last)

    def load(self, path):
        state = self.actor.load(Path(path))
        if self.rollout is not None:
            self.rollout.worker.policy_version = self.actor.version
        return state

    def close(self):
        if self.rollout is not None:
            self.rollout.close()


@torch.no_grad()
def broadcast(group, params: list[torch.Tensor], bucket_mb: int, src: int, receive: bool,
              dtype: torch.dtype = torch.float32, full=None, member: bool = True) -> None:
    """Broadcast tensors from `src` in flat buckets of `dtype` (the rollouts' own: the model dtype for full weights,
    fp32 for a LoRA) of ≤ bucket_mb; receivers copy each bucket as it lands. `full` makes a sharded tensor whole
    (every actor rank gathers each bucket in turn); `member=False`: an actor rank outside the broadcast group, which
    only takes part in the gathers."""
    import torch.distributed as dist

    limit = max(1, bucket_mb * 2**20 // torch.empty((), dtype=dtype).element_size())
    bucket: list[torch.Tensor] = []

    def flush():
        if not bucket:
            return
        whole = [full(p.detach()) if full is not None else p.detach() for p in bucket]
        if not member:
            bucket.clear()
            return
        # NCCL needs CUDA tensors, gloo CPU ones: keep the bucket on the parameters' own device
        flat = torch.cat([p.to(dtype).flatten() for p in whole]).to(whole[0].device)
        dist.broadcast(flat, src=src, group=group)
        if receive:
            off = 0
            for p in bucket:
                p.copy_(flat[off:off + p.numel()].view_as(p).to(p.device, p.dtype))
                off += p.numel()
        bucket.clear()

    size = 0
    for p in params:
        if size + p.numel() > limit:
            flush()
            size = 0
        bucket.append(p)
        size += p.numel()
    flush()
