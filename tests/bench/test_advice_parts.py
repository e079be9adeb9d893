"""`pipemesh bench --advice`'s parts of an iteration: predicted from a simulation, measured from Megatron's per-rank
timers, and which part a missed prediction got wrong."""
from types import SimpleNamespace

import pytest

from megatron_pipemesh.bench.advice_parts import (PARTS, RankParts, attribute, cause_text, measured_parts,
                                                  predicted_parts)
from megatron_pipemesh.bench.logparse import IterationRecord

PREDICTED = [RankParts(compute=1.0, p2p=0.2, dp=0.05, optimizer=0.05),
             RankParts(compute=1.0, p2p=0.2, dp=0.05, optimizer=0.05)]
"""Two pipeline ranks, 1.3 s per iteration each."""


def _scaled(parts, rank=None, **factors):
    """``parts`` with the named parts multiplied (on ``rank`` only, or every rank)."""
    out = []
    for r, p in enumerate(parts):
        values = p.to_dict()
        if rank is None or rank == r:
            values.update({k: values[k] * f for k, f in factors.items()})
        out.append(RankParts(**values))
    return out


def _iteration_s(parts):
    return max(p.total for p in parts)


def test_predicted_parts_add_up_to_the_iteration():
    """Compute is busy time, DP the exposed data-parallel time, p2p the rest of the idle time, and the optimizer
    what is left of the iteration: the four add up to the iteration on every rank."""
    ranks = [SimpleNamespace(busy_s=1.0, idle_s=0.5, exposed_dp_s=0.1), SimpleNamespace(busy_s=1.2, idle_s=0.25,
                                                                                       exposed_dp_s=0.0)]
    parts = predicted_parts(1.55, ranks)
    assert parts[0] == RankParts(compute=1.0, p2p=0.4, dp=0.1, optimizer=pytest.approx(0.05))
    assert parts[1].p2p == 0.25 and parts[1].optimizer == pytest.approx(0.1)
    assert all(p.total == pytest.approx(1.55) for p in parts)


def _record(iteration, elapsed_ms, per_rank):
    timers = {}
    for rank, values in per_rank.items():
        for name, ms in values.items():
            timers.setdefault(name, {})[rank] = ms
    return IterationRecord(iteration, elapsed_ms, timers=timers)


def test_measured_parts_from_megatron_timers():
    """Per rank: compute = forward + backward compute; DP = the finalize timers; p2p = forward-backward less both;
    the optimizer timer; other = the iteration less forward-backward and the optimizer. Medians over iterations,
    the data-parallel replicas of a stage averaged (global rank r is stage r // dp)."""
    def rank(fwd, bwd, sync, fb, opt):
        return {"forward-compute": fwd, "backward-compute": bwd, "all-grads-sync": sync,
                "embedding-grads-all-reduce": 1.0, "forward-backward": fb, "optimizer": opt}
    its = [_record(i, 1000.0 + i, {0: rank(300, 500, 49, 900, 50), 1: rank(300, 500, 99, 900, 50),
                                   2: rank(350, 550, 19, 950, 40), 3: rank(350, 550, 19, 950, 40)})
           for i in (2, 3, 4)]
    parts = measured_parts(its, pp=2, dp=2)
    assert len(parts) == 2
    assert parts[0].compute == pytest.approx(0.8) and parts[0].dp == pytest.approx(0.075)
    assert parts[0].p2p == pytest.approx(0.025) and parts[0].optimizer == pytest.approx(0.05)
    assert parts[0].other == pytest.approx(0.053)  # median elapsed 1003 ms - 900 - 50
    assert parts[1].compute == pytest.approx(0.9) and parts[1].dp == pytest.approx(0.02)
    assert parts[0].total == pytest.approx(1.003) and parts[1].total == pytest.approx(1.003)
    assert measured_parts([_record(2, 1000.0, {0: rank(1, 1, 1, 5, 1)})], pp=2, dp=1) is None  # rank 1 has no timers


