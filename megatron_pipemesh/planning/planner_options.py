"""What the planner searches and with which memory levers (:class:`PlannerOptions`), and the structured search
the advice and the study share (:func:`structured_options`).

Pure: no torch, no processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..schedule.levers import FULL
from ..schedule.lower import check_lookahead
from .memory import selective_levels

RECOMPUTE_ONLY = "recompute-only"
"""The placement mode where recomputation is the only memory lever (the default)."""

PLACEMENT_MODES = (RECOMPUTE_ONLY, "auto", "device")
"""``PlannerOptions.activation_placement`` values (``--pipemesh-activation-placement``)."""



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
    activation_placement: str = RECOMPUTE_ONLY
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
        if self.reload_lookahead is not None:
            check_lookahead("reload_lookahead", self.reload_lookahead)
        if self.host_budget_bytes is not None and not self.host_budget_bytes >= 0:
            raise ValueError(f"host memory budget must be >= 0 bytes, got {self.host_budget_bytes}")



def structured_options(pp: int, microbatches: int, placement: str = RECOMPUTE_ONLY,
                       host_budget_bytes: Optional[float] = None, fit_limit: Optional[int] = None) -> PlannerOptions:
    """The structured group family (first forward group and last backward group at multiples of p and m, groups of
    p in between, plus every stock group size: :func:`.planner.candidate_configs`): the exhaustive search over all
    group lists gains little and costs minutes per layout. ``placement``, ``host_budget_bytes``, ``fit_limit``: as
    :class:`PlannerOptions`."""
    sizes = tuple(sorted(set(range(pp, microbatches + 1, pp)) | {microbatches}))
    return PlannerOptions(first_forward_candidates=sizes, last_backward_candidates=sizes,
                          activation_placement=placement, host_budget_bytes=host_budget_bytes, fit_limit=fit_limit)
