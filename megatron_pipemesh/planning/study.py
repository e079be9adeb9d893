"""Paper-scale study with the simulator: depth-first, breadth-first and PipeMesh auto for GPT
models of about 7B, 13B and 30B on 16-64 devices over commodity Ethernet.

Stock schedules get what stock Megatron offers when memory is short: no recomputation if they
fit, else selective recomputation everywhere, else full recomputation everywhere (uniform
policies); PipeMesh gets its planner (groups + pipeline-aware recomputation).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule.config import ScheduleConfig
from .costs import GB, ClusterSpec, ModelSpec, analytic_costs
from .planner import NoFeasiblePlan, plan_schedule
from .simulator import SimulationResult, simulate


@dataclass(frozen=True)
class StudyCase:
    name: str
    model: ModelSpec
    tp: int
    pp: int
    vpp: int
    dp: int
    microbatches: int

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp


CASES: Tuple[StudyCase, ...] = (
    StudyCase("GPT-7B", ModelSpec(32, 4096, 32, 2048, 1), tp=2, pp=4, vpp=2, dp=2, microbatches=32),
    StudyCase("GPT-13B", ModelSpec(40, 5120, 40, 2048, 1), tp=4, pp=4, vpp=2, dp=2, microbatches=32),
    StudyCase("GPT-30B", ModelSpec(48, 7168, 56, 2048, 1), tp=8, pp=4, vpp=3, dp=2, microbatches=32),
)


def _uniform(config: ScheduleConfig, level: str) -> Dict[Tuple[int, int, int], str]:
    return {(r, c, j): level for r in range(config.pp) for c in range(config.vpp) for j in range(config.microbatches)}


def stock(config: ScheduleConfig, costs, budget: float) -> Tuple[Optional[SimulationResult], str]:
    """Best uniform recompute policy that fits (what stock Megatron offers), or (None, 'OOM')."""
    for level in ("none", "selective", "full"):
        result = simulate(config, costs, _uniform(config, level) if level != "none" else None)
        if max(r.peak_memory_bytes for r in result.ranks) <= budget:
            return result, level
    return None, "OOM"


def run_case(case: StudyCase, gbps: float, memory_gb: float, tflops: float = 312.0, mfu: float = 0.45) -> dict:
    cluster = ClusterSpec(tp=case.tp, dp=case.dp, device_tflops=tflops, mfu=mfu, device_memory_gb=memory_gb,
                          dp_gbps=gbps, p2p_gbps=gbps, sequence_parallel=case.tp > 1, distributed_optimizer=True)
    costs_for = lambda cfg: analytic_costs(case.model, cluster, cfg)  # noqa: E731
    budget = memory_gb * GB * 0.9
    row = {"model": case.name, "devices": case.devices, "gbps": gbps, "memory_gb": memory_gb,
           "layout": f"TP{case.tp} PP{case.pp} V{case.vpp} DP{case.dp} m{case.microbatches}"}
    for name, config in (("depth-first", ScheduleConfig.depth_first(case.pp, case.vpp, case.microbatches)),
                         ("breadth-first", ScheduleConfig.breadth_first(case.pp, case.vpp, case.microbatches))):
        result, level = stock(config, costs_for(config), budget)
        row[name] = None if result is None else {"iteration_s": result.iteration_s, "idle": result.idle_fraction,
                                                 "peak_gb": max(r.peak_memory_bytes for r in result.ranks) / GB,
                                                 "recompute": level}
    try:
        best, _ = plan_schedule(case.pp, case.vpp, case.microbatches, costs_for, budget)
        row["pipemesh"] = {"iteration_s": best.result.iteration_s, "idle": best.result.idle_fraction,
                           "peak_gb": max(r.peak_memory_bytes for r in best.result.ranks) / GB,
                           "recompute": f"{100 * best.recompute_share:.2f}% time",
                           "groups": f"{' '.join(map(str, best.config.forward_groups))} / "
                                     f"{' '.join(map(str, best.config.backward_groups))}"}
    except NoFeasiblePlan:
        row["pipemesh"] = None
    stock_times = [row[k]["iteration_s"] for k in ("depth-first", "breadth-first") if row[k]]
    row["speedup_vs_best_stock"] = (min(stock_times) / row["pipemesh"]["iteration_s"]
                                    if row["pipemesh"] and stock_times else None)
    # The limit: the best schedule with free communication (depth-first then has no exposed sync).
    depth_first = ScheduleConfig.depth_first(case.pp, case.vpp, case.microbatches)
    free = dataclasses.replace(costs_for(depth_first), p2p_s=0.0, dp_reduce_s=0.0, dp_gather_s=0.0, latency_s=0.0)
    row["limit_iteration_s"] = simulate(depth_first, free).iteration_s
    return row


def markdown(rows: Sequence[dict]) -> str:
    def cell(entry: Optional[dict]) -> str:
        if entry is None:
            return "OOM"
        return f"{entry['iteration_s']:.2f} s, idle {100 * entry['idle']:.0f}%, {entry['peak_gb']:.0f} GB, rc {entry['recompute']}"

    lines = ["| model | devices | layout | Gbit/s | GB | depth-first | breadth-first | PipeMesh auto (groups) | speed-up vs best stock | PipeMesh / limit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        pm = row["pipemesh"]
        speed = f"{row['speedup_vs_best_stock']:.2f}x" if row["speedup_vs_best_stock"] else "n/a"
        limit = f"{row['limit_iteration_s'] / pm['iteration_s']:.2f}" if pm else "n/a"
        lines.append(f"| {row['model']} | {row['devices']} | {row['layout']} | {row['gbps']:g} | {row['memory_gb']:g} | "
                     f"{cell(row['depth-first'])} | {cell(row['breadth-first'])} | {cell(pm)}"
                     f"{' (' + pm['groups'] + ')' if pm else ''} | {speed} | {limit} |")
    return "\n".join(lines)


def run_study(cases: Sequence[StudyCase] = CASES, bandwidths: Sequence[float] = (25, 50, 100),
              memories: Sequence[float] = (40, 80)) -> List[dict]:
    return [run_case(case, gbps, memory) for case in cases for memory in memories for gbps in bandwidths]


if __name__ == "__main__":  # pragma: no cover
    print(markdown(run_study()))
