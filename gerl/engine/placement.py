"""Where the Ray engine's hosts go: one placement group, one bundle per host, and host ranks sorted by node.

A placement group reserves every host's resources at once (or none: a run never starts half its hosts and waits on the
rest), with Ray's PACK strategy: as few nodes as the bundles fit on. Ray decides which bundle lands on which node; the
engine then gives the hosts their ranks in node order (`node_sorted`): the node holding the most bundles first, so
actor ranks 0 … k−1 share a node, k … on the next. Data-parallel neighbours are then on one node wherever they can be,
and NCCL's rings and trees cross the network between nodes only once per boundary, not at every other rank.

`engine.env` reaches every host through Ray's runtime_env (`runtime_env`): NCCL and InfiniBand variables
(NCCL_SOCKET_IFNAME, NCCL_IB_HCA, …) are read by NCCL when the process group starts, in the host's own process,
so setting them in the driver alone would change nothing on another node.
"""

from __future__ import annotations

from gerl.errors import UserError


def node_sorted(bundle_nodes: list[str]) -> list[int]:
    """Bundle indices in rank order: grouped by node, the node with the most bundles first (ties: the node of the
    lower bundle index), bundle index order within a node. `bundle_nodes[i]` is bundle i's node id."""
    count: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, n in enumerate(bundle_nodes):
        count[n] = count.get(n, 0) + 1
        first.setdefault(n, i)
    order = sorted(count, key=lambda n: (-count[n], first[n]))
    rank_of_node = {n: r for r, n in enumerate(order)}
    return sorted(range(len(bundle_nodes)), key=lambda i: (rank_of_node[bundle_nodes[i]], i))


def reserve(ray, request: dict[str, float], n: int, timeout_s: float):
    """A placement group of n bundles of `request` (PACK), ready within timeout_s, else a UserError saying what the
    cluster had free."""
    from ray.util import placement_group

    bundle = {k: v for k, v in request.items() if v}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        from gerl.engine.resources import describe

        free = describe({k: ray.available_resources().get(k, 0.0) for k in bundle})
        release(ray, pg)
        raise UserError(f"Ray could not reserve {n} hosts × {describe(bundle)} within engine.setup_timeout_s="
                        f"{timeout_s:g} s (free now: {free}; another job holds them, or a node left?)") from None
    return pg


def bundle_nodes(pg) -> list[str]:
    """The node id of each bundle of a ready placement group."""
    from ray.util import placement_group_table

    table = placement_group_table(pg)["bundles_to_node_id"]
    return [table[i] for i in range(len(table))]


def strategy(pg, bundle: int) -> dict:
    """Ray actor options that place an actor in bundle `bundle` of `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=False)}


def runtime_env(env: dict[str, str]) -> dict:
    """Ray actor options that set `env` (engine.env) in a host's process before it imports anything."""
    return {"runtime_env": {"env_vars": {str(k): str(v) for k, v in env.items()}}} if env else {}


def release(ray, pg) -> None:
    """Give the placement group's resources back (its actors, if any are left, are killed with it)."""
    if pg is None:
        return
    try:
        from ray.util import remove_placement_group

        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 — Ray shutting down, or already removed
        pass
