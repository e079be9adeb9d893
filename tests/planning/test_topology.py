"""planning/topology.py: which resources each transfer of a pipeline replica crosses, with what weight."""
import pytest

from megatron_pipemesh.planning.costs import ClusterSpec
from megatron_pipemesh.planning.network import max_min_rates
from megatron_pipemesh.planning.topology import GBIT, topology


def names(topo, route):
    return {topo.names[r]: w for r, w in route.demands}


def test_eight_gpu_server_holds_two_stages():
    """TP1 DP4 PP4 on 8-GPU servers: stages 0-1 on node 0, 2-3 on node 1. Links inside a node and every
    data-parallel ring run on the devices' intra-node links; links 1->2 and 3->0 leave the node: the stage's 4
    devices share its NIC (weight 4), as the loopback of the interleaved schedule does."""
    topo = topology(ClusterSpec(tp=1, dp=4, devices_per_node=8, nic_gbps=50, intra_node_gbps=100), 4)
    assert names(topo, topo.p2p_route(0, 1)) == {"intra-out 0": 1, "intra-in 1": 1}
    assert names(topo, topo.p2p_route(1, 2)) == {"nic-out 0": 4, "nic-in 1": 4}
    assert names(topo, topo.p2p_route(3, 0)) == {"nic-out 1": 4, "nic-in 0": 4}
    assert names(topo, topo.dp_route(2)) == {"intra-out 2": 1, "intra-in 2": 1}
    assert topo.p2p_route(0, 1).lone_bytes_per_s == 100 * GBIT and topo.p2p_route(1, 2).lone_bytes_per_s == 12.5 * GBIT
    assert topo.inside == {(0, 1), (1, 0), (2, 3), (3, 2)} and topo.tp_gbps == 100


def test_stage_over_two_servers():
    """TP2 DP8: 16 devices per stage on two servers; each server's NIC carries both TP ranks' ring hop out of
    it (weight 2) and its 8 devices' pipeline sends (weight 8); the ring runs at its slowest hop."""
    topo = topology(ClusterSpec(tp=2, dp=8, devices_per_node=8, nic_gbps=50, intra_node_gbps=100), 2)
    assert names(topo, topo.dp_route(0)) == {"nic-out 0": 2, "nic-in 0": 2, "intra-out 0": 1, "intra-in 0": 1}
    assert names(topo, topo.p2p_route(0, 1)) == {"nic-out 0": 8, "nic-in 1": 8}
    assert topo.dp_route(0).lone_bytes_per_s == 25 * GBIT
    # Both at once on nic-out 0 (capacity 50): 10 device flows, 5 Gbit/s each (the old static split's share).
    rates = max_min_rates([topo.dp_route(0).demands, topo.p2p_route(0, 1).demands], topo.capacity)
    assert [r / GBIT for r in rates] == [pytest.approx(5.0), pytest.approx(5.0)]


def test_one_gpu_per_vm_shares_its_nic_and_stages_through_host_memory():
    """One GPU per VM: the data-parallel ring and both pipeline directions leave through the VM's NIC; with
    nic_via_host each also crosses the host link, which the activation copies use."""
    topo = topology(ClusterSpec(tp=1, dp=4, devices_per_node=1, nic_gbps=6.25, nic_via_host=True,
                                host_link_gbps=100), 4)
    assert names(topo, topo.dp_route(1)) == {"nic-out 1": 1, "nic-in 1": 1, "d2h 1": 1, "h2d 1": 1}
    assert names(topo, topo.p2p_route(1, 0)) == {"nic-out 1": 1, "nic-in 0": 1, "d2h 1": 1, "h2d 0": 1}
    assert names(topo, topo.host_route(1, offload=True)) == {"d2h 1": 1}
    # A lone transfer gets the whole NIC; an offload next to the ring keeps what the NIC leaves of the link.
    assert topo.dp_route(1).lone_bytes_per_s == 6.25 * GBIT
    ring, copy = max_min_rates([topo.dp_route(1).demands, topo.host_route(1, True).demands], topo.capacity)
    assert (ring / GBIT, copy / GBIT) == (pytest.approx(6.25), pytest.approx(93.75))


