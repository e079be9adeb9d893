"""The message latency a plan uses (planning/profile_network.py): the flag wins, else the profile's round trip
(between nodes before inside one, half its median), else the default; each says where it came from."""
import pytest

from megatron_pipemesh.planning.profile_network import (BETWEEN_NODES, ROUND_TRIP, WITHIN_NODE, LinkPoint,
                                                        NetworkProfile, chosen_latency)


def trip(scope, ranks, seconds):
    return LinkPoint(ROUND_TRIP, scope, ranks, (ranks, ranks[::-1]), 4, seconds, 1.0)


def network(*points):
    return NetworkProfile(nic_gbps=None, nic_from="", intra_node_gbps=None, backend="gloo", node_of_rank=(0, 0, 1, 1),
                          sizes={}, warmup=1, points=points)


def test_the_latency_is_half_the_median_round_trip_between_nodes_first():
    inside, between = trip(WITHIN_NODE, (0, 1), (0.2e-3, 0.1e-3, 0.3e-3)), trip(BETWEEN_NODES, (0, 2), (1e-3, 3e-3))
    assert network(inside).latency_us == pytest.approx(100.0)
    both = network(inside, between)
    assert both.round_trip is between and both.latency_us == pytest.approx(1000.0)
    assert network().latency_us is None and network().round_trip is None
    # a file written before round trips were timed reads without one
    assert NetworkProfile.from_dict(network(inside).to_dict()).latency_us == pytest.approx(100.0)


def test_the_flag_wins_then_the_measurement_then_the_default_each_naming_its_source():
    measured = network(trip(BETWEEN_NODES, (0, 2), (0.8e-3,)))
    given = chosen_latency(50.0, measured, 30.0)
    assert (given.us, given.source) == (50.0, "--latency-us; the profile measured 400 us")
    chosen = chosen_latency(None, measured, 30.0)
    assert chosen.us == pytest.approx(400.0)
    assert chosen.source == ("measured by the profile: half a 4-byte round trip between nodes (ranks 0 and 2, gloo), "
                             "each after the link idled 20 ms")
    default = chosen_latency(None, network(), 30.0)
    assert default.us == 30.0 and default.source.startswith("the default, not measured")
    assert chosen_latency(None, None, 30.0) == default
    assert chosen_latency(0.0, None, 30.0).us == 0.0
