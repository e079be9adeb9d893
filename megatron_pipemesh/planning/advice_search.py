"""The advice's search (:mod:`.advice`): PipeMesh's plan and stock's best setting for one candidate, the rows they
make, the user's own layout, and the layout search over the candidates in order of their bound.

Pure: no torch, no Megatron.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Tuple

from ..schedule.config import ScheduleConfig, ScheduleConfigError
from ..schedule.levers import RECOMPUTE_ONLY
from .advice_candidates import Candidate
from .advice_rows import AdviceCluster, AdviceProblem, AdviceRow, SearchLog
from .bounds import virtual_sizes
from .clusters import costs_for
from .costs import GB
from .planner import NoFeasiblePlan, Plan, PlannerOptions, fit_with_recompute, plan_schedule
from .planner_options import structured_options
from .pool import board
from .search_control import StopRequest, progress_line, stopped
from .simulator import SearchTimeUp, TimeUp, simulate
from .stock import StockResult, activation_budget, best_stock, evaluate, uniform_plan


FIT_LIMIT = 3
"""Group lists fitted to the memory per (layout, V, split) at most, the fastest without memory levers first
(:attr:`.planner.PlannerOptions.fit_limit`). Fitting re-simulates a candidate once per recomputation or placement
round; with every list that may win fitted, one GPT-13B candidate of 16 ranks and 64 micro-batches took minutes.
The lists are simulated without levers first, so the three fitted are the three that are fastest before memory."""


def search_options(pp: int, microbatches: int, host_budget_bytes: Optional[float]) -> PlannerOptions:
    """PipeMesh's search for the advice: the structured group family (:func:`.planner_options.structured_options`),
    with host placement when host memory is given (recomputation only otherwise), fitting at most
    :data:`FIT_LIMIT` lists per candidate."""
    placement = "auto" if host_budget_bytes is not None else RECOMPUTE_ONLY
    return structured_options(pp, microbatches, placement, host_budget_bytes, FIT_LIMIT)


def host_bytes(cluster: AdviceCluster) -> Optional[float]:
    return None if cluster.host_memory_gb is None else cluster.host_memory_gb * GB


def plan_candidate(candidate: Candidate, cluster: AdviceCluster, incumbent_s: float = float("inf"),
          time_up: TimeUp = None) -> Optional[Plan]:
    """PipeMesh's best plan for one candidate (None: nothing fits or beats ``incumbent_s``; :class:`SearchTimeUp`
    when ``time_up`` says so)."""
    model, spec = candidate.model, candidate.cluster
    try:
        plan, _ = plan_schedule(candidate.layout.pp, candidate.vpp, candidate.microbatches,
                                lambda config: costs_for(model, spec, config, profile=candidate.profile),
                                cluster.budget_bytes,
                                search_options(candidate.layout.pp, candidate.microbatches, host_bytes(cluster)),
                                incumbent_s=incumbent_s, time_up=time_up)
    except (NoFeasiblePlan, ScheduleConfigError):
        return None
    return plan if plan.result.iteration_s < incumbent_s else None


def stock_candidate(candidate: Candidate, problem: AdviceProblem, cluster: AdviceCluster,
           incumbent_s: float = float("inf"), vpps: Optional[Sequence[int]] = None,
           time_up: TimeUp = None, groups: Optional[Sequence[Optional[int]]] = None) -> Optional[StockResult]:
    """Stock's best setting for one candidate's layout and split, at its V (or ``vpps``; ``groups``: only these group
    sizes, :func:`.stock.best_stock`)."""
    budget = activation_budget(candidate.model, candidate.cluster, candidate.layout.pp, cluster.budget_bytes,
                               candidate.vpp)
    host = host_bytes(cluster) if candidate.model.layer_spec == "te" else None
    return best_stock(candidate.model, candidate.cluster, candidate.layout.pp, candidate.microbatches, budget,
                      problem.grad_reduce_in_bf16, sharding=candidate.stock_sharding, host_limit=host,
                      vpps=vpps or (candidate.vpp,),
                      incumbent_s=incumbent_s, time_up=time_up, profile=candidate.profile, groups=groups)


FIRST_ROWS = 4
"""Candidates, least bound first, priced quickly before the layout search (:func:`first_row`): at large micro-batch
counts one candidate's whole search takes a minute per side, and the first rows bound it from the start."""