def test_without_a_nic_each_link_is_its_own():
    """nic_gbps None: the data-parallel ring and each pipeline link run on links of their own (nothing shared)."""
    topo = topology(ClusterSpec(tp=1, dp=2, dp_gbps=10, p2p_gbps=20), 2)
    assert names(topo, topo.dp_route(0)) == {"dp 0": 1}
    assert names(topo, topo.p2p_route(0, 1)) == {"p2p 0->1": 1}
    assert topo.p2p_route(1, 0).lone_bytes_per_s == 20 * GBIT and topo.dp_route(1).lone_bytes_per_s == 10 * GBIT


def test_layouts_that_split_stages_unevenly_are_refused():
    with pytest.raises(ValueError, match="one must divide the other"):
        topology(ClusterSpec(tp=1, dp=6, devices_per_node=8, nic_gbps=50), 2)


def test_ranks_sharing_cores_get_cores_fairly_and_a_core_per_process_at_most():
    """PP=2 x DP=2 on one host of 2 cores (4 processes): each pipeline rank's compute stands for its 2 replicas
    (weight 2) on the host's cores and on its own 2 threads. Both stages computing: 2 cores / 4 processes = 0.5
    core each; one stage alone: 1.0 (one thread per process); PP=2, DP=1 on 1 core, both computing: 0.5 each."""
    topo = topology(ClusterSpec(dp=2, devices_per_node=1, nic_gbps=1.0, shared_cores=2), 2)
    assert names(topo, topo.compute_route(0)) == {"cpu cores": 2, "cpu threads 0": 2}
    assert names(topo, topo.compute_route(1)) == {"cpu cores": 2, "cpu threads 1": 2}
    both = max_min_rates([topo.compute_route(0).demands, topo.compute_route(1).demands], topo.capacity)
    assert both == [pytest.approx(0.5), pytest.approx(0.5)]
    assert max_min_rates([topo.compute_route(0).demands], topo.capacity) == [pytest.approx(1.0)]
    assert topo.compute_route(0).lone_bytes_per_s == 1.0  # the network's work is then one-core seconds directly
    one_core = topology(ClusterSpec(devices_per_node=1, nic_gbps=1.0, shared_cores=1), 2)
    assert max_min_rates([one_core.compute_route(r).demands for r in (0, 1)], one_core.capacity) == [
        pytest.approx(0.5), pytest.approx(0.5)]
    # More processes per stage than cores: even alone a stage's processes share the cores.
    crowded = topology(ClusterSpec(dp=4, devices_per_node=1, nic_gbps=1.0, shared_cores=2), 2)
    assert crowded.compute_route(0).lone_bytes_per_s == 0.5
    assert "cpu cores: 2 cores" in topo.describe().splitlines()
    # Without shared cores every rank computes on a device of its own.
    assert topology(ClusterSpec(dp=2, devices_per_node=1, nic_gbps=1.0), 2).compute_route(0) is None


def test_pinned_ranks_share_the_core_of_their_pipeline_rank_only():
    """--pin-cores: PP=4 x DP=2 on 2 cores pins pipeline ranks 0 and 2 to core 0, 1 and 3 to core 1; a stage's two
    replicas share their core (0.5 each alone); ranks 0 and 2 computing at once get 0.25 each, and rank 1 keeps
    its own core's 0.5."""
    topo = topology(ClusterSpec(dp=2, devices_per_node=1, nic_gbps=1.0, shared_cores=2, pinned_cores=True), 4)
    assert [names(topo, topo.compute_route(r)) for r in range(4)] == [
        {"cpu core 0": 2}, {"cpu core 1": 2}, {"cpu core 0": 2}, {"cpu core 1": 2}]
    assert topo.compute_route(0).lone_bytes_per_s == 0.5
    rates = max_min_rates([topo.compute_route(r).demands for r in (0, 2, 1)], topo.capacity)
    assert rates == [pytest.approx(0.25), pytest.approx(0.25), pytest.approx(0.5)]


@pytest.mark.parametrize("fields,message", [({"shared_cores": 0}, "shared_cores=0 is invalid"),
                                            ({"shared_cores": 1.5}, "whole number"),
                                            ({"pinned_cores": True}, "needs shared_cores")])
def test_shared_cores_must_be_a_count(fields, message):
    with pytest.raises(ValueError, match=message):
        ClusterSpec(**fields)
