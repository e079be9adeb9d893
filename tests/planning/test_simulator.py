"""Planning layer: simulator end points (paper claims), worked examples, accounting identities,
analytic cost model sanity, Chrome trace and PNG plot."""
import dataclasses
import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pipemesh.planning.costs import ClusterSpec, ModelSpec, OpCosts, analytic_costs
from megatron_pipemesh.planning.simulator import simulate
from megatron_pipemesh.planning.trace import trace_events, write_trace
from megatron_pipemesh.schedule import ScheduleConfig

MS = 1e-3
ONE_BYTE = {"none": 1.0, "selective": 1.0, "full": 1.0}


def costly_dp() -> OpCosts:
    """Commodity-cloud shape: DP collectives far slower than a chunk's compute."""
    return OpCosts(forward_s=1 * MS, backward_s=2 * MS, p2p_s=0.01 * MS, dp_reduce_s=20 * MS,
                   dp_gather_s=20 * MS, activation_bytes=dict(ONE_BYTE))


def free_comm() -> OpCosts:
    """Textbook setting: F = 1, B = 2, communication free."""
    return OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0, activation_bytes=dict(ONE_BYTE))


def mean_exposed_dp(result) -> float:
    return sum(r.exposed_dp_s for r in result.ranks) / len(result.ranks)


def peak_activation(result) -> float:
    return max(r.peak_activation_bytes for r in result.ranks)


# ---------------------------------------------------------------------------------------------
# The two end points (paper, section 1 / paper-notes section 3)


@pytest.mark.parametrize("pp,vpp,m", [(4, 2, 8), (4, 2, 16), (4, 4, 12), (2, 2, 4), (3, 3, 9), (2, 4, 8)])
def test_breadth_first_hides_dp_but_holds_more_memory(pp, vpp, m):
    """With costly DP, breadth-first exposes less DP communication and holds more activations."""
    depth = simulate(ScheduleConfig.depth_first(pp, vpp, m), costly_dp())
    breadth = simulate(ScheduleConfig.breadth_first(pp, vpp, m), costly_dp())
    assert mean_exposed_dp(breadth) < mean_exposed_dp(depth)
    assert peak_activation(breadth) > peak_activation(depth)
    assert breadth.iteration_s < depth.iteration_s


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 5), st.integers(2, 4), st.integers(2, 4))
def test_end_points_random(pp, vpp, k):
    """Same claim over random p, V and m = k*p >= 2p."""
    m = k * pp
    depth = simulate(ScheduleConfig.depth_first(pp, vpp, m), costly_dp())
    breadth = simulate(ScheduleConfig.breadth_first(pp, vpp, m), costly_dp())
    assert mean_exposed_dp(breadth) < mean_exposed_dp(depth)
    assert peak_activation(breadth) > peak_activation(depth)


# ---------------------------------------------------------------------------------------------
# Worked examples (paper-notes section 7, zero communication, F = 1, B = 2)


@pytest.mark.parametrize("cfg,makespan,peak_live", [
    (ScheduleConfig.depth_first(4, 2, 8), 57.0, [11, 9, 7, 5]),
    (ScheduleConfig.depth_first(4, 2, 12), 81.0, [11, 9, 7, 5]),
    (ScheduleConfig(4, 2, 12, (8, 4), (6, 6)), 81.0, [15, 13, 11, 9]),
    (ScheduleConfig.breadth_first(4, 2, 8), 57.0, None),
    (ScheduleConfig.breadth_first(4, 2, 12), 81.0, None),
], ids=["df-m8", "df-m12", "8-4/6-6", "bf-m8", "bf-m12"])
def test_worked_examples(cfg, makespan, peak_live):
    """Makespans (57 for DF m=8, 81 for `8 4 / 6 6` m=12) and peak live chunk-micro-batches per rank."""
    result = simulate(cfg, free_comm())
    assert result.iteration_s == pytest.approx(makespan)
    if peak_live is not None:
        assert [r.peak_live for r in result.ranks] == peak_live
    for r in result.ranks:
        assert r.exposed_p2p_s == pytest.approx(0.0) and r.exposed_dp_s == pytest.approx(0.0)
        assert r.busy_s == pytest.approx(3.0 * cfg.microbatches * cfg.vpp)


# ---------------------------------------------------------------------------------------------
# Accounting identities


