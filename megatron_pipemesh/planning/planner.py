"""Planner: choose forward/backward groups and a recomputation plan that fit a memory budget.

Search (each candidate is simulated with the same engine the runtime's plan is checked with):

* small spaces: every pair of valid group lists; otherwise
  forward groups = [f_1] + groups of p for the rest; backward groups = groups of p + [b_last]
  (the middle groups only need to be bubble-free, so p is the cheapest size: paper-notes §6);
  f_1 and b_last range over the multiples of p up to m (and m itself);
* for a candidate whose peak memory exceeds the budget on some rank, pipeline-aware
  recomputation is added as a knapsack (:func:`fit_with_recompute`): on each rank over budget,
  the chunk-micro-batches alive at that rank's peak are upgraded by bytes freed per second of
  recomputation (per chunk-micro-batch and level: selective module sets, full), those that wait
  longest between their forward and backward first among equals (early micro-batches on early
  ranks), until the rank fits; the extra backward time is part of the simulated time;
* with ``activation_placement='auto'`` the chunk-micro-batches may also go to host memory
  (:func:`fit_with_placement`): offloaded after their forward, reloaded before their backward, where
  the host link carries the bytes within the compute in between; host moves and recomputation
  compete by the same rule, bytes freed per second of added time;
* the fastest candidate that fits on every rank wins (ties: less memory, less recompute).

Pure: no torch, no processes.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..schedule.config import ScheduleConfig, ScheduleConfigError, depth_first_groups
from ..schedule.ops import OpKind
from .costs import GB, OpCosts, ScheduleCosts, StageCosts
from ..schedule.levers import BASIC_LEVERS, CATEGORIES, DEVICE, FULL, HOST, KEPT, Lever
from ..schedule.lower import lower
from ..schedule.plan import PREDICTION_KEYS, RunPlan
from ..schedule.ops import Op
from ..schedule.lower import DEFAULT_RELOAD_LOOKAHEAD
from .memory import host_block_bytes, selective_levels
from .simulator import (DeadlineExceeded, RecomputePlan, SimulationResult, TimeUp, check_time, lowering_for,
                        pinned_pool_bytes, simulate)

PLACEMENT_MODES = ("recompute-only", "auto", "device")
"""``PlannerOptions.activation_placement`` values (``--pipemesh-activation-placement``)."""


class NoFeasiblePlan(ValueError):
    """Nothing fits the memory budget; the message says what would."""


@dataclass
class Plan:
    """A chosen schedule with its recomputation and predicted behaviour."""

    config: ScheduleConfig
    recompute: RecomputePlan
    """The placement plan: (rank, chunk, micro-batch) -> lever (:class:`.levers.Lever`); missing = 'none'."""
    result: SimulationResult
    budget_bytes: float
    sharding: object = None
    """The :class:`.sharding.ShardingModel` the plan was simulated with (None: no mixed sharding)."""
    host_budget_bytes: Optional[float] = None
    """Host memory per rank offloaded activations may hold, in pinned blocks (each chunk-micro-batch's bytes
    rounded up to a power of two: :func:`.memory.host_block_bytes`); None = unlimited."""
    reload_lookahead: int = DEFAULT_RELOAD_LOOKAHEAD
    """Compute ops between a RELOAD and its backward in the lowered program the plan was simulated with."""

    @property
    def fits(self) -> bool:
        host = float("inf") if self.host_budget_bytes is None else self.host_budget_bytes
        return all(r.peak_memory_bytes <= self.budget_bytes and r.peak_pinned_bytes <= host for r in self.result.ranks)

    def placement_counts(self) -> List[Dict[str, int]]:
        """Per rank: chunk-micro-batches kept on the device whole, on the host, recomputed selectively or fully."""
        counts = [dict.fromkeys(CATEGORIES, 0) for _ in range(self.config.pp)]
        for rank in range(self.config.pp):
            counts[rank]["device"] = self.config.vpp * self.config.microbatches
        for (rank, _, _), level in self.recompute.items():
            counts[rank]["device"] -= 1  # back where it was for an explicit 'none'
            counts[rank][Lever.parse(level).category] += 1
        return counts

    @property
    def recompute_share(self) -> float:
        """Recompute time as a fraction of the iteration (mean over ranks)."""
        ranks = self.result.ranks
        return sum(r.recompute_s for r in ranks) / (len(ranks) * self.result.iteration_s) if self.result.iteration_s else 0.0

    def summary(self) -> str:
        """One line: the group flags, predicted iteration time, peak memory per rank, recompute share."""
        peaks = " ".join(f"{r.peak_memory_bytes / GB:.2f}" for r in self.result.ranks)
        line = (f"{self.config.group_flags()}; predicted iteration {self.result.iteration_s * 1e3:.1f} ms, peak memory "
                f"GiB per rank {peaks}, recompute {100 * self.recompute_share:.2f}% of the time")
        if any(r.host_placed for r in self.result.ranks):
            placed = " ".join(str(r.host_placed) for r in self.result.ranks)
            host = " ".join(f"{r.peak_host_bytes / GB:.2f}" for r in self.result.ranks)
            line += (f", host placement per rank {placed} chunk-micro-batches holding {host} GiB at peak, "
                     f"exposed host copies {self.result.exposed_host_s * 1e3:.1f} ms")
        return line

    def run_plan(self, recv_lookahead: int = 1, sharding: Tuple[str, ...] = (),
                 shard_scope: str = "data-parallel") -> RunPlan:
        """What the runtime runs for this plan, with its prediction (``pipemesh plan --output`` saves it). The
        plan's own sharding levels, if it was made with mixed sharding, win over ``sharding``/``shard_scope``."""
        if self.sharding is not None:
            sharding, shard_scope = self.sharding.spec.levels, self.sharding.spec.scope
        data = self.to_dict()
        return RunPlan(self.config, self.recompute, tuple(sharding), shard_scope, recv_lookahead, self.reload_lookahead,
                       predicted={key: data[key] for key in PREDICTION_KEYS},
                       host_blocks={(r.rank, chunk): size for r in self.result.ranks for chunk, size in r.host_blocks.items()})

    def to_dict(self) -> dict:
        counts = {lever: 0 for lever in BASIC_LEVERS if lever.recomputes}
        for level in self.recompute.values():
            if Lever.parse(level).recomputes:
                counts[level] = counts.get(level, 0) + 1
        return {
            "forward_groups": list(self.config.forward_groups),
            "backward_groups": list(self.config.backward_groups),
            "predicted_iteration_time_s": self.result.iteration_s,
            "idle_fraction": self.result.idle_fraction,
            "exposed_comm_s": [r.exposed_p2p_s + r.exposed_dp_s for r in self.result.ranks],
            "peak_memory_gb": [r.peak_memory_bytes / GB for r in self.result.ranks],
            "memory_budget_gb": self.budget_bytes / GB,
            "fits": self.fits,
            "recompute_share": self.recompute_share,
            "recompute_counts": counts,
            "recompute": [{"rank": r, "chunk": c, "microbatch": j, "level": level}
                          for (r, c, j), level in sorted(self.recompute.items()) if not Lever.parse(level).is_device],
            **({"sharding": list(self.sharding.spec.levels), "shard_scope": self.sharding.spec.scope}
               if self.sharding is not None else {}),
            "placement_counts": self.placement_counts(),
            "peak_host_gb": [r.peak_host_bytes / GB for r in self.result.ranks],
            "host_memory_budget_gb": None if self.host_budget_bytes is None else self.host_budget_bytes / GB,
            "exposed_host_s": [r.exposed_host_s for r in self.result.ranks],
            "reload_lookahead": self.reload_lookahead,
        }


