"""``PlanRequest``: what a run asks the planner for, one typed object every surface builds.

A surface (Megatron's args at run time, the ``pipemesh`` command, the measured re-planner) describes its run in
its own words and builds one :class:`PlanRequest` through its adapter; :func:`.resolve.resolve` turns it into the
complete :class:`~..schedule.plan.RunPlan`. Each field is checked where it is declared (``__post_init__``), so a
request that exists is a valid one.

Pure: no torch, no processes.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple, Union

from ..schedule.config import ScheduleConfig
from ..schedule.lower import check_lookahead
from ..schedule.plan import SHARD_SCOPES
from ..schedule.spans import SHARD_LEVELS
from .clusters import costs_for
from .costs import ClusterSpec, ModelSpec, OpCosts
from .planner import PlannerOptions
from .profile import Profile

PLAN_FILE, AUTO, GROUPS, PLACED_GROUPS = "plan file", "auto", "groups", "placed groups"
PLAN_SOURCES = (PLAN_FILE, AUTO, GROUPS, PLACED_GROUPS)
"""Where a run's plan comes from: a saved plan file, the planner (groups, memory levers, optionally the sharding
levels), given groups (or Megatron's group size where none are given), given groups whose memory levers the
planner places under the budget."""

SHARDING_AUTO = "auto"
"""The sharding levels the planner chooses jointly with the groups."""


@dataclass(frozen=True)
class LoweringSettings:
    """How the plan is lowered: the settings the resolution copies into the plan as they are."""

    recv_lookahead: int = 1
    """Compute ops between posting a pipeline receive and its consumer (>= 0)."""
    sharding: Union[str, Tuple[str, ...]] = ()
    """ZeRO level per virtual chunk, :data:`SHARDING_AUTO` (the planner chooses) or () (Megatron's own)."""
    shard_scope: str = "data-parallel"
    """Ranks a ZeRO-2/3 shard spans (:data:`~..schedule.plan.SHARD_SCOPES`)."""

    def __post_init__(self) -> None:
        try:
            check_lookahead("recv_lookahead", self.recv_lookahead)
        except ValueError as error:
            raise ValueError(f"--pipemesh-recv-lookahead {self.recv_lookahead} is invalid: {error}. Example: "
                             "--pipemesh-recv-lookahead 1") from error
        if self.sharding != SHARDING_AUTO:
            object.__setattr__(self, "sharding", tuple(self.sharding))
            unknown = [level for level in self.sharding if level not in SHARD_LEVELS]
            if unknown:
                raise ValueError(f"unknown sharding level(s) {unknown}; levels are {', '.join(SHARD_LEVELS)}")
        if self.shard_scope not in SHARD_SCOPES:
            raise ValueError(f"shard scope {self.shard_scope!r}: use one of {', '.join(SHARD_SCOPES)}")

    @property
    def levels(self) -> Tuple[str, ...]:
        """The given levels (() for none or for the planner's choice)."""
        return () if self.sharding == SHARDING_AUTO else self.sharding


@dataclass(frozen=True)
class PlanRequest:
    """One run's request: its sizes, where its plan comes from, and what the planner prices it with."""

    pp: int
    """Pipeline-parallel size p."""
    vpp: int
    """Virtual chunks per rank V."""
    microbatches: int
    """Micro-batches per iteration m."""
    source: str
    """Where the plan comes from (:data:`PLAN_SOURCES`)."""
    forward_groups: Optional[Tuple[int, ...]] = None
    """Given forward groups (:data:`GROUPS`, :data:`PLACED_GROUPS`); None: Megatron's group size (in both directions
    when neither list is given)."""
    backward_groups: Optional[Tuple[int, ...]] = None
    """Given backward groups; None: the forward's with a forward list given, else Megatron's group size."""
    group_size: Optional[int] = None
    """Megatron's ``--microbatch-group-size-per-virtual-pipeline-stage`` (None: p)."""
    plan_file: Optional[str] = None
    """Path of a plan saved by ``pipemesh plan --output`` (:data:`PLAN_FILE`)."""
    model: Optional[ModelSpec] = None
    """The model the costs price (the planner's sources)."""
    cluster: Optional[ClusterSpec] = None
    """The cluster the costs price (the planner's sources; built by :mod:`.clusters`)."""
    budget_bytes: Optional[float] = None
    """Device memory a plan may use per rank (the planner's sources), > 0."""
    planner: PlannerOptions = PlannerOptions()
    """The planner's search space and memory levers."""
    measured: Optional[Mapping[str, float]] = None
    """Measured per-op times (a profile, :data:`.clusters.MEASURED_TIME_FIELDS`) in place of the analytic ones."""
    profile: Optional[Profile] = None
    """A measured profile (``pipemesh profile``): its layer, embedding, output, optimizer and activation costs in
    place of the analytic ones wherever it has them (checked against the model by whoever loaded it)."""
    lowering: LoweringSettings = LoweringSettings()
    """Lookahead and sharding settings the plan carries."""
    price_sharding: bool = False
    """The planner prices the given levels' gathers, reductions and memory (``pipemesh plan --sharding``); False:
    given levels are only carried into the plan (training's flags). The planner's own levels are always priced."""
    direct_costs: Optional[OpCosts] = None
    """Per-op costs given directly (``pipemesh plan --forward-ms ...``), the same for every schedule, in place of the
    model's on the cluster."""

    def __post_init__(self) -> None:
        if self.source not in PLAN_SOURCES:
            raise ValueError(f"plan source {self.source!r}: use one of {', '.join(PLAN_SOURCES)}")
        for name in ("pp", "vpp", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} must be a positive integer")
        for name in ("forward_groups", "backward_groups"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.source == PLAN_FILE and not self.plan_file:
            raise ValueError("a plan-file request needs the plan's path (pipemesh plan ... --output plan.json)")
        if self.plans:
            needed = ("budget_bytes",) if self.direct_costs is not None else ("model", "cluster", "budget_bytes")
            missing = [name for name in needed if getattr(self, name) is None]
            if missing:
                raise ValueError(f"the planner ({self.source}) needs the request's {', '.join(missing)}")
            if not self.budget_bytes > 0:
                raise ValueError(f"memory budget {self.budget_bytes / 2 ** 30:.2f} GiB is invalid: it must be > 0")
        if self.lowering.sharding == SHARDING_AUTO and self.source != AUTO:
            raise ValueError("sharding auto is chosen by the planner with the groups: it needs --forward-groups auto")
        if self.direct_costs is not None and (self.measured or self.profile or self.prices_sharding):
            raise ValueError("costs given directly have no model to price measured times or sharding levels with")

    @property
    def plans(self) -> bool:
        """Whether the planner runs (it needs the model, the cluster and the budget)."""
        return self.source in (AUTO, PLACED_GROUPS)

    @property
    def prices_sharding(self) -> bool:
        """Whether the planner searches with a sharding model (the planner's levels, or given ones it prices)."""
        return self.lowering.sharding == SHARDING_AUTO or bool(self.price_sharding and self.lowering.levels)

    def costs_for(self, config: ScheduleConfig) -> OpCosts:
        """The planner's costs for ``config`` (analytic on the request's cluster, with its measured times; or the
        direct costs, a fresh copy per schedule)."""
        if self.direct_costs is not None:
            return copy.deepcopy(self.direct_costs)
        return costs_for(self.model, self.cluster, config, dict(self.measured) if self.measured else None,
                         self.profile)
