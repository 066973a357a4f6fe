"""Idle Ray hosts kept for the next run on the same Ray, so that a driver that starts many runs — a test suite, a
sweep from one Python process — pays a host's start-up (a Ray worker, then torch, diffusers and transformers
imported: ~7 s of CPU each on this project's machine) once per host, not once per run.

Off unless `enable()` is called. Only a Ray the runs do not own can keep hosts between them (a run that started Ray
stops it). A host goes back to the pool only after `Host.reset` has made it what a fresh one is — process group
left, roles and models dropped, torch's global generator, thread count and CPU affinity as the process started — and
is killed instead when the reset fails or does not answer. A deterministic run (train.deterministic) neither takes
nor leaves pooled hosts: the settings it makes in its processes are not undone. Python modules stay imported in a
kept host, so a reward module's globals carry over from the run before: keep per-run state in a reward class's
instance (each run makes its own). On a GPU the reset frees the cached memory and restarts the peak count; on the CPU
a host's peak memory is its process's peak resident size, which no reset can lower, so a kept host reports the
largest of its runs.

A kept host still holds the Ray resources it asked for, inside its run's placement group (gerl/engine/placement.py),
which is kept with it: the next run of the same key takes both, each host back in its own bundle, and starts fresh
hosts in the bundles whose host was not kept. Whatever starts on this Ray through gerl first evicts the kept hosts it
does not reuse and their placement group (`take`, `evict`), and a pooled run asks for exactly the resources a fresh
one would.
"""

from __future__ import annotations

import contextlib

_enabled = False
_idle: dict[tuple, tuple] = {}  # key → (placement group, {bundle index: idle host handle})


def enable() -> None:
    global _enabled
    _enabled = True


def disable(ray=None) -> None:
    """Stop keeping hosts; kill the idle ones (before the Ray they live on is shut down)."""
    global _enabled
    _enabled = False
    evict(ray)


@contextlib.contextmanager
def kept():
    """Within: runs on the Ray that is up keep their hosts for the next run (e.g. a sweep: `with pool.kept(): for
    lr in ...: train(cfg)`); on leaving, the idle ones are killed."""
    enable()
    try:
        yield
    finally:
        disable()


def key(ray, cfg, options: dict, concurrency: bool, hosts: int) -> tuple | None:
    """The pool a run's hosts come from and go back to (None: this run does not use the pool): the Ray cluster
    (its node), the resources each host asks for and the environment it gets (engine.env), whether hosts have the
    stream's concurrency groups, and how many hosts the placement group holds."""
    if not _enabled or cfg.train.deterministic:
        return None
    node = ray.get_runtime_context().get_node_id()
    return (node, tuple(sorted((k, repr(v)) for k, v in options.items())), concurrency, hosts)


def take(ray, pool_key: tuple | None) -> tuple:
    """(placement group, {bundle: idle host}) kept under `pool_key`, or (None, {}); every other idle host is killed
    and its placement group removed, so their resources are free for this run."""
    unit = _idle.pop(pool_key, None) if pool_key is not None else None
    evict(ray)
    return unit or (None, {})


def give_back(ray, pool_key: tuple, pg, hosts: dict[int, object], timeout_s: float = 30.0) -> int:
    """Reset each host (after its roles closed) and keep those whose reset answered, with the placement group they
    live in; kill the rest. Returns how many were kept."""
    refs = {}
    for b, h in hosts.items():
        try:
            refs[b] = h.reset.remote()
        except Exception:  # noqa: BLE001 — a dead handle
            refs[b] = None
    kept = {}
    for b, h in hosts.items():
        try:
            ok = refs[b] is not None and ray.get(refs[b], timeout=timeout_s)
        except Exception:  # noqa: BLE001 — died, or did not answer: never reused
            ok = False
        if ok:
            kept[b] = h
        else:
            _kill(ray, [h])
    if not kept:
        _release(ray, pg)
        return 0
    if pool_key in _idle:  # one unit per key: an older one is let go
        old_pg, old = _idle.pop(pool_key)
        _kill(ray, list(old.values()))
        _release(ray, old_pg)
    _idle[pool_key] = (pg, kept)
    return len(kept)


def evict(ray=None) -> None:
    """Kill every idle host and remove its placement group (a run about to start that does not reuse them, or Ray
    about to stop)."""
    units = list(_idle.values())
    _idle.clear()
    if ray is None:
        import ray
    if ray.is_initialized():
        for pg, hosts in units:
            _kill(ray, list(hosts.values()))
            _release(ray, pg)


def idle() -> int:
    return sum(len(hs) for _, hs in _idle.values())


def _release(ray, pg) -> None:
    from gerl.engine.placement import release

    release(ray, pg)


def _kill(ray, hosts: list) -> None:
    for h in hosts:
        try:
            ray.kill(h)
        except Exception:  # noqa: BLE001 — already gone
            pass
