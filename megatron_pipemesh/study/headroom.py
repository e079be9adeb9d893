"""``pipemesh headroom``: how much faster than the best stock schedule *any* schedule could be, over the
whole commodity space of the study, from the simulator's cost model.

Per setting (model, TP, DP, PP, global batch, device memory, network rate, GPUs per node):

* ``best_stock``: the fastest stock Megatron setting that fits (:func:`..planning.stock.best_stock`: 1F1B and
  interleaved for every V and group size, every recomputation option);
* ``bound``: the least iteration time of any exact synchronous schedule of the layout, memory ignored
  (:func:`..planning.bounds.iteration_lower_bound`: the stage-0 chain in series, reductions after the last
  stage's last forward, every link's bytes at its capacity);
* ``headroom = best_stock / bound``: no schedule, PipeMesh's included, beats the best stock setting by
  more than this, under the same costs.

The space is the cross product the performance issue names for the commodity regime: device memory
24/32/40 GB, TP 1 / 2 / 2 with sequence parallelism, 6.25/10/25/50 Gbit/s, DP 2/4/8, GPT
1.3B/2.7B/6.7B/13B, global batch 64/256 (``--batches`` for others), the pipeline size of 2/4/8 where
the best stock setting is fastest (the layout a Megatron user would pick), and two node shapes:
8-GPU servers, whose data-parallel rings stay inside the node when TP x DP <= 8 (PCIe,
:data:`.rows.INTRA_NODE_GBPS`), and one GPU (one TP group) per VM, where every ring and pipeline link
crosses the network. Settings where no stock schedule fits at any pipeline size are counted and left
out. Costs are the study's (:func:`.rows.row_specs`: bf16, distributed optimizer, seq 2048,
micro-batch 1, local layer spec, 10% memory margin).

Pure: no torch.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

from ..planning.bounds import iteration_lower_bound
from ..planning.costs import GB
from ..planning.stock import activation_budget, best_stock
from ..planning.memory import MEMORY_MARGIN
from .rows import TARGET, StudyRow, row_specs


@dataclass(frozen=True)
class Setting:
    """One point of the commodity space."""

    model: str
    tp: int
    sequence_parallel: bool
    dp: int
    global_batch: int
    memory_gb: int
    gbps: float
    gpus_per_node: int
    """8: an 8-GPU PCIe server; 1: one GPU (one TP group) per VM."""

    def describe(self) -> str:
        sp = "+SP" if self.sequence_parallel else ""
        return (f"{self.model} TP{self.tp}{sp} DP{self.dp} GB{self.global_batch} {self.memory_gb}GB "
                f"{self.gbps:g}Gb/s {self.gpus_per_node}/node")


def commodity_space(batches: Sequence[int] = (64, 256)) -> List[Setting]:
    """The issue's commodity cross product (see the module docstring)."""
    out = []
    for model, (tp, sp), dp, batch, memory, gbps, node in itertools.product(
            ("GPT-1.3B", "GPT-2.7B", "GPT-6.7B", "GPT-13B"), ((1, False), (2, False), (2, True)), (2, 4, 8),
            batches, (24, 32, 40), (6.25, 10.0, 25.0, 50.0), (8, 1)):
        out.append(Setting(model, tp, sp, dp, batch, memory, gbps, node))
    return out


def study_row(setting: Setting, pp: int):
    """``setting`` at pipeline size ``pp`` as a :class:`.rows.StudyRow` (the study's model and cluster)."""
    return StudyRow("commodity", setting.model, setting.tp, pp, setting.dp, setting.global_batch, setting.memory_gb,
                    setting.gbps, setting.sequence_parallel, gpus_per_node=setting.gpus_per_node)


def evaluate(setting: Setting) -> Optional[dict]:
    """best stock, bound and headroom at the pipeline size (2, 4 or 8) where stock is fastest, the layout a
    Megatron user would pick (None: stock fits at none)."""
    model, cluster = row_specs(study_row(setting, 2))
    m = setting.global_batch // setting.dp
    budget = setting.memory_gb * GB * (1 - MEMORY_MARGIN)
    best = None
    for pp in (2, 4, 8):
        if model.num_layers % pp or m < pp:
            continue
        left = activation_budget(model, cluster, pp, budget)
        if min(left) <= 0:
            continue
        stock = best_stock(model, cluster, pp, m, left)
        if stock is not None and (best is None or stock.iteration_s < best[1].iteration_s):
            best = (pp, stock)
    if best is None:
        return None
    pp, stock = best
    bound = iteration_lower_bound(model, cluster, pp, m)
    return {"setting": setting.describe(), **dataclasses.asdict(setting), "pp": pp, "microbatches": m,
            "best_stock": stock.setting.describe(), "best_stock_s": stock.iteration_s,
            "bound": bound.to_dict(), "headroom": stock.iteration_s / bound.seconds}


def sweep(settings: Iterable[Setting], jobs: int = 1) -> Iterator[Optional[dict]]:
    """:func:`evaluate` of every setting, in order, as each is done (``jobs`` worker processes)."""
    settings = list(settings)
    if jobs <= 1:
        yield from map(evaluate, settings)
        return
    with ProcessPoolExecutor(jobs) as pool:
        yield from pool.map(evaluate, settings, chunksize=2)


def summary(rows: Sequence[Optional[dict]]) -> Dict[str, object]:
    """Share of settings where some schedule could reach :data:`TARGET`, overall and per node shape and rate."""
    fitted = [r for r in rows if r]
    out: Dict[str, object] = {"settings": len(rows), "no_stock_fits": len(rows) - len(fitted)}

    def share(subset: List[dict]) -> float:
        return sum(r["headroom"] >= TARGET for r in subset) / len(subset) if subset else math.nan

    out["share_headroom_at_least_1_15"] = share(fitted)
    heads = sorted(r["headroom"] for r in fitted)
    out["median_headroom"] = heads[len(heads) // 2] if heads else math.nan
    for node in (8, 1):
        for gbps in (6.25, 10.0, 25.0, 50.0):
            subset = [r for r in fitted if r["gpus_per_node"] == node and r["gbps"] == gbps]
            out[f"share_{node}_per_node_{gbps:g}gbps"] = share(subset)
    return out


def cmd_headroom(args) -> int:
    """Entry point of ``pipemesh headroom``."""
    import json
    import os

    settings = [s for s in commodity_space(tuple(args.batches)) if args.only in s.describe()]
    rows = []
    for row in sweep(settings, args.jobs or os.cpu_count() or 1):
        rows.append(row)
        if row and not args.json:
            print(f"{row['setting']:48s} PP{row['pp']} best stock {row['best_stock_s']:8.3f} s  bound "
                  f"{row['bound']['seconds']:8.3f} s ({row['bound']['bottleneck']})  headroom {row['headroom']:.3f}",
                  flush=True)
    if args.json:
        print(json.dumps([r for r in rows if r], indent=1))
        return 0
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary(rows).items()))
    return 0


def add_headroom_parser(sub) -> None:
    """Register ``pipemesh headroom`` on the CLI's subparsers."""
    p = sub.add_parser("headroom", help="upper bound on any schedule's speed-up over best stock, commodity space")
    p.add_argument("--json", action="store_true", help="print a JSON list of settings")
    p.add_argument("--only", metavar="TEXT", default="", help="only settings whose description contains TEXT")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256], metavar="GB",
                   help="global batch sizes of the sweep (default 64 256)")
    p.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per core)")
    p.set_defaults(func=cmd_headroom)
