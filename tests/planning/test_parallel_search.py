"""planning/parallel_search.py: the layout search on worker processes gives the sequential search's rows and counts,
to the float; what it relies on (a larger incumbent finds the same row wherever the row beats the smaller); the
time limit and the cap on worker processes; no nested pools."""
import dataclasses
import time

import pytest

from megatron_pipemesh.planning import advice as adv
from megatron_pipemesh.planning import pool
from megatron_pipemesh.planning.advice import ROWS, AdviceCluster, AdviceProblem, ParallelLayout, advise, candidates
from megatron_pipemesh.planning.costs import ModelSpec
from megatron_pipemesh.planning.advice import run_side
from megatron_pipemesh.planning.parallel_search import search_parallel
from megatron_pipemesh.planning.stock import StockSetting

# 16 layers on 4 nodes of 4 GPUs, 64 sequences: dozens of candidates, of which the search simulates several per side,
# and the host memory makes PipeMesh place activations (the planner's longest path).
MODEL = ModelSpec(num_layers=16, hidden_size=512, num_attention_heads=8, seq_length=512, micro_batch_size=1,
                  vocab_size=8192)
CLUSTER = AdviceCluster(nodes=4, gpus_per_node=4, nic_gbps=10.0, intra_node_gbps=100.0, device_memory_gb=1.0,
                        device_tflops=50.0, host_memory_gb=4.0)
PROBLEM = AdviceProblem(MODEL, ParallelLayout(1, 4, 4), 2, 64, StockSetting(4, 2, 16), distributed_optimizer=True)


def rows(advice):
    """What a user reads of each row: name, words, prediction, peaks, fit, and the plan's groups."""
    return {name: None if row is None else (row.describe(), row.iteration_s, row.peak_memory_bytes, row.fits,
                                            row.compute_s, row.stock, row.plan and row.plan.config)
            for name in ROWS for row in [advice.rows[name]]}


@pytest.fixture(scope="module")
def sequential():
    return advise(PROBLEM, CLUSTER, jobs=1)


def test_two_workers_give_the_sequential_rows_and_counts(sequential):
    """jobs 1 and 2 (and 3, more than the candidates running at once on this machine): the same rows to the float,
    the same counts of simulated candidates, the same notes. A worker's incumbent that pruned what the sequential
    search keeps, or a result accepted out of candidate order, would change a row or a count here."""
    assert sequential.search.simulated["pipemesh"] >= 3 and sequential.search.simulated["stock"] >= 3
    assert sequential.candidates > 20 and sequential.search.stopped_by is None
    for jobs in (2, 3):
        parallel = advise(PROBLEM, CLUSTER, jobs=jobs)
        assert rows(parallel) == rows(sequential), jobs
        assert parallel.search.simulated == sequential.search.simulated and parallel.notes == sequential.notes
        assert parallel.search.stopped_by is None and parallel.candidates == sequential.candidates


def test_a_larger_incumbent_finds_the_same_row_wherever_it_beats_the_smaller(sequential):
    """What the workers rely on: each side of a candidate searched below a larger incumbent returns the row searched
    below the smaller one wherever that row beats the smaller (and nothing below it where that one has nothing)."""
    found = candidates(PROBLEM, CLUSTER)[:6]
    checked = 0
    for candidate in found:
        for side in ("pipemesh", "stock"):
            if side == "pipemesh" and candidate.vpp < 2:
                continue
            status, free = run_side(PROBLEM, CLUSTER, candidate, side, float("inf"), None, False)
            assert status == "done"
            if free is None:
                continue
            for scale in (0.98, 1.0, 1.0001, 1.05):
                smaller = free.iteration_s * scale
                _, low = run_side(PROBLEM, CLUSTER, candidate, side, smaller, None, False)
                kept = free if free.iteration_s < smaller else None
                assert (low and low.describe(), low and low.iteration_s) == (kept and kept.describe(),
                                                                             kept and kept.iteration_s)
                checked += 1
    assert checked >= 8


def test_the_cap_on_candidates_is_the_sequential_searchs(sequential):
    """max_simulated (the study's cap) stops a side at the same candidate with one worker or two."""
    found = candidates(PROBLEM, CLUSTER)
    logs = [adv.SearchLog(), adv.SearchLog()]
    out = [adv.search_layouts(PROBLEM, CLUSTER, found, log=log, max_simulated=2, jobs=jobs)
           for log, jobs in zip(logs, (1, 2))]
    assert [(r.describe(), r.iteration_s) for r in out[0]] == [(r.describe(), r.iteration_s) for r in out[1]]
    assert logs[0].simulated == logs[1].simulated == {"pipemesh": 2, "stock": 2}
    assert (logs[0].stopped_by, logs[0].unsearched_bound_s) == (logs[1].stopped_by, logs[1].unsearched_bound_s)
    assert logs[0].stopped_by == "max_simulated"


