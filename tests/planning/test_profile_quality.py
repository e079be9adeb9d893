"""A profile's trustworthiness (planning/profile_quality.py): the median's confidence interval and the stability
rule, a piece's spread, and the load record that names the pieces other processes computed beside."""
import pytest

from megatron_pipemesh.planning.profile_quality import (MIN_STABLE_SAMPLES, PACE_WINDOW_S, LoadRecord, MachinePace,
                                                        Spread, is_stable, load_problem, median_interval, pace_of,
                                                        spread_of)


def test_the_median_interval_narrows_with_more_samples():
    """Below 6 samples the interval is the whole range; at 9 it drops the extreme on each side; at 20 the 6th and
    15th (the binomial rank interval at ~95%)."""
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) == (1.0, 5.0)
    assert median_interval([float(x) for x in range(1, 10)]) == (2.0, 8.0)
    assert median_interval([float(x) for x in range(1, 21)]) == (6.0, 15.0)


def test_stable_needs_enough_samples_and_a_narrow_interval():
    """A constant piece is stable from MIN_STABLE_SAMPLES on, never before; a spread of 10% either side is not
    stable at 2%, but is under a floor wider than its interval."""
    assert not is_stable([1.0] * (MIN_STABLE_SAMPLES - 1), 0.02, 0.0)
    assert is_stable([1.0] * MIN_STABLE_SAMPLES, 0.02, 0.0)
    noisy = [0.9, 1.1, 1.0, 0.95, 1.05, 0.9, 1.1]
    assert not is_stable(noisy, 0.02, 0.0)
    assert is_stable(noisy, 0.02, 0.2)
    assert is_stable(noisy, 0.11, 0.0)


def test_a_spread_keeps_quartiles_interval_and_whether_it_was_capped():
    spread = spread_of([4.0, 1.0, 3.0, 2.0, 5.0], stable=False)
    assert spread == Spread(samples=5, median_s=3.0, q1_s=2.0, q3_s=4.0, low_s=1.0, high_s=5.0, stable=False)
    assert spread.relative_half_width == pytest.approx(2 / 3) and spread.relative_iqr == pytest.approx(2 / 3)
    assert spread.describe() == "±66.7% (IQR 66.7%, 5 samples, capped)"
    assert Spread.from_dict(spread.to_dict()) == spread


def test_a_load_record_names_the_pieces_other_processes_computed_beside():
    """Only groups at or above the threshold count; the refusal names the load average and those pieces; an idle
    record, or none, is no problem."""
    busy = LoadRecord(cores=2, loadavg_before=(2.1, 1.0, 0.5), loadavg_after=(2.9, 1.2, 0.6),
                      others_cores={"layers mbs 1": 1.8, "embedding mbs 1": 0.05, "output mbs 1": 0.4})
    assert busy.affected == {"layers mbs 1": 1.8, "output mbs 1": 0.4}
    problem = load_problem(busy, "p.json")
    assert problem.startswith("p.json was timed while other processes computed on its 2 core(s)")
    assert "load average 2.10 -> 2.90" in problem and "layers mbs 1 (1.80 cores)" in problem
    assert "output mbs 1 (0.40 cores)" in problem and "embedding" not in problem
    assert LoadRecord.from_dict(busy.to_dict()) == busy
    idle = LoadRecord(cores=2, loadavg_before=(0.0,) * 3, loadavg_after=(0.0,) * 3, others_cores={"layers": 0.02})
    assert load_problem(idle) is None and load_problem(None) is None
    assert "no other process took" in idle.describe()


def test_a_pace_keeps_its_median_and_how_far_the_machine_moved_window_by_window():
    """Ticks over 25 s fall in three windows; the pace is the median of all, ``moved`` the windows' medians' range
    over it; the record survives its dictionary and says both."""
    ticks = [(100.0 + t, 0.002) for t in range(10)] + [(110.0 + t, 0.0024) for t in range(10)] + \
            [(120.0 + t, 0.0021) for t in range(5)]
    pace = pace_of("the block", ticks)
    assert pace.seconds == pytest.approx(0.0021) and pace.spread.samples == 25
    assert pace.window_medians_s == pytest.approx((0.002, 0.0024, 0.0021)) and PACE_WINDOW_S == 10.0
    assert pace.moved == pytest.approx(0.0004 / 0.0021)
    assert MachinePace.from_dict(pace.to_dict()) == pace
    assert pace.describe().startswith("machine pace 2.10 ms per block (the block, 25 rounds); the machine moved 19% "
                                      "across 3 windows of 10 s")