def _groups(draw, m, pp, limits=None):
    """Random partition of m into parts >= p whose prefix sums stay within ``limits``."""
    groups, done = [], 0
    while done < m:
        rest = m - done
        cap = rest if limits is None else min(rest, (limits[len(groups)] if len(groups) < len(limits) else m) - done)
        size = draw(st.sampled_from([g for g in range(pp, cap + 1) if rest - g == 0 or rest - g >= pp]))
        groups.append(size)
        done += size
    return tuple(groups)


@st.composite
def cases(draw):
    """A random valid config (depth-first, breadth-first or elastic) with random costs."""
    pp = draw(st.integers(2, 5))
    vpp = draw(st.integers(1, 4))
    m = draw(st.integers(pp, 3 * pp))
    forward = _groups(draw, m, pp)
    backward = _groups(draw, m, pp, [sum(forward[:i + 1]) for i in range(len(forward))])
    cfg = ScheduleConfig(pp, vpp, m, forward, backward)
    time = st.floats(0.0, 5.0, allow_nan=False)
    costs = OpCosts(forward_s=draw(st.floats(0.1, 2.0)), backward_s=draw(st.floats(0.1, 4.0)), p2p_s=draw(time),
                    dp_reduce_s=draw(st.floats(0.0, 30.0)), dp_gather_s=draw(st.floats(0.0, 30.0)),
                    latency_s=draw(time), first_stage_extra_s=draw(time), last_stage_extra_s=draw(time),
                    activation_bytes=dict(ONE_BYTE), static_bytes=tuple(float(r) for r in range(pp)))
    return cfg, costs


@settings(max_examples=80, deadline=None)
@given(cases())
def test_time_accounting(case):
    """Per rank: busy + idle == iteration time; exposed p2p + exposed DP + bubble == idle; none negative."""
    cfg, costs = case
    result = simulate(cfg, costs)
    for r in result.ranks:
        assert r.busy_s + r.idle_s == pytest.approx(result.iteration_s)
        assert r.exposed_p2p_s + r.exposed_dp_s + r.bubble_s == pytest.approx(r.idle_s, abs=1e-9)
        assert min(r.exposed_p2p_s, r.exposed_dp_s, r.bubble_s, r.idle_s) >= -1e-9
        assert r.peak_memory_bytes == pytest.approx(costs.static_bytes[r.rank] + r.peak_activation_bytes)
    assert 0.0 <= result.idle_fraction < 1.0
    assert result.iteration_s == pytest.approx(result.timeline.makespan)
    json.dumps(result.to_dict())


def test_recompute_adds_backward_time():
    """A recompute plan adds its per-level time to the chosen backwards and shrinks their activations."""
    cfg = ScheduleConfig.depth_first(2, 2, 4)
    costs = OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0, activation_bytes={"none": 4.0, "selective": 2.0, "full": 1.0},
                    recompute_s={"none": 0.0, "selective": 0.25, "full": 1.0})
    plain = simulate(cfg, costs)
    one = simulate(cfg, costs, placement={(0, 0, 0): "full", (0, 1, 1): "selective"})
    assert one.ranks[0].recompute_s == pytest.approx(1.25)
    assert one.ranks[0].busy_s == pytest.approx(plain.ranks[0].busy_s + 1.25)
    assert one.ranks[1].recompute_s == 0.0 and one.ranks[1].busy_s == pytest.approx(plain.ranks[1].busy_s)
    everything = simulate(cfg, costs, placement={(0, c, j): "full" for c in range(2) for j in range(4)})
    assert everything.ranks[0].recompute_s == pytest.approx(8.0)
    assert plain.ranks[0].peak_activation_bytes == pytest.approx(4.0 * plain.ranks[0].peak_live)
    assert everything.ranks[0].peak_activation_bytes == pytest.approx(1.0 * everything.ranks[0].peak_live)


# ---------------------------------------------------------------------------------------------
# Analytic costs


MODEL = ModelSpec(num_layers=16, hidden_size=1024, num_attention_heads=16, seq_length=1024)
DF = ScheduleConfig.depth_first(4, 2, 8)


def test_analytic_costs_positive():
    """Compute, transfer and DP times are positive; backward = 2 x forward; the head is on the last stage."""
    costs = analytic_costs(MODEL, ClusterSpec(dp=4), DF)
    assert costs.forward_s > 0 and costs.p2p_s > 0 and costs.latency_s > 0
    assert costs.backward_s == pytest.approx(2 * costs.forward_s)
    assert costs.dp_reduce_s > 0 and costs.dp_gather_s > 0
    assert costs.last_stage_extra_s > 0
    assert len(costs.static_bytes) == DF.pp and all(b > 0 for b in costs.static_bytes)
    assert all(v >= 0 for v in costs.recompute_s.values())
    assert costs.recompute_s["full"] == pytest.approx(costs.forward_s)