@dataclass(frozen=True)
class PlannerOptions:
    """Search space and limits."""

    first_forward_candidates: Optional[Tuple[int, ...]] = None
    """f_1 values to try; default: multiples of p up to m, and m."""
    last_backward_candidates: Optional[Tuple[int, ...]] = None
    """b_last values to try; default: multiples of p up to m, and m."""
    allow_recompute: Tuple[str, ...] = selective_levels("local") + (FULL,)
    """Recompute levels the planner may use (:class:`.levers.Lever` or names; PipeMesh's runtime applies
    each per chunk-micro-batch): every selective module set and full. Only those the costs price are used
    (:func:`.costs.planning_levels` prices the ones that act on the model's layer spec)."""
    max_recompute_rounds: int = 64
    """Re-simulations per candidate while adding recomputation."""
    fit_limit: Optional[int] = None
    """Group lists :func:`plan_schedule` fits to the memory at most, the fastest without memory levers first (None:
    every one whose time without them is below the best fitted time). Fitting re-simulates a candidate once per
    lever round, so where memory binds it is most of a search; the advice caps it to search many layouts."""
    exhaustive_limit: int = 400
    """Search every pair of group lists when there are at most this many pairs."""
    activation_placement: str = "recompute-only"
    """'recompute-only' (recomputation is the only memory lever), 'auto' (host offload and recomputation
    per chunk-micro-batch, :func:`fit_with_placement`) or 'device' (no lever: a plan over budget does not fit)."""
    host_budget_bytes: Optional[float] = None
    """Host memory per rank offloaded activations may hold, in pinned blocks (each chunk-micro-batch's bytes
    rounded up to a power of two: :func:`.memory.host_block_bytes`; None = unlimited)."""
    reload_lookahead: Optional[int] = None
    """Compute ops between a RELOAD's launch and its backward; None: enough forwards to hide one copy
    (:func:`reload_lookahead_for`)."""

    def __post_init__(self) -> None:
        if self.activation_placement not in PLACEMENT_MODES:
            raise ValueError(f"activation placement {self.activation_placement!r}: use one of {', '.join(PLACEMENT_MODES)}")
        if self.reload_lookahead is not None and self.reload_lookahead < 1:
            raise ValueError(f"reload_lookahead must be >= 1, got {self.reload_lookahead}")
        if self.host_budget_bytes is not None and not self.host_budget_bytes >= 0:
            raise ValueError(f"host memory budget must be >= 0 bytes, got {self.host_budget_bytes}")


def _sizes(pp: int, microbatches: int, given: Optional[Iterable[int]]) -> List[int]:
    if given:
        return sorted({g for g in given if pp <= g <= microbatches})
    return sorted(set(range(pp, microbatches + 1, pp)) | {microbatches})


def compositions(total: int, smallest: int, limit: int) -> Optional[List[Tuple[int, ...]]]:
    """All ordered splits of ``total`` into parts >= ``smallest``; None if there are more than ``limit``."""
    out: List[Tuple[int, ...]] = []

    def extend(prefix: Tuple[int, ...], rest: int) -> bool:
        if rest == 0:
            out.append(prefix)
            return len(out) <= limit
        for part in range(smallest, rest + 1):
            if rest - part == 0 or rest - part >= smallest:
                if not extend(prefix + (part,), rest - part):
                    return False
        return True

    return out if extend((), total) else None


def candidate_configs(pp: int, vpp: int, microbatches: int, options: PlannerOptions = PlannerOptions()) -> List[ScheduleConfig]:
    """Every valid (forward, backward) pair of the search space, depth-first and breadth-first included.

    Small spaces (at most ``exhaustive_limit`` pairs) are searched exhaustively over all group
    lists; larger ones over the structured family of the module docstring.
    """
    configs, seen = [], set()
    if options.first_forward_candidates is None and options.last_backward_candidates is None:
        every = compositions(microbatches, pp, options.exhaustive_limit)
        if every is not None and len(every) ** 2 <= options.exhaustive_limit:
            for forward in every:
                for backward in every:
                    try:
                        configs.append(ScheduleConfig(pp, vpp, microbatches, forward, backward))
                    except ScheduleConfigError:
                        continue
            return configs
    for f1 in _sizes(pp, microbatches, options.first_forward_candidates):
        rest = microbatches - f1
        if 0 < rest < pp:
            continue
        forward = (f1,) + tuple(depth_first_groups(rest, pp) if rest else ())
        for b_last in _sizes(pp, microbatches, options.last_backward_candidates):
            rest_b = microbatches - b_last
            if 0 < rest_b < pp:
                continue
            backward = tuple(depth_first_groups(rest_b, pp) if rest_b else ()) + (b_last,)
            try:
                config = ScheduleConfig(pp, vpp, microbatches, forward, backward)
            except ScheduleConfigError:
                continue
            if (forward, backward) not in seen:
                seen.add((forward, backward))
                configs.append(config)
    # Every stock group size too (Megatron's --microbatch-group-size-per-virtual-pipeline-stage g), so
    # that PipeMesh's search contains every stock interleaved schedule of this V.
    uniform = [ScheduleConfig.uniform(pp, vpp, microbatches, g) for g in range(pp, microbatches + 1)
               if microbatches % g == 0 or microbatches % g >= pp]
    for preset in [ScheduleConfig.depth_first(pp, vpp, microbatches), ScheduleConfig.breadth_first(pp, vpp, microbatches)] + uniform:
        if (preset.forward_groups, preset.backward_groups) not in seen:
            seen.add((preset.forward_groups, preset.backward_groups))
            configs.append(preset)
    return configs


