"""What the Ray engine's hosts ask of the cluster, checked before any host starts, and a bounded wait for them.

Each host asks for `engine.gpus_per_worker` GPUs (on a GPU layout) and `host_cpus(cfg)` CPUs. Ray places an actor
only where one node has all it asks for; one that fits nowhere stays pending forever and `ray.get` on it never
returns. So the totals *and* a per-node packing are checked up front, and the set-up wait has a deadline whose
message names the host that did not start and why.
"""

from __future__ import annotations

import math
import os
import time

from gerl.config import gpu_topology, host_cpus
from gerl.errors import UserError


def host_request(cfg) -> dict[str, float]:
    """Ray resources one host asks for: {"CPU": n} or {"CPU": n, "GPU": share}."""
    req = {"CPU": float(host_cpus(cfg))}
    if gpu_topology(cfg):
        req["GPU"] = cfg.engine.gpus_per_worker
    return req


def host_names(cfg) -> list[str]:
    g = cfg.engine
    if g.hybrid:
        return [f"hybrid{i}" for i in range(g.actor_workers)]
    return [f"actor{i}" for i in range(g.actor_workers)] + [f"rollout{j}" for j in range(g.rollout_workers)]


def describe(req: dict[str, float]) -> str:
    return " + ".join(f"{v:g} {k}" + ("s" if v != 1 else "") for k, v in sorted(req.items(), reverse=True))


# The environment of a Ray that gerl starts itself (read by its raylet when it starts): no auth token on a private
# local cluster, and worker processes at the normal priority. Ray nices its workers to 15 by default, and gerl's
# hosts are the run's whole work: at 15 any other busy process on the machine (a reward server, a data loader, the
# test suite's other process) takes their CPU first. Measured: a Ray test beside two busy processes took 98 s at
# Ray's default and 17 s at 0 (9 s alone). A user's own setting wins.
OWN_RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}


def own_ray_env() -> None:
    """Call before ray.init starts a local Ray (gerl's engine, its reward pool, the tests' clusters)."""
    for var, value in OWN_RAY_ENV.items():
        os.environ.setdefault(var, value)


def rehearsal_init_args(cfg) -> dict:
    """ray.init arguments of a rehearsal: declare exactly the GPUs and CPUs the config's hosts ask for."""
    req, n = host_request(cfg), len(host_names(cfg))
    return {"num_gpus": math.ceil(n * req["GPU"] - 1e-9), "num_cpus": math.ceil(n * req["CPU"])}


def check_fits(cfg, nodes: list[dict[str, float]]) -> None:
    """UserError unless every host fits: the cluster's totals, then first-fit of the hosts onto the nodes'
    resources (Ray never splits one actor's request across nodes)."""
    req, names = host_request(cfg), host_names(cfg)
    g = cfg.engine
    layout = f"{g.actor_workers} colocated" if g.hybrid else f"{g.actor_workers} actor + {g.rollout_workers} rollout"
    for k, v in req.items():
        need, have = v * len(names), sum(n.get(k, 0.0) for n in nodes)
        if need > have + 1e-9:
            key = "gpus_per_worker" if k == "GPU" else "cpus_per_worker"
            auto = " (0 = auto: 4 per GPU host)" if k == "CPU" and not g.cpus_per_worker else ""
            raise UserError(f"engine asks for {need:g} {k}s ({layout} hosts × {v:g} engine.{key}{auto}) but the Ray "
                            f"cluster has {have:g}; lower engine.actor_workers/rollout_workers/{key} or add nodes")
    free = [dict(n) for n in nodes]
    for name in names:
        node = next((n for n in free if all(n.get(k, 0.0) + 1e-9 >= v for k, v in req.items())), None)
        if node is None:
            biggest = ", ".join(describe({k: n.get(k, 0.0) for k in req}) for n in free)
            raise UserError(f"host {name} asks for {describe(req)} on one node, and no node has that left (free per "
                            f"node after the hosts before it: {biggest}); lower engine.cpus_per_worker or "
                            "gpus_per_worker, or add a larger node")
        for k, v in req.items():
            node[k] -= v


def node_resources(ray) -> list[dict[str, float]]:
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


def wait_for_setup(ray, refs: list, names: list[str], req: dict[str, float], timeout_s: float) -> list:
    """ray.get the hosts' setup calls, but give up after timeout_s with a message naming each host that did not
    start and whether Ray could not place it (too few free resources) or it is still loading its model."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        ray.get(done)  # a host whose set-up raised is reported at once, not after the others' deadline
    if pending:
        late = [names[refs.index(r)] for r in pending]
        avail = ray.available_resources()
        placed = all(avail.get(k, 0.0) + 1e-9 >= v for k, v in req.items())
        why = ("Ray has the resources free, so it is most likely still loading the model (a slow disk or a hub "
               "download): raise engine.setup_timeout_s" if placed else
               f"Ray could not place it: it asks for {describe(req)} and the cluster has only "
               f"{describe({k: avail.get(k, 0.0) for k in req})} free (another job, or a node that left?)")
        raise UserError(f"host{'s' if len(late) > 1 else ''} {', '.join(late)} did not start within "
                        f"engine.setup_timeout_s={timeout_s:g} s: {why}")
    return ray.get(refs)