def test_analytic_costs_dp_modes():
    """dp=1: no DP traffic; without the distributed optimizer gradients are all-reduced and nothing is gathered."""
    single = analytic_costs(MODEL, ClusterSpec(dp=1), DF)
    assert single.dp_reduce_s == 0 and single.dp_gather_s == 0
    plain = analytic_costs(MODEL, ClusterSpec(dp=4, distributed_optimizer=False), DF)
    dist = analytic_costs(MODEL, ClusterSpec(dp=4, distributed_optimizer=True), DF)
    assert plain.dp_gather_s == 0 and plain.dp_reduce_s > dist.dp_reduce_s > 0
    slow = analytic_costs(MODEL, ClusterSpec(dp=4, dp_gbps=10.0), DF)
    assert slow.dp_reduce_s > dist.dp_reduce_s


def test_static_bytes_shrink_with_distributed_optimizer():
    """With the distributed optimizer the static bytes of every rank decrease as dp grows."""
    per_dp = [analytic_costs(MODEL, ClusterSpec(dp=d, distributed_optimizer=True), DF).static_bytes for d in (1, 2, 4, 8)]
    for rank in range(DF.pp):
        values = [static[rank] for static in per_dp]
        assert values == sorted(values, reverse=True) and len(set(values)) == len(values), values
    replicated = [analytic_costs(MODEL, ClusterSpec(dp=d, distributed_optimizer=False), DF).static_bytes for d in (1, 8)]
    assert replicated[0] == replicated[1]


def test_activation_bytes_by_recompute_level():
    """Activation bytes: none > selective > full; sequence parallel divides them by TP."""
    costs = analytic_costs(MODEL, ClusterSpec(dp=2), DF)
    act = costs.activation_bytes
    assert act["none"] > act["selective"] > act["full"] > 0
    sp = analytic_costs(MODEL, ClusterSpec(dp=2, tp=2, sequence_parallel=True), DF).activation_bytes
    assert sp["selective"] == pytest.approx(act["selective"] / 2, rel=0.02)  # the s*s mask is not split


@pytest.mark.parametrize("layers", [10, 12, 20])
def test_layers_must_split_over_stages(layers):
    """num_layers not divisible by p*V raises ValueError naming --num-layers."""
    model = ModelSpec(num_layers=layers, hidden_size=256, num_attention_heads=4, seq_length=128)
    with pytest.raises(ValueError, match="--num-layers"):
        analytic_costs(model, ClusterSpec(), DF)


def test_analytic_costs_simulate():
    """Analytic costs drive the simulator end to end (PARAM_SYNC emitted when gathers cost time)."""
    cfg = ScheduleConfig(4, 2, 12, (8, 4), (6, 6))
    result = simulate(cfg, analytic_costs(MODEL, ClusterSpec(dp=8, dp_gbps=10.0), cfg))
    assert result.iteration_s > 0
    assert any(c.lane == "dp" and c.op.kind.value == "PARAM_SYNC" for c in result.timeline.comms)
    assert all(r.peak_memory_bytes > r.peak_activation_bytes for r in result.ranks)


# ---------------------------------------------------------------------------------------------
# Trace and plot


def test_trace_has_every_compute_op(tmp_path):
    """write_trace emits valid JSON whose 'X' compute events cover every op of every rank once."""
    cfg = ScheduleConfig(4, 2, 12, (8, 4), (6, 6))
    result = simulate(cfg, costly_dp())
    path = tmp_path / "trace.json"
    write_trace(result, str(path))
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    assert events == json.loads(json.dumps(trace_events(result)))
    compute = [e for e in events if e["ph"] == "X" and e.get("cat") == "compute"]
    expected = Counter((rank, f"{kind}{c}.{j}") for rank in range(cfg.pp) for kind in "FB"
                       for c in range(cfg.vpp) for j in range(cfg.microbatches))
    assert Counter((e["pid"], e["name"]) for e in compute) == expected
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in compute)
    assert any(e["ph"] == "X" and e.get("cat") == "dp" for e in events)
    assert {e["pid"] for e in events if e["ph"] == "M"} == set(range(cfg.pp))