def first_row(problem: AdviceProblem, cluster: AdviceCluster, candidate: Candidate, side: str,
              deadline_s: Optional[float] = None, time_up: TimeUp = None) -> Optional[AdviceRow]:
    """A quick real row of ``candidate`` for ``side`` (None where nothing fits, or the time passed): PipeMesh's plan
    of Megatron's order (groups of p, the structured family's least activation memory) fitted to the memory with the
    search's levers, one group list where the search fits the three fastest of a hundred or more; stock's best setting
    at Megatron's default group size (g = p; 1F1B at V = 1), one schedule where the search tries every g. Stock's is
    one of the settings its search compares, so never faster than the candidate's ``best_layout_stock``; PipeMesh's may
    be faster than the search's (whose three lists are the fastest before memory levers, not after). ``deadline_s``
    (a :func:`time.monotonic` instant, for worker processes) or ``time_up``: asked before each simulation."""
    def late() -> bool:
        return stopped(deadline_s, None) is not None or (time_up is not None and time_up())

    try:
        if side == "pipemesh":
            config = ScheduleConfig.depth_first(candidate.layout.pp, candidate.vpp, candidate.microbatches)
            costs = costs_for(candidate.model, candidate.cluster, config, profile=candidate.profile)
            plan = fit_with_recompute(config, costs, cluster.budget_bytes,
                                      search_options(candidate.layout.pp, candidate.microbatches, host_bytes(cluster)),
                                      time_up=late)
            return plan_row("best_layout", candidate, plan) if plan.fits else None
        result = stock_candidate(candidate, problem, cluster, time_up=late,
                                 groups=(None,) if candidate.vpp == 1 else (candidate.layout.pp,))
        return None if result is None else stock_row("best_layout_stock", candidate, result, cluster)
    except (SearchTimeUp, ScheduleConfigError):
        return None


def first_tasks(found: Sequence[Candidate], pipemesh: bool, limits: Tuple[float, float]) -> List[Tuple[Candidate, str]]:
    """The (candidate, side) pairs :func:`first_row` prices: the :data:`FIRST_ROWS` least-bound candidates of each
    side (PipeMesh: V >= 2) whose bound is below that side's time so far (``limits``: PipeMesh's, stock's)."""
    tasks = []
    for side, limit in zip(("pipemesh", "stock"), limits):
        if side == "pipemesh" and not pipemesh:
            continue
        fit = [c for c in found if c.bound_s < limit and (side == "stock" or c.vpp >= 2)][:FIRST_ROWS]
        tasks += [(c, side) for c in fit]
    return tasks


def faster(row: Optional[AdviceRow], other: Optional[AdviceRow]) -> Optional[AdviceRow]:
    """The faster fitting row of the two (ties: ``row``)."""
    if other is None or not other.fits or (row is not None and row.fits and row.iteration_s <= other.iteration_s):
        return row
    return other


def stock_row(name: str, candidate: Candidate, result: StockResult, cluster: AdviceCluster) -> AdviceRow:
    setting = result.setting
    config = setting.config()
    peaks = tuple(a + s for a, s in zip(result.peak_activation_bytes, result.static_bytes))
    costs = costs_for(candidate.model, candidate.cluster, config, profile=candidate.profile,
                      levels=(setting.recompute.level,))
    compute = tuple(r.busy_s for r in simulate(config, costs, uniform_plan(config, setting.recompute.level)).ranks)
    layers = candidate.model.stage_layers(setting.pp, setting.vpp)
    return AdviceRow(name, candidate.layout, setting.vpp, candidate.split, layers, setting.microbatches,
                     result.iteration_s, peaks, all(p <= cluster.budget_bytes for p in peaks), compute, stock=setting,
                     micro_batch_size=candidate.micro_batch_size, added_flags=candidate.added_flags)


