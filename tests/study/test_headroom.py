"""study/headroom.py: the commodity space, node shapes, and headroom as best stock over the bound."""
from megatron_pipemesh.planning.bounds import iteration_lower_bound
from megatron_pipemesh.planning.costs import ClusterSpec
from megatron_pipemesh.planning.topology import GBIT, topology
from megatron_pipemesh.study.headroom import Setting, commodity_space, evaluate, study_row, summary
from megatron_pipemesh.study.rows import GPT, INTRA_NODE_GBPS, row_specs


def cluster_for(setting: Setting) -> ClusterSpec:
    """The study's cluster for ``setting`` (it does not depend on the pipeline size)."""
    return row_specs(study_row(setting, 2))[1]


def test_space_is_the_issues_cross_product():
    """4 models x 3 TP variants x DP 2/4/8 x 2 batches x 3 memories x 4 rates x 2 node shapes."""
    space = commodity_space()
    assert len(space) == 4 * 3 * 3 * 2 * 3 * 4 * 2
    assert {s.gpus_per_node for s in space} == {1, 8} and {s.gbps for s in space} == {6.25, 10.0, 25.0, 50.0}


def test_node_shape_sets_the_data_parallel_rate():
    """DP4 x TP1 inside an 8-GPU server reduces over PCIe; one GPU per VM reduces over its NIC, which it shares
    with the pipeline (fairly, while both send: alone each gets the whole NIC)."""
    server = topology(cluster_for(Setting("GPT-2.7B", 1, False, 4, 64, 24, 6.25, 8)), 4)
    vm = topology(cluster_for(Setting("GPT-2.7B", 1, False, 4, 64, 24, 6.25, 1)), 4)
    assert server.dp_route(1).lone_bytes_per_s == INTRA_NODE_GBPS["commodity"] * GBIT
    assert vm.dp_route(1).lone_bytes_per_s == vm.p2p_route(1, 2).lone_bytes_per_s == 6.25 * GBIT
    nic = {r for r, _ in vm.dp_route(1).demands} & {r for r, _ in vm.p2p_route(1, 2).demands}
    assert [vm.names[r] for r in sorted(nic)] == ["nic-out 1", "d2h 1"]  # staged through host memory


def test_headroom_is_best_stock_over_the_bound():
    """The row's headroom is its best stock time over the bound at its pipeline size, and at least 1."""
    setting = Setting("GPT-1.3B", 1, False, 4, 64, 24, 10.0, 1)
    row = evaluate(setting)
    bound = iteration_lower_bound(GPT["GPT-1.3B"], cluster_for(setting), row["pp"], row["microbatches"])
    assert row["headroom"] == row["best_stock_s"] / bound.seconds >= 1.0
    stats = summary([row, None])
    assert stats["settings"] == 2 and stats["no_stock_fits"] == 1
    assert stats["share_headroom_at_least_1_15"] in (0.0, 1.0)