@pytest.mark.parametrize("part", ["compute", "dp", "optimizer"])
def test_a_slower_part_is_named(part):
    """A row whose measured compute (DP wait, optimizer step) is above its prediction on every rank, enough to
    miss by more than 10%, is attributed to that part."""
    factor = {"compute": 1.3, "dp": 7.0, "optimizer": 7.0}[part]
    measured = _scaled(PREDICTED, **{part: factor})
    result = attribute(_iteration_s(PREDICTED), _iteration_s(measured), PREDICTED, measured)
    assert result["miss"] and result["cause"] == part
    assert result["differences_s"][part] == pytest.approx(PREDICTED[0].get(part) * (factor - 1))
    assert part.split()[0] in cause_text(result).lower()


def test_compute_30_percent_above_is_compute():
    measured = _scaled(PREDICTED, compute=1.3)
    result = attribute(1.3, 1.6, PREDICTED, measured)
    assert result["measured_over_predicted"] == pytest.approx(1.6 / 1.3)
    assert result["cause"] == "compute" and "compute (forward/backward compute) differs by +300 ms" in cause_text(result)


def test_slower_pipeline_transfers_are_p2p():
    """Every rank waits longer on pipeline transfers (a slower network than planned): p2p."""
    measured = _scaled(PREDICTED, p2p=2.5)
    result = attribute(1.3, 1.6, PREDICTED, measured)
    assert result["cause"] == "p2p"


def test_a_wait_caused_by_another_ranks_compute_is_compute():
    """Rank 0 computes 30% longer, so rank 1 waits that long for it: the wait is a consequence, compute the cause."""
    measured = _scaled(PREDICTED, rank=0, compute=1.3)
    measured[1] = RankParts(**{**measured[1].to_dict(), "p2p": measured[1].p2p + 0.3})
    result = attribute(1.3, 1.6, PREDICTED, measured)
    assert result["differences_s"]["p2p"] == pytest.approx(0.3) and result["cause"] == "compute"


def test_faster_than_predicted_names_the_part_that_was_overestimated():
    measured = _scaled(PREDICTED, compute=0.6)
    result = attribute(1.3, 0.9, PREDICTED, measured)
    assert result["miss"] and result["cause"] == "compute" and "-31%" in cause_text(result)


def test_within_ten_percent_is_no_miss():
    measured = _scaled(PREDICTED, compute=1.1)
    result = attribute(1.3, 1.4, PREDICTED, measured)
    assert not result["miss"] and result["cause"] is None and cause_text(result) == ""
    assert set(result["differences_s"]) == set(PARTS)


def test_a_miss_without_timers_says_so():
    result = attribute(1.0, 2.0, PREDICTED, None)
    assert result["miss"] and result["cause"] is None and "no timers" in cause_text(result)


def test_a_total_within_ten_percent_whose_parts_miss_is_cancelling_errors():
    """Compute 20% over and communication 150 ms under on one rank: the total holds (1.00), the parts do not, and the
    verdict says so with both parts named; within their limits (compute 5%, communication 40 ms, optimizer 15 ms) the
    row is within 10%."""
    from megatron_pipemesh.bench.advice_parts import judgement, part_misses

    predicted = [RankParts(compute=1.0, p2p=0.3, dp=0.1, optimizer=0.1)]
    cancelling = [RankParts(compute=1.2, p2p=0.2, dp=0.05, optimizer=0.05)]
    misses = part_misses(predicted, cancelling)
    assert misses == ["rank 0 compute +20% (1200 vs 1000 ms)", "rank 0 communication -38% (250 vs 400 ms)",
                      "rank 0 optimizer -50% (50 vs 100 ms)"]
    total = attribute(1.5, 1.5, predicted, cancelling)
    assert judgement(total, misses) == "within 10% only by cancelling errors"
    close = [RankParts(compute=1.05, p2p=0.34, dp=0.1, optimizer=0.085)]
    assert part_misses(predicted, close) == [] and judgement(attribute(1.5, 1.575, predicted, close), []) == "within 10%"
    assert judgement(attribute(1.5, 1.8, predicted, close), []) == "miss"
    assert part_misses(predicted, None) is None
    assert judgement(total, None) == "total within 10%, parts not measured"
