"""Host ranks sorted by node (gerl/engine/placement.py), on the bundle layouts Ray's PACK strategy gives; the two-node
rehearsal (tests/engine/test_rehearsal_two_nodes.py) checks it on real Ray nodes."""

from gerl.engine.placement import node_sorted, runtime_env


def test_ranks_follow_nodes_the_fullest_node_first():
    # what PACK gave on the two-raylet test cluster (1 GPU on the head, 2 on the other): bundles 0, 1 on B, 2 on A
    assert node_sorted(["B", "B", "A"]) == [0, 1, 2]
    # bundles interleaved over two nodes: ranks 0-3 on A, 4-7 on B, never alternating
    nodes = ["A", "B", "A", "B", "B", "A", "A", "B"]
    order = node_sorted(nodes)
    assert [nodes[b] for b in order] == ["A"] * 4 + ["B"] * 4 and order[:4] == [0, 2, 5, 6]
    # the node with more bundles takes rank 0 (the actor ranks fill it first)
    assert [n for n in (["A", "B", "B"][b] for b in node_sorted(["A", "B", "B"]))] == ["B", "B", "A"]
    assert node_sorted([]) == []


def test_engine_env_travels_as_strings():
    assert runtime_env({}) == {}
    assert runtime_env({"NCCL_IB_DISABLE": 1, "NCCL_DEBUG": "WARN"}) == {
        "runtime_env": {"env_vars": {"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}}}