def plan_row(name: str, candidate: Candidate, plan: Plan) -> AdviceRow:
    config = plan.config
    return AdviceRow(name, candidate.layout, config.vpp, candidate.split,
                     candidate.model.stage_layers(config.pp, config.vpp), config.microbatches, plan.result.iteration_s,
                     tuple(r.peak_memory_bytes for r in plan.result.ranks), plan.fits,
                     tuple(r.busy_s for r in plan.result.ranks), plan=plan, micro_batch_size=candidate.micro_batch_size)


def user_candidate(problem: AdviceProblem, cluster: AdviceCluster, vpp: int) -> Candidate:
    layout = problem.layout
    spec = cluster.spec(layout.tp, layout.dp, problem.sequence_parallel, problem.distributed_optimizer,
                        problem.overlap, layout.cp, problem.cp_comm, layout.ep, layout.etp)
    return Candidate(layout, vpp, problem.model.layer_split, problem.model, spec, problem.microbatches(layout.dp), 0.0,
                      problem.profile)


def user_row(problem: AdviceProblem, cluster: AdviceCluster) -> AdviceRow:
    """The command as it is: its stock setting simulated, or its PipeMesh groups (fitted to the memory as the runtime's
    start-up planner fits them)."""
    user = user_candidate(problem, cluster, problem.vpp)
    if problem.stock is not None:
        budget = activation_budget(user.model, user.cluster, user.layout.pp, cluster.budget_bytes, problem.vpp)
        return stock_row("user", user, evaluate(problem.stock, user.model, user.cluster, budget, problem.profile),
                          cluster)
    if problem.pipemesh is None:  # --forward-groups auto: what its planner finds (the same search as ours)
        plan = plan_candidate(user, cluster)
        if plan is None:
            raise NoFeasiblePlan(f"the command's --forward-groups auto finds no plan that fits "
                                 f"{cluster.device_memory_gb:g} GiB per GPU")
        return plan_row("user", user, plan)
    costs = costs_for(user.model, user.cluster, problem.pipemesh, profile=problem.profile)
    plan = fit_with_recompute(problem.pipemesh, costs, cluster.budget_bytes,
                              search_options(user.layout.pp, user.microbatches, host_bytes(cluster)))
    return plan_row("user", user, plan)


