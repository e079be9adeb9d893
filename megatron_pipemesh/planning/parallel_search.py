"""The advice's layout search on several worker processes, with the same rows as the sequential search
(:func:`.advice.search_layouts` with ``jobs`` 1), to the float.

The sequential search walks the candidates in order of their bound and simulates a side (PipeMesh, stock) of a
candidate while its bound is below that side's best time so far, its limit; a result replaces the best only if it is
strictly faster. Here the sides of the candidates are tasks run by the workers in that order, each with the least time
known when it starts (the initial rows and every result returned so far, all of earlier candidates) as its
incumbent, and the parent then applies the sequential rule candidate by candidate, in order:

* every time known when a task starts is a real time of an earlier candidate, so it is never below the limit the
  sequential search has at that candidate: a task is started wherever the sequential search simulates, and more
  often, never less;
* a search given a larger incumbent finds the same plan wherever the plan beats the smaller one (the planner and
  stock's search prune only what cannot beat their incumbent, and what the larger one adds is slower than the
  smaller), so the result the parent accepts is the sequential search's;
* the parent counts, accepts and stops exactly where the sequential search does (``max_simulated`` included): the
  counts of :class:`.advice.SearchLog` are the sequential search's, and the extra simulations the workers ran
  (tasks the sequential search would have pruned) are not counted there.

A worker drops its task at its next simulation once the parent has published, on the pool's board, a limit at or
below the task's bound (then the sequential search prunes it too), and every task once the search has ended.

``deadline_s`` (``--search-seconds``) is the one part that is not the sequential search's: no task starts after it,
a task whose side has a row stops at its next simulation after it, and the search keeps the candidates whose results
came back before it, in order, and stops at the first one without, at the deadline (a task whose side has no row yet
is waited for); so, as with one process, the rows then depend on the machine's speed.
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from .pool import WorkerPool
from .search_control import progress_line, stopped

AdviceProblem = AdviceCluster = AdviceRow = SearchLog = Candidate = Any
"""The advice's types (:mod:`.advice`, which calls this module with its own pieces: it is not imported here)."""

SIDES = ("pipemesh", "stock")
"""The two sides, in the order the sequential search simulates them within a candidate (and their board slots)."""

INF = float("inf")

POLL_S = 0.2
"""Seconds the parent waits for a result before it looks again at its stop request and its deadline."""