def _live_at_peak(result: SimulationResult, rank: int) -> List[Tuple[float, int, int]]:
    """(wait between forward end and backward start, chunk, micro-batch) of activations alive at the rank's peak."""
    events = result.timeline.compute[rank]
    forward_end = {(e.op.chunk, e.op.microbatch): (e.start, e.end) for e in events if e.op.kind is OpKind.FORWARD}
    backward = {(e.op.chunk, e.op.microbatch): (e.start, e.end) for e in events if e.op.kind is OpKind.BACKWARD}
    peak_time, peak = 0.0, -1.0
    for t, size in result.memory[rank]:
        if size > peak:
            peak_time, peak = t, size
    alive = []
    for key, (f_start, f_end) in forward_end.items():
        b_start, b_end = backward[key]
        if f_start <= peak_time < b_end:
            alive.append((b_start - f_end, key[0], key[1]))
    return sorted(alive, reverse=True)


def least_peaks(config: ScheduleConfig, costs: OpCosts, levels: Sequence[str]) -> List[float]:
    """Per rank: a lower bound on the peak device memory of ``config`` under *any* recomputation plan over ``levels``
    (no host placement, no sharding), from its ops' order alone. On the simulator's memory timeline a forward adds
    its chunk-micro-batch's bytes at its start, a backward adds its recomputation's transient bytes at its start and
    frees both at its end, and a rank's ops run one after another; so at each op every chunk-micro-batch alive holds
    at least its least bytes over ``levels``, and the backward running at least its least bytes plus transient. A
    backward that takes no time is not counted (its end sorts before its start on the timeline)."""
    adapter = ScheduleCosts(config, costs)
    schedule = lower(config, lowering_for(costs))
    out = []
    for rank, program in enumerate(schedule.programs):
        least = [min(adapter.bytes_at(rank, chunk, level) for level in levels) for chunk in range(config.vpp)]
        running = [min(adapter.bytes_at(rank, chunk, level) + adapter.transient(rank, chunk, level) for level in levels)
                   for chunk in range(config.vpp)]
        # Without recomputation a backward's time is its chunk's, the same for every micro-batch.
        timed = [adapter.compute(rank, Op(OpKind.BACKWARD, chunk, 0)) > 0 for chunk in range(config.vpp)]
        live = peak = 0.0
        for op in program:
            if op.kind is OpKind.FORWARD:
                live += least[op.chunk]
                peak = max(peak, live)
            elif op.kind is OpKind.BACKWARD:
                if timed[op.chunk]:
                    peak = max(peak, live - least[op.chunk] + running[op.chunk])
                live -= least[op.chunk]
        out.append((costs.static_bytes[rank] if rank < len(costs.static_bytes) else 0.0) + peak)
    return out


def _allowed(options: PlannerOptions, costs: OpCosts) -> List[Lever]:
    """The levers of ``options.allow_recompute`` that ``costs`` price."""
    return [Lever.parse(level) for level in options.allow_recompute if level in costs.activation_bytes]


def _moves(costs: StageCosts, level: Lever, allowed: Sequence[Lever]) -> List[Tuple[float, float, Lever]]:
    """(bytes freed per second of recomputation, bytes freed, new level) of every upgrade from
    ``level`` that frees memory in a chunk-micro-batch of a stage with these ``costs``, best ratio first.
    (A backward's transient recomputation bytes are held once per rank, by the one backward running, not
    per chunk-micro-batch: the simulation that follows each round accounts for them.)"""
    have, spent = costs.activation_bytes[level], costs.recompute_s.get(level, 0.0)
    out = []
    for new in allowed:
        freed = have - costs.activation_bytes[new]
        extra = costs.recompute_s[new] - spent
        if freed > 0:
            out.append((freed / extra if extra > 0 else float("inf"), freed, new))
    return sorted(out, reverse=True)


def fit_with_recompute(config: ScheduleConfig, costs: OpCosts, budget_bytes: float,
                       options: PlannerOptions = PlannerOptions(), sharding=None,
                       bare: Optional[SimulationResult] = None, time_up: TimeUp = None) -> Plan:
    """Add pipeline-aware recomputation to ``config`` until every rank fits ``budget_bytes``
    (or nothing is left to recompute; the returned plan then has ``fits == False``).

    A knapsack by bytes freed per second of recomputation: on each rank over budget, among the
    chunk-micro-batches alive at its peak, take the upgrades (to any allowed level: selective
    module sets, full) with the most bytes freed per second of extra backward time first, the
    longest-waiting chunk-micro-batch first among equals, one upgrade per chunk-micro-batch per
    round, until the excess is covered; then re-simulate (the peak may move) and repeat. ``bare``: the
    simulation of ``config`` without levers (with ``sharding``), where the caller has run it already. ``time_up``:
    asked before each simulation (:class:`.simulator.SearchTimeUp` when it says so).
    """
    if options.activation_placement != "recompute-only":
        return fit_with_placement(config, costs, budget_bytes, options, sharding, bare, time_up)
    plan: RecomputePlan = {}
    allowed = _allowed(options, costs)
    options_ = lowering_for(costs)
    schedule = lower(config, sharding.lowering(options_) if sharding is not None else options_)
    result = bare or simulate(config, costs, plan, schedule, sharding)
    for _ in range(options.max_recompute_rounds):
        over = [r for r in result.ranks if r.peak_memory_bytes > budget_bytes]
        if not over:
            break
        changed = False
        for rank_result in over:
            changed |= _recompute_rank(result, costs, plan, rank_result, budget_bytes, allowed, sharding is None)
        if not changed:
            break
        check_time(time_up)
        result = simulate(config, costs, plan, schedule, sharding)
    return Plan(config, plan, result, budget_bytes, sharding, options.host_budget_bytes, options.reload_lookahead or DEFAULT_RELOAD_LOOKAHEAD)


