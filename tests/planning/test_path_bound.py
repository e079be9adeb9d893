"""planning/path_bound.py: the critical path of a fixed-order schedule never exceeds its simulated iteration (shared
NICs, token buckets, data parallelism with and without overlap, host copies, recomputation per micro-batch, shared
CPU cores, ZeRO-3, Megatron's own p2p), equals it where nothing is shared or waited on, and is close on a real layout."""
import random

import pytest

from megatron_pipemesh.planning.costs import ClusterSpec, ModelSpec, OpCosts, analytic_costs, planning_levels
from megatron_pipemesh.planning.layout import LayerSplit
from megatron_pipemesh.planning.sharding import ShardingModel, ShardingSpec
from megatron_pipemesh.planning.simulator import lower_bound, megatron_lowering, megatron_schedule, simulate
from megatron_pipemesh.schedule import ScheduleConfig

ONE_BYTE = {"none": 1.0, "selective": 1.0, "full": 1.0}


def _configs(pp, vpp, m):
    out = [ScheduleConfig.depth_first(pp, vpp, m), ScheduleConfig.breadth_first(pp, vpp, m)]
    if vpp > 1 and m >= 2 * pp and m % pp == 0:  # elastic: a larger first forward group
        out.append(ScheduleConfig(pp, vpp, m, (2 * pp,) + (pp,) * ((m - 2 * pp) // pp), (pp,) * (m // pp)))
    return out


CLUSTERS = {
    "shared NIC": dict(dp=2, devices_per_node=2, nic_gbps=5.0, dp_gbps=5, p2p_gbps=5),
    "token bucket": dict(dp=2, devices_per_node=1, nic_gbps=2.0, nic_burst_bytes=256 * 1024),
    "no overlap": dict(dp=4, dp_gbps=3, p2p_gbps=20, overlap_grad_reduce=False, overlap_param_gather=False),
    "per-device links": dict(dp=2, dp_gbps=1, p2p_gbps=2, intra_node_gbps=50, devices_per_node=4),
    "shared cores": dict(dp=2, devices_per_node=1, nic_gbps=100.0, shared_cores=2, host_copies_on_compute=True),
    "pinned cores": dict(dp=2, devices_per_node=1, nic_gbps=100.0, shared_cores=2, pinned_cores=True),
}


@pytest.mark.parametrize("name", sorted(CLUSTERS))
@pytest.mark.parametrize("pp,vpp,m,tied", [(2, 2, 4, True), (4, 2, 8, False), (3, 1, 6, True), (4, 3, 12, True),
                                           (1, 1, 4, True)])
def test_the_path_never_exceeds_the_simulation(name, pp, vpp, m, tied):
    """Random recomputation and host placement per chunk-micro-batch, PipeMesh's lowering and Megatron's: the path is
    at most the simulated iteration (to rounding). A rule of the engine the path read wrongly (a transfer faster than
    alone, a gather or reduction overlapping its channel's other work, a step before the last collective) fails."""
    rng = random.Random(f"{name}{pp}{vpp}{m}")
    model = ModelSpec(num_layers=pp * vpp * 2, hidden_size=512, num_attention_heads=8, seq_length=512,
                      vocab_size=8192, tied_embeddings=tied)
    cluster = ClusterSpec(tp=1, device_tflops=20, **CLUSTERS[name])
    levels = ("none", "selective", "full", "host")
    for config in _configs(pp, vpp, m):
        costs = analytic_costs(model, cluster, config, planning_levels(model))
        plans = [None, {(r, c, j): rng.choice(levels) for r in range(pp) for c in range(vpp) for j in range(m)}]
        for plan in plans:
            simulated = simulate(config, costs, plan).iteration_s
            assert 0 < lower_bound(config, costs, plan) <= simulated * (1 + 1e-12), (config.describe(), plan)
        uniform = {(r, c, j): "selective" for r in range(pp) for c in range(vpp) for j in range(m)}
        stock = megatron_schedule(config, costs)
        simulated = simulate(config, costs, uniform, stock).iteration_s
        assert 0 < lower_bound(config, costs, uniform, options=megatron_lowering(costs, config)) <= \
            simulated * (1 + 1e-12)


def test_the_path_bounds_zero3_sharding():
    """ZeRO-3 on one chunk (gathers per span, reductions per group): its waits only lengthen the path's schedule."""
    model = ModelSpec(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=512, vocab_size=8192)
    cluster = ClusterSpec(dp=4, dp_gbps=2, p2p_gbps=10, device_tflops=20)
    config = ScheduleConfig.breadth_first(2, 2, 8)
    costs = analytic_costs(model, cluster, config)
    sharding = ShardingModel(model, cluster, ShardingSpec(("optim_grads_params", "optim")))
    simulated = simulate(config, costs, sharding=sharding).iteration_s
    assert 0 < lower_bound(config, costs, sharding=sharding) <= simulated * (1 + 1e-12)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 3, 12), (3, 1, 7)])
def test_without_shared_links_or_collectives_the_path_is_the_simulation(pp, vpp, m):
    """Transfers on links of their own, no data parallelism: the engine's iteration is the critical path itself, so
    the bound equals it (a bound that dropped a dependency, or a transfer's latency, would fall below it)."""
    costs = OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.3, latency_s=0.05, activation_bytes=dict(ONE_BYTE),
                    first_stage_extra_s=0.2, last_stage_extra_s=0.7, optimizer_s=tuple(0.1 * r for r in range(pp)))
    for config in _configs(pp, vpp, m):
        assert lower_bound(config, costs) == pytest.approx(simulate(config, costs).iteration_s, rel=1e-12)


def test_the_path_is_within_a_few_percent_on_an_uneven_layout():
    """A GPT over 8 nodes' NICs with an uneven split and tied embeddings: the path is a tight bound (above 90% of the
    simulation), far above the bound of any schedule (planning/bounds.py), which the layout search sorts by."""
    from megatron_pipemesh.planning.bounds import bound_for
    from megatron_pipemesh.planning.costs import ScheduleCosts

    model = ModelSpec(num_layers=14, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50257,
                      layer_split=LayerSplit.of_stages((1, 2, 2, 2, 2, 2, 2, 1)))
    cluster = ClusterSpec(tp=1, dp=2, devices_per_node=2, nic_gbps=25.0, device_tflops=125)
    config = ScheduleConfig.breadth_first(4, 2, 16)
    costs = analytic_costs(model, cluster, config)
    simulated = simulate(config, costs).iteration_s
    path = lower_bound(config, costs)
    assert 0.9 * simulated < path <= simulated * (1 + 1e-12)
    assert path > bound_for(config, ScheduleCosts(config, costs)).seconds
