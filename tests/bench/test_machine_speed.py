"""The machine's own speed (bench/machine_speed.py): a reading times the block on every core; drift compares
medians of readings, slower positive."""
import os

import pytest

from megatron_pipemesh.bench.machine_speed import drift, reference_s, time_blocks


def test_every_core_times_blocks_and_a_reading_is_their_median():
    found = time_blocks(0.3)
    assert len(found) == len(os.sched_getaffinity(0)) and all(len(samples) >= 1 for samples in found)
    assert all(0 < seconds < 1 for samples in found for _, seconds in samples)
    assert 0 < reference_s(0.3) < 1


def test_drift_is_the_ratio_of_medians_less_one():
    assert drift([1.1, 1.2, 1.0], [1.0, 1.0]) == pytest.approx(0.1)
    assert drift([0.9], [1.0]) == pytest.approx(-0.1)
    assert drift([], [1.0]) is None and drift([1.0], []) is None
