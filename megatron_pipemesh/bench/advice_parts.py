"""Where an iteration's time goes, predicted and measured, and which cost a missed prediction got wrong
(``pipemesh bench --advice``).

One iteration of one pipeline rank splits into four parts that add up to the iteration time on both sides:

* ``compute``: forwards, backwards and their recomputation. Predicted: the simulator's ``busy_s`` (ranks sharing
  cores: stretched while the other stages compute, as the wall-clock timers see it); measured: Megatron's
  ``forward-compute`` + ``backward-compute`` timers.
* ``p2p``: the rest of the schedule, time waiting on pipeline transfers and the bubble they leave. Predicted: the
  rank's idle time less its exposed data-parallel time (``exposed_p2p_s`` + ``bubble_s`` + host waits); measured:
  ``forward-backward`` less compute and the data-parallel timers (both run inside ``forward-backward``).
* ``dp``: gradient synchronisation left exposed. Predicted: ``exposed_dp_s``; measured: the timers Megatron's
  ``finalize_model_grads`` starts (:data:`DP_TIMERS`: with ``--overlap-grad-reduce`` ``all-grads-sync`` is the wait
  for the reductions still in flight).
* ``optimizer``: the step. Predicted: the iteration less busy and idle time (the simulator ends a rank's iteration
  with its step); measured: the ``optimizer`` timer (which holds the parameter all-gather of the distributed
  optimizer when it is not overlapped).

The measured iteration time also holds what runs outside both timers (data loading, logging): ``other``, predicted 0.

Pure: standard library only.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

PARTS = ("compute", "p2p", "dp", "optimizer", "other")
"""The parts of an iteration, in report order (``other``: measured only)."""

CAUSES = {"compute": "compute (forward/backward compute)", "p2p": "p2p (pipeline waits)",
          "dp": "DP (gradient/param sync exposed)", "optimizer": "optimizer (optimizer step)",
          "other": "other (outside forward-backward and the optimizer: data loading, logging)"}
"""What each part is called in the report."""

DP_TIMERS = ("all-grads-sync", "embedding-grads-all-reduce", "non-tensor-parallel-grads-all-reduce",
             "conditional-embedder-grads-all-reduce")
"""Megatron's data-parallel timers inside ``forward-backward`` (``finalize_model_grads``), ms per iteration."""

MISS_TOLERANCE = 0.10
"""A prediction off by more than this fraction of itself is a miss, and the report says which cost differs."""

WAIT_DEFERENCE = 0.8
"""A rank's pipeline wait is often another rank's extra work: the p2p part is named the cause only when no other
part's excess reaches this fraction of its own."""


@dataclass(frozen=True)
class RankParts:
    """One pipeline rank's iteration split into :data:`PARTS` (seconds)."""

    compute: float
    p2p: float
    dp: float
    optimizer: float
    other: float = 0.0

    def get(self, part: str) -> float:
        return getattr(self, part)

    @property
    def total(self) -> float:
        return sum(self.get(p) for p in PARTS)

    def to_dict(self) -> Dict[str, float]:
        return {p: self.get(p) for p in PARTS}


def predicted_parts(iteration_s: float, ranks) -> List[RankParts]:
    """Per pipeline rank, from a :class:`~megatron_pipemesh.planning.simulator.SimulationResult`'s iteration time and
    ranks (``busy_s``, ``idle_s``, ``exposed_dp_s``); the parts add up to ``iteration_s`` on every rank."""
    out = []
    for r in ranks:
        optimizer = max(0.0, iteration_s - r.busy_s - r.idle_s)
        out.append(RankParts(compute=r.busy_s, p2p=max(0.0, r.idle_s - r.exposed_dp_s), dp=r.exposed_dp_s,
                             optimizer=optimizer))
    return out


def _median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def measured_parts(iterations: Sequence, pp: int, dp: int) -> Optional[List[RankParts]]:
    """Per pipeline rank, the medians over ``iterations`` (:class:`~.logparse.IterationRecord`, already past the
    warm-up) of its parts, the data-parallel replicas of a stage averaged (Megatron's default rank order with TP = 1:
    global rank r is stage r // dp). None without a ``forward-backward`` timer for every rank (timers off)."""
    world = pp * dp
    per_rank: List[Dict[str, List[float]]] = [{p: [] for p in PARTS} for _ in range(world)]
    for it in iterations:
        timers = it.timers
        for rank in range(world):
            fb = timers.get("forward-backward", {}).get(rank)
            if fb is None:
                continue
            compute = sum(timers.get(name, {}).get(rank, 0.0) for name in ("forward-compute", "backward-compute"))
            sync = sum(timers.get(name, {}).get(rank, 0.0) for name in DP_TIMERS)
            optimizer = timers.get("optimizer", {}).get(rank, 0.0)
            values = {"compute": compute, "dp": sync, "p2p": max(0.0, fb - compute - sync), "optimizer": optimizer,
                      "other": max(0.0, it.elapsed_ms - fb - optimizer)}
            for part, ms in values.items():
                per_rank[rank][part].append(ms / 1e3)
    if any(not parts["compute"] for parts in per_rank):
        return None
    out = []
    for stage in range(pp):
        replicas = [per_rank[stage * dp + d] for d in range(dp)]
        out.append(RankParts(**{p: statistics.fmean(_median(r[p]) for r in replicas) for p in PARTS}))
    return out


