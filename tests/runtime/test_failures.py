"""Failures end with a clear error naming rank and step, never a hang."""
import time

import pytest

from tests import megatron_harness as h


def test_plan_mismatch_is_detected_at_start_up():
    with pytest.raises(h.WorkerError) as info:
        h.run_worker("tests.runtime.workers:plan_mismatch", nproc=2, timeout=90)
    text = str(info.value)
    assert "ranks disagree on the PipeMesh plan" in text
    assert "--forward-groups 6 2 --backward-groups 4 4" in text and "--forward-groups 2 2 2 2" in text


def test_stuck_peer_times_out_naming_rank_step_and_op():
    start = time.monotonic()
    with pytest.raises(h.WorkerError) as info:
        h.run_worker("tests.runtime.workers:faulty_peer", nproc=2, timeout=90, kwargs={"mode": "stuck", "timeout_s": 4})
    assert time.monotonic() - start < 60
    text = str(info.value)
    assert "rank 0 (pipeline rank 0), step" in text
    assert "timed out after 4 s" in text or "Timed out" in text or "timeout" in text.lower()


def test_killed_peer_ends_the_job():
    start = time.monotonic()
    with pytest.raises(h.WorkerError) as info:
        h.run_worker("tests.runtime.workers:faulty_peer", nproc=2, timeout=90, kwargs={"mode": "killed", "timeout_s": 20})
    assert time.monotonic() - start < 60
    text = str(info.value)
    assert "exitcode  : 17" in text or "rank 0 (pipeline rank 0), step" in text
