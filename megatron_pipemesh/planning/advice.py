"""What to run on a cluster: the user's command, the best stock flags and PipeMesh for its layout, and the best
parallel layout (TP x PP x DP, V, layer split) for the same GPUs with each, ranked by predicted iteration time.

The search prices every candidate with the planner's own costs and simulator, and prunes by lower bounds first:

* a parallel layout (:func:`parallel_layouts`): TP inside a node and dividing the heads, query groups and FFN; every
  PP, PP = 1 included (no pipeline: data parallel, Megatron's ``forward_backward_no_pipelining``, stock rows only:
  PipeMesh needs a pipeline); DP from the GPU count; the layouts the topology can describe (whole stages per node, or
  whole nodes per stage);
* per layout, every micro-batch size that divides the per-replica batch into at least p micro-batches
  (:func:`micro_batch_sizes`; the command's own first), priced from the profile where it measured that size;
* per layout and micro-batch size, every V the model allows (1 at PP = 1) and the layer splits of
  :func:`.layout.split_candidates` (the even split, and fewer layers on the stages that also hold the embedding and
  the output layer); at PP = 1 over DP > 1, stock also as Megatron recommends data parallelism where the command
  differs (:func:`_optimizers`): with the distributed optimizer (ZeRO-1, the sharding level Megatron's DDP offers)
  and with it and --overlap-grad-reduce --overlap-param-gather, the flags added;
* each (layout, V, split) gets the tight bound of any exact synchronous schedule (:func:`.bounds.bound_for`: memory
  ignored, so it bounds stock and PipeMesh alike) and is dropped if its weights, gradients and optimizer state alone
  exceed the memory; the rest are searched in order of that bound, on each side, until the bound reaches the best
  time found (PipeMesh: :func:`.planner.plan_schedule`, which prunes its group lists by their time without memory
  levers and their critical path and fits at most :data:`FIT_LIMIT` of them to the memory; stock:
  :func:`.stock.best_stock` at that V, which prunes by compute and critical path). :func:`search_layouts` is that
  loop (the study runs its PipeMesh side). It starts from the faster of the user layout's rows and the first rows
  (:func:`.advice_search.first_row`: the :data:`.advice_search.FIRST_ROWS` least-bound candidates, each priced on one
  schedule, Megatron's order), so that a search stopped early where one candidate's whole search takes minutes still
  answers with rows near the best. Stopped early (a time limit, ``pipemesh plan``'s default
  :data:`.defaults.SEARCH_SECONDS`; a stop request from a signal; or the study's cap on candidates), it keeps the rows
  found and records the least bound left (:class:`SearchLog`): no layout left unsearched runs faster than that, and a
  side with no row says its candidates were not reached. With ``jobs`` > 1 the loop runs on worker processes
  (:mod:`.parallel_search`), and so do the user layout's rows and the first rows, with the same rows to the float.

The rows (:class:`Advice`): ``user`` (the command as given), ``best_stock`` (stock's best V, group size,
recomputation, offloading for the user's layout and split), ``pipemesh`` (PipeMesh for the user's layout, V and
split), ``best_layout`` (PipeMesh's best over the layouts) and ``best_layout_stock`` (stock's). Rows that do not fit
the memory are never best.

Pure: no torch, no Megatron.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional

from .costs import ep_crosses_nic, ep_exchange_s
from .advice_candidates import OVERLAP_FLAGS, Candidate, candidates, micro_batch_sizes, parallel_layouts
from .advice_rows import (ROWS, Advice, AdviceCluster, AdviceProblem, AdviceRow, ParallelLayout, SearchLog,
                          tokens_per_s)
from .advice_search import (Progress, StopRequest, UserLayout, faster, run_side, say_row, search_layouts,
                            user_candidate, user_row, plan_row, stock_row)
from .simulator import SearchTimeUp

__all__ = ["ROWS", "OVERLAP_FLAGS", "Advice", "AdviceCluster", "AdviceProblem", "AdviceRow", "Candidate",
           "ParallelLayout", "SearchLog", "StopRequest", "advise", "candidates", "dispatch", "micro_batch_sizes",
           "parallel_layouts", "run_side",
           "search_layouts", "tokens_per_s"]


def advise(problem: AdviceProblem, cluster: AdviceCluster, search_seconds: Optional[float] = None,
           progress: Progress = None, jobs: int = 1, stop: Optional[StopRequest] = None,
           counted_from: Optional[float] = None) -> Advice:
    """The five rows of the module docstring for ``problem`` on ``cluster``.

    ``search_seconds`` (None or 0: no limit): from the start, the time after which the layout search stops (the rows
    of the user's layout are always priced); a note then says how much faster a layout left unsearched could be, at
    most (``pipemesh plan`` gives :data:`.defaults.SEARCH_SECONDS` unless told otherwise), counted from
    ``counted_from`` (a :func:`time.monotonic` instant; default: now). ``stop`` (a
    :class:`.search_control.StopRequest`, set by a signal): the search stops at once, with the same kind of note.
    ``progress`` hears each row found and, every :data:`.advice_search.HEARTBEAT_S`, where the search is. ``jobs``:
    worker processes for the layout search (:func:`search_layouts`; the same rows for every number when the search
    is complete)."""
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    deadline_s = (time.monotonic() if counted_from is None else counted_from) + search_seconds if search_seconds else None
    rows: Dict[str, Optional[AdviceRow]] = dict.fromkeys(ROWS)
    notes: List[str] = []
    user = user_candidate(problem, cluster, problem.vpp)
    pipemesh_ok = problem.pipemesh_refused is None
    unpriced: List[str] = []
    first_pm = first_st = None
    with UserLayout(problem, cluster, user, pipemesh_ok and problem.vpp >= 2, jobs, stop, progress) as own:
        rows["user"] = user_row(problem, cluster)
        say_row(progress, rows["user"])
        found = candidates(problem, cluster)
        own.start_first(found, pipemesh_ok, deadline_s)
        stock = plan = None
        for name, price in (("best_stock", own.stock), ("pipemesh", own.plan)):
            try:
                if name == "best_stock":
                    stock = price()
                else:
                    plan = price()
            except SearchTimeUp:
                unpriced.append(name)
        limits = (plan.result.iteration_s if plan is not None else float("inf"),
                  stock.iteration_s if stock is not None else float("inf"))
        if not unpriced:
            try:
                first_pm, first_st = own.first_rows(found, pipemesh_ok, limits, deadline_s)
            except SearchTimeUp:
                pass
    for name in unpriced:
        notes.append(f"{name}: not priced, the advice was interrupted ({stop.reason}) before it was")
    if stock is not None:
        rows["best_stock"] = stock_row("best_stock", dataclasses.replace(user, vpp=stock.setting.vpp), stock, cluster)
        say_row(progress, rows["best_stock"])
    elif "best_stock" not in unpriced:
        notes.append(f"best_stock: no stock setting fits {cluster.device_memory_gb:g} GiB per GPU with "
                     f"{problem.layout.describe()}")
    if not pipemesh_ok:
        notes.append(f"pipemesh, best_layout: {problem.pipemesh_refused}")
    elif problem.layout.pp == 1:
        notes.append("pipemesh: the command runs no pipeline (PP = 1); PipeMesh schedules one (see best_layout)")
    elif problem.vpp < 2:
        notes.append("pipemesh: the command has no virtual stages (V = 1); PipeMesh needs V >= 2 (see best_layout)")
    elif plan is not None:
        rows["pipemesh"] = plan_row("pipemesh", user, plan)
        say_row(progress, rows["pipemesh"])
    elif "pipemesh" not in unpriced:
        notes.append(f"pipemesh: no PipeMesh plan fits {cluster.device_memory_gb:g} GiB per GPU with "
                     f"{problem.layout.describe()} V={problem.vpp}")
    if progress is not None:
        left = "" if deadline_s is None else f" for up to {max(0.0, deadline_s - time.monotonic()):.0f} s more"
        progress(f"{len(found)} candidates (TP x PP x DP, V, layer split) whose weights fit, searched in the order of "
                 f"their bound{left}")
    log = SearchLog()
    best_pm = faster(rows["pipemesh"], first_pm) if pipemesh_ok else None
    best_st = faster(rows["best_stock"], first_st)
    for row in (best_pm, best_st):
        if row is not None and row.name.startswith("best_layout"):  # a first row beat the user layout's
            say_row(progress, row)
    if stop and found:
        log.stop("interrupted", found[0].bound_s)
    else:
        best_pm, best_st = search_layouts(problem, cluster, found, best_pm, best_st, pipemesh=pipemesh_ok, log=log,
                                          progress=progress, deadline_s=deadline_s, jobs=jobs, stop=stop)
    reached = sum(1 for c in found if log.unsearched_bound_s is None or c.bound_s < log.unsearched_bound_s)
    why = _why_stopped(log, search_seconds, stop)
    if pipemesh_ok:
        rows["best_layout"] = dataclasses.replace(best_pm, name="best_layout") if best_pm else None
        if best_pm is None and not any(c.vpp >= 2 for c in found):
            notes.append("best_layout: no layout whose weights fit allows V >= 2 (the layers per stage, or "
                         "--no-overlap-p2p-communication at PP = 2), so PipeMesh has none")
        elif best_pm is None and log.stopped_by is None:
            notes.append(f"best_layout: no PipeMesh plan (PP >= 2, V >= 2) fits {cluster.device_memory_gb:g} GiB per GPU")
        elif best_pm is None:
            notes.append(f"best_layout: no PipeMesh plan found before the layout search {why}: its candidates "
                         f"left (V >= 2) were not reached, so whether one fits is not known")
    rows["best_layout_stock"] = dataclasses.replace(best_st, name="best_layout_stock") if best_st else None
    if best_st is None and log.stopped_by is None:
        notes.append(f"best_layout_stock: no stock setting fits {cluster.device_memory_gb:g} GiB per GPU in any layout")
    elif best_st is None:
        notes.append(f"best_layout_stock: no stock setting found before the layout search {why}: the candidates left "
                     f"were not reached, so whether one fits is not known")
    if log.stopped_by is not None:
        gains = [f"{_percent(log.gain(row.iteration_s))} faster than {name} ({row.iteration_s:.3f} s)"
                 for name in ("best_layout", "best_layout_stock") if (row := rows[name]) is not None]
        notes.append(f"the layout search {why} after {reached} of {len(found)} candidates (the least bounds first); "
                     f"the rest run no faster than {log.unsearched_bound_s:.3f} s"
                     + (", so a layout left unsearched is at most " + " and ".join(gains) if gains else "")
                     + ("" if log.stopped_by == "interrupted" else "; --search-seconds 0 searches to the end"))
    return Advice(rows, notes, len(found), log, time.perf_counter() - started, _cpu_seconds() - cpu_started)


def dispatch(problem: AdviceProblem, cluster: AdviceCluster, row: AdviceRow) -> Optional[Dict[str, object]]:
    """Where a MoE row's expert-parallel group runs and what its token dispatch costs per MoE layer and micro-batch
    (None for a dense model): whether it crosses a NIC, and the forward and backward milliseconds it adds
    (:func:`.costs.ep_exchange_s`)."""
    if problem.model.moe is None:
        return None
    layout = row.layout
    spec = cluster.spec(layout.tp, layout.dp, problem.sequence_parallel, problem.distributed_optimizer, problem.overlap,
                        layout.cp, problem.cp_comm, layout.ep, layout.etp)
    model = dataclasses.replace(problem.model, micro_batch_size=row.micro_batch_size or problem.model.micro_batch_size)
    forward, backward = ep_exchange_s(model, spec)
    share = model.moe_fraction or 1.0
    return {"ep": layout.ep, "crosses_nic": ep_crosses_nic(spec), "forward_ms": 1e3 * forward / share,
            "backward_ms": 1e3 * backward / share}


def _why_stopped(log: SearchLog, search_seconds: Optional[float], stop: Optional[StopRequest]) -> str:
    """What stopped the layout search, in words ('' when it finished)."""
    if log.stopped_by == "interrupted":
        return f"was interrupted ({stop.reason if stop else 'stop requested'})"
    if log.stopped_by == "search_seconds":
        return f"stopped at its deadline, --search-seconds {search_seconds:g},"
    if log.stopped_by is not None:
        return f"stopped at its cap on candidates ({log.stopped_by})"
    return ""


def _percent(gain: float) -> str:
    """How much faster a gain (a ratio of times >= 1) is, in percent ('0%': none)."""
    return f"{100 * (gain - 1):.1f}%"


def _cpu_seconds() -> float:
    """CPU time of this process and of its workers that have ended (a search's pool ends with the search)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime
