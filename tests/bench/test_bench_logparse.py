"""Parsing Megatron's log text (fixture: a real PP=2 interleaved run of `pipemesh bench`, 2 ranks, gloo,
200-400 Mbit/s shaped loopback; the argument dump is cut and most RNG warnings dropped)."""
from pathlib import Path

import pytest

from megatron_pipemesh.bench.logparse import parse_log

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_pp2_interleaved.log"


def test_iterations_and_timers_from_real_log():
    """A real Megatron log gives every iteration's time, loss and per-rank timers."""
    parsed = parse_log(FIXTURE.read_text())
    assert [it.iteration for it in parsed.iterations] == [1, 2, 3, 4, 5, 6]
    assert parsed.train_iters == 6
    first, third = parsed.iterations[0], parsed.iterations[2]
    assert first.elapsed_ms == pytest.approx(1206.9)
    assert first.loss == pytest.approx(5.937136)
    assert third.elapsed_ms == pytest.approx(691.5)
    assert third.timers["forward-backward"] == {0: pytest.approx(662.38), 1: pytest.approx(658.86)}
    assert third.timers["forward-compute"] == {0: pytest.approx(261.41), 1: pytest.approx(278.93)}
    assert third.timers["backward-compute"] == {0: pytest.approx(262.43), 1: pytest.approx(286.63)}
    assert set(third.timers) >= {"embedding-grads-all-reduce", "all-grads-sync", "optimizer", "batch-generator"}
    assert [it.iteration for it in parsed.measured(2)] == [3, 4, 5, 6]


def test_second_iteration_block_has_first_subtracted():
    """Iteration 2's timers have iteration 1's subtracted (Megatron does not reset them after iteration 1)."""
    # Megatron prints iterations 1 + 2 together after iteration 2 (no timer reset after the first one):
    # in the raw text iteration 2's forward-backward is 1852.12 / 1849.17 ms while it took 976.5 ms
    parsed = parse_log(FIXTURE.read_text())
    second = parsed.iterations[1]
    assert second.timers["forward-backward"][0] == pytest.approx(1852.12 - 1151.17)
    assert second.timers["forward-backward"][1] == pytest.approx(1849.17 - 1153.80)


def test_interleaved_lines_and_auto_plan():
    """Iteration lines after other text, other ranks' lines inside timer blocks and the auto plan line parse."""
    text = "\n".join([
        "PipeMesh plan (auto, 12 candidates, budget 8.00 GiB): --forward-groups 8 --backward-groups 4 4; predicted "
        "iteration 512.3 ms, peak memory GiB per rank 0.10 0.09, recompute 0.00% of the time",
        "Number of parameters in billions:  0.00 [2026-11-29 23:44:19.960963] iteration        3/       8 | consumed "
        "samples:           48 | elapsed time per iteration (ms): 700.5 | learning rate: 5.0E-04 | lm loss: 4.5E+00 |",
        "INFO:megatron.core.timers:times across ranks (ms):",
        "  forward-backward:",
        "     rank  0: 650.00",
        "WARNING:megatron.core.tensor_parallel.random:CPU RNG state changed within GPU RNG context",
        "     rank  1: 651.50",
        "  forward-compute:",
        "     rank  0: 200.00",
        "     rank  1: 210.00",
    ])
    parsed = parse_log(text)
    assert parsed.auto_forward_groups == [8] and parsed.auto_backward_groups == [4, 4]
    (it,) = parsed.iterations
    assert it.iteration == 3 and it.elapsed_ms == 700.5 and it.loss == 4.5
    assert it.timers["forward-backward"] == {0: 650.0, 1: 651.5}
    assert it.timers["forward-compute"] == {0: 200.0, 1: 210.0}


def test_no_iterations():
    """A log without iteration lines (a crash) parses to no iterations."""
    parsed = parse_log("Traceback (most recent call last):\nRuntimeError: boom\n")
    assert parsed.iterations == [] and parsed.measured(0) == []


def test_iteration_line_fields():
    """parse_iteration_line reads iteration, total, time, loss and global batch size, tolerates rank prefixes
    and non-numbers (nan), and ignores validation lines and lines without a time."""
    from megatron_pipemesh.bench.logparse import parse_argument_line, parse_iteration_line

    line = ("[default1]: [2026-01-01 00:00:00] iteration       12/      30 | consumed samples: 384 | elapsed time "
            "per iteration (ms): 1234.5 | learning rate: 1.0E-04 | global batch size:    32 | lm loss: 2.1E+00 |")
    found = parse_iteration_line(line)
    assert (found.iteration, found.train_iters, found.elapsed_ms, found.loss, found.global_batch_size) == \
        (12, 30, 1234.5, 2.1, 32)
    nan = parse_iteration_line(line.replace("1234.5", "nan").replace("2.1E+00", "nan"))
    assert nan.elapsed_ms != nan.elapsed_ms and nan.loss != nan.loss
    assert parse_iteration_line(" validation loss at iteration 20 | lm loss value: 2.98E+00 |") is None
    assert parse_iteration_line(" iteration 3/ 8 | consumed samples: 48 |") is None
    assert parse_argument_line("[default0]:  seq_length ...................... 2048") == ("seq_length", 2048)
    assert parse_argument_line("  tokenizer_type .................. NullTokenizer") is None
