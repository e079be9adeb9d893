"""planning/search_control.py: a stop request, why the search must stop, and the progress line."""
import time
from types import SimpleNamespace

from megatron_pipemesh.planning.search_control import StopRequest, brief, progress_line, stopped


def _candidate(words: str, bound: float):
    return SimpleNamespace(describe=lambda: words, bound_s=bound)


def test_the_first_stop_request_wins_and_stops_before_the_deadline():
    stop = StopRequest()
    assert not stop and stopped(None, stop) is None and stopped(time.monotonic() + 60, stop) is None
    assert stopped(time.monotonic() - 1, stop) == "search_seconds"
    stop.request("SIGTERM")
    stop.request("SIGINT")
    assert stop and stop.reason == "SIGTERM" and stopped(time.monotonic() - 1, stop) == "interrupted"


def test_a_progress_line_counts_what_may_still_beat_the_rows_and_says_what_runs():
    """Done candidates, the rest split by their bound against the larger best time, what runs for how long (runs of
    equal layer counts written once), the best times, the time left."""
    found = [_candidate(f"TP1 PP4 DP2 V=2, layers 0/{'/'.join(['2'] * 6)}/1 mbs {i}", 1.0 + i) for i in range(6)]
    best = SimpleNamespace(iteration_s=4.5)
    line = progress_line(found, 2, 4.5, [(found[2], "stock", time.monotonic() - 3)], None, best,
                         time.monotonic() + 30)
    assert line.startswith("2 of 6 candidates done, 2 left whose bound may beat the rows (2 ruled out); simulating "
                           "TP1 PP4 DP2 V=2, layers 0/2x6/1 mbs 2 (stock, bound 3.000 s, 3 s so far)")
    assert "best stock 4.500 s" in line and "PipeMesh" not in line and line.endswith("s to the deadline")
    assert brief(_candidate("TP8 PP8 DP4 V=2", 1.0)) == "TP8 PP8 DP4 V=2"
