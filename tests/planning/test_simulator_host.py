"""Simulator with activations placed in host memory: the device memory timeline, the host-memory
timeline and the exposed host-copy time, on hand-checkable PP=2 V=2 cases."""
import pytest

from megatron_pipemesh.planning.costs import OpCosts
from megatron_pipemesh.planning.simulator import lowering_for, simulate
from megatron_pipemesh.planning.trace import trace_events
from megatron_pipemesh.schedule import ScheduleConfig, lower

# Breadth-first, F = 1, B = 2, free pipeline: rank 0 runs F0.0..F0.3 at 0..4, F1.0..F1.2 at 4..7 (7
# chunk-micro-batches live: the peak), B1.0 8..10, F1.3, B1.1 11..13, B1.2 14..16, B1.3 17..19, B0.0 19..21.
CFG = ScheduleConfig.breadth_first(2, 2, 4)
BYTES = 1e8


def _costs(copy_s: float) -> OpCosts:
    """Each chunk-micro-batch holds 1e8 bytes; one host copy of it takes ``copy_s`` seconds."""
    return OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0,
                   activation_bytes={"none": BYTES, "selective": BYTES / 2, "full": BYTES / 10},
                   recompute_s={"none": 0.0, "selective": 0.2, "full": 1.0},
                   host_link_gbps=BYTES * 8 / copy_s / 1e9, static_bytes=(0.0, 0.0))


def _b00(result):
    return next(e for e in result.timeline.compute[0] if str(e.op) == "B0.0")


def test_hidden_offload_lowers_the_device_peak_by_exactly_its_bytes():
    """A copy that ends before the peak and comes back after it frees exactly its bytes, costs no time."""
    base = simulate(CFG, _costs(0.1))
    placed = simulate(CFG, _costs(0.1), {(0, 0, 0): "host"})
    assert base.ranks[0].peak_activation_bytes == pytest.approx(7 * BYTES)
    assert placed.ranks[0].peak_activation_bytes == pytest.approx(base.ranks[0].peak_activation_bytes - BYTES)
    assert placed.ranks[0].peak_live == base.ranks[0].peak_live - 1
    assert placed.iteration_s == base.iteration_s
    assert (placed.ranks[0].exposed_host_s, placed.ranks[0].host_placed) == (0.0, 1)
    assert placed.ranks[0].peak_host_bytes == pytest.approx(BYTES)
    assert placed.ranks[1].peak_host_bytes == 0.0 and placed.ranks[1].peak_activation_bytes == base.ranks[1].peak_activation_bytes
    # Off the device from the offload's end (1.1) to the reload's start (13: two compute ops before B0.0).
    copies = {str(c.op): (c.start, c.end, c.lane) for c in placed.timeline.comms if c.lane in ("d2h", "h2d")}
    assert copies == {"OFFLOAD0.0": (1.0, pytest.approx(1.1), "d2h"), "RELOAD0.0": (13.0, pytest.approx(13.1), "h2d")}


def test_slow_link_delays_the_backward_by_exactly_the_unhidden_copy():
    """Copies of 10 s: offload 1..11, reload 13..23, so B0.0 (due at 19) waits 4 s on 'host'."""
    base = simulate(CFG, _costs(10.0))
    placed = simulate(CFG, _costs(10.0), {(0, 0, 0): "host"})
    b00 = _b00(placed)
    assert (b00.start, b00.waited_on) == (pytest.approx(23.0), "host")
    assert _b00(base).start == 19.0
    assert placed.ranks[0].exposed_host_s == pytest.approx(4.0)
    assert placed.iteration_s == pytest.approx(base.iteration_s + 4.0)
    r0 = placed.ranks[0]
    # Idle time is split without overlap: bubbles are what neither communication nor host copies explain.
    assert r0.bubble_s == pytest.approx(r0.idle_s - r0.exposed_p2p_s - r0.exposed_dp_s - r0.exposed_host_s)
    assert r0.bubble_s == pytest.approx(base.ranks[0].bubble_s)
    # The copy ends after the peak: the device peak is unchanged (the bytes leave only once copied).
    assert r0.peak_activation_bytes == base.ranks[0].peak_activation_bytes
    assert placed.to_dict()["ranks"][0]["exposed_host_s"] == pytest.approx(4.0)


def test_host_memory_timeline_counts_overlapping_offloads():
    """Two offloads held at once on rank 0 need twice the bytes on the host; rank 1's one, once."""
    plan = {(0, 0, 0): "host", (0, 0, 1): "host", (1, 0, 0): "host", (0, 1, 3): "selective"}
    result = simulate(CFG, _costs(0.1), plan)
    assert [r.peak_host_bytes for r in result.ranks] == [pytest.approx(2 * BYTES), pytest.approx(BYTES)]
    assert [r.host_placed for r in result.ranks] == [2, 1]
    assert result.ranks[0].recompute_s == pytest.approx(0.2)  # host costs no recomputation, selective does
    assert result.to_dict()["ranks"][1]["peak_host_gb"] == pytest.approx(BYTES / 1024 ** 3)


def test_prebuilt_schedule_must_carry_the_plans_host_placement():
    """A schedule lowered without the plan's host copies is refused (it would simulate a different program)."""
    costs = _costs(0.1)
    plan = {(0, 0, 0): "host"}
    with pytest.raises(ValueError, match="host placement differs"):
        simulate(CFG, costs, plan, lower(CFG, lowering_for(costs)))
    assert simulate(CFG, costs, plan, lower(CFG, lowering_for(costs, plan))).ranks[0].host_placed == 1


def test_trace_shows_the_host_lanes():
    """The Chrome trace puts offloads and reloads on their own tracks per rank."""
    events = trace_events(simulate(CFG, _costs(0.1), {(0, 0, 0): "host"}))
    tracks = {(e["tid"], e["name"]) for e in events if e.get("cat") in ("d2h", "h2d")}
    assert tracks == {("device to host", "OFFLOAD0.0"), ("host to device", "RELOAD0.0")}
    assert any(e["name"] == "host memory" for e in events)
