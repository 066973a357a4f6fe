"""Ray placement: actor and rollout roles as Ray actors (gerl/engine/host.py) on resource pools.

hybrid=true : N hosts, each holding both roles on one shared model (generation is sharded over the hosts, training
              is data-parallel across them; weights never move).
hybrid=false: N actor hosts (data-parallel training) + M rollout hosts (sharded generation). After each update the
              actor's trained tensors (the adapter only, for LoRA) go to every rollout: through the object store
              (non-blocking) or a bucketed torch.distributed broadcast from actor rank 0.

Works on GPUs (one per host, or a share: engine.gpus_per_worker), on CPU (cpus_per_worker cores pinned per host),
and as a rehearsal of a GPU layout on CPU (engine.rehearse: Ray declares the GPUs, gloo stands in for NCCL). A dead
rollout host is replaced and its in-flight shards re-issued; a dead actor host stops the run with the last
checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time

import torch

from gerl.config import gpu_topology, host_cpus, weight_sync_mode
from gerl.engine import dist as gdist
from gerl.engine import placement, pool, resources
from gerl.engine.host import Host
from gerl.errors import RunAborted, UserError
from gerl.workers.batch import merge
from gerl.workers.reward import merge_results


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
            resources.own_ray_env()
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
            # address="local": a new Ray of our own, never a cluster someone started here with `ray start`
            # (ray.init() alone joins it, and then refuses num_cpus); engine.ray_address is how to join one.
            elif g.rehearse:  # declare what the GPU layout asks for; the hosts then run on this machine's CPUs
                ray.init(address="local", **resources.rehearsal_init_args(cfg), **kwargs)
            else:
                ray.init(address="local", num_cpus=os.cpu_count(), **kwargs)
        try:
            self._start(cfg)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg) -> None:
        ray, g = self.ray, cfg.engine
        self.use_gpu = gpu_topology(cfg)  # hosts ask Ray for GPUs (real ones, or declared ones in a rehearsal)
        self.hybrid = g.hybrid
        n_actor, n_roll = g.actor_workers, g.rollout_workers
        names = resources.host_names(cfg)
        resources.check_fits(cfg, resources.node_resources(ray))
        # devices in use, for images/s/device and GPU-hours: 1 actor + 1 rollout at 0.5 GPU each is one GPU
        share = len(names) * g.gpus_per_worker if self.use_gpu else len(names)
        self.devices = int(share) if share == int(share) else share  # logged as 1, not 1.0, when shares fill GPUs
        self.actor_devices, self.rollout_devices = n_actor, (n_actor if g.hybrid else n_roll)
        self.sync_mode = weight_sync_mode(cfg)
        broadcast = not g.hybrid and self.sync_mode == "broadcast"
        # One process group: actor ranks 0..N-1 (data parallel), plus the rollouts when weights are broadcast.
        world = n_actor + n_roll if broadcast else n_actor
        sync_ranks = [0] + list(range(n_actor, n_actor + n_roll)) if broadcast else None
        shared_gpu = self.use_gpu and g.gpus_per_worker < 1  # NCCL cannot join two ranks on one GPU
        self.backends = gdist.backend_map(self.use_gpu, g.rehearse, shared_gpu)
        self.host_device = "cuda" if self.use_gpu and not g.rehearse else "cpu"
        c = host_cpus(cfg)
        req = resources.host_request(cfg)
        self._opts = {"num_cpus": req["CPU"], **({"num_gpus": req["GPU"]} if "GPU" in req else {}),
                      **placement.runtime_env(g.env)}  # engine.env: NCCL/IB variables in every host's process
        # a rehearsal runs every host on this machine's few cores: one torch thread each, not the declared CPUs
        threads = max(1, (os.cpu_count() or 1) // len(names)) if g.rehearse else None
        # stream: a host generates (default group, one call at a time) while other threads wait for the rewards
        # of its earlier groups and stage new weights into the second buffer.
        groups = {"concurrency_groups": {"weights": 1, "rewards": 64}} if g.schedule == "stream" else {}
        self._host_cls = ray.remote(**groups)(Host) if groups else ray.remote(Host)
        self.stream = None
        self._spec: dict[int, tuple] = {}
        # hosts a previous run on this Ray left idle with their placement group, when the pool is on
        # (gerl/engine/pool.py); the bundles without a kept host get fresh ones
        self._pool_key = None if self._owns_ray else pool.key(ray, cfg, self._opts, bool(groups), len(names))
        self.pg, kept = pool.take(ray, self._pool_key) if not self._owns_ray else (None, {})
        if self.pg is None:  # one bundle per host, reserved all at once (gerl/engine/placement.py)
            self.pg = placement.reserve(ray, req, len(names), g.setup_timeout_s)
        nodes = placement.bundle_nodes(self.pg)
        # host i (actor ranks 0…N−1, then the rollouts) goes to bundle order[i]: ranks sorted by node
        self._order = order = placement.node_sorted(nodes)
        reused: set[int] = set()  # indices of the hosts that are kept ones (placement.json's "reused_host")

        def spawn(i, roles, rank, world_size):
            b = order[i]
            on_node = sum(nodes[order[j]] == nodes[b] for j in range(i))  # hosts before this one on its node
            cores = None if self.use_gpu else list(range(on_node * c, (on_node + 1) * c))
            self._spec[i] = (cfg, roles, rank, world_size, n_actor, cores, sync_ranks if world_size > 1 else None,
                             names[i], threads)
            if b in kept:
                h = kept.pop(b)
                try:
                    ray.get(h.reinit.remote(*self._spec[i]))  # milliseconds
                    reused.add(i)
                    return h
                except ray.exceptions.RayError:  # a fresh host then raises the same in its own __init__, if any
                    ray.kill(h)
            return self._host_cls.options(**self._opts, **placement.strategy(self.pg, b)).remote(*self._spec[i])

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
            refs = [h.setup.remote(addr, self.backends, self.host_device) for h in self.hosts]
            self.placement = resources.wait_for_setup(ray, refs, names, req, g.setup_timeout_s)
        except ray.exceptions.RayError as e:
            raise UserError(f"a Ray worker failed to start ({str(e).strip().splitlines()[-1][:200]}); "
                            "run with --debug for the full error") from None
        for i, p in enumerate(self.placement):  # placement follows self.hosts, which follows the spawn index
            p.update(reused_host=i in reused, bundle=order[i])
        self.device_name = self.placement[0]["device_name"]
        self._started = True  # hosts that never got placed or set up are not given back to the pool
        if g.rehearse:
            gpu_run = gdist.backend_map(True, shared_gpu=shared_gpu)
            print("gerl: rehearsal placement: " + "; ".join(
                f"{p['host']} on GPU {','.join(p['gpu_ids']) or '-'} (CUDA_VISIBLE_DEVICES={p['cuda_visible_devices']}, "
                f"node {p['node'][:8]})" for p in self.placement)
                + f"; process groups {self.backends} (the GPU run's: {gpu_run}); model {cfg.model.dtype} on the CPU",
                file=sys.stderr)
        self.restarts = 0
        self._version = 0
        self._pending_loads: list = []
        self._replay: dict[int, dict] = {}  # after an async resume: older versions' weights for re-issued steps
        self.sync()  # rollouts start from the actor's exact weights

    @property
    def actor_version(self) -> int:
        return self._version

    def _actor_call(self, method: str, *args, **kwargs):
        """A call on actor rank 0 whose answer needs whole weights. Under shards every actor rank must take part in
        each gather (in the same order: Ray runs a host's calls in submission order), and rank 0's answer is the
        one returned; the other ranks answer {}."""
        ranks = self.actors if self.cfg.engine.fsdp else self.actors[:1]
        return [getattr(h, method).remote(*args, **kwargs) for h in ranks][0]

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
            current = self._actor_call("actor_weights")
            self._pending_loads = [h.load_weights.remote(current, self._version) for h in self.rollouts]
        return {"step": step, "shards": shards, "refs": refs, "hosts": list(self.rollouts)}

    def open_stream(self, draw, state: dict | None = None, steps_left: int | None = None) -> None:
        """schedule=stream: rollouts pull groups from draw(1), draw(2), … (gerl/engine/stream.py)."""
        from gerl.engine.stream import GroupStream

        s = state or {}
        self.stream = GroupStream(self, draw, s.get("first_draw", 1), s.get("consumed", []), s.get("dropped_total", 0),
                                  steps_left)

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
        self.rollouts[j] = self._host_cls.options(**self._opts, **placement.strategy(self.pg, self._order[idx])).remote(
            *self._spec[idx])  # in the dead host's bundle, whose resources its death gave back
        self.ray.get(self.rollouts[j].setup.remote(None, self.backends, self.host_device))
        self.hosts = self.actors + self.rollouts
        self.ray.get(self.rollouts[j].load_weights.remote(self._actor_call("actor_weights"), self._version))
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
        m["actor_peak_mem_gib"] = max(r["actor_peak_mem_gib"] for r in results)  # each rank measures its own
        return m

    def sync(self) -> float:
        """Actor → rollouts. Hybrid: nothing moves. Object store: non-blocking (queued behind in-flight generation).
        Broadcast: bucketed collective, measured end to end."""
        if self.hybrid:
            return 0.0
        t0 = time.perf_counter()
        if self.stream is not None:  # staged while generating; loaded between micro-batches (RolloutRole)
            weights = self._actor_call("actor_weights")
            self.ray.wait([weights])
            self._pending_loads = [h.stage_weights.options(concurrency_group="weights").remote(weights, self._version)
                                   for h in self.rollouts]
        elif self.sync_mode == "object_store":
            weights = self._actor_call("actor_weights")
            self.ray.wait([weights])
            self._pending_loads = [h.load_weights.remote(weights, self._version) for h in self.rollouts]
        else:
            bucket = self.cfg.engine.sync_bucket_mb
            senders = self.actors if self.cfg.engine.fsdp else self.actors[:1]  # shards: every rank gathers
            refs = [h.send_broadcast.remote(bucket) for h in senders] + [
                h.recv_broadcast.remote(self._version, bucket) for h in self.rollouts]
            self.ray.get(refs)
        return time.perf_counter() - t0

    def validate(self, prompts, metadata):
        # Validation scores the actor's weights now. The rollouts hold the sampling weights, loaded in call order
        # (async), or staged and loaded only when the next group starts (stream): there rollout 0 may still hold
        # an older version, so stream always hands the weights over; and EMA / nft validate other tensors.
        if self.hybrid and (self.cfg.engine.fsdp or len(self.actors) > 1):
            # the shared weights are the data-parallel layer's DTensors: each host swaps its own validation weights
            # in; under shards every host generates (each forward all-gathers) and host 0's answer counts
            hosts = self.actors if self.cfg.engine.fsdp else self.actors[:1]
            return self.ray.get([h.validate.remote(prompts, metadata, "actor") for h in hosts])[0]
        weights = self.ray.get(self._actor_call("actor_weights", validation=True, current=self.stream is not None))
        return self.ray.get(self.rollouts[0].validate.remote(prompts, metadata, weights))

    def weights_equal(self) -> bool:
        """Test hook: every rollout's trained tensors equal what the actor samples with (nft: its anchor), exactly
        (waits for pending syncs; a streaming rollout's are those it holds once its staged buckets are in)."""
        self.ray.get(self._pending_loads)
        a = self.ray.get(self._actor_call("actor_weights"))
        # streaming hosts answer on their weights thread, beside the generation their default thread is running
        call = (lambda h: h.rollout_weights.options(concurrency_group="weights")) if self.stream is not None else (
            lambda h: h.rollout_weights)
        held = self.ray.get([call(h).remote(pending=True) for h in self.rollouts])
        return all(all(torch.equal(a[k], w[k]) for k in a) for w in held)

    def save(self, run_dir, step, extra, keep_last) -> None:
        writers = self.actors if self.cfg.engine.fsdp else self.actors[:1]  # shards: every rank writes its own
        self.ray.get([h.save.remote(run_dir, step, extra, keep_last) for h in writers])

    def load(self, path) -> dict:
        states = self.ray.get([h.load.remote(str(path)) for h in self.actors])
        self._version = states[0]["policy_version"]
        if self.cfg.engine.schedule == "async":
            self._replay = self.ray.get(self.actors[0].older_versions.remote())
        self.sync()
        return states[0]

    def close(self) -> None:
        stream = getattr(self, "stream", None) is not None  # None too when the start failed before it was set
        if stream:  # nothing more is generated or scored; the hosts close beside any call still running
            self.stream.cancel()
        try:
            self.ray.get([(h.close.options(concurrency_group="weights") if stream else h.close).remote()
                          for h in self.hosts], timeout=30)
        except Exception:  # noqa: BLE001 — shutting down; a dead host has nothing left to close
            pass
        pg = getattr(self, "pg", None)
        if getattr(self, "_pool_key", None) is not None and getattr(self, "_started", False):
            # reset, kept with their placement group for the next run on this Ray
            pool.give_back(self.ray, self._pool_key, pg, {self._order[i]: h for i, h in enumerate(self.hosts)})
        else:
            for h in self.hosts:
                self.ray.kill(h)
            placement.release(self.ray, pg)
        self.hosts, self.pg = [], None
        if self._owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
