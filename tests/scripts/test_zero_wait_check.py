"""scripts/zero_wait_check.py without a training run: the ranks' wait timer around the runtime's ZeRO-2/3
reductions, the lines it prints and how the script reads them back (the measurement itself is a script run:
docs/sharding.md)."""
import importlib.util
import time

import pytest

from .helpers import REPO


def _script():
    spec = importlib.util.spec_from_file_location("zero_wait_check", REPO / "scripts" / "zero_wait_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Work:
    def __init__(self, seconds):
        self.seconds = seconds

    def wait(self):
        time.sleep(self.seconds)


def test_the_timer_measures_waits_for_reductions_in_flight_only(monkeypatch, capsys):
    """A wait with a REDUCE in flight is timed (and its launch-to-done time), one without is not; each training
    call prints one line that parse_waits reads back."""
    import torch.distributed as dist

    from megatron_pipemesh.runtime import sharding

    def finish(self):  # the runtime's finish_reduce: wait for the reduce-scatters, then forget them
        for work in self.pending:
            work.wait()
        self.pending = []

    def reduce(self):
        self.pending = [_Work(0.05)]
        return 0

    monkeypatch.setattr(sharding.ChunkSharding, "finish_reduce", finish)
    monkeypatch.setattr(sharding.ChunkSharding, "reduce", reduce)
    monkeypatch.setattr(sharding.ProgramSharding, "end", lambda self: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    script = _script()
    script.install_wait_timer()
    chunk = sharding.ChunkSharding.__new__(sharding.ChunkSharding)
    chunk.chunk, chunk.pending = 1, []
    program = sharding.ProgramSharding.__new__(sharding.ProgramSharding)
    chunk.finish_reduce()  # nothing in flight: not a wait
    chunk.reduce()
    chunk.finish_reduce()
    program.end()
    program.end()  # a call without reductions
    waits = script.parse_waits("other rank output\n" + capsys.readouterr().out)
    (seconds, done), (none, no_done) = waits[3][1], waits[3][2]
    assert 0.05 <= seconds < 1.0 and seconds <= done < 1.0 and none == no_done == 0.0


def test_measured_wait_is_the_median_of_measured_calls_averaged_over_data_parallel_ranks():
    """Calls up to the warm-up are dropped; pipeline rank = global rank // 2 (PP=2 x DP=2, Megatron's order)."""
    script = _script()
    runs = [{"waits": {"0": {"1": [9.0, 0], "2": [0.1, 0], "3": [0.3, 0]}, "1": {"2": [0.2, 0], "3": [0.2, 0]},
                       "2": {"2": [0.0, 0]}, "3": {"2": [0.4, 0]}}},
            {"waits": {"0": {"2": [0.2, 0]}, "1": {"1": [5.0, 0]}, "2": {}, "3": {}}}]
    assert script.measured_wait_ms(runs, warmup=1) == pytest.approx([200.0, 200.0])