def test_a_deadline_passed_stops_the_parallel_search_before_its_first_candidate(sequential):
    """With the time already up no worker starts a task: the search keeps the rows it was given and bounds what it left
    by the least candidate's bound, as the sequential search does."""
    found = candidates(PROBLEM, CLUSTER)
    log = adv.SearchLog()
    start = sequential.rows["pipemesh"]
    best_pm, best_st = adv.search_layouts(PROBLEM, CLUSTER, found, best_pm=start, log=log, jobs=2, deadline_s=0.0)
    assert best_pm is start and best_st is None
    assert log.stopped_by == "search_seconds" and log.unsearched_bound_s == found[0].bound_s
    assert log.simulated == {"pipemesh": 0, "stock": 0}
    with pytest.raises(ValueError, match="deadline_s"):
        adv.search_layouts(PROBLEM, CLUSTER, found, jobs=2, time_up=lambda: False)


def _a_long_side(problem, cluster, candidate, side, incumbent_s, deadline_s, may_stop):
    """A task whose simulation outlasts the deadline by far."""
    time.sleep(120)
    return "done", None


def test_past_the_deadline_the_search_ends_without_waiting_for_its_running_tasks(sequential):
    """A task whose side has a row stops at its next simulation after the deadline, and its result would come too late:
    the search ends at the deadline (its workers ended), not when the task notices, with the rows it had."""
    found = candidates(PROBLEM, CLUSTER)
    log = adv.SearchLog()
    pm, st = sequential.rows["pipemesh"], sequential.rows["best_stock"]
    started = time.monotonic()
    best_pm, best_st = search_parallel(PROBLEM, CLUSTER, found, pm, st, True, True, float("inf"), log, None,
                                       started + 1.0, None, 2, _a_long_side, adv.say_row, 5.0)
    assert time.monotonic() - started < 15
    assert best_pm is pm and best_st is st
    assert log.stopped_by == "search_seconds" and log.unsearched_bound_s == found[0].bound_s


_FAST: dict = {}


def _a_fast_pipemesh_side_and_a_long_stock_side(problem, cluster, candidate, side, incumbent_s, deadline_s, may_stop):
    if side == "stock":
        time.sleep(120)
    return "done", _FAST["row"]


def test_past_the_deadline_the_sides_back_before_it_are_kept(sequential):
    """A candidate whose PipeMesh side came back before the deadline and whose stock side did not: the PipeMesh row is
    taken (as the sequential search takes it before starting stock's), the stock side abandoned."""
    found = [c for c in candidates(PROBLEM, CLUSTER) if c.vpp >= 2]
    pm, st = sequential.rows["pipemesh"], sequential.rows["best_stock"]
    _FAST["row"] = dataclasses.replace(pm, name="best_layout", iteration_s=pm.iteration_s / 10)
    log = adv.SearchLog()
    best_pm, best_st = search_parallel(PROBLEM, CLUSTER, found, pm, st, True, True, float("inf"), log, None,
                                       time.monotonic() + 1.0, None, 2, _a_fast_pipemesh_side_and_a_long_stock_side,
                                       adv.say_row, 5.0)
    assert best_pm == _FAST["row"] and best_st is st
    assert log.stopped_by == "search_seconds" and log.unsearched_bound_s == found[0].bound_s


def _jobs_in_a_worker(jobs):
    return pool.jobs_here(jobs), pool.in_worker()


def test_a_worker_never_starts_workers():
    """Inside a pool's worker (a study row) a search runs on one process whatever it is asked; outside, as asked."""
    assert pool.jobs_here(3) == 3 and pool.jobs_here(None) == pool.default_jobs() >= 1 and not pool.in_worker()
    with pool.WorkerPool(2) as workers:
        assert workers.map(_jobs_in_a_worker, [4, None]) == [(1, True), (1, True)]
    with pytest.raises(ValueError, match="at least one worker"):
        pool.WorkerPool(0)


def test_the_study_row_advice_is_the_same_in_a_worker():
    """The study's rows run in the shared pool: a row's advice there (one process) is the one computed here."""
    from megatron_pipemesh.study.study import COMMODITY, run_study

    row = COMMODITY[0]
    here = run_study([row], jobs=1)[0]
    there = run_study([row, row], jobs=2)
    for out in there:
        assert out["advice_best_layout"] == here["advice_best_layout"]
        assert out["pipemesh_auto"] == here["pipemesh_auto"] and out["best_stock"] == here["best_stock"]


def test_a_stop_request_ends_the_parallel_search_with_real_rows(sequential, monkeypatch):
    """A stop request in the middle of the search (as a signal sets it; here at its first progress line): the search
    says it was interrupted, ends its workers, and what it keeps is real: the full search's best is at least the
    lesser of a kept row and the bound it left."""
    from megatron_pipemesh.planning import advice_search

    monkeypatch.setattr(advice_search, "HEARTBEAT_S", 0.0)
    found = candidates(PROBLEM, CLUSTER)
    stop = adv.StopRequest()
    log, lines = adv.SearchLog(), []
    best_pm, best_st = adv.search_layouts(PROBLEM, CLUSTER, found, log=log, jobs=2, stop=stop,
                                          progress=lambda line: lines.append(line) or stop.request("SIGINT"))
    assert log.stopped_by == "interrupted" and log.unsearched_bound_s is not None, lines
    assert sum(log.simulated.values()) < sum(sequential.search.simulated.values())
    for name, row in (("best_layout", best_pm), ("best_layout_stock", best_st)):
        full = sequential.rows[name].iteration_s
        assert full >= min(row.iteration_s if row else float("inf"), log.unsearched_bound_s) - 1e-12