def attribute(predicted_s: float, measured_s: float, predicted: Sequence[RankParts],
              measured: Optional[Sequence[RankParts]], tolerance: float = MISS_TOLERANCE) -> dict:
    """How far the measurement is from the prediction and, when it misses by more than ``tolerance``, which part.

    Per part, the difference (measured - predicted) on the rank where it is largest in the direction of the miss
    (a slow part on one rank is enough to slow every rank). The part with the largest such difference is the cause,
    except that pipeline waits (p2p) defer to another part within :data:`WAIT_DEFERENCE` of them."""
    ratio = measured_s / predicted_s if predicted_s > 0 else float("inf")
    out = {"predicted_s": predicted_s, "measured_s": measured_s, "measured_over_predicted": ratio,
           "miss": abs(ratio - 1.0) > tolerance, "cause": None, "differences_s": None}
    if measured is None or len(measured) != len(predicted):
        return out
    sign = 1.0 if measured_s >= predicted_s else -1.0
    differences = {}
    for part in PARTS:
        diffs = [m.get(part) - p.get(part) for m, p in zip(measured, predicted)]
        differences[part] = max(diffs, key=lambda d: sign * d)
    out["differences_s"] = differences
    if out["miss"]:
        ranked = sorted(PARTS, key=lambda part: sign * differences[part], reverse=True)
        cause = ranked[0]
        if cause == "p2p":
            others = [p for p in ranked if p != "p2p" and sign * differences[p] >= WAIT_DEFERENCE * sign * differences["p2p"]]
            cause = others[0] if others else cause
        out["cause"] = cause if sign * differences[cause] > 0 else None
    return out


PART_LIMITS = {"compute": (0.10, 0.0), "communication": (0.20, 0.050), "optimizer": (0.20, 0.020)}
"""A part's prediction holds when measured within (fraction of the prediction, or seconds) of it, whichever is
larger; communication is p2p + dp (a wait moves between them with the order of the ranks' work)."""


def _grouped(parts: RankParts) -> Dict[str, float]:
    return {"compute": parts.compute, "communication": parts.p2p + parts.dp, "optimizer": parts.optimizer}


def part_misses(predicted: Sequence[RankParts], measured: Optional[Sequence[RankParts]]) -> Optional[List[str]]:
    """Per pipeline rank, the parts (:data:`PART_LIMITS`) measured outside their limit, in words ('rank 1 compute
    +14% (412 vs 361 ms)'); None without measured parts."""
    if measured is None or len(measured) != len(predicted):
        return None
    out = []
    for rank, (p, m) in enumerate(zip(predicted, measured)):
        want, got = _grouped(p), _grouped(m)
        for part, (fraction, floor_s) in PART_LIMITS.items():
            if abs(got[part] - want[part]) > max(fraction * want[part], floor_s):
                off = f"{100 * (got[part] / want[part] - 1):+.0f}%" if want[part] > 0 else "predicted 0"
                out.append(f"rank {rank} {part} {off} ({1e3 * got[part]:.0f} vs {1e3 * want[part]:.0f} ms)")
    return out


def judgement(attribution: dict, misses: Optional[List[str]]) -> str:
    """A row's verdict: 'within 10%' only where its total and every part hold; 'within 10% only by cancelling errors'
    where the total holds and a part does not; 'miss' where the total misses; 'total within 10%, parts not
    measured' without timers."""
    if attribution["miss"]:
        return "miss"
    if misses is None:
        return "total within 10%, parts not measured"
    return "within 10% only by cancelling errors" if misses else "within 10%"


def cause_text(attribution: dict) -> str:
    """One line on a missed prediction: the cost that differs and by how much (empty when it did not miss)."""
    if not attribution["miss"]:
        return ""
    ratio = attribution["measured_over_predicted"]
    head = f"measured {100 * (ratio - 1):+.0f}% against the prediction"
    cause = attribution.get("cause")
    if cause is None:
        return head + ("; no timers to say which cost differs" if attribution.get("differences_s") is None
                       else "; no single part explains it")
    diffs = attribution["differences_s"]
    rest = ", ".join(f"{p} {1e3 * diffs[p]:+.0f} ms" for p in PARTS if p != cause)
    return f"{head}: {CAUSES[cause]} differs by {1e3 * diffs[cause]:+.0f} ms per iteration (others: {rest})"
