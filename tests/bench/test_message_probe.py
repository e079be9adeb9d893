"""The bench's message latency (bench/message_probe.py): two gloo ranks time 4-byte round trips where the rows run;
on the emulated NICs (root) the one-way time lies between a back-to-back message's and a few milliseconds."""
import pytest

from megatron_pipemesh.bench.message_probe import LINE_PREFIX, MeasuredLatency, measure_latency, parse_round_trips


def test_rank_zeros_line_is_read_and_a_missing_one_is_none():
    text = "noise\n[rank0]: " + LINE_PREFIX + '{"seconds": [0.001, 0.002]}\nmore'
    assert parse_round_trips(text) == (0.001, 0.002)
    assert parse_round_trips("Traceback ...") is None
    measured = MeasuredLatency(1500.0, (0.004, 0.003, 0.002), "the plain loopback")
    assert measured.describe() == ("message latency 1500 us (half the median of 3 round trips of 4 bytes, 1000-2000 "
                                   "us; the plain loopback)")


def test_the_latency_is_timed_on_the_emulated_nics(tmp_path):
    from megatron_pipemesh.bench.netns import Shaping, permission_problem

    problem = permission_problem()
    if problem:
        pytest.skip(problem)
    measured = measure_latency(Shaping(100.0), str(tmp_path / "latency.log"))
    assert len(measured.round_trips_s) == 15 and 20 < measured.us < 5000
    assert measured.where == "two ranks' NICs, 100 Mbit/s per rank each way, fair share per peer"


def test_a_failed_probe_names_its_log(tmp_path, monkeypatch):
    from megatron_pipemesh.bench import runner

    monkeypatch.setattr(runner, "run_once", lambda *a, **k: (1, 0.1, {}, "RuntimeError: gloo connect failed"))
    with pytest.raises(RuntimeError, match=r"timing the message latency failed \(exit 1\); log .*latency.log: "
                                           r"RuntimeError: gloo connect failed"):
        measure_latency(None, str(tmp_path / "latency.log"))
