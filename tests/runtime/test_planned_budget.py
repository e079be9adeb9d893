"""A CPU training step under a tight memory budget: the planner recomputes, the measured activation
peak of every rank stays within the budget, and losses and gradients equal the run without
recomputation."""
from tests import megatron_harness as h


def test_tight_budget_recomputes_stays_within_budget_and_keeps_numerics():
    """At 70% of the unplanned peak: recomputation, peaks within budget, numerics of a plain run."""
    results = h.run_worker("tests.runtime.workers:planned_under_budget", nproc=2, kwargs={"budget_fraction": 0.7})
    merged_plain = h.merge_rank_results([r["plain"] for r in results])
    merged_planned = h.merge_rank_results([r["planned"] for r in results])
    for r in results:
        assert r["recomputed"] > 0, r["groups"]
        assert r["predicted_peak"] <= r["budget"]
        assert r["measured_peak"] <= r["budget"], (r["measured_peak"], r["budget"])
    assert merged_planned["losses"] == merged_plain["losses"]
    diffs = h.compare_grads(merged_planned["grads"], merged_plain["grads"])
    assert max(diffs.values()) <= 1e-6
