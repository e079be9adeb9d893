"""The planner's result: a schedule with where each activation is kept, its predicted behaviour, and its file form.

:meth:`Plan.to_dict` is what ``pipemesh plan`` reports; :meth:`Plan.run_plan` the :class:`..schedule.plan.RunPlan`
the runtime runs (and ``pipemesh plan --output`` saves).

Pure: no torch, no processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..schedule.config import ScheduleConfig
from ..schedule.levers import BASIC_LEVERS, CATEGORIES, Lever
from ..schedule.lower import DEFAULT_RELOAD_LOOKAHEAD
from ..schedule.plan import PREDICTION_KEYS, RunPlan
from .costs import GB
from .simulator import PlacementPlan, SimulationResult


class NoFeasiblePlan(ValueError):
    """Nothing fits the memory budget; the message says what would."""


@dataclass
class Plan:
    """A chosen schedule with its recomputation and predicted behaviour."""

    config: ScheduleConfig
    placement: PlacementPlan
    """Where each chunk-micro-batch's activations are: (rank, chunk, micro-batch) -> lever (:class:`.levers.Lever`:
    a recompute level or host memory); missing = on the device."""
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
        for (rank, _, _), level in self.placement.items():
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
        return RunPlan(self.config, self.placement, tuple(sharding), shard_scope, recv_lookahead, self.reload_lookahead,
                       predicted={key: data[key] for key in PREDICTION_KEYS},
                       host_blocks={(r.rank, chunk): size for r in self.result.ranks for chunk, size in r.host_blocks.items()})

    def to_dict(self) -> dict:
        counts = {lever: 0 for lever in BASIC_LEVERS if lever.recomputes}
        for level in self.placement.values():
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
            "placement": [{"rank": r, "chunk": c, "microbatch": j, "level": level}
                          for (r, c, j), level in sorted(self.placement.items()) if not Lever.parse(level).is_device],
            **({"sharding": list(self.sharding.spec.levels), "shard_scope": self.sharding.spec.scope}
               if self.sharding is not None else {}),
            "placement_counts": self.placement_counts(),
            "peak_host_gb": [r.peak_host_bytes / GB for r in self.result.ranks],
            "host_memory_budget_gb": None if self.host_budget_bytes is None else self.host_budget_bytes / GB,
            "exposed_host_s": [r.exposed_host_s for r in self.result.ranks],
            "reload_lookahead": self.reload_lookahead,
        }
