"""Mixed sharding model: bytes per parameter per level, scopes, flag parsing, gather/reduce counts, and the
reduce-scatter a ZeRO-2/3 backward waits for in the predicted iteration."""
import pytest

from megatron_pipemesh.planning.costs import ClusterSpec, ModelSpec, analytic_costs
from megatron_pipemesh.planning.sharding import (ShardingError, ShardingSpec, bytes_per_param, chunk_traffic,
                                                 parse_levels, rank_splits, shard_size)
from megatron_pipemesh.schedule.config import ScheduleConfig

ELASTIC = ScheduleConfig(2, 2, 8, (6, 2), (4, 4))


def test_bytes_per_param_by_level():
    """The table of the module docstring: 16-bit weights, fp32 grads, d = s = 4 (a wrong transient fails)."""
    z1 = bytes_per_param("optim", 4, 2, 4)
    assert (z1.weights, z1.grads, z1.optimizer, z1.gathered, z1.grad_buffer) == (2, 4, 3, 0, 0)
    assert z1.resident == 9  # Megatron's 6 + 12/d
    z2 = bytes_per_param("optim_grads", 4, 2, 4)
    assert (z2.weights, z2.grads, z2.optimizer, z2.gathered, z2.grad_buffer) == (2, 1, 3, 0, 4)
    z3 = bytes_per_param("optim_grads_params", 4, 2, 4)
    assert (z3.weights, z3.grads, z3.optimizer, z3.gathered, z3.grad_buffer) == (0.5, 1, 3, 1.5, 4)
    # The weight shard is a slice of the gathered buffer; the gradient shard is an accumulator of its own,
    # held next to the whole buffer while a backward group runs (g/d more than ZeRO-1 at that moment).
    assert z3.resident == 4.5 and z3.peak == z1.peak + 1 == 10


def test_fp32_weights_have_no_main_copy():
    """fp32 models: Megatron's optimizer shard is a view of the weights, so only Adam's 8 bytes are sharded."""
    assert bytes_per_param("optim", 2, 4, 4).resident == 4 + 4 + 8 / 2


def test_analytic_static_bytes_equal_uniform_optim():
    """rank_splits with 'optim' everywhere reproduces the simulator's static bytes (one memory model)."""
    model, cluster = ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=128), ClusterSpec(dp=4)
    splits = rank_splits(model, cluster, ELASTIC, ShardingSpec(("optim", "optim")))
    static = analytic_costs(model, cluster, ELASTIC).static_bytes
    assert [s.state.resident for s in splits] == pytest.approx(list(static))
    mixed = rank_splits(model, cluster, ELASTIC, ShardingSpec(("optim", "optim_grads_params")))
    assert all(m.state.resident < s.state.resident for m, s in zip(mixed, splits))


def test_node_scope_shards_within_the_node():
    """node scope: weights, grads and optimizer state over the DP ranks of a node (8 devices, TP 2 -> 4), as
    Megatron's distributed-optimizer instances."""
    assert shard_size("data-parallel", 16, 2, 8) == 16
    assert shard_size("node", 16, 2, 8) == 4
    assert shard_size("node", 2, 1, 8) == 2
    with pytest.raises(ShardingError, match="multiple"):
        shard_size("node", 6, 1, 4)
    z3 = bytes_per_param("optim_grads_params", 4, 2, 4)
    assert (z3.weights, z3.grads, z3.optimizer) == (0.5, 1, 12 / 4)


def test_gathers_follow_groups():
    """ZeRO-3 chunk 1 on rank 0 of 6 2 / 4 4 is gathered 3 times (merged group spans), ZeRO-1 once;
    depth-first groups of 2 re-gather 5 times; ZeRO-2/3 reduce once per backward group."""
    z3 = chunk_traffic(ELASTIC, 0, 1, "optim_grads_params", 1000, 2, 2, 4, 4)
    assert (z3.gathers, z3.reduces, z3.gather_bytes, z3.reduce_bytes) == (3, 2, 4000, 4000)
    assert z3.sent_bytes() == 0.5 * (3 * 4000 + 2 * 4000)
    z1 = chunk_traffic(ELASTIC, 0, 1, "optim", 1000, 2, 2, 4, 4)
    assert (z1.gathers, z1.reduces) == (1, 1)
    deep = chunk_traffic(ScheduleConfig.depth_first(2, 2, 8), 0, 1, "optim_grads_params", 1000, 2, 2, 4, 4)
    assert (deep.gathers, deep.reduces) == (5, 4)