def _recompute_rank(result: SimulationResult, costs: OpCosts, plan: RecomputePlan, rank_result, budget_bytes: float,
                    allowed: Sequence[Lever], estimate: bool) -> bool:
    """One round of :func:`fit_with_recompute` on a rank over budget: the knapsack at its simulated peak, then
    (``estimate``) the same rule at each next peak of its memory estimated at this simulation's times
    (:meth:`_RankModel.device_peak`; recomputation lengthens backwards, so the re-simulation that follows the
    round may still find excess), one upgrade per chunk-micro-batch per round."""
    config, rank = result.config, rank_result.rank
    excess = rank_result.peak_memory_bytes - budget_bytes
    alive = _live_at_peak(result, rank)
    model, upgraded = None, set()
    while True:
        candidates = []
        for wait, chunk, microbatch in alive:
            key = (rank, chunk, microbatch)
            moves = _moves(costs.stage(config.stage(rank, chunk)), plan.get(key, DEVICE), allowed) if key not in upgraded else ()
            if moves:
                ratio, freed, new = moves[0]
                candidates.append((ratio, wait, freed, key, new))
        took = False
        for _, _, freed, key, new in sorted(candidates, reverse=True):
            if excess <= 0:
                break
            plan[key] = new
            upgraded.add(key)
            excess -= freed
            took = True
        if not took or not estimate:
            return bool(upgraded)
        model = model or _RankModel(result, ScheduleCosts(config, costs), rank, DEFAULT_RELOAD_LOOKAHEAD)
        peak_time, peak = model.device_peak(plan, {})
        excess = peak - budget_bytes
        if excess <= 0:
            return True
        alive = sorted(((times[5] - times[1], key[0], key[1]) for key, times in model.keys.items()
                        if times[0] <= peak_time < times[6]), reverse=True)


class _RankModel:
    """One rank of a simulated timeline, to try placements without re-simulating. Host copies: offloads
    launch when their forward ends, reloads when the compute op ``reload_lookahead`` before their
    backward is reached (the end of the op before it); each direction serves its copies one at a time
    in launch order (the engine's FIFO channels), a reload no earlier than its offload's end; a backward
    waits for its reload, and the exposed wait is how much later the reload ends than the backward was
    ready. Copies on the compute stream (CPU ranks, :attr:`.costs.ScheduleCosts.host_copies_on_compute`): each
    copy holds the rank's compute for its length, offload after its forward, reload at its launch, so both are
    exposed whole. Device memory: the simulator's accounting with those copy times, compute times held fixed."""

    def __init__(self, result: SimulationResult, adapter: ScheduleCosts, rank: int, lookahead: int):
        events = result.timeline.compute[rank]
        position = {(e.op.kind, e.op.chunk, e.op.microbatch): i for i, e in enumerate(events)}
        # key -> (forward start, offload launch, reload launch, reload's program slot, backward ready,
        #         backward start, backward end, copy seconds, backward's program position)
        self.keys: Dict[Tuple[int, int], Tuple[float, ...]] = {}
        for i, e in enumerate(events):
            if e.op.kind is not OpKind.FORWARD:
                continue
            b = position[(OpKind.BACKWARD, e.op.chunk, e.op.microbatch)]
            slot = max(b - lookahead, i + 1)
            back = events[b]
            ready = back.start - (back.comm_part if back.waited_on == "host" else 0.0)
            copy = adapter.host_copy(rank, Op(OpKind.OFFLOAD, e.op.chunk, e.op.microbatch))
            self.keys[(e.op.chunk, e.op.microbatch)] = (e.start, e.end, events[slot - 1].end, slot, ready,
                                                        back.start, back.end, copy, b)
        self.by_offload = sorted(self.keys, key=lambda k: (self.keys[k][1], k))  # d2h channel order
        self.by_reload = sorted(self.keys, key=lambda k: (self.keys[k][3], k))  # h2d channel order (program order)
        self.rank, self.adapter = rank, adapter
        self.on_compute = adapter.host_copies_on_compute
        static = adapter.costs.static_bytes
        self.static = static[rank] if rank < len(static) else 0.0

    def wait_before_backward(self, key: Tuple[int, int]) -> float:
        """Time between the forward's end and its backward being ready."""
        return self.keys[key][4] - self.keys[key][1]

    def windows(self, placed: set) -> Tuple[Dict[Tuple[int, int], Tuple[float, ...]], float]:
        """(per key: offload start and end, reload start and end; total exposed wait) for the host set ``placed``."""
        if self.on_compute:  # no link to hide behind: every copy is compute time (the shifts they cause are ignored)
            keys = self.keys
            return ({key: (keys[key][1], keys[key][1] + keys[key][7], keys[key][2], keys[key][2] + keys[key][7])
                     for key in placed}, sum(2 * keys[key][7] for key in placed))
        times: Dict[Tuple[int, int], List[float]] = {}
        free = 0.0
        for key in self.by_offload:
            if key not in placed:
                continue
            start = max(self.keys[key][1], free)
            free = start + self.keys[key][7]
            times[key] = [start, free]
        # A backward that waits delays everything after it on the rank: later reload launches and backwards
        # shift by the waits before them (offloads, early in the iteration, are taken as they were).
        free = exposed = 0.0
        delays: List[Tuple[int, float]] = []
        for key in self.by_reload:
            if key not in placed:
                continue
            _, _, launch, slot, ready, _, _, copy, position = self.keys[key]
            start = max(launch + sum(d for p, d in delays if p < slot), free, times[key][1])
            free = start + copy
            times[key] += [start, free]
            wait = max(0.0, free - ready - sum(d for p, d in delays if p < position))
            if wait > 0:
                delays.append((position, wait))
                exposed += wait
        return {k: tuple(v) for k, v in times.items()}, exposed

    def host_peak(self, windows) -> float:
        """Pinned bytes of the copies in ``windows`` (held from the offload's start to the reload's end) as the
        runtime's pool takes them (:func:`.simulator.pinned_pool_bytes`, which the budget limits)."""
        deltas = []
        for (chunk, _), (off_start, _, _, rel_end) in windows.items():
            size = self.adapter.bytes_at(self.rank, chunk, DEVICE)
            deltas += [(off_start, size), (rel_end, -size)]
        return pinned_pool_bytes(deltas)

    def device_peak(self, plan: RecomputePlan, windows) -> Tuple[float, float]:
        """(time, bytes) of the device memory peak under ``plan`` with the host copies at ``windows``."""
        deltas = []
        for key, (f_start, _, _, _, _, b_start, b_end, _, _) in self.keys.items():
            kept = KEPT[plan.get((self.rank,) + key, DEVICE)]
            size, extra = self.adapter.bytes_at(self.rank, key[0], kept), self.adapter.transient(self.rank, key[0], kept)
            deltas += [(f_start, size), (b_start, extra), (b_end, -size - extra)]
            if key in windows:
                deltas += [(windows[key][1], -size), (windows[key][2], size)]
        time, peak = _peak(deltas)
        return time, self.static + peak


