"""`pipemesh bench --network-check`: its scenarios, the predictions it takes from the product's network model, the
document it writes and the flags it refuses (nothing here builds a namespace)."""
import json

import pytest

from megatron_pipemesh.bench import cli as bench_cli
from megatron_pipemesh.bench.flow_probe import LINE_PREFIX, combine, group_keys, parse_runs
from megatron_pipemesh.bench.flow_scenarios import (ALL_REDUCE, MIB, SENDS, AllReduce, Scenario, Send,
                                                    check_scenarios)
from megatron_pipemesh.bench.netns import Shaping
from megatron_pipemesh.bench.network_check import NetworkCheckSettings, build_cases, format_check, predict_s
from megatron_pipemesh.cli import UsageError

RATE = 1e7  # bytes/s


def _by_name(size=8 * MIB):
    return {s.name.split()[0]: s for s in check_scenarios([size])}


def test_scenarios_are_the_three_of_the_check():
    """Per size: one flow alone (0 -> 2), one rank sending to two peers (0 -> 1, 0 -> 2), and the ring all-reduce over
    0 and 1 with a quarter-size pipeline send each way between 0 and 2; three ranks in all; a scenario survives its
    JSON round trip."""
    scenarios = _by_name()
    assert scenarios["alone"].sends == (Send(0, 2, 8 * MIB),) and scenarios["alone"].measures == (SENDS,)
    assert scenarios["two-peers"].sends == (Send(0, 1, 8 * MIB), Send(0, 2, 8 * MIB))
    ring = scenarios["ring+pipeline"]
    assert ring.all_reduce == AllReduce((0, 1), 8 * MIB) and ring.sends == (Send(0, 2, 2 * MIB), Send(2, 0, 2 * MIB))
    assert ring.measures == (SENDS, ALL_REDUCE) and NetworkCheckSettings().world == 3
    assert Scenario.from_dict(json.loads(json.dumps(ring.to_dict()))) == ring


@pytest.mark.parametrize("kwargs,match", [(dict(), "transfers nothing"),
                                          (dict(sends=(Send(1, 1, 4),)), "two different ranks"),
                                          (dict(sends=(Send(0, 1, 0),)), "positive size"),
                                          (dict(all_reduce=AllReduce((0, 0), 8)), "two or more ranks")])
def test_bad_scenarios_are_refused(kwargs, match):
    """A scenario without transfers, a send to itself or of no bytes, a ring of one rank: ValueError."""
    with pytest.raises(ValueError, match=match):
        Scenario("bad", **kwargs)


def test_predictions_are_the_fair_share_model():
    """The product's model, by hand: a lone flow takes S/R; two flows out of one NIC R/2 each, so 2S/R; the ring of
    two ranks (2 steps of S/2) shares rank 0's uplink and downlink with a pipeline send of S/4 each way: both at R/2
    until the sends end at S/(2R), the rest of the first step at R, then the second: the all-reduce takes 1.25 S/R."""
    size = 8 * MIB
    t = size / RATE
    scenarios = _by_name(size)
    assert predict_s(scenarios["alone"], RATE) == {SENDS: pytest.approx(t)}
    assert predict_s(scenarios["two-peers"], RATE) == {SENDS: pytest.approx(2 * t)}
    assert predict_s(scenarios["ring+pipeline"], RATE) == {SENDS: pytest.approx(0.5 * t),
                                                            ALL_REDUCE: pytest.approx(1.25 * t)}


