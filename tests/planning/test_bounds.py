"""planning/bounds.py: no schedule the simulator runs beats the lower bound, and the bound is tight where it should be."""
import dataclasses

import pytest

from megatron_pipemesh.planning.bounds import iteration_lower_bound
from megatron_pipemesh.planning.costs import ClusterSpec, ModelSpec, analytic_costs
from megatron_pipemesh.planning.simulator import simulate
from megatron_pipemesh.planning.stock import uniform_plan
from megatron_pipemesh.schedule.config import ScheduleConfig

MODEL = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024)


@pytest.mark.parametrize("gbps", [0.5, 5.0, 100.0])
@pytest.mark.parametrize("level", ["none", "full"])
@pytest.mark.parametrize("pp,m", [(2, 8), (4, 4)])
def test_no_schedule_beats_the_bound(gbps, level, pp, m):
    """Depth-first, breadth-first, uniform and uneven groups at every V, with and without recomputation:
    each simulated iteration is at least the bound (a bound that counted an overlap or the pipeline's
    fill and drain twice would fail), and with m > p the closest schedule comes within 30% of it."""
    cluster = ClusterSpec(dp=4, device_tflops=125, dp_gbps=gbps, p2p_gbps=gbps)
    bound = iteration_lower_bound(MODEL, cluster, pp, m)
    closest = float("inf")
    for vpp in [v for v in (1, 2, 4) if (8 // pp) % v == 0]:
        configs = [ScheduleConfig.depth_first(pp, vpp, m), ScheduleConfig.uniform(pp, vpp, m, m)]
        if vpp > 1 and m == 8:
            configs += [ScheduleConfig.uniform(pp, vpp, m, 4), ScheduleConfig(pp, vpp, m, (6, 2), (4, 4))]
        for config in configs:
            costs = analytic_costs(MODEL, cluster, config)
            result = simulate(config, costs, uniform_plan(config, level))
            assert result.iteration_s >= bound.seconds * (1 - 1e-9), (config, result.iteration_s, bound)
            closest = min(closest, result.iteration_s)
    if level == "none" and m > pp:  # m = p leaves a bubble no bound of this kind sees whole
        assert closest <= 1.3 * bound.seconds, (closest, bound)


def test_bottleneck_follows_the_network():
    """Slow data-parallel links make the data-parallel need the bound; fast ones leave compute; the
    best breadth-first schedule at a slow rate lies within 25% of it (the bound is not vacuous)."""
    slow = iteration_lower_bound(MODEL, ClusterSpec(dp=4, device_tflops=125, dp_gbps=0.5, p2p_gbps=0.5), 2, 8)
    fast = iteration_lower_bound(MODEL, ClusterSpec(dp=4, device_tflops=125, dp_gbps=400, p2p_gbps=400), 2, 8)
    assert slow.bottleneck == "data-parallel" and fast.bottleneck == "compute"
    assert slow.seconds > fast.seconds
    cluster = ClusterSpec(dp=4, device_tflops=125, dp_gbps=400, p2p_gbps=400)
    config = ScheduleConfig.uniform(2, 4, 8, 8)
    best = simulate(config, analytic_costs(MODEL, cluster, config)).iteration_s
    assert best <= 1.25 * fast.seconds


def test_intra_node_rate_applies_only_inside_a_node():
    """A data-parallel ring inside one node runs at the intra-node rate; one that leaves keeps the NIC share."""
    inside = ClusterSpec(dp=4, tp=1, dp_gbps=6.25, p2p_gbps=6.25, devices_per_node=8, nic_gbps=50, intra_node_gbps=100)
    across = dataclasses.replace(inside, dp=16)
    plain = dataclasses.replace(inside, intra_node_gbps=None)
    config = ScheduleConfig.depth_first(4, 1, 8)
    assert analytic_costs(MODEL, inside, config).dp_reduce_s * 16 == pytest.approx(
        analytic_costs(MODEL, plain, config).dp_reduce_s)
    assert analytic_costs(MODEL, across, config).dp_reduce_s == pytest.approx(
        analytic_costs(MODEL, dataclasses.replace(across, intra_node_gbps=None), config).dp_reduce_s)
