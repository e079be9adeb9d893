"""planning/network.py: max-min fair sharing of egress and ingress, ring collectives at their slowest hop."""
import pytest

from megatron_pipemesh.planning.network import (FairShareNetwork, Flow, _run, collective_with_flows_finish_times,
                                                fair_share_finish_times, make_route, max_min_rates,
                                                ring_allreduce_flows)

RATE = {0: 100.0, 1: 100.0, 2: 100.0, 3: 100.0}


def test_a_lone_flow_gets_the_whole_nic():
    assert fair_share_finish_times([Flow(0, 1, 500.0)], RATE, RATE) == [5.0]
    assert fair_share_finish_times([Flow(0, 1, 500.0, start_s=2.0)], RATE, RATE, latency_s=0.25) == [7.25]


def test_two_flows_from_one_rank_each_get_half():
    """Both leave rank 0: 50 each until the shorter ends at 4 (200 bytes), then the other gets all 100."""
    ends = fair_share_finish_times([Flow(0, 1, 200.0), Flow(0, 2, 400.0)], RATE, RATE)
    assert ends == [pytest.approx(4.0), pytest.approx(6.0)]


def test_two_flows_into_one_rank_share_its_ingress():
    ends = fair_share_finish_times([Flow(1, 0, 300.0), Flow(2, 0, 300.0)], RATE, RATE)
    assert ends == [pytest.approx(6.0), pytest.approx(6.0)]


def test_a_flow_blocked_at_the_receivers_ingress_frees_egress_for_the_other():
    """0->1 and 2->1 share rank 1's ingress (50 each); rank 0's other flow 0->3 takes the 50 left of rank 0's
    egress, not a fair third: max-min, not an equal split of every resource."""
    flows = [Flow(0, 1, 100.0), Flow(2, 1, 100.0), Flow(0, 3, 100.0)]
    assert max_min_rates([[(0, 1), (5, 1)], [(2, 1), (5, 1)], [(0, 1), (7, 1)]], [100.0] * 8) == [50.0, 50.0, 50.0]
    slow_in = {**RATE, 1: 40.0}
    ends = fair_share_finish_times(flows, RATE, slow_in)
    # 0->1 and 2->1 get 20 each at rank 1's ingress; 0->3 the 80 left of rank 0's egress.
    assert ends[2] == pytest.approx(100.0 / 80.0)
    assert ends[0] == pytest.approx(ends[1]) == pytest.approx(5.0)


def test_a_flow_that_starts_later_slows_the_running_one():
    """0->1 alone for 1 s (100 bytes), then shares rank 0's egress with 0->2 until it ends."""
    ends = fair_share_finish_times([Flow(0, 1, 300.0), Flow(0, 2, 100.0, start_s=1.0)], RATE, RATE)
    assert ends == [pytest.approx(4.0), pytest.approx(3.0)]


def test_weights_count_device_flows():
    """A flow standing for 3 devices through one NIC takes 3 shares of it: 75 of 100 next to a flow of weight 1."""
    capacity = [100.0, 100.0]
    assert max_min_rates([[(0, 3.0)], [(0, 1.0)]], capacity) == [pytest.approx(25.0), pytest.approx(25.0)]
    route = make_route([(0, 3.0), (1, 1.0)], capacity)
    assert route.lone_bytes_per_s == pytest.approx(100 / 3)


def test_network_reports_ends_in_order_and_lone_work_exactly():
    net = FairShareNetwork([10.0, 10.0])
    a, b = make_route([(0, 1)], net.capacity), make_route([(1, 1)], net.capacity)
    net.start("a", a, 0.75)
    net.start("b", b, 0.5)
    assert net.pop() == (0.5, ["b"])
    assert net.pop() == (0.75, ["a"])
    with pytest.raises(ValueError, match="no flow is running"):
        net.pop()
    with pytest.raises(ValueError, match="cannot go back"):
        net.advance(0.1)


def test_a_token_bucket_passes_its_burst_at_once_and_refills_while_idle():
    """A NIC direction of 100 B/s with a 200-byte bucket (tc tbf): a 500-byte flow on a full bucket takes (500 -
    200) / 100 = 3 s; the next, started at once, finds it empty (5 s); after 1 s idle it holds 100 bytes (4 s). A
    route crossing a resource without a bucket passes nothing at once; a flow of weight 2 spends twice its bytes."""
    net = FairShareNetwork([100.0, 100.0, 100.0], burst=[200.0, 200.0, 0.0])
    nic, both, plain = (make_route([(0, 1)], net.capacity), make_route([(0, 1), (2, 1)], net.capacity),
                        make_route([(1, 2)], net.capacity))
    net.start("a", nic, 5.0)
    assert net.pop() == (pytest.approx(3.0), ["a"])
    net.start("b", nic, 5.0)
    assert net.pop() == (pytest.approx(8.0), ["b"])
    net.advance(9.0)
    net.start("c", nic, 5.0)
    assert net.pop() == (pytest.approx(13.0), ["c"])
    net.advance(20.0)
    net.start("d", both, 5.0)  # resource 2 has no bucket
    assert net.pop() == (pytest.approx(25.0), ["d"])
    net.start("e", plain, 4.0)  # 200 bytes per device flow at 50 B/s; the 200-byte bucket passes 100 of each at once
    assert net.pop() == (pytest.approx(27.0), ["e"])
    with pytest.raises(ValueError, match="one value >= 0 bytes per resource"):
        FairShareNetwork([100.0], burst=[1.0, 2.0])