def test_worker_groups_and_timing_are_combined_per_run():
    """Every rank creates one group per pair of a send and per ring, in one order; a run's seconds are counted from
    the first rank's start to each measure's last completion (and each rank's start is reported); the log lines
    parse back."""
    scenarios = check_scenarios([MIB])
    assert group_keys(scenarios) == [("p2p", (0, 1)), ("p2p", (0, 2)), ("ring", (0, 1))]
    parts = [(10.0, {SENDS: 10.5, "receive 2->0": 10.5, ALL_REDUCE: 11.0}), (10.1, {ALL_REDUCE: 11.2}),
             (10.05, {SENDS: 10.4}), (None, {})]
    run = combine("ring+pipeline 1MiB", 0, parts)
    assert run.seconds[SENDS] == pytest.approx(0.5) and run.seconds[ALL_REDUCE] == pytest.approx(1.2)
    assert run.seconds["start rank 1"] == pytest.approx(0.1) and "start rank 3" not in run.seconds
    text = "noise\n" + LINE_PREFIX + json.dumps({"scenario": run.scenario, "repeat": 0, "seconds": run.seconds})
    assert parse_runs(text) == [{"scenario": "ring+pipeline 1MiB", "repeat": 0, "seconds": run.seconds}]


def test_document_cases_name_measured_and_predicted():
    """Each (scenario, measure) at a rate is one case with `name`, `measured_s` (median of the runs), `predicted_s`,
    the relative error and whether it is within the tolerance; the table shows every case and the count within."""
    scenarios = _by_name(MIB)
    t = MIB / RATE
    runs = [{"scenario": scenarios["alone"].name, "repeat": r, "seconds": {SENDS: t * f, "receive 0->2": t * f}}
            for r, f in enumerate((1.02, 0.98, 1.30))]
    runs += [{"scenario": scenarios["ring+pipeline"].name, "repeat": 0, "seconds": {SENDS: 0.5 * t, ALL_REDUCE: 1.5 * t}}]
    cases = build_cases(runs, [scenarios["alone"], scenarios["ring+pipeline"]], 80.0, RATE, 0.1)
    assert [c["name"] for c in cases] == ["alone 1MiB sends @ 80 Mbit/s", "ring+pipeline 1MiB sends @ 80 Mbit/s",
                                          "ring+pipeline 1MiB all-reduce @ 80 Mbit/s"]
    alone, sends, ring = cases
    assert alone["measured_s"] == pytest.approx(1.02 * t) and alone["predicted_s"] == pytest.approx(t)
    assert alone["within_tolerance"] and alone["ops_s"] == {"receive 0->2": pytest.approx(1.02 * t)}
    assert alone["spread"] == pytest.approx(0.32 / 1.02)
    assert sends["within_tolerance"] and not ring["within_tolerance"]
    assert ring["error"] == pytest.approx(1.25 / 1.5 - 1)
    for case in cases:
        assert {"name", "measured_s", "predicted_s"} <= set(case)
    document = {"network": {"nic_queue": "fair", "burst_bytes": 262144}, "repeats": 3, "model": "m", "fitted": "nothing",
                "cases": cases, "tolerance": 0.1, "worst_abs_error": abs(ring["error"]), "wall_s": 1.0}
    table = format_check(document)
    assert "ring+pipeline 1MiB all-reduce @ 80 Mbit/s" in table and "OUTSIDE" in table
    assert "2 of 3 cases within 10%" in table


def _args(*argv):
    return bench_cli.build_parser().parse_args(["bench", *argv])


@pytest.mark.parametrize("argv,match", [
    (["--quick"], "--quick"), (["--unshaped"], "--unshaped"), (["--rate", "100mbit"], "--rate"),
    (["--network", "shared"], "--network shared"), (["--delay-ms", "1"], "--delay-ms"),
    (["--sharding"], "--sharding"), (["--burst", "1000"], "MTU"), (["--queue-ms", "0"], "--queue-ms"),
])
def test_network_check_refuses_what_it_cannot_honour(argv, match):
    """--network-check runs no training and measures the per-rank network at its own rates: the flags that would say
    otherwise, and bad network values, are usage errors naming the flag before anything runs."""
    with pytest.raises(UsageError, match=match):
        bench_cli.network_check_shaping(_args("--network-check", *argv))


def test_network_check_takes_the_nic_queue():
    """--network-check measures the fair queue by default and the FIFO with --nic-queue fifo."""
    assert bench_cli.network_check_shaping(_args("--network-check")) == Shaping(1.0)
    assert bench_cli.network_check_shaping(_args("--network-check", "--nic-queue", "fifo")).nic_queue == "fifo"