def _peak(deltas: List[Tuple[float, float]]) -> Tuple[float, float]:
    """(time, value) of the running sum's maximum; frees before allocations at equal times."""
    held, peak, when = 0.0, 0.0, 0.0
    for t, size in sorted(deltas):
        held += size
        if held > peak:
            peak, when = held, t
    return when, peak


def _place_rank(result: SimulationResult, adapter: ScheduleCosts, plan: RecomputePlan, rank: int, budget: float,
                allowed: Sequence[Lever], options: PlannerOptions) -> bool:
    """Moves for a rank over budget, chosen on :class:`_RankModel` (no re-simulation): at the estimated
    peak, a knapsack step (:func:`_place_at`), then the peak is estimated again (offloads move it), until
    the estimate fits or nothing is left to move. ``plan`` is :func:`fit_with_placement`'s own: its values
    are levers (of ``allowed``, or HOST), asked without parsing in these loops."""
    model = _RankModel(result, adapter, rank, options.reload_lookahead)
    changed = False
    for _ in range(4 * len(model.keys)):
        windows, _ = model.windows({(c, j) for (r, c, j), level in plan.items() if r == rank and level.is_host})
        peak_time, peak = model.device_peak(plan, windows)
        if peak <= budget or not _place_at(model, plan, peak_time, peak - budget, allowed, options):
            break
        changed = True
    return changed


def _place_at(model: _RankModel, plan: RecomputePlan, peak_time: float, excess: float, allowed: Sequence[Lever],
              options: PlannerOptions) -> bool:
    """One knapsack step at ``peak_time``: among the chunk-micro-batches on the device then, take the moves
    (to host memory, to a recompute level) with the most bytes freed per second of added time until
    ``excess`` is covered. Added time: the extra backward time of a recompute level; for a host move the
    estimated exposed reload wait it adds to the rank's copies (contention included), minus any
    recomputation it replaces. A host move frees bytes at the peak only if its offload ends before it
    and its reload starts after it, and only within the host budget."""
    rank, adapter = model.rank, model.adapter
    host = {(c, j) for (r, c, j), level in plan.items() if r == rank and level.is_host}
    windows, exposed = model.windows(host)
    host_budget = float("inf") if options.host_budget_bytes is None else options.host_budget_bytes

    def host_move(key, level):
        """(ratio, freed) of moving ``key`` (now at ``level``) to the host, or None."""
        if model.keys[key][1] + model.keys[key][7] > peak_time:
            return None  # even on an idle link the offload would end after the peak
        windows_new, exposed_new = model.windows(host | {key})
        off_end, rel_start = windows_new[key][1], windows_new[key][2]
        if not off_end <= peak_time < rel_start:
            return None
        if host_budget < float("inf") and model.host_peak(windows_new) > host_budget:
            return None
        freed = adapter.bytes_at(rank, key[0], level)
        cost = exposed_new - exposed - adapter.stage_costs(rank, key[0]).recompute_s.get(level, 0.0)
        return (freed / cost if cost > 1e-12 else float("inf")), freed

    heap = []
    for key, (f_start, _, _, _, _, _, b_end, _, _) in model.keys.items():
        if not f_start <= peak_time < b_end:
            continue
        level = plan.get((rank,) + key, DEVICE)
        if level.is_host:
            if windows[key][1] <= peak_time < windows[key][2]:
                continue  # already off the device at the peak
            saved = exposed - model.windows(host - {key})[1]
        else:
            saved = 0.0
        kept = level.kept
        wait = model.wait_before_backward(key)
        spent = adapter.stage_costs(rank, key[0]).recompute_s
        for new in allowed if not level.is_host else [new for new in allowed if not new.is_selective]:
            freed = adapter.bytes_at(rank, key[0], kept) - adapter.bytes_at(rank, key[0], new)
            cost = spent[new] - spent.get(kept, 0.0) - saved
            if freed > 0:
                ratio = freed / cost if cost > 1e-12 else float("inf")
                heapq.heappush(heap, (-ratio, -freed, -wait, key, new))
        # Levels only go forward along none -> selective -> host -> full (a selective chunk-micro-batch may
        # trade its recomputation for a copy, a host one only for full recomputation): the search cannot cycle.
        if (level.is_device or level.is_selective) and options.activation_placement == "auto":
            move = host_move(key, level)
            if move is not None:
                heapq.heappush(heap, (-move[0], -move[1], -wait, key, HOST))
    changed, moved = False, set()
    while heap and excess > 0:
        _, neg_freed, neg_wait, key, new = heapq.heappop(heap)
        if key in moved:
            continue
        if new.is_host:
            # The copies chosen since this estimate share the link: re-estimate, and requeue if it got worse.
            move = host_move(key, plan.get((rank,) + key, DEVICE))
            if move is None:
                continue
            if heap and (-move[0], -move[1], neg_wait) > heap[0][:3]:
                heapq.heappush(heap, (-move[0], -move[1], neg_wait, key, new))
                continue
            neg_freed = -move[1]
            host.add(key)
            windows, exposed = model.windows(host)
        elif plan.get((rank,) + key, DEVICE).is_host:
            host.discard(key)
            windows, exposed = model.windows(host)
        plan[(rank,) + key] = new
        moved.add(key)
        excess += neg_freed  # neg_freed = -bytes freed
        changed = True
    return changed