def test_node_scope_adds_one_cross_node_reduction():
    """Node scope: every level's gathers and reduce-scatters over the s ranks of a node, plus one all-reduce of the
    node shard of the gradients across the d/s nodes per iteration (ZeRO-1 too: Megatron's instances)."""
    t = chunk_traffic(ELASTIC, 0, 1, "optim_grads", 800, 4, 2, 4, 4)
    assert (t.group, t.nodes, t.cross_node_bytes, t.reduces) == (2, 2, 800 * 4 / 2, 2)
    assert t.sent_bytes() == 0.5 * (3200 + 2 * 3200) + 2 * 0.5 * 1600
    z1 = chunk_traffic(ELASTIC, 0, 1, "optim", 800, 4, 2, 4, 4)
    assert (z1.group, z1.cross_node_bytes, z1.gathers, z1.reduces) == (2, 1600, 1, 1)
    assert chunk_traffic(ELASTIC, 0, 1, "optim", 800, 4, 4, 4, 4).cross_node_bytes == 0


@pytest.mark.parametrize("values, vpp, message", [
    (["optim", "optim", "optim"], 2, "one per virtual chunk"),
    (["zero3"], 2, "unknown level"),
    (["auto", "optim"], 2, "stands alone"),
])
def test_parse_errors_name_the_rule(values, vpp, message):
    """Wrong count, unknown level and 'auto' mixed with levels are refused with the rule and an example."""
    with pytest.raises(ShardingError, match=message) as info:
        parse_levels(values, vpp)
    assert "--pipemesh-sharding" in str(info.value) and "Example" in str(info.value)


def test_parse_levels():
    """One level applies to every chunk; levels need the distributed optimizer."""
    assert parse_levels(["optim_grads"], 3) == ("optim_grads",) * 3
    assert parse_levels("optim optim_grads_params", 2) == ("optim", "optim_grads_params")
    assert parse_levels(["auto"], 2) == "auto"
    assert parse_levels(None, 2) is None
    with pytest.raises(ShardingError, match="--use-distributed-optimizer"):
        parse_levels(["optim"], 2, distributed_optimizer=False)


def _sim(levels, config=ELASTIC, dp_gbps=25.0, scope="data-parallel", intra=None):
    from megatron_pipemesh.planning.sharding import ShardingModel
    from megatron_pipemesh.planning.simulator import simulate
    model = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=512)
    cluster = ClusterSpec(dp=4, dp_gbps=dp_gbps)
    costs = analytic_costs(model, cluster, config)
    sharding = None if levels is None else ShardingModel(model, cluster, ShardingSpec(levels, scope, intra))
    return simulate(config, costs, sharding=sharding), costs


def test_simulator_all_optim_equals_plain():
    """'optim' everywhere is Megatron's distributed optimizer: same iteration time and memory as without sharding."""
    plain, _ = _sim(None)
    same, _ = _sim(("optim", "optim"))
    assert same.iteration_s == pytest.approx(plain.iteration_s)
    assert [r.peak_memory_bytes for r in same.ranks] == pytest.approx([r.peak_memory_bytes for r in plain.ranks])


def test_simulator_charges_gathers_and_holds_them_only_during_spans():
    """ZeRO-3 chunk 1: resident bytes drop by its weight shards, the memory timeline rises by its whole weights
    while a span runs, and the data-parallel channel carries one GATHER per span (more exposed time on a slow link)."""
    plain, costs = _sim(("optim", "optim"), dp_gbps=1.0)
    mixed, _ = _sim(("optim", "optim_grads_params"), dp_gbps=1.0)
    gathers = [c for c in mixed.timeline.comms if c.op.kind.value == "GATHER" and c.src == 0]
    assert len(gathers) == 3
    model = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=512)
    params = 2 * model.layer_params()  # chunk 1 of rank 0 = stage 2: two layers, no embedding or head
    assert gathers[0].end - gathers[0].start == pytest.approx(0.75 * params * 2 * 8 / 1e9 + costs.latency_s)
    z3 = bytes_per_param("optim_grads_params", 4, 2, 4)
    resident = mixed.memory[0][0][1]
    assert plain.memory[0][0][1] - resident == pytest.approx(params * (9 - z3.resident))
    # Between spans the timeline sits at resident + activations; the peak includes the gathered weights.
    assert max(b for _, b in mixed.memory[0]) == pytest.approx(mixed.ranks[0].peak_memory_bytes)
    assert mixed.ranks[0].exposed_dp_s > plain.ranks[0].exposed_dp_s