class UserLayout:
    """Stock's best setting over V and PipeMesh's plan for the user's layout (the ``best_stock`` and ``pipemesh``
    rows), and the first rows (:meth:`start_first`, :meth:`first_rows`): with ``jobs`` > 1 on two worker processes
    while the caller prices the user's command and bounds the candidates, else when asked. The same functions either
    way, so the same rows. A ``stop`` request ends them (:class:`.simulator.SearchTimeUp` from :meth:`stock` /
    :meth:`plan`); while they run, ``progress`` hears every :data:`HEARTBEAT_S` what is being priced."""

    def __init__(self, problem: AdviceProblem, cluster: AdviceCluster, user: Candidate, pipemesh: bool, jobs: int,
                 stop: Optional["StopRequest"] = None, progress: "Progress" = None):
        from .pool import WorkerPool, jobs_here

        self._args = (user, problem, cluster, virtual_sizes(problem.model, problem.layout.pp))
        self._pipemesh, self._stop, self._progress = pipemesh, stop, progress
        self._started = time.monotonic()
        self._next_beat = self._started + HEARTBEAT_S
        self._pool = WorkerPool(min(2, jobs_here(jobs))) if jobs_here(jobs) > 1 else None
        self._stock = self._plan = None
        self._first: List[Tuple[Candidate, str, object]] = []
        if self._pool is not None:
            user, problem, cluster, vpps = self._args
            self._stock = self._pool.submit(stock_candidate, user, problem, cluster, float("inf"), vpps)
            self._plan = self._pool.submit(plan_candidate, user, cluster) if pipemesh else None

    def __enter__(self) -> "UserLayout":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:  # a first row still running is not waited for (it was left out)
            self._pool.close(abandon=bool(self._stop) or any(not future.done() for _, _, future in self._first))

    def _beat(self, what: str) -> bool:
        """Progress when due; True when asked to stop."""
        if self._progress is not None and time.monotonic() >= self._next_beat:
            self._progress(f"pricing {what} ({time.monotonic() - self._started:.0f} s so far)")
            self._next_beat = time.monotonic() + HEARTBEAT_S
        return bool(self._stop)

    def _wait(self, future, what: str, deadline_s: Optional[float] = None):
        """``future``'s result; None once ``deadline_s`` (a :func:`time.monotonic` instant) has passed."""
        from concurrent.futures import TimeoutError as Waiting
        from concurrent.futures.process import BrokenProcessPool

        while True:
            if stopped(deadline_s, None) and not future.done():
                return None
            try:
                return future.result(timeout=0.2)
            except Waiting:
                if self._beat(what):
                    raise SearchTimeUp("interrupted") from None
            except BrokenProcessPool:
                if self._stop:  # its workers were ended with the signal
                    raise SearchTimeUp("interrupted") from None
                raise

    def stock(self) -> Optional[StockResult]:
        what = "stock's settings (every V, group size, recomputation) for your layout"
        if self._pool is not None:
            return self._wait(self._stock, what)
        user, problem, cluster, vpps = self._args
        return stock_candidate(user, problem, cluster, vpps=vpps, time_up=lambda: self._beat(what))

    def plan(self) -> Optional[Plan]:
        if not self._pipemesh:
            return None
        what = "PipeMesh's groups and placement for your layout"
        if self._pool is not None:
            return self._wait(self._plan, what)
        return plan_candidate(self._args[0], self._args[2], time_up=lambda: self._beat(what))

    def start_first(self, found: Sequence[Candidate], pipemesh: bool, deadline_s: Optional[float]) -> None:
        """With workers: queue :func:`first_row` for :func:`first_tasks` behind the user layout's rows (a worker done
        with stock's row takes them while the other prices PipeMesh's); nothing once stopped or past ``deadline_s``."""
        if self._pool is None or stopped(deadline_s, self._stop):
            return
        _, problem, cluster, _ = self._args
        self._first = [(candidate, side, self._pool.submit(first_row, problem, cluster, candidate, side, deadline_s))
                       for candidate, side in first_tasks(found, pipemesh, (float("inf"), float("inf")))]

    def first_rows(self, found: Sequence[Candidate], pipemesh: bool, limits: Tuple[float, float],
                   deadline_s: Optional[float]) -> Tuple[Optional[AdviceRow], Optional[AdviceRow]]:
        """(PipeMesh's, stock's) fastest :func:`first_row` strictly below ``limits`` (ties: the least bound), None
        where none is: the same rows with workers (which priced them from :meth:`start_first` on, with no limit) as
        without (pricing here only the candidates whose bound is below the limits, which no other could beat). A row
        not back by ``deadline_s`` is left out."""
        what = f"the first rows of the {FIRST_ROWS} least-bound candidates"
        if self._pool is not None:
            priced = [(candidate, side, self._wait(future, what, deadline_s)) for candidate, side, future in self._first]
        elif stopped(deadline_s, self._stop):
            priced = []
        else:
            _, problem, cluster, _ = self._args
            priced = [(candidate, side, first_row(problem, cluster, candidate, side, deadline_s,
                                                  lambda: self._beat(what)))
                      for candidate, side in first_tasks(found, pipemesh, limits)]
        best: List[Optional[AdviceRow]] = [None, None]
        for _, side, row in priced:
            slot = ("pipemesh", "stock").index(side)
            if row is not None and row.iteration_s < limits[slot]:
                best[slot] = faster(best[slot], row)  # which keeps only a row that fits
        return best[0], best[1]