def test_plot_writes_png(tmp_path):
    """plot_timelines writes a non-empty PNG of several panels."""
    pytest.importorskip("matplotlib")
    from megatron_pipemesh.planning.plot import plot_timelines
    results = [simulate(cfg, costly_dp()) for cfg in (ScheduleConfig(4, 2, 12, (8, 4), (6, 6)),
                                                      ScheduleConfig.depth_first(4, 2, 12),
                                                      ScheduleConfig.breadth_first(4, 2, 12))]
    path = tmp_path / "timeline.png"
    plot_timelines(results, str(path), ["given", "depth-first", "breadth-first"])
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_copies_on_the_compute_stream_are_exposed_host_time():
    """A plan with host placement on CPU ranks (copies on the compute stream): every copy's time is exposed, and the
    iteration is longer than with the same copies on a host link of their own."""
    import dataclasses
    from megatron_pipemesh.planning.costs import ClusterSpec, ModelSpec, analytic_costs
    from megatron_pipemesh.schedule import ScheduleConfig
    config = ScheduleConfig(2, 2, 8, (6, 2), (4, 4))
    plan = {(0, 0, 0): "host", (0, 0, 1): "host", (1, 1, 5): "host"}
    cluster = ClusterSpec(dp=1, host_link_gbps=50.0)
    model = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=1024)
    on_link = simulate(config, analytic_costs(model, cluster, config), plan)
    on_compute = simulate(config, analytic_costs(model, dataclasses.replace(cluster, host_copies_on_compute=True),
                                                 config), plan)
    assert on_compute.iteration_s > on_link.iteration_s
    for rank in on_compute.ranks:
        copies = [c for c in on_compute.timeline.comms if c.lane in ("d2h", "h2d") and c.src == rank.rank]
        assert len(copies) == 2 * sum(1 for r, _, _ in plan if r == rank.rank)
        assert rank.exposed_host_s >= sum(c.end - c.start for c in copies) > 0 or not copies


def test_ranks_sharing_two_cores_run_at_half_speed_while_both_stages_compute():
    """PP=2 x DP=2 on one host of 2 cores (the bench's 4 ranks on this machine), 1F1B with m=2, F=1, B=2, free
    communication: both stages computing get 2 cores / 4 processes = 0.5 each, a stage alone 1.0, so the
    iteration is the total work per core, 12 (9 with a core per rank); busy time is the stretched compute."""
    from megatron_pipemesh.planning.topology import topology

    config = ScheduleConfig(2, 1, 2)
    shared = dataclasses.replace(free_comm(), network=topology(
        ClusterSpec(dp=2, devices_per_node=1, nic_gbps=1.0, shared_cores=2), 2))
    result = simulate(config, shared)
    spans = [{str(e.op): (e.start, e.end) for e in result.timeline.compute[r]} for r in range(2)]
    assert spans == [{"F0.0": (0, 1), "F0.1": (1, 3), "B0.0": (5, 9), "B0.1": (10, 12)},
                     {"F0.0": (1, 3), "B0.0": (3, 5), "F0.1": (5, 7), "B0.1": (7, 10)}]
    assert result.iteration_s == 12 and simulate(config, free_comm()).iteration_s == 9
    assert [r.busy_s for r in result.ranks] == [9, 9]  # 1 + 2 + 4 + 2 and 2 + 2 + 2 + 3
    for r in result.ranks:
        assert r.busy_s + r.idle_s == pytest.approx(result.iteration_s)
    own = dataclasses.replace(free_comm(), network=topology(ClusterSpec(dp=2, devices_per_node=1, nic_gbps=1.0), 2))
    assert simulate(config, own).iteration_s == 9  # no shared cores: a device each


