"""Host placement in the PipeMesh runtime on real ranks (CPU, gloo; PP=2 V=2 m=8 groups 6 2 / 4 4, and PP=4 V=2 m=4).

A plan with every placement kind (none / host / selective / full on different chunk-micro-batches of
every rank) must leave losses and every gradient equal to the run without offloading or recomputation;
offloading must lower the measured device-resident peak and report the host bytes; under a budget at
70% of the unplanned peak (where recompute-only recomputes), 'auto' placement offloads instead and the
measured device and host peaks are within 10% of the planner's prediction; a failing host copy ends with
the runtime's error naming rank, step and op. One torchrun launch per pipeline size.
"""
import re

import pytest

from tests import megatron_harness as h

TOL = 1e-6


@pytest.fixture(scope="module")
def pp2():
    return h.run_worker("tests.runtime.workers:placement_runs", nproc=2,
                        kwargs={"runs": ["plain", "measured", "placed", "host", "host-outside"], "budget_fraction": 0.7,
                                "failing_host_copy": True})


@pytest.fixture(scope="module")
def pp4():
    return h.run_worker("tests.runtime.workers:recompute_runs", nproc=4, timeout=240,
                        kwargs={"runs": ["plain", "placed"], "pp": 4, "microbatches": 4, "forward_groups": [4],
                                "backward_groups": [4]})


def _flat(losses):
    return [value for pair in losses for value in pair]


def _assert_same(runs, name):
    plain, got = h.merge_rank_results([r["plain"] for r in runs]), h.merge_rank_results([r[name] for r in runs])
    assert plain["losses"] and len(plain["grads"]) > 0
    assert _flat(got["losses"]) == pytest.approx(_flat(plain["losses"]), rel=TOL, abs=0)
    diffs = h.compare_grads(got["grads"], plain["grads"])
    assert max(diffs.values()) <= TOL, max(diffs.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("name", ["placed", "host"])
def test_host_placement_keeps_losses_and_grads_pp2(pp2, name):
    """Offloading (alone or mixed with recomputation) leaves losses and all gradients unchanged, PP=2 V=2."""
    _assert_same(pp2, name)


def test_every_placement_kind_keeps_losses_and_grads_pp4(pp4):
    """The mixed none/host/selective/full plan leaves losses and all gradients unchanged, PP=4 V=2."""
    _assert_same(pp4, "placed")
    for r in pp4:
        plan, rank = r["placed"]["plan"], r["placed"]["pp_rank"]
        assert {plan[(rank, c, j)] for c in range(2) for j in range(4)} == {"none", "host", "selective", "full"}
        assert set(r["placed"]["offloaded"]) == {(c, j) for (p, c, j), lv in plan.items() if p == rank and lv == "host"}


def test_offloading_lowers_device_peak_and_reports_host_bytes(pp2):
    """Host placement lowers the device-resident peak, and offloaded bytes are reported separately."""
    for r in pp2:
        measured, host = r["measured"], r["host"]
        assert host["source"] == "saved-tensors"
        print("device peak", host["rank"], host["peak"], measured["peak"], r["placed"]["peak"], max(host["saved"].values()), host["peak_host"])
        assert 0 < host["peak"] < 0.75 * measured["peak"], (host["rank"], host["peak"], measured["peak"])
        assert set(host["offloaded"]) == {(c, j) for c in range(2) for j in range(8)}
        # What moved is what the forward saved, minus the chunk input the executor keeps on the device.
        for key, moved in host["offloaded"].items():
            assert 0 < moved <= host["saved"][key] == measured["saved"][key]
        assert host["peak_host"] >= max(host["offloaded"].values())
        assert host["summary"]["peak_host_bytes"] == host["peak_host"]
        assert measured["peak_host"] == 0 and measured["offloaded"] == {}
        placed = r["placed"]
        assert 0 < placed["peak_host"] < host["peak_host"]


def test_meter_around_the_whole_call_sees_host_placed_activations(pp2):
    """A meter around the whole call (the bench's) sees host-placed chunk-micro-batches on the device until they
    are offloaded and after they are reloaded (their own hooks hide them from outer ones): the runtime meter's peak
    up to the chunk outputs only the runtime tracks, and the same bytes moved (without it: 0 bytes)."""
    for r in pp2:
        inside, outside = r["host"], r["host-outside"]
        # The runtime's meter also counts the chunk outputs it keeps for the send and the backward.
        assert inside["peak"] - sum(inside["outputs"].values()) <= outside["peak"] <= inside["peak"], (inside["peak"], outside["peak"])
        assert outside["offloaded"] == inside["offloaded"] and outside["peak_host"] == inside["peak_host"]


def test_auto_placement_under_a_tight_budget_offloads_and_meets_the_prediction(pp2):
    """Where recompute-only must recompute (70% budget), 'auto' offloads; measured peaks within 10% of the plan's; the
    pinned pool is allocated from the plan before the first call, so no OFFLOAD allocates."""
    plain = h.merge_rank_results([r["auto_placement"]["plain"] for r in pp2])
    planned = h.merge_rank_results([r["auto_placement"]["planned"] for r in pp2])
    assert _flat(planned["losses"]) == pytest.approx(_flat(plain["losses"]), rel=TOL, abs=0)
    assert max(h.compare_grads(planned["grads"], plain["grads"]).values()) <= TOL
    for r in pp2:
        auto = r["auto_placement"]
        assert auto["hosted"] > 0, auto["groups"]
        assert auto["measured_peak"] <= auto["budget"]
        assert abs(auto["measured_peak"] - auto["predicted_peak"]) <= 0.10 * auto["predicted_peak"], auto
        if auto["predicted_host_peak"]:
            assert abs(auto["measured_host_peak"] - auto["predicted_host_peak"]) <= 0.10 * auto["predicted_host_peak"], auto
            print("host peak: activations", auto["measured_host_peak"], auto["predicted_host_peak"],
                  "blocks", auto["measured_block_peak"], auto["predicted_block_peak"])
            assert auto["measured_block_peak"] == auto["predicted_block_peak"], auto  # the real pinned bytes
            # The plan's block sizes sized the pinned pool at the schedule's start: no OFFLOAD allocated one.
            assert auto["pool"]["reserved"] and auto["pool"]["late_allocations"] == 0, auto["pool"]


def test_failing_host_copy_names_rank_step_and_op(pp2):
    """A host copy that fails ends with the runtime's error naming rank, step and the OFFLOAD op."""
    for r in pp2:
        message, rank = r["failure"], r["plain"]["rank"]
        assert re.search(rf"rank {rank} \(pipeline rank {rank}\), step \d+ \(OFFLOAD0\.0\) of plan", message), message
        assert "host placement failed" in message and "cannot allocate" in message
