"""scripts/group_compute_check.py: a rank's compute is read from the runtime's own interval lines (the schedule's time
less its waits, past the warm-up), and group sizes that do not divide m are refused before anything runs."""
from __future__ import annotations

import subprocess
import sys

import pytest

from .helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import group_compute_check as check  # noqa: E402

from megatron_pipemesh.integration.report import format_interval  # noqa: E402


def _line(iteration: int, fb, pipeline, dp) -> str:
    figures = [{"pipeline_wait_ms": p, "dp_wait_ms": d, "forward_backward_ms": f, "peak_activation_mib": 0.0,
                "memory_source": None, "iterations": 1, "peak_host_mib": 0.0} for f, p, d in zip(fb, pipeline, dp)]
    return "[rank 0] " + format_interval(iteration, figures)


def test_compute_is_the_schedule_less_its_waits_past_the_warm_up():
    lines = [_line(i, (1000.0 + i, 900.0), (100.0, 50.0), (10.0, 0.0)) for i in range(1, check.WARMUP + 4)]
    lines[0] = _line(1, (9999.0, 9999.0), (0.0, 0.0), (0.0, 0.0))  # a warm-up iteration: not counted
    got = check.compute_per_rank("\n".join(["Megatron's own line", *lines]))
    counted = [1000.0 + i - 110.0 for i in range(check.WARMUP + 1, check.WARMUP + 4)]
    assert got == pytest.approx([sorted(counted)[1], 850.0])
    assert check.compute_per_rank("no interval line") is None


def test_a_group_size_that_does_not_divide_m_is_refused():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "group_compute_check.py"), "--groups", "2", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--groups 3: each must be >= 2 (p) and divide m = 16" in proc.stderr, proc.stderr