def test_ring_allreduce_steps():
    steps = ring_allreduce_flows([3, 5, 7], 300.0)
    assert len(steps) == 4 and all(len(step) == 3 for step in steps)
    assert [(f.src, f.dst, f.nbytes) for f in steps[0]] == [(3, 5, 100.0), (5, 7, 100.0), (7, 3, 100.0)]
    assert ring_allreduce_flows([1], 10.0) == []
    with pytest.raises(ValueError, match="distinct"):
        ring_allreduce_flows([1, 1], 10.0)


def test_ring_runs_at_its_slowest_hop():
    """Alone, 4 steps of 100 bytes at 100 B/s with 0.5 s latency each: 6 s. A concurrent 0->2 send halves hop
    0->1 in each step it overlaps, so every step waits for that hop."""
    steps = ring_allreduce_flows([0, 1, 2], 300.0)
    alone, _ = collective_with_flows_finish_times(steps, [], RATE, RATE, latency_s=0.5)
    assert alone == pytest.approx(6.0)
    end, (send,) = collective_with_flows_finish_times(steps, [Flow(0, 3, 150.0)], RATE, RATE)
    # Step 1: 0->1 and 0->3 at 50 each: both 2 s (100 of the send); step 2: 50 more of the send at 50 (1 s),
    # then hop 0->1 alone; steps 3 and 4 alone: 1 s each.
    assert send == pytest.approx(3.0)
    assert end == pytest.approx(2.0 + 1.5 + 1.0 + 1.0)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="no egress rate"):
        fair_share_finish_times([Flow(9, 1, 1.0)], RATE, RATE)
    with pytest.raises(ValueError, match="does not send to itself"):
        fair_share_finish_times([Flow(1, 1, 1.0)], RATE, RATE)
    with pytest.raises(ValueError, match="capacity > 0"):
        FairShareNetwork([0.0])
    with pytest.raises(ValueError, match="weight"):
        make_route([(0, 0.0)], [1.0])


def test_a_reused_token_is_not_ended_by_its_predecessors_stale_end():
    """'a' shares with 'b' (end due at 8), runs alone after b ends and ends at 5; a new flow named 'a' then
    runs 10 s alone: it ends at 15, not at the first flow's stale 8."""
    net = FairShareNetwork([1.0])
    route = make_route([(0, 1)], net.capacity)
    net.start("a", route, 4.0)
    net.start("b", route, 1.0)
    assert net.pop() == (2.0, ["b"])
    assert net.pop() == (5.0, ["a"])
    net.start("a", route, 10.0)
    assert net.pop() == (15.0, ["a"])


def _reference_finish_times(flows, capacity):
    """Every flow's end with the max-min rates of all running flows computed from scratch at each event."""
    left = {i: nbytes for i, (_, _, nbytes) in enumerate(flows)}
    ends, now, running = {}, 0.0, set()
    pending = sorted(range(len(flows)), key=lambda i: (flows[i][0], i))
    while pending or running:
        rates = dict(zip(sorted(running), max_min_rates([flows[i][1] for i in sorted(running)], capacity)))
        t_end = min((now + left[i] / rates[i] for i in running), default=float("inf"))
        t_start = flows[pending[0]][0] if pending else float("inf")
        t = min(t_end, t_start)
        for i in running:
            left[i] -= (t - now) * rates[i]
        now = t
        for i in [i for i in running if left[i] <= 1e-9 * flows[i][2]]:
            running.discard(i)
            ends[i] = now
        while pending and flows[pending[0]][0] <= now:
            running.add(pending.pop(0))
    return [ends[i] for i in range(len(flows))]


def test_random_mixes_match_rates_recomputed_at_every_event():
    """Flows that start on idle resources, end alone, share partly or wholly, with weights: the network's
    incremental rating (lone flows skip it, the rest re-rate from a cache) gives the ends of a from-scratch
    max-min rating at every event. Integer start times make many starts and ends coincide."""
    import random

    rng = random.Random(7)
    capacity = [100.0, 50.0, 80.0, 100.0, 30.0, 60.0]
    for _ in range(60):
        flows = []
        for _ in range(rng.randint(1, 12)):
            resources = rng.sample(range(len(capacity)), rng.randint(1, 3))
            demands = [(r, float(rng.choice((1, 1, 2, 3)))) for r in resources]
            flows.append((float(rng.randint(0, 6)), demands, float(rng.choice((50, 100, 150, 400)))))
        routes = [make_route(demands, capacity) for _, demands, _ in flows]
        pending = [(start, i, route, nbytes / route.lone_bytes_per_s)
                   for i, ((start, _, nbytes), route) in enumerate(zip(flows, routes))]
        got = {}
        _run(FairShareNetwork(capacity), pending, lambda t, i: got.__setitem__(i, t))
        want = _reference_finish_times(flows, capacity)
        assert [got[i] for i in range(len(flows))] == pytest.approx(want, rel=1e-9)