Progress = Optional[Callable[[str], None]]
"""Where the search says what it is doing, one line at a time (the CLI's stderr); None: silent."""

HEARTBEAT_S = 5.0
"""Seconds between the layout search's progress lines (what is being simulated, how many candidates are left)."""


def search_layouts(problem: AdviceProblem, cluster: AdviceCluster, found: Sequence[Candidate],
                   best_pm: Optional[AdviceRow] = None, best_st: Optional[AdviceRow] = None, pipemesh: bool = True,
                   stock: bool = True, pm_incumbent_s: float = float("inf"), log: Optional[SearchLog] = None,
                   max_simulated: Optional[int] = None, time_up: TimeUp = None,
                   progress: Progress = None, jobs: int = 1,
                   deadline_s: Optional[float] = None,
                   stop: Optional[StopRequest] = None) -> Tuple[Optional[AdviceRow], Optional[AdviceRow]]:
    """The fastest PipeMesh and stock rows over ``found`` (sorted by bound), each side starting from its given row
    (or, for PipeMesh, from ``pm_incumbent_s``, a time reached otherwise): a candidate is simulated for a side only
    while its bound is below that side's best time, and the search stops once the bound reaches both. A side that is
    not searched (``pipemesh`` / ``stock`` False) keeps its given row. ``log`` records what was simulated.

    Limits (None: none), each recorded in ``log`` with the least bound left: ``max_simulated`` stops a side after
    that many candidates; ``time_up`` (asked between candidates and between the simulations of one) stops both sides
    once it says the time has passed, abandoning the candidate in progress unless its side has no row yet. Either way
    the rows are real plans, and no candidate left runs faster than that bound. ``deadline_s`` (a
    :func:`time.monotonic` instant) is the same limit as ``time_up`` given as the time it passes. ``stop`` (a
    :class:`StopRequest`, e.g. a signal): the search stops at once, the candidate in progress abandoned whatever its
    side has ('interrupted' in ``log``).

    ``jobs`` > 1 (1 inside a worker, :func:`.pool.jobs_here`): the candidates are simulated on that many worker
    processes (:mod:`.parallel_search`) with the same rows and counts as here, to the float, when no time limit stops
    the search (``time_up`` cannot be sent to a worker: give ``deadline_s``)."""
    log = log if log is not None else SearchLog()
    from .pool import jobs_here

    jobs = jobs_here(jobs)
    if jobs > 1 and len(found) > 1:
        if time_up is not None:
            raise ValueError("search_layouts: a time_up function cannot be sent to worker processes; give deadline_s "
                             "(a time.monotonic() instant), or jobs=1")
        from .parallel_search import search_parallel

        return search_parallel(problem, cluster, found, best_pm, best_st, pipemesh, stock, pm_incumbent_s, log,
                               max_simulated, deadline_s, progress, jobs, run_side, say_row, HEARTBEAT_S, stop)

    def why() -> Optional[str]:
        return stopped(deadline_s, stop) or ("search_seconds" if time_up is not None and time_up() else None)

    next_beat = [time.monotonic() + HEARTBEAT_S]
    now_on: List[Tuple[Candidate, str, float]] = []

    def beat(index: int, limit_s: float) -> None:
        if progress is not None and time.monotonic() >= next_beat[0]:
            progress(progress_line(found, index, limit_s, now_on, best_pm, best_st, deadline_s))
            next_beat[0] = time.monotonic() + HEARTBEAT_S

    def asker(index: int, limit_s: float, may_stop: bool) -> Callable[[], bool]:
        """Asked before each simulation inside a candidate: progress when due; time up only if ``may_stop`` (a side
        without a row finishes its first candidate), an interruption always."""
        def ask() -> bool:
            beat(index, limit_s)
            return stopped(None, stop) is not None or (may_stop and why() is not None)
        return ask

    for index, candidate in enumerate(found):
        pm_limit = min(best_pm.iteration_s if best_pm else float("inf"), pm_incumbent_s) if pipemesh else -float("inf")
        st_limit = (best_st.iteration_s if best_st else float("inf")) if stock else -float("inf")
        if max_simulated is not None:  # a capped side stops at the first candidate it would have simulated
            if log.simulated["pipemesh"] >= max_simulated and candidate.vpp >= 2 and candidate.bound_s < pm_limit:
                log.stop("max_simulated", candidate.bound_s)
                pm_limit = -float("inf")
            if log.simulated["stock"] >= max_simulated and candidate.bound_s < st_limit:
                log.stop("max_simulated", candidate.bound_s)
                st_limit = -float("inf")
        limit = max(pm_limit, st_limit)
        if candidate.bound_s >= limit:
            break  # sorted by bound: no later candidate beats either side
        reason = why()
        if reason is not None:
            log.stop(reason, candidate.bound_s)
            break
        now_on[:] = [(candidate, "pipemesh" if candidate.vpp >= 2 and candidate.bound_s < pm_limit else "stock",
                      time.monotonic())]
        beat(index, limit)
        try:
            if candidate.vpp >= 2 and candidate.bound_s < pm_limit:
                log.simulated["pipemesh"] += 1
                now_on[:] = [(candidate, "pipemesh", time.monotonic())]
                plan = plan_candidate(candidate, cluster, pm_limit, asker(index, limit, best_pm is not None))
                if plan is not None:
                    best_pm = plan_row("best_layout", candidate, plan)
                    say_row(progress, best_pm)
            if candidate.bound_s < st_limit:
                log.simulated["stock"] += 1
                now_on[:] = [(candidate, "stock", time.monotonic())]
                result = stock_candidate(candidate, problem, cluster, st_limit,
                                         time_up=asker(index, limit, best_st is not None))
                if result is not None and result.iteration_s < st_limit:
                    best_st = stock_row("best_layout_stock", candidate, result, cluster)
                    say_row(progress, best_st)
        except SearchTimeUp:
            log.stop(stopped(None, stop) or "search_seconds", candidate.bound_s)
            break
    return best_pm, best_st