def _relieve_host(result: SimulationResult, adapter: ScheduleCosts, plan: RecomputePlan, rank: int, excess: float,
                  allowed: Sequence[Lever]) -> bool:
    """A rank over its host budget (the estimate of :func:`_place_rank` missed): recompute, at the allowed
    level keeping the fewest bytes, the offloaded chunk-micro-batches held on the host at its host peak,
    longest held first, until ``excess`` bytes are off the host."""
    if not allowed or not result.host_memory[rank]:
        return False
    peak_time = max(result.host_memory[rank], key=lambda step: step[1])[0]
    held: Dict[Tuple[int, int], List[float]] = {}
    for c in result.timeline.comms:
        if c.src == rank and c.lane in ("d2h", "h2d"):
            span = held.setdefault((c.op.chunk, c.op.microbatch), [0.0, 0.0])
            if c.lane == "d2h":
                span[0] = c.start
            else:
                span[1] = c.end
    changed = False
    for _, key in sorted(((end - start, key) for key, (start, end) in held.items() if start <= peak_time < end), reverse=True):
        if excess <= 0:
            break
        plan[(rank,) + key] = min(allowed, key=lambda level: adapter.bytes_at(rank, key[0], level))
        excess -= host_block_bytes(adapter.bytes_at(rank, key[0], DEVICE))
        changed = True
    return changed


class _Curve:
    """A rank's device memory as steps (time, bytes from then on), edited by intervals."""

    def __init__(self, steps: List[Tuple[float, float]]):
        self.times, self.values = [], []
        for t, value in steps:
            if self.times and self.times[-1] == t:
                self.values[-1] = value
            else:
                self.times.append(t)
                self.values.append(value)

    def _index(self, t: float) -> int:
        """Index of the step starting at ``t`` (inserted if missing)."""
        i = bisect.bisect_left(self.times, t)
        if i < len(self.times) and self.times[i] == t:
            return i
        self.times.insert(i, t)
        self.values.insert(i, self.values[i - 1] if i else 0.0)
        return i

    def peak(self, start: float, end: float) -> float:
        """Largest value on [start, end)."""
        if end <= start:
            return -math.inf
        i = max(bisect.bisect_right(self.times, start) - 1, 0)
        j = bisect.bisect_left(self.times, end)
        return max(self.values[i:max(j, i + 1)])

    def add(self, start: float, end: float, delta: float) -> None:
        if end <= start:
            return
        i, j = self._index(start), self._index(end)
        for k in range(i, j):
            self.values[k] += delta


def _offload_recomputation(config: ScheduleConfig, costs: OpCosts, start: Plan, options: PlannerOptions,
                           rounds: int = 2, sharding=None, time_up: TimeUp = None) -> Plan:
    """Improve a fitting plan by trading recomputation for host copies: per rank, the recomputed
    chunk-micro-batches that save the most backward time first (longest-waiting first among equals) go
    to the host where the estimated copies (:class:`_RankModel`, contention included) expose less wait
    than the recomputation saved and the device memory stays within the budget while the bytes are on
    the device (from the forward to the offload's end, from the reload's start to the backward's end).
    The estimate holds compute times fixed; the re-simulation is the judge: if the plan no longer fits
    or is not faster, only the first half of each rank's moves is kept, and so on (at most 4 halvings)."""
    best = start
    host_budget = math.inf if options.host_budget_bytes is None else options.host_budget_bytes
    for _ in range(rounds):
        moves = [_host_moves(best, costs, rank, options, host_budget) for rank in range(config.pp)]
        if not any(moves):
            break
        improved = False
        for halving in range(5):
            plan = dict(best.recompute)
            for rank_moves in moves:
                for key in rank_moves[:math.ceil(len(rank_moves) / 2 ** halving)]:
                    plan[key] = HOST
            check_time(time_up)
            lowering = lowering_for(costs, plan, options.reload_lookahead)
            schedule = lower(config, sharding.lowering(lowering) if sharding is not None else lowering)
            try:  # kept only if faster than the best
                result = simulate(config, costs, plan, schedule, sharding, deadline_s=best.result.iteration_s)
            except DeadlineExceeded:
                continue
            candidate = Plan(config, plan, result, best.budget_bytes, sharding, options.host_budget_bytes,
                             options.reload_lookahead)
            if candidate.fits and candidate.result.iteration_s < best.result.iteration_s:
                best, improved = candidate, True
                break
        if not improved:
            break
    return best


