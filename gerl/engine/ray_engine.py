"""Ray placement: actor and rollout roles as Ray actors on resource pools.

hybrid=true : N hosts, each holding both roles on one shared model (generation is sharded over the hosts, training
              is data-parallel across them; weights never move).
hybrid=false: N actor hosts (data-parallel training) + M rollout hosts (sharded generation). After each update the
              actor's trained tensors (the adapter only, for LoRA) go to every rollout: through the object store
              (non-blocking) or a bucketed torch.distributed broadcast from actor rank 0.

Works on GPUs (one per host) and on CPU for tests (cpus_per_worker cores pinned per host). A dead rollout host is
replaced and its in-flight shards re-issued; a dead actor host stops the run with the last checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from pathlib import Path

import torch

from gerl.config import weight_sync_mode
from gerl.errors import RunAborted, UserError
from gerl.workers.batch import merge
from gerl.workers.reward import merge_results


class Host:
    """One Ray actor process: builds the roles it is given (the same classes the local engine uses)."""

    def __init__(self, cfg, roles: tuple[str, ...], rank: int, world: int, actor_world: int, cores,
                 sync_ranks: list[int] | None):
        from gerl.cli import _quiet_libraries

        _quiet_libraries()
        from gerl.engine.roles import pin_cpus

        pin_cpus(cores)
        self.cfg, self.roles, self.rank, self.world = cfg, roles, rank, world
        self.actor_world, self.sync_ranks = actor_world, sync_ranks
        self.dp_group = self.sync_group = self.rollout = self.actor = None

    def rendezvous(self) -> str:
        """This host's node address and a free port: rank 0 serves the torch.distributed store (any node)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return f"{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"

    def setup(self, dist_addr: str | None) -> int:
        """Join the process group (if any), then build the roles on one shared pipeline."""
        from gerl.engine.roles import ActorRole, RolloutRole, build_pipeline

        if self.world > 1:
            import torch.distributed as dist

            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{dist_addr}", rank=self.rank, world_size=self.world)
            # Every process creates every group, in the same order (a torch.distributed rule).
            self.dp_group = dist.new_group(list(range(self.actor_world))) if self.actor_world > 1 else None
            self.sync_group = dist.new_group(self.sync_ranks) if self.sync_ranks else None
        pipe = build_pipeline(self.cfg)
        self.rollout = RolloutRole(self.cfg, pipe) if "rollout" in self.roles else None
        grad_sync = self._grad_sync if self.dp_group is not None else None
        if "actor" in self.roles:
            self.actor = ActorRole(self.cfg, pipe, self.rank, self.actor_world, grad_sync=grad_sync)
        return os.getpid()

    def _grad_sync(self, params, finite: bool) -> bool:
        """Average gradients over the data-parallel ranks; all skip the step if any rank saw a non-finite loss."""
        import torch.distributed as dist

        flag = torch.tensor([0.0 if finite else 1.0])
        dist.all_reduce(flag, group=self.dp_group)
        n = dist.get_world_size(self.dp_group)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.dp_group)
            p.grad /= n
        return bool(flag.item() == 0)

    def pid(self) -> int:
        return os.getpid()

    # rollout role
    def generate(self, prompts, metadata, group_ids, step, offset):
        return self.rollout.generate(prompts, metadata, group_ids, step, offset)

    def validate(self, prompts, metadata, weights=None):
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

    def finish(self, key):
        return self.rollout.finish(key)

    def stage_weights(self, state, version) -> float:
        return self.rollout.stage_weights(state, version)

    def load_weights(self, state, version) -> float:
        t0 = time.perf_counter()
        self.rollout.load_weights(state, version)
        return time.perf_counter() - t0

    def rollout_weights(self):
        return self.rollout.weights()

    def recv_broadcast(self, version, bucket_mb) -> float:
        t0 = time.perf_counter()
        params = dict(self.rollout.pipe.transformer.named_parameters())
        _broadcast([params[n] for n in self.rollout.names], self.sync_group, bucket_mb, src=0, receive=True)
        self.rollout.worker.policy_version = version
        return time.perf_counter() - t0

    # actor role
    def update(self, batch, advantages, step):
        t0 = time.time()
        m = self.actor.update(batch, advantages, step)
        m["_span"] = {"name": "train", "start": t0, "end": time.time()}
        if self.rollout is not None:  # hybrid: the colocated rollout uses these very weights
            self.rollout.worker.policy_version = self.actor.version
        return m

    def actor_weights(self, ema: bool = False):
        if ema and self.actor.worker.ema is not None:
            return {n: s.float().cpu() for (n, _), s in zip(self.actor.worker.named_params, self.actor.worker.ema.shadow)}
        return self.actor.weights()

    def send_broadcast(self, bucket_mb) -> float:
        t0 = time.perf_counter()
        _broadcast(self.actor.worker.params, self.sync_group, bucket_mb, src=0, receive=False)
        return time.perf_counter() - t0

    def actor_version(self) -> int:
        return self.actor.version

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
def _broadcast(params: list[torch.Tensor], group, bucket_mb: int, src: int, receive: bool) -> None:
    """Broadcast tensors from `src` in flat fp32 buckets of ≤ bucket_mb; receivers copy each bucket as it lands."""
    import torch.distributed as dist

    limit = max(1, bucket_mb * 2**20 // 4)
    bucket: list[torch.Tensor] = []

    def flush():
        if not bucket:
            return
        # NCCL needs CUDA tensors, gloo CPU ones: keep the bucket on the parameters' own device
        flat = torch.cat([p.detach().float().flatten() for p in bucket]).to(bucket[0].device)
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


def check_ray_address(address: str, timeout_s: float = 10.0) -> None:
    """UserError within `timeout_s` when a host:port engine.ray_address accepts no connection: ray.init would
    otherwise retry for minutes. "auto" is left to ray.init, which fails fast when no cluster runs here."""
    host_port = address.split("://", 1)[-1]
    if address == "auto" or ":" not in host_port:
        return
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except ValueError:
        raise UserError(f"engine.ray_address={address}: the port {port!r} is not a number; write host:port, "
                        "e.g. 10.0.0.1:6379, or auto") from None
    except OSError as e:
        raise UserError(f"engine.ray_address={address}: nothing answers at {host}:{port} ({e.strerror or e}); start "
                        "the cluster with `ray start --head`, fix the address, or leave it empty for a local Ray") from None


class RayEngine:
    def __init__(self, cfg):
        try:
            import ray
        except ImportError:
            raise UserError("engine.kind=ray needs Ray: pip install 'gerl[ray]'") from None
        self.ray, self.cfg = ray, cfg
        self.hosts: list = []
        g = cfg.engine
        # A run that starts (or connects) Ray itself also stops it (close, or Ray's own atexit on a signal):
        # no raylet, GCS or worker processes outlive the driver. A Ray the caller started is left alone.
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            # Workers import gerl, rewards and user reward modules from the driver's working directory.
            os.environ["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *sys.path[1:3], os.environ.get("PYTHONPATH", "")])
            kwargs = {"include_dashboard": False, "log_to_driver": True}
            if g.ray_address:
                check_ray_address(g.ray_address)
                try:
                    ray.init(address=g.ray_address, **kwargs)
                except ConnectionError as e:
                    raise UserError(f"engine.ray_address={g.ray_address}: no Ray cluster there ({str(e).splitlines()[0][:160]}); "
                                    "start one with `ray start --head`, or set engine.ray_address= to start a local Ray") from None
            else:
                ray.init(num_cpus=os.cpu_count(), **kwargs)
        try:
            self._start(cfg)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg) -> None:
        ray, g = self.ray, cfg.engine
        self.use_gpu = g.device == "cuda" or (g.device == "auto" and torch.cuda.is_available())
        self.hybrid = g.hybrid
        n_actor, n_roll = g.actor_workers, g.rollout_workers
        hosts = n_actor if g.hybrid else n_actor + n_roll
        self._check_resources(hosts)
        # devices in use, for images/s/device and GPU-hours: 1 actor + 1 rollout at 0.5 GPU each is one GPU
        share = hosts * g.gpus_per_worker if self.use_gpu else hosts
        self.devices = int(share) if share == int(share) else share  # logged as 1, not 1.0, when shares fill GPUs
        self.actor_devices, self.rollout_devices = n_actor, (n_actor if g.hybrid else n_roll)
        self.sync_mode = weight_sync_mode(cfg)
        broadcast = not g.hybrid and self.sync_mode == "broadcast"
        # One process group: actor ranks 0..N-1 (data parallel), plus the rollouts when weights are broadcast.
        world = n_actor + n_roll if broadcast else n_actor
        sync_ranks = [0] + list(range(n_actor, n_actor + n_roll)) if broadcast else None
        c = g.cpus_per_worker
        self._opts = {"num_gpus": g.gpus_per_worker} if self.use_gpu else {"num_cpus": c}
        # stream: a host generates (default group, one call at a time) while other threads wait for the rewards
        # of its earlier groups and stage new weights into the second buffer.
        groups = {"concurrency_groups": {"weights": 1, "rewards": 64}} if g.schedule == "stream" else {}
        self._host_cls = ray.remote(**groups)(Host) if groups else ray.remote(Host)
        self.stream = None
        self._spec: dict[int, tuple] = {}

        def spawn(i, roles, rank, world_size):
            cores = None if self.use_gpu else list(range(i * c, (i + 1) * c))
            self._spec[i] = (cfg, roles, rank, world_size, n_actor, cores, sync_ranks if world_size > 1 else None)
            return self._host_cls.options(**self._opts).remote(*self._spec[i])

        if g.hybrid:
            self.actors = [spawn(i, ("actor", "rollout"), i, world) for i in range(n_actor)]
            self.rollouts = self.actors
        else:
            self.actors = [spawn(i, ("actor",), i, world) for i in range(n_actor)]
            self.rollouts = [spawn(n_actor + j, ("rollout",), n_actor + j if broadcast else 0, world if broadcast else 1)
                             for j in range(n_roll)]
        self.hosts = self.actors if g.hybrid else self.actors + self.rollouts
        try:
            addr = ray.get(self.actors[0].rendezvous.remote())  # on actor rank 0's node, so multi-node works
            ray.get([h.setup.remote(addr) for h in self.hosts])
        except ray.exceptions.RayError as e:
            raise UserError(f"a Ray worker failed to start ({str(e).strip().splitlines()[-1][:200]}); "
                            "run with --debug for the full error") from None
        self.restarts = 0
        self._version = 0
        self._pending_loads: list = []
        self._replay: dict[int, dict] = {}  # after an async resume: older versions' weights for re-issued steps
        self.sync()  # rollouts start from the actor's exact weights

    def _check_resources(self, hosts: int) -> None:
        res = self.ray.cluster_resources()
        g = self.cfg.engine
        if self.use_gpu:
            have, need, what = res.get("GPU", 0), hosts * g.gpus_per_worker, "GPUs"
        else:
            have, need, what = int(res.get("CPU", 0)), hosts * g.cpus_per_worker, "CPUs"
        if need > have:
            layout = (f"{g.actor_workers} colocated" if g.hybrid else f"{g.actor_workers} actor + {g.rollout_workers} rollout")
            per = f" × {g.gpus_per_worker:g} gpus_per_worker" if self.use_gpu else f" × {g.cpus_per_worker} cpus_per_worker"
            raise UserError(f"engine asks for {need:g} {what} ({layout} workers{per}) but the Ray cluster has {have:g}; "
                            "lower engine.actor_workers/rollout_workers/cpus_per_worker/gpus_per_worker or add nodes")

    @property
    def actor_version(self) -> int:
        return self._version

    # ---------------------------------------------------------------- generation
    def _shards(self, prompts, metadata, group_ids):
        m, n = len(self.rollouts), len(prompts)
        size = n // m
        return [(prompts[j * size:(j + 1) * size], metadata[j * size:(j + 1) * size],
                 group_ids[j * size:(j + 1) * size], j * size) for j in range(m)]

    def submit(self, step, prompts, metadata, group_ids):
        shards = self._shards(prompts, metadata, group_ids)
        # An uninterrupted async run generates step t with version max(0, t − k − 1) (see Trainer.fit); after a
        # resume the steps that were in flight get that very version back, then the rollouts return to the current.
        v = max(0, step - self.cfg.engine.max_staleness - 1)
        old = self._replay.get(v)  # a host runs its calls in order: load old → generate → load current
        if old is not None:
            old_ref = self.ray.put(old)
            for h in self.rollouts:
                h.load_weights.remote(old_ref, v)
        refs = [h.generate.remote(*s[:3], step, s[3]) for h, s in zip(self.rollouts, shards)]
        if old is not None:
            current = self.actors[0].actor_weights.remote()
            self._pending_loads = [h.load_weights.remote(current, self._version) for h in self.rollouts]
        return {"step": step, "shards": shards, "refs": refs, "hosts": list(self.rollouts)}

    def open_stream(self, draw, state: dict | None = None) -> None:
        """schedule=stream: rollouts pull groups from draw(1), draw(2), … (gerl/engine/stream.py)."""
        from gerl.engine.stream import GroupStream

        s = state or {}
        self.stream = GroupStream(self, draw, s.get("first_draw", 1), s.get("consumed", []), s.get("dropped_total", 0))

    def collect(self, handle):
        if "stream" in handle:
            return self.stream.take(self._version)
        ray = self.ray
        out = []
        for j, ref in enumerate(handle["refs"]):
            for attempt in range(self.cfg.engine.max_rollout_restarts + 1):
                try:
                    out.append(ray.get(ref))
                    break
                except ray.exceptions.RayActorError:
                    if attempt == self.cfg.engine.max_rollout_restarts:
                        raise RunAborted(f"rollout worker {j} died {attempt + 1} times at step {handle['step']}; "
                                         "check its logs (out of memory? a crashing reward?)") from None
                    self._replace_rollout(j, handle["hosts"][j])
                    s = handle["shards"][j]
                    ref = self.rollouts[j].generate.remote(*s[:3], handle["step"], s[3])
                    handle["hosts"][j] = self.rollouts[j]
        batches, results = zip(*out)
        return merge(list(batches)), merge_results(list(results), [f"rollout{j}" for j in range(len(results))])

    def _replace_rollout(self, j: int, dead) -> None:
        """Start a fresh rollout host j (unless another shard already did) and give it the current weights."""
        if self.rollouts[j] is not dead:
            return
        if self.hybrid or self.sync_mode == "broadcast":
            raise RunAborted(f"rollout worker {j} died; replacing it is supported with engine.hybrid=false and "
                             "engine.weight_sync=object_store (a broadcast group cannot take a new member)")
        idx = self.cfg.engine.actor_workers + j
        self.rollouts[j] = self._host_cls.options(**self._opts).remote(*self._spec[idx])
        self.ray.get(self.rollouts[j].setup.remote(None))
        self.hosts = self.actors + self.rollouts
        self.ray.get(self.rollouts[j].load_weights.remote(self.actors[0].actor_weights.remote(), self._version))
        self.restarts += 1

    # ---------------------------------------------------------------- training
    def update(self, batch, advantages, step: int) -> dict:
        """Data parallel: rank r trains on the r-th contiguous slice of the batch (equal sizes)."""
        n = len(self.actors)
        size = len(batch) // n
        from gerl.workers.batch import subset

        refs = []
        for r, h in enumerate(self.actors):
            keep = torch.zeros(len(batch), dtype=torch.bool)
            keep[r * size:(r + 1) * size if r < n - 1 else len(batch)] = True
            part = batch if n == 1 else subset(batch, keep)
            # The actor needs trajectories, not pictures: 64 images of 512 px would be ~50 MB to ship every step.
            part = dataclasses.replace(part, images=[], reward_extras={}, spans=[])
            refs.append(h.update.remote(part, advantages[keep] if n > 1 else advantages, step))
        try:
            results = self.ray.get(refs)
        except self.ray.exceptions.RayActorError:
            raise RunAborted(f"an actor (training) worker died at step {step}; the last checkpoint in "
                             f"{self.cfg.output_dir}/checkpoints is intact — fix the cause and rerun with resume=true") from None
        self._version += 1
        m = results[0]
        m["_spans"] = [dict(r.pop("_span"), lane=f"actor{i}") for i, r in enumerate(results)]
        return m

    def sync(self) -> float:
        """Actor → rollouts. Hybrid: nothing moves. Object store: non-blocking (queued behind in-flight generation).
        Broadcast: bucketed collective, measured end to end."""
        if self.hybrid:
            return 0.0
        t0 = time.perf_counter()
        if self.stream is not None:  # staged while generating; loaded between micro-batches (RolloutRole)
            weights = self.actors[0].actor_weights.remote()
            self.ray.wait([weights])
            self._pending_loads = [h.stage_weights.options(concurrency_group="weights").remote(weights, self._version)
                                   for h in self.rollouts]
        elif self.sync_mode == "object_store":
            weights = self.actors[0].actor_weights.remote()
            self.ray.wait([weights])
            self._pending_loads = [h.load_weights.remote(weights, self._version) for h in self.rollouts]
        else:
            bucket = self.cfg.engine.sync_bucket_mb
            refs = [self.actors[0].send_broadcast.remote(bucket)] + [
                h.recv_broadcast.remote(self._version, bucket) for h in self.rollouts]
            self.ray.get(refs)
        return time.perf_counter() - t0

    def validate(self, prompts, metadata):
        ema = self.actors[0].actor_weights.remote(ema=True) if self.cfg.train.ema_decay > 0 else None
        return self.ray.get(self.rollouts[0].validate.remote(prompts, metadata, ema))

    def weights_equal(self) -> bool:
        """Test hook: every rollout's trained tensors equal the actor's exactly (waits for pending syncs)."""
        self.ray.get(self._pending_loads)
        a = self.ray.get(self.actors[0].actor_weights.remote())
        return all(all(torch.equal(a[k], w[k]) for k in a) for w in self.ray.get([h.rollout_weights.remote() for h in self.rollouts]))

    def save(self, run_dir, step, extra, keep_last) -> None:
        self.ray.get(self.actors[0].save.remote(run_dir, step, extra, keep_last))

    def load(self, path) -> dict:
        states = self.ray.get([h.load.remote(str(path)) for h in self.actors])
        self._version = states[0]["policy_version"]
        if self.cfg.engine.schedule == "async":
            self._replay = self.ray.get(self.actors[0].older_versions.remote())
        self.sync()
        return states[0]

    def close(self) -> None:
        try:
            self.ray.get([h.close.remote() for h in self.hosts], timeout=30)
        except Exception:  # noqa: BLE001 — shutting down; a dead host has nothing left to close
            pass
        for h in self.hosts:
            self.ray.kill(h)
        self.hosts = []
        if self._owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