def test_auto_shards_only_when_memory_demands_it():
    """plan auto: with room, ZeRO-1 everywhere (no extra collectives); on a budget that ZeRO-1 cannot meet
    even with full recomputation, a mix that shards some chunk (and it is simulated to fit)."""
    from megatron_pipemesh.planning.planner import NoFeasiblePlan, PlannerOptions, plan_schedule
    from megatron_pipemesh.planning.sharding import plan_with_sharding
    model = ModelSpec(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256, vocab_size=1024)
    # d = 8: the gradient accumulator a ZeRO-2/3 group holds next to the whole buffer (g/d) is small enough
    # that sharding lowers the peak (at d = 4 nothing fits below ZeRO-1's 69.5 MiB).
    cluster = ClusterSpec(dp=8, dp_gbps=100.0)
    costs_for = lambda cfg: analytic_costs(model, cluster, cfg)  # noqa: E731
    options = PlannerOptions()
    roomy, _ = plan_with_sharding(2, 2, 4, costs_for, 64 * 1024 ** 3, model, cluster, options=options)
    assert roomy.sharding.spec.levels == ("optim", "optim")
    budget = 58 * 1024 ** 2  # ZeRO-1 everywhere needs 60 MiB even with full recomputation, a ZeRO-2/3 mix 58
    with pytest.raises(NoFeasiblePlan):
        plan_schedule(2, 2, 4, costs_for, budget, options)
    tight, by_levels = plan_with_sharding(2, 2, 4, costs_for, budget, model, cluster, options=options)
    assert tight.fits and tight.sharding.spec.levels != ("optim", "optim") and by_levels[("optim", "optim")] is None
    assert tight.to_dict()["sharding"] == list(tight.sharding.spec.levels)


def test_node_scope_costs_and_memory_follow_megatrons_instances():
    """Node scope (nodes of 2 of d=4): ZeRO-1's PARAM_SYNC gathers over the node at the intra-node bandwidth, each
    GRAD_SYNC adds the cross-node all-reduce of the node shard, optimizer state and step cover a 1/s shard."""
    from megatron_pipemesh.planning.sharding import ShardedCosts, ShardingModel, chunk_params
    from megatron_pipemesh.schedule.lower import lower
    from megatron_pipemesh.planning.simulator import lowering_for
    model = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=512)
    cluster = ClusterSpec(dp=4, dp_gbps=25.0, devices_per_node=2)
    sharding = ShardingModel(model, cluster, ShardingSpec(("optim", "optim_grads"), "node", 200.0))
    costs = analytic_costs(model, cluster, ELASTIC)
    adapter = sharding.adapter(ELASTIC, costs, {})
    assert isinstance(adapter, ShardedCosts) and adapter.shard == 2
    params = chunk_params(model, cluster, ELASTIC)[0]
    ring = lambda payload, gbps, steps=1: steps * 0.5 * payload * 8 / (gbps * 1e9) + costs.latency_s  # noqa: E731
    ops = {(op.kind.value, op.chunk): op for op in lower(ELASTIC, sharding.lowering(lowering_for(costs))).programs[0]
           if op.kind.value in ("PARAM_SYNC", "GRAD_SYNC", "REDUCE")}
    w, g = model.dtype_bytes, model.grad_bytes
    assert adapter.data_parallel(0, ops[("PARAM_SYNC", 0)]) == pytest.approx(ring(params[0] * w, 200.0))
    for chunk in (0, 1):
        assert adapter.data_parallel(0, ops[("GRAD_SYNC", chunk)]) == pytest.approx(
            ring(params[chunk] * g, 200.0) + ring(params[chunk] * g / 2, 25.0, 2))
    assert adapter.data_parallel(0, ops[("REDUCE", 1)]) == pytest.approx(ring(params[1] * g, 200.0))
    split = sharding.splits(ELASTIC)[0]
    assert split.chunks[0].optimizer == pytest.approx(params[0] * 12 / 2)
    assert sharding.optimizer_seconds([1.0, 3.0]) == [2.0, 6.0]