def _host_moves(plan: Plan, costs: OpCosts, rank: int, options: PlannerOptions, host_budget: float) -> List[Tuple[int, int, int]]:
    """The recomputed chunk-micro-batches of ``rank`` that :func:`_offload_recomputation` moves to the host,
    in the order chosen (most recomputation saved first)."""
    result, levels = plan.result, plan.recompute
    adapter = ScheduleCosts(plan.config, costs, levels)
    model = _RankModel(result, adapter, rank, options.reload_lookahead)
    curve = _Curve(result.memory[rank])
    host = {(c, j) for (r, c, j), level in levels.items() if r == rank and Lever.parse(level).is_host}
    _, exposed = model.windows(host)
    saved_s = {(c, j): adapter.stage_costs(rank, c).recompute_s.get(level, 0.0)
               for (r, c, j), level in levels.items() if r == rank and Lever.parse(level).recomputes}
    candidates = sorted(((saved, model.wait_before_backward(key), key) for key, saved in saved_s.items() if saved > 0),
                        reverse=True)
    chosen = []
    for saved, _, key in candidates:
        f_start, f_end, _, _, ready, b_start, b_end, copy, _ = model.keys[key]
        if f_end + 2 * copy > ready:
            continue  # both copies cannot fit between the forward and the backward
        trial = host | {key}
        trial_windows, trial_exposed = model.windows(trial)
        if trial_exposed - exposed >= saved:
            continue
        if host_budget < math.inf and model.host_peak(trial_windows) > host_budget:
            continue
        level = levels[(rank,) + key]
        whole, kept = adapter.bytes_at(rank, key[0], DEVICE), adapter.bytes_at(rank, key[0], level)
        transient = adapter.transient(rank, key[0], level)
        off_end, rel_start = trial_windows[key][1], trial_windows[key][2]
        if max(curve.peak(f_start, off_end), curve.peak(rel_start, b_end)) + whole - kept > plan.budget_bytes:
            continue
        curve.add(f_start, off_end, whole - kept)
        curve.add(off_end, rel_start, -kept)
        curve.add(rel_start, b_end, whole - kept)
        curve.add(b_start, b_end, -transient)
        chosen.append((rank,) + key)
        host, exposed = trial, trial_exposed
    return chosen


def reload_lookahead_for(config: ScheduleConfig, costs: OpCosts, options: PlannerOptions) -> int:
    """``options.reload_lookahead``, or (None) the compute ops a reload needs to hide behind: its copy time
    over the shortest compute op (a forward), at least the lowering's default. Reloading earlier keeps the
    bytes on the device longer; the simulation charges both."""
    if options.reload_lookahead is not None:
        return options.reload_lookahead
    adapter = ScheduleCosts(config, costs)
    copy = max(adapter.host_copy(rank, Op(OpKind.RELOAD, chunk, 0)) for rank in range(config.pp) for chunk in range(config.vpp))
    shortest = min(adapter.compute(rank, Op(OpKind.FORWARD, chunk, 0)) for rank in range(config.pp) for chunk in range(config.vpp))
    return max(DEFAULT_RELOAD_LOOKAHEAD, math.ceil(copy / shortest) if shortest > 0 else DEFAULT_RELOAD_LOOKAHEAD)


def fit_with_placement(config: ScheduleConfig, costs: OpCosts, budget_bytes: float,
                       options: PlannerOptions = PlannerOptions(activation_placement="auto"), sharding=None,
                       bare: Optional[SimulationResult] = None, time_up: TimeUp = None) -> Plan:
    """The memory levers of ``options.activation_placement`` applied to ``config`` until every rank fits.

    'device': none (the plan is the bare schedule; ``fits`` says whether it fits). 'auto': per round, on
    each rank over budget, the joint knapsack of :func:`_place_rank` (host memory, selective and full
    recomputation by bytes freed per second of added time, the copy slack estimated from the current
    simulation), then one re-simulation (the truth: the peak may move, copies may contend); a rank
    over the host budget gives back offloads to recomputation. A plan that recomputes, waits on host
    copies or does not fit is compared with recomputation alone (same budget); the fitting ones are then
    improved by trading recomputation for hidden copies (:func:`_offload_recomputation`), and the fastest
    is returned, so 'auto' is never slower than 'recompute-only' on a candidate. ``bare``, ``time_up``: as for
    :func:`fit_with_recompute` (without host copies the reload lookahead changes nothing).
    """
    allowed = _allowed(options, costs)
    plan: RecomputePlan = {}
    options = dataclasses.replace(options, reload_lookahead=reload_lookahead_for(config, costs, options))

    def run(plan):
        check_time(time_up)
        lowering = lowering_for(costs, plan, options.reload_lookahead)
        schedule = lower(config, sharding.lowering(lowering) if sharding is not None else lowering)
        return simulate(config, costs, plan, schedule, sharding)

    result = bare or run(plan)
    host_budget = float("inf") if options.host_budget_bytes is None else options.host_budget_bytes
    for _ in range(options.max_recompute_rounds if options.activation_placement == "auto" else 0):
        adapter = sharding.adapter(config, costs, plan) if sharding is not None else ScheduleCosts(config, costs, plan)
        changed = False
        for r in result.ranks:
            if r.peak_pinned_bytes > host_budget:
                changed |= _relieve_host(result, adapter, plan, r.rank, r.peak_pinned_bytes - host_budget, allowed)
        for r in result.ranks:
            if r.peak_memory_bytes > budget_bytes:
                changed |= _place_rank(result, adapter, plan, r.rank, budget_bytes, allowed, options)
        if not changed:
            break
        result = run(plan)
    placed = Plan(config, plan, result, budget_bytes, sharding, options.host_budget_bytes, options.reload_lookahead)
    # Without recomputation and without a wait on the host link the plan runs exactly as the bare schedule
    # (copies block nothing else): nothing can be faster. Otherwise recomputation alone may be.
    costly = any(r.recompute_s > 0 or r.exposed_host_s > 0 for r in result.ranks)
    if options.activation_placement != "auto" or (placed.fits and not costly):
        return placed
    alone = fit_with_recompute(config, costs, budget_bytes, dataclasses.replace(options, activation_placement="recompute-only"),
                               sharding, bare, time_up)
    fitting = [_offload_recomputation(config, costs, plan, options, sharding=sharding, time_up=time_up)
               for plan in (placed, alone) if plan.fits]
    return min(fitting, key=lambda plan: plan.result.iteration_s) if fitting else placed


_WHAT_WOULD_FIT = ("What would fit: a smaller --micro-batch-size, more pipeline stages (--pipeline-model-parallel-size) or "
                   "tensor parallelism to split weights and activations, the distributed optimizer over more "
                   "data-parallel ranks to shard optimizer state, or a larger budget")