def run_side(problem: AdviceProblem, cluster: AdviceCluster, candidate: Candidate, side: str, incumbent_s: float,
             deadline_s: Optional[float], may_stop: bool) -> Tuple[str, Optional[AdviceRow]]:
    """One task, in a worker: ``side`` of ``candidate`` searched below ``incumbent_s``. Returns ('done', its row or
    None when nothing fits or beats the incumbent), ('pruned', None) when the board's limit for the side fell to the
    candidate's bound or below, or ('time_up', None) when ``deadline_s`` (a :func:`time.monotonic` instant) passed
    and ``may_stop``."""
    slot = ("pipemesh", "stock").index(side)  # the board's slots (:data:`.parallel_search.SIDES`)
    why: List[str] = []

    def time_up() -> bool:
        shared = board()
        if shared is not None and candidate.bound_s >= shared[slot]:
            why.append("pruned")
            return True
        if may_stop and deadline_s is not None and time.monotonic() >= deadline_s:
            why.append("time_up")
            return True
        return False

    try:
        if side == "pipemesh":
            plan = plan_candidate(candidate, cluster, incumbent_s, time_up)
            return "done", None if plan is None else plan_row("best_layout", candidate, plan)
        result = stock_candidate(candidate, problem, cluster, incumbent_s, time_up=time_up)
        if result is None or not result.iteration_s < incumbent_s:
            return "done", None
        return "done", stock_row("best_layout_stock", candidate, result, cluster)
    except SearchTimeUp:
        return why[-1], None


def say_row(progress: Progress, row: Optional[AdviceRow]) -> None:
    if progress is not None and row is not None:
        progress(f"{row.name}: {row.iteration_s:.3f} s{'' if row.fits else ' (does not fit)'}, {row.describe()}")
