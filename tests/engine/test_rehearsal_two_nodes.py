"""engine.rehearse=true across two Ray nodes in one machine (ray.cluster_utils.Cluster): the decoupled launchers'
rehearsal (every check of tests/engine/test_rehearsal.py) with cross-node placement, the data-parallel process
group and the weight sync, on declared GPUs; the hosts placed through one placement group with their ranks sorted by
node, and engine.env set in every host's process."""

import pytest

ray = pytest.importorskip("ray")

from gerl.engine import pool  # noqa: E402
from gerl.engine.resources import own_ray_env  # noqa: E402
from tests.engine.test_rehearsal import DECOUPLED, check_rehearsal, rehearse, rows  # noqa: E402


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes on this machine: the head with 1 declared GPU, a second node with 2."""
    from ray.cluster_utils import Cluster

    own_ray_env()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 1})
    cluster.add_node(num_cpus=8, num_gpus=2)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    with pool.kept():
        yield cluster
    ray.shutdown()
    cluster.shutdown()


ENV = "{NCCL_DEBUG: WARN, NCCL_IB_DISABLE: 1}"  # engine.env: read by NCCL on a GPU run, harmless to gloo


def _weights(handles, method: str) -> list[dict]:
    return ray.get([getattr(h, method).remote() for h in handles])


@pytest.mark.parametrize("launcher", DECOUPLED)
def test_two_node_rehearsal(launcher, tmp_path, two_nodes, capfd, monkeypatch):
    """Around every weight sync: before it a rollout holds other weights than actor 0 (there is something to move),
    after it every rollout holds actor 0's exactly, and every data-parallel actor holds them too (the gradient
    all-reduce); one of those exchanges crosses the two nodes, whichever way Ray placed the hosts."""
    import torch

    from gerl.engine.ray_engine import RayEngine

    checks, real_sync = [], RayEngine.sync

    def sync(engine):
        before = _weights(engine.rollouts, "rollout_weights")
        actors = _weights(engine.actors, "actor_weights")
        seconds = real_sync(engine)
        equal = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
        checks.append({"to_move": any(not equal(actors[0], w) for w in before), "rollouts": engine.weights_equal(),
                       "actors": all(equal(actors[0], w) for w in actors[1:])})
        return seconds

    monkeypatch.setattr(RayEngine, "sync", sync)
    rehearse(launcher, tmp_path, f"engine.env={ENV}")
    hosts = check_rehearsal(launcher, tmp_path, capfd.readouterr().err)
    # engine.env reached every host's own process (Ray's runtime_env), on both nodes
    assert all(h["env"] == {"NCCL_DEBUG": "WARN", "NCCL_IB_DISABLE": "1"} for h in hosts), [h["env"] for h in hosts]
    # ranks sorted by node (gerl/engine/placement.py): each node's hosts are consecutive in rank order, and the
    # actor ranks share the node that holds the most hosts (2 of the 3 GPUs are on the second node). Without the
    # placement group Ray put actor 0 on the head node and actor 1 on the other (a2_r1's actors split).
    in_rank_order = [h["node"] for h in hosts]  # placement.json lists actors by rank, then the rollouts
    runs = [n for i, n in enumerate(in_rank_order) if i == 0 or n != in_rank_order[i - 1]]
    assert len(runs) == len(set(runs)), f"a node's hosts are not consecutive in rank order: {in_rank_order}"
    actors = [h["node"] for h in hosts if "actor" in h["roles"]]
    assert len(set(actors)) == 1 and in_rank_order.count(actors[0]) == 2, in_rank_order
    assert len({h["bundle"] for h in hosts}) == len(hosts), "one bundle per host"
    # check_rehearsal: each host on its own (node, GPU), the data-parallel group's backend map, a real first update
    nodes = {h["host"]: h["node"] for h in hosts}
    assert len(set(nodes.values())) == 2, f"the hosts span both nodes: {nodes}"
    assert rows(tmp_path)[2]["policy_lag"] == 1
    # the start-up sync (the rollouts already hold the initial weights), then one after each of the 2 steps
    assert len(checks) == 3 and all(c["rollouts"] and c["actors"] for c in checks), checks
    assert [c["to_move"] for c in checks[1:]] == [True, True], checks
    # actor 0 sends the weights to every rollout, and its gradients meet every other actor's
    exchanges = [("actor0", h) for h in nodes if h != "actor0"]
    assert any(nodes[a] != nodes[b] for a, b in exchanges), f"no exchange crossed the nodes: {nodes}"
