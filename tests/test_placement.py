from pipeplan.planner.dp import StageNode
from pipeplan.planner.placement import flatten
from pipeplan.topology import preset


def test_hierarchical_placement_keeps_replicas_inside_servers():
    topo = preset("cluster-a")  # 4 servers x 4 devices, ranks innermost first
    inner_a = (StageNode(1, 0, 2, 2), StageNode(1, 2, 3, 2))  # 2 + 2 devices in a server
    inner_b = (StageNode(1, 3, 5, 4),)
    tree = (StageNode(2, 0, 3, 3, inner_a), StageNode(2, 3, 5, 1, inner_b))
    flat = flatten(tree, topo)
    assert [(s.start, s.end) for s in flat] == [(0, 2), (2, 3), (3, 5)]
    assert flat[0].ranks == (0, 1, 4, 5, 8, 9)
    assert flat[1].ranks == (2, 3, 6, 7, 10, 11)
    assert flat[2].ranks == (12, 13, 14, 15)
    assert sorted(r for s in flat for r in s.ranks) == list(range(16))