def plan_schedule(pp: int, vpp: int, microbatches: int, costs_for, budget_bytes: float,
                  options: PlannerOptions = PlannerOptions(),
                  incumbent_s: float = float("inf"), sharding=None, time_up: TimeUp = None) -> Tuple[Plan, List[Plan]]:
    """Search the candidates; return (best fitting plan, every plan fitted with recomputation).

    Candidates whose time without recomputation already exceeds the best fitting time (or
    ``incumbent_s``, a time known to be reachable otherwise, e.g. with another V) are skipped.

    ``costs_for(config) -> OpCosts`` gives the costs of a candidate (they do not depend on the
    groups for analytic costs, but measured ones may). ``sharding`` (a :class:`.sharding.ShardingModel`)
    simulates every candidate with those per-chunk levels. Raises :class:`NoFeasiblePlan`, and
    :class:`.simulator.SearchTimeUp` when ``time_up`` says so before a simulation (the fits' included: a fit asks
    before each of its own).
    """
    # Recomputation only lengthens backwards, and a fixed-order schedule never finishes earlier when
    # an op gets longer: a candidate's time without recomputation bounds its time with it. Fit the
    # candidates in order of that bound and stop once the bound reaches the best fitting time.
    # Only candidates ending by the incumbent, and (with a fit limit) among the fit_limit fastest so far, can be
    # fitted: a simulation stops once its clock passes that, and the candidate is dropped. With a fit limit the
    # simulations of the fit_limit fastest so far are kept: their fits start from them.
    # With recomputation the only lever (no host placement, no sharding), a candidate whose least peak under any
    # recomputation exceeds the budget cannot fit: it is dropped before its simulation.
    limit = options.fit_limit
    bare: List[list] = []  # [time, enumeration order, config, costs, simulation or None], fastest first
    deadline = incumbent_s
    floors = options.activation_placement == "recompute-only" and sharding is None
    unfit: Optional[Tuple[float, int, ScheduleConfig]] = None  # the least (peak bound, rank, config) dropped
    for config in candidate_configs(pp, vpp, microbatches, options):
        costs = costs_for(config)
        if floors:
            least = least_peaks(config, costs, [DEVICE] + _allowed(options, costs))
            worst = max(range(pp), key=least.__getitem__)
            if least[worst] > budget_bytes:
                if unfit is None or least[worst] < unfit[0]:
                    unfit = (least[worst], worst, config)
                continue
        check_time(time_up)
        try:
            result = simulate(config, costs, sharding=sharding, deadline_s=deadline)
        except DeadlineExceeded:
            continue
        bare.append([result.iteration_s, len(bare), config, costs, result if limit is not None else None])
        bare.sort(key=lambda item: item[:2])
        if limit is not None and len(bare) >= limit:
            deadline = min(incumbent_s, bare[limit - 1][0])
            for item in bare[limit:]:
                item[4] = None
    evaluated, best_time = [], incumbent_s
    for bound, _, config, costs, result in bare:
        if bound > best_time or (options.fit_limit is not None and len(evaluated) >= options.fit_limit):
            break
        plan = fit_with_recompute(config, costs, budget_bytes, options, sharding, result, time_up)
        evaluated.append(plan)
        if plan.fits:
            best_time = min(best_time, plan.result.iteration_s)
    feasible = [plan for plan in evaluated if plan.fits]
    if not bare and unfit is not None:
        peak, rank, config = unfit
        raise NoFeasiblePlan(
            f"no schedule fits the memory budget of {budget_bytes / GB:.2f} GiB per device: the smallest peak, with "
            f"every activation recomputed ({config.describe()}), is at least {peak / GB:.2f} GiB on rank {rank}. "
            + _WHAT_WOULD_FIT)
    if not evaluated:
        raise NoFeasiblePlan(f"no candidate can beat the incumbent's {incumbent_s:.6f} s (each is slower even "
                             "without recomputation)")
    if not feasible and options.activation_placement == "device":
        least = min(evaluated, key=lambda plan: max(r.peak_memory_bytes for r in plan.result.ranks))
        worst = max(least.result.ranks, key=lambda r: r.peak_memory_bytes)
        raise NoFeasiblePlan(
            f"--pipemesh-activation-placement device keeps every activation on the device, and no schedule fits the "
            f"memory budget of {budget_bytes / GB:.2f} GiB per device that way: the smallest peak "
            f"({least.config.describe()}) is {worst.peak_memory_bytes / GB:.2f} GiB on rank {worst.rank}. What would fit: "
            "--pipemesh-activation-placement auto (host offload and recomputation) or recompute-only, a smaller "
            "--micro-batch-size, more pipeline stages, or a larger budget")
    if not feasible:
        least = min(evaluated, key=lambda plan: max(r.peak_memory_bytes for r in plan.result.ranks))
        peak = max(r.peak_memory_bytes for r in least.result.ranks)
        static = max(least.result.ranks, key=lambda r: r.peak_memory_bytes)
        raise NoFeasiblePlan(
            f"no schedule fits the memory budget of {budget_bytes / GB:.2f} GiB per device: the smallest peak, with "
            f"every activation recomputed ({least.config.describe()}), is {peak / GB:.2f} GiB on rank {static.rank}. "
            + _WHAT_WOULD_FIT)
    best = min(feasible, key=lambda plan: (round(plan.result.iteration_s, 12),
                                           max(r.peak_memory_bytes for r in plan.result.ranks),
                                           plan.recompute_share))
    return best, evaluated


def baseline_plans(pp: int, vpp: int, microbatches: int, costs_for, budget_bytes: float,
                   options: PlannerOptions = PlannerOptions(), sharding=None) -> Dict[str, Plan]:
    """Depth-first and breadth-first, each with the recomputation it needs to fit (if any)."""
    return {name: fit_with_recompute(config, costs_for(config), budget_bytes, options, sharding)
            for name, config in (("depth-first", ScheduleConfig.depth_first(pp, vpp, microbatches)),
                                 ("breadth-first", ScheduleConfig.breadth_first(pp, vpp, microbatches)))}