def test_gloo_reduce_scatter_of_a_zero2_chunk_costs_an_all_reduce():
    """A ZeRO-2 chunk's REDUCE on gloo moves 2(n-1)/n of its gradients (an all-reduce), on NCCL (n-1)/n."""
    from megatron_pipemesh.planning.sharding import ShardingModel
    from megatron_pipemesh.schedule.ops import Op, OpKind

    model = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=512)
    config = ScheduleConfig.depth_first(2, 2, 4)
    spec = ShardingSpec(("optim", "optim_grads"))
    seconds = {}
    for library in ("nccl", "gloo"):
        cluster = ClusterSpec(dp=4, dp_gbps=1.0, collectives=library)
        adapter = ShardingModel(model, cluster, spec).adapter(config, analytic_costs(model, cluster, config), {})
        seconds[library] = adapter.data_parallel(0, Op(OpKind.REDUCE, 1, 0)) - adapter.costs.latency_s
    params = 2 * model.layer_params()  # rank 0's chunk 1 = stage 2: two layers
    assert seconds["nccl"] == pytest.approx(0.75 * params * model.grad_bytes * 8 / 1e9)
    assert seconds["gloo"] == pytest.approx(2 * seconds["nccl"])


def _zero2_with_reduce_of(reduce_s):
    """OpCosts F=1 s, B=2 s, free p2p, and a ZeRO-2 sharding model (p=2, V=1, d=2) whose data-parallel link makes a
    reduce-scatter of the chunk's gradients take ``reduce_s`` on both ranks."""
    from megatron_pipemesh.planning.costs import OpCosts
    from megatron_pipemesh.planning.sharding import ShardingModel, chunk_params

    model = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=8, seq_length=512, position_embedding="rope")
    params = chunk_params(model, ClusterSpec(dp=2), ScheduleConfig(2, 1, 4))
    assert params[0] == params[1]  # embedding on rank 0, untied output layer of the same size on rank 1
    gbps = 0.5 * params[0][0] * model.grad_bytes * 8 / (reduce_s * 1e9)  # NCCL ring over d=2: half the buffer
    sharding = ShardingModel(model, ClusterSpec(dp=2, dp_gbps=gbps), ShardingSpec(("optim_grads",)))
    return OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0), sharding


@pytest.mark.parametrize("reduce_s", [5.0, 3.0])
def test_zero2_plan_with_two_backward_groups_pays_the_reduce_its_backward_waits_for(reduce_s):
    """The runtime's backward of a ZeRO-2/3 chunk waits for the chunk's previous REDUCE (they share the gradient
    buffer), so the plan's predicted iteration includes that wait. p=2 V=1 m=4, backward groups 2 2, F=1 s, B=2 s,
    free p2p, and a data-parallel link slow enough that a reduce-scatter of the chunk takes R (3 or 5 s).
    By hand (tests/schedule/test_timeline.py has the event list for R=5): rank 1 launches REDUCE at 7 (after B1), its
    B2 waits for it until 7+R instead of starting at 8 after F2, and everything after moves by R-1: rank 0 ends
    with its GRAD_SYNC at 14+2R. Without the wait the iteration would end at max(15, 9+R)+R."""
    from megatron_pipemesh.planning.simulator import simulate

    config = ScheduleConfig(2, 1, 4, (2, 2), (2, 2))
    costs, sharding = _zero2_with_reduce_of(reduce_s)
    result = simulate(config, costs, sharding=sharding)
    assert result.iteration_s == pytest.approx(14 + 2 * reduce_s)
    assert result.iteration_s - (max(15, 9 + reduce_s) + reduce_s) == pytest.approx(reduce_s - 1)
    # Rank 1's exposed data-parallel time: the wait before B2 (R-1) and its GRAD_SYNC after the last backward (R).
    assert result.ranks[1].exposed_dp_s == pytest.approx(2 * reduce_s - 1)


def test_planner_ranks_zero2_plans_by_their_reduce_wait():
    """The planner simulates its candidates, so it ranks them with the wait: in the setting above (R = 5 s) two
    backward groups take 14+2R = 24 s, one backward group (no REDUCE: the gradients are reduced once, in
    GRAD_SYNC, after the last backward at 15) takes 15+R = 20 s. Without the wait both were 20 s and the planner
    kept the two groups."""
    from megatron_pipemesh.planning.planner import PlannerOptions, plan_schedule

    costs, sharding = _zero2_with_reduce_of(5.0)
    best, _ = plan_schedule(2, 1, 4, lambda config: costs, float("inf"), PlannerOptions(), sharding=sharding)
    assert best.config.backward_groups == (4,) and best.result.iteration_s == pytest.approx(20.0)
