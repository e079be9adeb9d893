"""Stock Megatron's whole option set (:mod:`.stock_options`) for one (model, cluster, p, d, m), predicted and ranked.

Each setting's cost is predicted with the simulator (:mod:`.simulator`, the same engine and costs as PipeMesh's
planner) and its per-rank peak activation bytes with :mod:`.stock_memory`. Because a fixed-order schedule never
finishes earlier when its ops get longer, the fastest setting of one (schedule, V, g) that fits a budget is the
fitting one with the least recomputation time; :func:`best_stock` simulates only those, in order of a lower
bound (the critical path of its schedule), and stops once the bound exceeds the fastest time found; the
memory comes from the compute order, so only the settings simulated are lowered.

Pure: no torch, no processes.
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from ..schedule.config import ScheduleConfig
from ..schedule.lower import LoweredSchedule
from ..schedule.ops import Op, OpKind
from .bounds import virtual_sizes
from .clusters import costs_for
from .costs import ClusterSpec, ModelSpec, OpCosts, ScheduleCosts, analytic_costs
from .path_bound import beyond
from .profile import Profile
from .simulator import (DeadlineExceeded, TimeUp, check_time, lower_bound, megatron_lowering, megatron_schedule,
                        simulate)
from .stock_memory import (FSDP_MODELS, Budget, ChunkKinds, MegatronFsdpSharding, OffloadModel, live_states,
                           level_peaks, model_for, order_peaks, per_rank, sharding_model, uniform_plan)
from .stock_options import (OFFLOAD_FRACTIONS, STOCK_SHARDING, StockOffload, StockRecompute, StockSetting,
                            default_recompute_ladder, group_sizes, recompute_options, schedule_options, sharding_flags)

__all__ = [  # the options and the memory model are also reached through the search, their first home
    "Budget", "STOCK_SHARDING", "StockOffload", "StockRecompute", "StockSetting", "default_recompute_ladder",
    "group_sizes", "live_states", "order_peaks", "recompute_options", "schedule_options", "sharding_flags",
    "uniform_plan", "StockResult", "evaluate", "best_per_schedule", "best_stock", "default_settings", "default_stock",
    "activation_budget"]


@dataclass
class StockResult:
    """A stock setting with its predicted iteration time and per-rank peaks."""

    setting: StockSetting
    iteration_s: Optional[float]
    """Simulated iteration time; None when not simulated (it does not fit, see :func:`best_stock`)."""
    peak_activation_bytes: Tuple[float, ...]
    """Per pipeline rank: the peak of what the activation budget (:data:`Budget`) must hold: activation bytes
    (transient recomputation included); with ZeRO-2/3 the peak of activations plus gather and gradient
    buffers, less the static bytes the level saves against the distributed optimizer."""
    static_bytes: Tuple[float, ...]
    """Per pipeline rank: weights, gradients and optimizer state (at the setting's sharding level)."""
    fsdp_model: Optional[str] = None
    """ZeRO-2/3 (Megatron-FSDP): which prediction (:data:`FSDP_MODELS`) gave the time and peaks."""
    host_peak_bytes: Tuple[float, ...] = ()
    """Per pipeline rank with offloading: the peak of offloaded activations in host memory (else empty)."""

    def fits(self, budget: Budget) -> bool:
        return all(peak <= limit for peak, limit in zip(self.peak_activation_bytes, per_rank(budget, len(self.peak_activation_bytes))))

    def to_dict(self) -> dict:
        return {**self.setting.to_dict(), "iteration_s": self.iteration_s,
                "peak_activation_bytes": list(self.peak_activation_bytes), "fsdp_model": self.fsdp_model,
                "host_peak_bytes": list(self.host_peak_bytes)}


def _costs(model: ModelSpec, cluster: ClusterSpec, setting: StockSetting, levels: Iterable[str],
           profile: Optional[Profile] = None) -> OpCosts:
    """The planner's costs of ``setting`` (:func:`.clusters.costs_for`: with a measured ``profile``'s where given)."""
    return costs_for(model_for(model, setting), cluster, setting.config(), profile=profile, levels=tuple(levels))


def _result(setting: StockSetting, config: ScheduleConfig, costs: OpCosts, sharding: Optional[MegatronFsdpSharding],
            schedule: Optional[LoweredSchedule] = None, offload: Optional[OffloadModel] = None,
            deadline_s: Optional[float] = None) -> StockResult:
    """Simulate ``setting`` (its uniform recomputation, its sharding when given, and its offloading with the
    ``offload`` model); :class:`.timeline.DeadlineExceeded` once it is known to end after ``deadline_s``."""
    if setting.offload is not None:
        if sharding is not None or offload is None:
            raise ValueError("stock offloading is modelled with the distributed optimizer only and needs its OffloadModel")
        schedule = schedule or megatron_schedule(config, costs)
        result = simulate(config, costs, uniform_plan(config, setting.recompute.level), schedule, deadline_s=deadline_s)
        adapter = ScheduleCosts(config, costs)
        kinds = ChunkKinds.of(config, adapter)
        counts = live_states(config, kinds)
        return StockResult(setting, max(result.iteration_s, offload.busy_s(config, setting.offload)),
                           offload.device_peaks(counts, kinds, adapter, setting.recompute.level, setting.offload),
                           tuple(costs.static_bytes), host_peak_bytes=offload.host_peaks(counts, kinds, setting.offload))
    if schedule is None:
        schedule = megatron_schedule(config, costs, sharding)
    result = simulate(config, costs, uniform_plan(config, setting.recompute.level), schedule, sharding, deadline_s)
    if sharding is None:
        return StockResult(setting, result.iteration_s, tuple(r.peak_activation_bytes for r in result.ranks),
                           tuple(costs.static_bytes))
    resident = tuple(split.state.resident for split in sharding.splits(config))
    # In the budget's terms: the whole peak less the distributed optimizer's static bytes.
    return StockResult(setting, result.iteration_s,
                       tuple(r.peak_memory_bytes - static for r, static in zip(result.ranks, costs.static_bytes)), resident,
                       FSDP_MODELS[0])


def _microbatch_bound(setting: StockSetting, config: ScheduleConfig, costs: OpCosts, sharding: MegatronFsdpSharding,
                      peaks: Sequence[float]) -> StockResult:
    """Megatron-FSDP's per-micro-batch pattern (:class:`MegatronFsdpSharding`): a lower bound of the time and
    the peak with one unit's buffers, from the program-order activation ``peaks``."""
    resident = tuple(split.state.resident for split in sharding.splits(config))
    busy = max(sharding.microbatch_channel_s(config, costs))
    time = max(compute_bound(config, costs, setting.recompute.level), busy)
    buffers = sharding.unit_buffers()
    return StockResult(setting, time, tuple(p + r + buffers - static for p, r, static in zip(peaks, resident, costs.static_bytes)),
                       resident, FSDP_MODELS[1])


def evaluate(setting: StockSetting, model: ModelSpec, cluster: ClusterSpec, budget: Budget = float("inf"),
             profile: Optional[Profile] = None) -> StockResult:
    """Simulate one stock setting: iteration time and per-rank peaks. ZeRO-2/3: the faster of the two
    predictions of :class:`MegatronFsdpSharding` that fits ``budget`` (the span model if neither does)."""
    config = setting.config()
    level = setting.recompute.level
    costs = _costs(model, cluster, setting, (level,), profile)
    sharding = sharding_model(setting, model, cluster)
    offload = OffloadModel.of(model_for(model, setting), cluster, config) if setting.offload else None
    span = _result(setting, config, costs, sharding, offload=offload)
    if sharding is None:
        return span
    bound = _microbatch_bound(setting, config, costs, sharding, order_peaks(config, costs, (level,))[level])
    fitting = [r for r in (span, bound) if r.fits(budget)]
    return min(fitting, key=lambda r: r.iteration_s) if fitting else span


@dataclass
class _Choice:
    """One stock (schedule, V, g, sharding level) with the recomputation options that may fit, before
    simulating it."""

    setting: StockSetting
    """The setting with the least recomputation time among ``options``."""
    config: ScheduleConfig
    costs: OpCosts
    lower_bound_s: float
    """No schedule finishes before its busiest rank's compute plus optimizer step (one stream per rank)."""
    sharding: Optional[MegatronFsdpSharding] = None
    """ZeRO-2/3: the sharding model (``schedule`` is lowered with its ops)."""
    options: Tuple[Tuple[float, StockRecompute, Tuple[float, ...]], ...] = ()
    """ZeRO-2/3: (compute bound, recomputation, activation peaks) of every option whose activation peak
    alone fits, least recomputation first (:func:`_simulated` takes the first that fits, per prediction)."""
    offload: Optional[OffloadModel] = None
    """With offloading options: their model."""
    without_offload: Optional[StockSetting] = None
    """When ``setting`` offloads: the fitting setting with the least recomputation that does not (its host
    link may make the offloading setting the slower one), or None if none fits."""
    _schedule: Optional[LoweredSchedule] = None

    @property
    def schedule(self) -> LoweredSchedule:
        """Megatron's lowered schedule of ``config`` (with ``sharding``'s ops), lowered when first simulated: most
        choices are decided by their bounds and peaks, which the compute order gives."""
        if self._schedule is None:
            self._schedule = megatron_schedule(self.config, self.costs, self.sharding)
        return self._schedule

    def path_bound_s(self) -> float:
        """At most the time of every setting :func:`_simulated` simulates for it (without ZeRO-2/3, whose
        per-micro-batch prediction is no simulation: its compute bound): the critical path of Megatron's schedule
        (:func:`.simulator.lower_bound`) at the least recomputation among them."""
        if self.sharding is not None:
            return self.lower_bound_s
        options = megatron_lowering(self.costs, self.config)
        settings = [setting for setting in (self.setting, self.without_offload) if setting is not None]
        return min(lower_bound(self.config, self.costs, uniform_plan(self.config, setting.recompute.level),
                               options=options) for setting in settings)


class _StockOption(NamedTuple):
    """One recomputation (and offloading) option of a stock schedule in :func:`_choices`, ordered by its first
    three fields: least recomputation time, then least offloading, then enumeration order."""

    recompute_s: float
    fraction: float
    """Offloaded share (0: no offloading)."""
    index: int
    recompute: StockRecompute
    offload: Optional[StockOffload]
    peaks: Tuple[float, ...]
    """Per-rank activation peak."""


def _choices(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int, budget: Budget,
             grad_reduce_in_bf16: bool, sharding: Sequence[Optional[str]] = (None,),
             host_limit: Optional[float] = None, vpps: Optional[Sequence[int]] = None,
             profile: Optional[Profile] = None, groups: Optional[Sequence[Optional[int]]] = None,
             incumbent_s: float = float("inf")) -> List[_Choice]:
    """For every stock (schedule kind, V, g) in :func:`schedule_options` order and every level of
    ``sharding``: the recomputation option with the least recomputation time whose peak fits ``budget``
    (left out where nothing fits), with what simulating it needs and a lower bound of its time.

    With ``host_limit`` (bytes of host memory per device) and Transformer Engine's layer spec, the options
    also include :class:`StockOffload` at every fraction of :data:`OFFLOAD_FRACTIONS`, with no or selective
    recomputation, where the offloaded bytes fit ``host_limit`` (distributed optimizer only): ties in
    recomputation time go to the least offloading, and an offloading choice keeps the best one without.

    Without buffers (no level, or ``optim``) the peak is exact from the program order. With ZeRO-2/3 the
    activation peak plus the resident bytes is a lower bound of the peak (buffers are >= 0): every
    option it admits is kept, and :func:`_simulate_choice` takes the first whose simulation fits. ``vpps``: only
    these V (default: every V of :func:`schedule_options`); ``groups``: only these g (None: 1F1B).

    ``incumbent_s``: a time reached otherwise (:func:`best_stock`'s): a choice whose first fitting option has its
    compute bound past it is left out, and the peaks of the options that could only be that (more recomputation
    time than every option bounded below it: each comes after all of those in the order above) are not computed;
    at large micro-batch counts they are most of the work here. The choices kept are the ones :func:`best_stock`
    could simulate without it."""
    out = []
    limits = per_rank(budget, pp)
    per_vpp: Dict[int, Tuple[OpCosts, Dict[str, float]]] = {}  # the costs and compute bounds do not depend on g
    for vpp, g in schedule_options(pp, model.num_layers, microbatches, model.layer_split):
        if (vpps is not None and vpp not in vpps) or (groups is not None and g not in groups):
            continue
        options = recompute_options(max(model.stage_layers(pp, vpp)), model.layer_spec)
        probe = StockSetting(pp, vpp, microbatches, g, StockRecompute(), grad_reduce_in_bf16)
        config = probe.config()
        if vpp not in per_vpp:
            costs = _costs(model, cluster, probe, [o.level for o in options], profile)
            per_vpp[vpp] = costs, {o.level: compute_bound(config, costs, o.level) for o in options}
        costs, bound_of = per_vpp[vpp]
        reach = max((costs.recompute_s[o.level] for o in options if not beyond(bound_of[o.level], incumbent_s)),
                    default=None)
        if reach is None:
            continue  # whatever fits first is bounded past the incumbent
        considered = [(index, o) for index, o in enumerate(options) if costs.recompute_s[o.level] <= reach]
        adapter = ScheduleCosts(config, costs)
        kinds = ChunkKinds.of(config, adapter)
        counts = live_states(config, kinds)
        peaks_of = level_peaks(counts, kinds, adapter, [o.level for _, o in considered])
        offload, offloads = None, []
        if host_limit is not None and model.layer_spec == "te":
            offload = OffloadModel.of(model_for(model, probe), cluster, config)
            # the host's bytes depend on the fraction alone
            held = [StockOffload(f) for f in OFFLOAD_FRACTIONS
                    if all(host <= host_limit for host in offload.host_peaks(counts, kinds, StockOffload(f)))]
            for _, option in considered:
                if option.granularity == "full":
                    continue
                for moved in held:
                    offloads.append((option, moved, offload.device_peaks(counts, kinds, adapter, option.level, moved)))
        for level in sharding:
            setting = dataclasses.replace(probe, sharding=level)
            shard = sharding_model(setting, model, cluster)
            room = list(limits)
            if shard is not None:  # the static bytes this level saves against the distributed optimizer
                room = [limit + static - split.state.resident
                        for limit, static, split in zip(limits, costs.static_bytes, shard.splits(config))]
            candidates = [_StockOption(costs.recompute_s[o.level], 0.0, index, o, None, peaks_of[o.level])
                          for index, o in considered]
            if shard is None:
                candidates += [_StockOption(costs.recompute_s[o.level], moved.fraction, len(options) + index, o, moved, peaks)
                               for index, (o, moved, peaks) in enumerate(offloads)]
            fitting = sorted((c for c in candidates if all(p <= b for p, b in zip(c.peaks, room))), key=lambda c: c[:3])
            if not fitting or beyond(bound_of[fitting[0].recompute.level], incumbent_s):
                continue
            first = fitting[0]
            plain = next((c.recompute for c in fitting if c.offload is None), None)
            without = (dataclasses.replace(setting, recompute=plain)
                       if (first.offload is not None and plain is not None) else None)
            # ZeRO-2/3 settings keep every fitting option for _simulated (no offloading with them).
            bounds = (tuple((bound_of[c.recompute.level], c.recompute, c.peaks) for c in fitting)
                      if shard is not None else ())
            out.append(_Choice(dataclasses.replace(setting, recompute=first.recompute, offload=first.offload), config,
                               costs, bound_of[first.recompute.level],
                               shard, bounds, offload if first.offload is not None else None, without))
    return out


def compute_bound(config: ScheduleConfig, costs: OpCosts, level: str) -> float:
    """max over ranks of (its forwards' and backwards' durations + its optimizer step), the
    simulator's own per-op durations (:class:`.costs.ScheduleCosts`)."""
    adapter = ScheduleCosts(config, costs, {(r, c, 0): level for r in range(config.pp) for c in range(config.vpp)})
    bound = 0.0
    for rank in range(config.pp):
        busy = sum(adapter.compute(rank, Op(kind, chunk, 0)) * config.microbatches
                   for chunk in range(config.vpp) for kind in (OpKind.FORWARD, OpKind.BACKWARD))
        optimizer = costs.optimizer_s[rank] if rank < len(costs.optimizer_s) else 0.0
        bound = max(bound, busy + optimizer)
    return bound


def _simulated(choice: _Choice, budget: Budget, best_s: float = float("inf")) -> Optional[StockResult]:
    """Simulate ``choice``: its setting; with ZeRO-2/3, per prediction of :class:`MegatronFsdpSharding`, the
    first option (least recomputation first) that fits ``budget`` -- options whose compute bound exceeds
    ``best_s`` are not tried -- and the faster of the two (None: nothing fits or can beat ``best_s``)."""
    if choice.sharding is None:  # a simulation stops once it is known to end after best_s
        found = []
        for setting, offload in ((choice.setting, choice.offload), (choice.without_offload, None)):
            if setting is not None:
                try:
                    found.append(_result(setting, choice.config, choice.costs, None, choice.schedule, offload, best_s))
                except DeadlineExceeded:
                    pass
        # the offloading setting unless the one without is faster
        return min(found, key=lambda r: r.iteration_s) if found else None
    found: List[StockResult] = []
    for predict in (lambda setting, peaks: _result(setting, choice.config, choice.costs, choice.sharding, choice.schedule),
                    lambda setting, peaks: _microbatch_bound(setting, choice.config, choice.costs, choice.sharding, peaks)):
        for bound, option, peaks in choice.options:
            if beyond(bound, best_s):
                break
            result = predict(dataclasses.replace(choice.setting, recompute=option), peaks)
            if result.fits(budget):
                found.append(result)
                break
    return min(found, key=lambda r: r.iteration_s) if found else None


def best_per_schedule(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int, budget: Budget,
                      grad_reduce_in_bf16: bool = False, sharding: Sequence[Optional[str]] = (None,),
                      host_limit: Optional[float] = None) -> Dict[Tuple[str, int, Optional[int], Optional[str]], StockResult]:
    """For every stock (schedule kind, V, g, sharding level): its fastest recomputation setting (and
    offloading, with ``host_limit``: see :func:`_choices`) that fits ``budget`` (see :data:`Budget`),
    simulated. Schedules where nothing fits are left out."""
    out: Dict[Tuple[str, int, Optional[int], Optional[str]], StockResult] = {}
    for choice in _choices(model, cluster, pp, microbatches, budget, grad_reduce_in_bf16, sharding, host_limit):
        result = _simulated(choice, budget)
        if result is not None:
            setting = result.setting
            out[(setting.schedule, setting.vpp, setting.effective_group_size, setting.sharding)] = result
    return out


def best_stock(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int, budget: Budget,
               grad_reduce_in_bf16: bool = False, sharding: Sequence[Optional[str]] = (None,),
               host_limit: Optional[float] = None, vpps: Optional[Sequence[int]] = None,
               incumbent_s: float = float("inf"), time_up: TimeUp = None,
               profile: Optional[Profile] = None,
               groups: Optional[Sequence[Optional[int]]] = None) -> Optional[StockResult]:
    """The fastest stock setting whose per-rank peak fits ``budget``; None if none fits. ``sharding``: the
    uniform levels to try (:data:`STOCK_SHARDING`; default: none named, the distributed optimizer assumed).
    ``host_limit``: host memory per device for Megatron's activation offloading (None: not tried; it is
    tried only on Transformer Engine's layer spec, see :func:`_choices`).

    The same answer as the fastest of :func:`best_per_schedule` (ties: the first in
    :func:`schedule_options` order, then ``sharding`` order), without simulating the choices whose
    bound already exceeds the fastest time found: their compute bound (sharding changes static memory and
    communication, never compute, so it holds at every level), then the critical path of those it leaves
    (:meth:`_Choice.path_bound_s`); they are simulated in order of that path, and a simulation stops once it is known
    to end after the fastest time found.
    ``vpps``: only these V; ``groups``: only these group sizes g (None: 1F1B). ``incumbent_s``: a time reached
    otherwise; choices whose bound exceeds it are not simulated, nor run past it (None if none can beat it).
    ``time_up``: asked before each simulation; True stops the search with :class:`.simulator.SearchTimeUp`."""
    choices = _choices(model, cluster, pp, microbatches, budget, grad_reduce_in_bf16, sharding, host_limit, vpps,
                       profile, groups, incumbent_s)
    # Simulated in the order of their critical path (:meth:`_Choice.path_bound_s`; most of a simulated time beyond
    # the compute bound is bubbles and exposed transfers, which the path has), each only while it may beat the fastest
    # found. A path is at least its compute bound, so it is taken only for the choices whose compute bound comes
    # before the least path known: the heap's top is then the least path of every choice left.
    by_compute = sorted((choice.lower_bound_s, index) for index, choice in enumerate(choices))
    paths: List[Tuple[float, int]] = []
    best: Optional[Tuple[float, int, StockResult]] = None
    taken = 0
    while True:
        limit = best[0] if best is not None else incumbent_s
        while (taken < len(by_compute) and not beyond(by_compute[taken][0], limit)
               and (not paths or by_compute[taken][0] < paths[0][0])):
            index = by_compute[taken][1]
            heapq.heappush(paths, (choices[index].path_bound_s(), index))
            taken += 1
        if not paths or beyond(paths[0][0], limit):
            break  # every choice left takes longer than the fastest found
        _, index = heapq.heappop(paths)
        check_time(time_up)
        result = _simulated(choices[index], budget, limit)
        if result is not None and (best is None or (result.iteration_s, index) < best[:2]):
            best = (result.iteration_s, index, result)
    return best[2] if best else None


def default_settings(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int, budget: Budget,
                     grad_reduce_in_bf16: bool = False) -> List[StockResult]:
    """Megatron's default command at every V: 1F1B, and the interleaved schedule with Megatron's default group
    size (``--microbatch-group-size-per-virtual-pipeline-stage`` unset: g = p) at every V that divides the layers
    per rank, each with the first recomputation of :func:`default_recompute_ladder` that fits ``budget``; no
    offloading. Simulated; the schedules where nothing fits (or g = p is not allowed) are left out."""
    out = []
    for vpp, g in schedule_options(pp, model.num_layers, microbatches, model.layer_split):
        if g not in (None, pp):
            continue
        ladder = default_recompute_ladder(max(model.stage_layers(pp, vpp)))
        probe = StockSetting(pp, vpp, microbatches, g, StockRecompute(), grad_reduce_in_bf16)
        costs = _costs(model, cluster, probe, [o.level for o in ladder])
        config = probe.config()
        peaks = order_peaks(config, costs, [o.level for o in ladder])
        limits = per_rank(budget, pp)
        fitting = next((o for o in ladder if all(peak <= limit for peak, limit in zip(peaks[o.level], limits))), None)
        if fitting is not None:
            out.append(_result(dataclasses.replace(probe, recompute=fitting), config, costs, None))
    return out


def default_stock(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int, budget: Budget,
                  grad_reduce_in_bf16: bool = False) -> Optional[StockResult]:
    """The fastest of :func:`default_settings` (ties: 1F1B, then the smaller V); None if none fits."""
    results = default_settings(model, cluster, pp, microbatches, budget, grad_reduce_in_bf16)
    return min(results, key=lambda r: r.iteration_s) if results else None


def activation_budget(model: ModelSpec, cluster: ClusterSpec, pp: int, memory_bytes: float,
                      vpp: Optional[int] = None) -> Tuple[float, ...]:
    """Activation bytes per rank left by ``memory_bytes`` of device memory after the static bytes
    (weights, gradients, optimizer state; the same for every V and schedule of one layer split; ``vpp``: the V to
    place the split at, default the first V it has)."""
    vpp = vpp or virtual_sizes(model, pp)[0]
    costs = analytic_costs(model, cluster, ScheduleConfig.depth_first(pp, vpp, pp))
    return tuple(memory_bytes - static for static in costs.static_bytes)
