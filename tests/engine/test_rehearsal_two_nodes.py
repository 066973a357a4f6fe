"""engine.rehearse=true across two Ray nodes in one machine (ray.cluster_utils.Cluster): the decoupled launchers'
rehearsal (every check of tests/engine/test_rehearsal.py) with cross-node placement, the data-parallel process
group and the weight sync, on declared GPUs."""

import pytest

ray = pytest.importorskip("ray")

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
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.parametrize("launcher", DECOUPLED)
def test_two_node_rehearsal(launcher, tmp_path, two_nodes, capfd):
    rehearse(launcher, tmp_path)
    hosts = check_rehearsal(launcher, tmp_path, capfd.readouterr().err)
    # check_rehearsal: each host on its own (node, GPU), the data-parallel group's backend map, a real first update
    nodes = {h["host"]: h["node"] for h in hosts}
    assert len(set(nodes.values())) == 2, f"the hosts span both nodes: {nodes}"
    assert rows(tmp_path)[2]["policy_lag"] == 1
    if sum("actor" in h["roles"] for h in hosts) == 1:
        # the actor's weights reached a rollout on the other node (policy_lag 1 means step 2 trained on them); two
        # data-parallel actors may share a node or not (Ray has done both)
        assert any(nodes[h] != nodes["actor0"] for h in ("rollout0", "rollout1"))