def search_parallel(problem: AdviceProblem, cluster: AdviceCluster, found: Sequence[Candidate],
                    best_pm: Optional[AdviceRow], best_st: Optional[AdviceRow], pipemesh: bool, stock: bool,
                    pm_incumbent_s: float, log: SearchLog, max_simulated: Optional[int], deadline_s: Optional[float],
                    progress, jobs: int, run_side: Callable, say: Callable,
                    heartbeat_s: float, stop=None) -> Tuple[Optional[AdviceRow], Optional[AdviceRow]]:
    """:func:`.advice.search_layouts` on ``jobs`` workers (module docstring); the same arguments, with the time limit
    as ``deadline_s``, a :func:`time.monotonic` instant (None: none), and the advice's own pieces: ``run_side`` (one
    task in a worker, :func:`.advice.run_side`), ``say`` (a row found, to ``progress``), ``heartbeat_s`` and ``stop``
    (a :class:`.search_control.StopRequest`)."""

    best = {"pipemesh": best_pm, "stock": best_st}
    searched = {"pipemesh": pipemesh, "stock": stock}

    def limit(side: str) -> float:
        """The side's limit at the next candidate to reduce, as the sequential search has it (before its cap)."""
        if not searched[side]:
            return -INF
        row = best[side]
        own = row.iteration_s if row is not None else INF
        return min(own, pm_incumbent_s) if side == "pipemesh" else own

    def capped(side: str) -> bool:
        return max_simulated is not None and log.simulated[side] >= max_simulated

    def wanted(candidate: Candidate, side: str, side_limit: float) -> bool:
        return (side == "stock" or candidate.vpp >= 2) and candidate.bound_s < side_limit

    # Every real time seen so far per side: a limit at or above the sequential search's at any later candidate.
    known = {side: limit(side) for side in SIDES}
    results: Dict[Tuple[int, str], Tuple[str, Optional[AdviceRow]]] = {}
    running: Dict[Future, Tuple[int, str, float]] = {}
    stoppable: Dict[Tuple[int, str], bool] = {}  # (candidate, side) -> its task stops at the deadline (the side has a row)
    next_submit, reduced = 0, 0
    submitting, out_of_time, done = True, False, False
    next_beat = time.monotonic() + heartbeat_s

    pool = WorkerPool(jobs, board_size=len(SIDES))
    try:
        shared = pool.board

        def publish() -> None:
            for slot, side in enumerate(SIDES):
                shared[slot] = -INF if done or capped(side) else limit(side)

        publish()
        while not done:
            if stopped(None, stop):  # a signal: keep what is reduced, drop the rest now
                log.stop("interrupted", found[reduced].bound_s if reduced < len(found) else INF)
                done = True
                break
            # Start tasks in candidate order, each with the least time known, while workers are free.
            while submitting and len(running) < jobs and next_submit < len(found):
                if stopped(deadline_s, None):
                    submitting, out_of_time = False, True
                    break
                candidate = found[next_submit]
                limits = {side: -INF if capped(side) else known[side] for side in SIDES}
                if candidate.bound_s >= max(limits.values()):
                    submitting = False  # sorted by bound: no later candidate is wanted either
                    break
                for side in SIDES:
                    if wanted(candidate, side, limits[side]):
                        future = pool.submit(run_side, problem, cluster, candidate, side, limits[side], deadline_s,
                                             best[side] is not None)
                        running[future] = (next_submit, side, time.monotonic())
                        stoppable[(next_submit, side)] = best[side] is not None
                next_submit += 1
            # Reduce in candidate order with the sequential rule, as far as the results allow.
            while not done and reduced < len(found):
                candidate = found[reduced]
                limits = {}
                for side in SIDES:
                    limits[side] = limit(side)
                    if capped(side) and wanted(candidate, side, limits[side]):
                        log.stop("max_simulated", candidate.bound_s)
                    if capped(side) and (side == "stock" or candidate.vpp >= 2):
                        limits[side] = -INF
                if candidate.bound_s >= max(limits.values()):
                    done = True
                    break
                needed = [side for side in SIDES if wanted(candidate, side, limits[side])]
                missing = [side for side in needed if (reduced, side) not in results]
                if missing:
                    if reduced >= next_submit and out_of_time:  # never started: the time had passed
                        log.stop("search_seconds", candidate.bound_s)
                        done = True
                        break
                    # Past the deadline, a task whose side has a row is dropped at its next simulation: its result
                    # would not come back before the deadline, so the search ends now, with the sides back so far.
                    late = stopped(deadline_s, None) and all(stoppable.get((reduced, side)) for side in missing)
                    if not late:
                        if reduced < next_submit and not any(task[:2] == (reduced, side) for task in running.values()
                                                             for side in missing):
                            raise AssertionError(f"{candidate.describe()}: the sequential search simulates its "
                                                 f"{missing[0]} side, which no worker was given")
                        break
                for side in needed:
                    if (reduced, side) not in results:  # late (above): the candidate in progress is abandoned here
                        log.stop("search_seconds", candidate.bound_s)
                        done = True
                        break
                    log.simulated[side] += 1
                    status, row = results[(reduced, side)]
                    if status == "time_up":
                        log.stop("search_seconds", candidate.bound_s)
                        done = True
                        break
                    if status != "done":
                        raise AssertionError(f"{candidate.describe()} ({side}) was dropped at a limit at or below its "
                                             f"bound {candidate.bound_s}, but the sequential search's is "
                                             f"{limits[side]}")
                    if row is not None and row.iteration_s < limits[side]:
                        best[side] = row
                        say(progress, row)
                for side in SIDES:
                    results.pop((reduced, side), None)
                reduced += 1
                publish()
            if reduced >= len(found):
                done = True
            if done:
                break
            if not running:
                raise AssertionError(f"the layout search waits at candidate {reduced} of {len(found)} with no task "
                                     "running")
            finished, _ = wait(list(running), timeout=POLL_S, return_when=FIRST_COMPLETED)
            for future in finished:
                index, side, _ = running.pop(future)
                status, row = future.result()
                results[(index, side)] = (status, row)
                if row is not None:
                    known[side] = min(known[side], row.iteration_s)
            if progress is not None and time.monotonic() >= next_beat:
                progress(progress_line(found, reduced, max(limit(side) for side in SIDES),
                                       [(found[index], side, since) for index, side, since in sorted(running.values())],
                                       best["pipemesh"], best["stock"], deadline_s))
                next_beat = time.monotonic() + heartbeat_s
        publish()  # done: every task still running drops at its next simulation
    except BrokenProcessPool:
        if not stop:  # a worker ended by something else than this search's stop
            raise
        log.stop("interrupted", found[reduced].bound_s if reduced < len(found) else INF)
    finally:
        # Stopped (a signal or the deadline), what still runs is dropped anyway: end it now rather than at its next
        # simulation, which may be seconds away.
        pool.close(abandon=bool(stop) or log.stopped_by == "search_seconds")
    return best["pipemesh"], best["stock"]