@pytest.mark.parametrize("cores,pinned", [(1, False), (2, False), (2, True), (4, False), (4, True), (8, False)])
def test_shared_cores_do_at_most_their_capacity_and_never_speed_a_rank_up(cores, pinned):
    """PP=4 x DP=2 (8 processes) on a few cores: the iteration is at least the one-core work of every process over
    the cores (they do no more than ``cores`` core-seconds per second) and at least the iteration with a core each;
    with as many cores as processes, unpinned, it is that iteration exactly."""
    from megatron_pipemesh.planning.costs import ScheduleCosts

    model = ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=256)
    config = ScheduleConfig(4, 2, 8)
    own = simulate(config, analytic_costs(model, ClusterSpec(dp=2, devices_per_node=1, nic_gbps=100.0), config))
    costs = analytic_costs(model, ClusterSpec(dp=2, devices_per_node=1, nic_gbps=100.0, shared_cores=cores,
                                              pinned_cores=pinned), config)
    result = simulate(config, costs)
    adapter = ScheduleCosts(config, costs)
    work = 2 * sum(adapter.compute(e.rank, e.op) for events in result.timeline.compute for e in events)
    assert result.iteration_s >= work / cores * (1 - 1e-9)
    assert result.iteration_s >= own.iteration_s * (1 - 1e-9)
    if cores == 8:
        assert result.iteration_s == pytest.approx(own.iteration_s, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Deadline: a search that keeps only schedules ending by a time stops the others early


@pytest.mark.parametrize("pp,vpp,m,dp,host,cores", [(2, 2, 4, 2, False, None), (4, 2, 8, 2, True, None),
                                                    (4, 1, 8, 4, False, None), (3, 2, 6, 1, True, None),
                                                    (4, 2, 8, 2, True, 2)])
def test_a_deadline_stops_only_schedules_that_end_after_it(pp, vpp, m, dp, host, cores):
    """Shared NIC, data parallelism, host copies, shared cores: with the deadline at the iteration's end the simulation
    is the same event for event; a deadline before the last event stops it with DeadlineExceeded. A deadline below
    half of every rank's compute stops it at the first op, from the compute left (the clock would pass it later)."""
    from megatron_pipemesh.planning.costs import ScheduleCosts
    from megatron_pipemesh.planning.simulator import DeadlineExceeded

    model = ModelSpec(num_layers=pp * vpp * 2, hidden_size=512, num_attention_heads=8, seq_length=512)
    cluster = ClusterSpec(tp=1, dp=dp, devices_per_node=1, nic_gbps=2, dp_gbps=2, p2p_gbps=2,
                          distributed_optimizer=True, shared_cores=cores, host_copies_on_compute=cores is not None)
    config = ScheduleConfig.breadth_first(pp, vpp, m)
    costs = analytic_costs(model, cluster, config)
    plan = {(r, 0, j): ("host" if host and j % 2 else "selective") for r in range(pp) for j in range(m)}
    full = simulate(config, costs, plan)
    again = simulate(config, costs, plan, deadline_s=full.iteration_s)
    assert again.iteration_s == full.iteration_s
    assert [(e.op, e.start, e.end) for r in range(pp) for e in again.timeline.compute[r]] == \
        [(e.op, e.start, e.end) for r in range(pp) for e in full.timeline.compute[r]]
    last_event = max(e.end for r in range(pp) for e in full.timeline.compute[r])
    with pytest.raises(DeadlineExceeded, match="past the deadline"):
        simulate(config, costs, plan, deadline_s=last_event * (1 - 1e-9))
    adapter = ScheduleCosts(config, costs, plan)
    least = min(sum(adapter.compute(r, e.op) for e in full.timeline.compute[r]) for r in range(pp))
    with pytest.raises(DeadlineExceeded) as stopped:
        simulate(config, costs, plan, deadline_s=least / 2)
    assert stopped.value.clock >= least * (1 - 1e-9)


def test_without_the_overlap_flags_the_data_parallel_syncs_are_exposed():
    """Megatron without --overlap-grad-reduce reduces every chunk after the last backward, and without
    --overlap-param-gather its optimizer step gathers the parameters: the iteration grows by what overlapped, the
    reductions all follow the rank's last compute op, and the step holds each chunk's gather."""
    config = ScheduleConfig.depth_first(2, 2, 8)
    model = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024)
    overlapped = ClusterSpec(dp=4, device_tflops=50, dp_gbps=10, p2p_gbps=100)
    costs = {flags: analytic_costs(model, dataclasses.replace(overlapped, overlap_grad_reduce=flags[0],
                                                              overlap_param_gather=flags[1]), config)
             for flags in ((True, True), (False, True), (True, False))}
    both, no_reduce, no_gather = (simulate(config, costs[flags]) for flags in costs)
    assert no_reduce.iteration_s > both.iteration_s and no_gather.iteration_s > both.iteration_s
    for rank in range(config.pp):
        last_compute = max(e.end for e in no_reduce.timeline.compute[rank])
        syncs = [c for c in no_reduce.timeline.comms if c.lane == "dp" and c.src == rank and c.op.kind.name == "GRAD_SYNC"]
        assert len(syncs) == config.vpp and all(c.start >= last_compute for c in syncs)
    assert not any(c.op.kind.name == "PARAM_SYNC" for c in no_gather.timeline.comms)
    gather = costs[True, False].dp_gather_s
    assert gather > 0
    # Each rank's step holds at least one chunk gather per chunk on top of Adam's.
    assert no_gather.iteration_s >= max(r.busy_s for r in no_gather.ranks) + config.vpp * gather
