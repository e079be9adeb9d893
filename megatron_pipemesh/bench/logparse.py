"""The one parser of Megatron's training log text (standard library only, so that
``scripts/summarize_runs.py`` runs it on a bare cluster node): iteration lines, the argument dump,
per-rank timers (``--timing-log-option all``) and the PipeMesh auto plan line.

Megatron prints, on the last rank, for every ``--log-interval`` iterations::

     [2026-...] iteration        3/       8 | consumed samples: ... | elapsed time per iteration (ms): 753.8 | ...
    INFO:megatron.core.timers:times across ranks (ms):
      forward-backward:
         rank  0: 958.34
         rank  1: 959.19
      forward-compute:
         rank  0: 314.66
      ...

and, on rank 0 at start-up, its arguments (``  seq_length ..... 2048``).

With ``--log-interval 1`` each timer block belongs to the iteration line printed just before it.
Timer values are per iteration (Megatron divides by the log interval), except that the block after
the second iteration also holds the first (Megatron does not reset timers after the first
iteration); :func:`parse_log` subtracts it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

_NUMBER = r"([-+0-9.eE]+|nan|inf)"
ITERATION_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
TIME_RE = re.compile(r"elapsed time per iteration \(ms\):\s*" + _NUMBER, re.IGNORECASE)
LOSS_RE = re.compile(r"\blm loss:\s*" + _NUMBER, re.IGNORECASE)
GLOBAL_BATCH_RE = re.compile(r"global batch size:\s*(\d+)")
ARGUMENT_RE = re.compile(r"(?<![A-Za-z0-9_])([a-z0-9_]+)\s+\.{2,}\s+(\d+)\s*$")
TIMER_HEADER_RE = re.compile(r"times across ranks \(ms\):")
TIMER_NAME_RE = re.compile(r"^\s{2}([A-Za-z0-9_/\-]+):\s*$")
TIMER_RANK_RE = re.compile(r"^\s+rank\s+(\d+):\s*([0-9.]+)\s*$")
AUTO_PLAN_RE = re.compile(r"PipeMesh plan \(auto.*?--forward-groups ([0-9 ]+) --backward-groups ([0-9 ]+);")


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


@dataclass
class IterationLine:
    """The numbers of one Megatron iteration line."""

    iteration: int
    train_iters: int
    elapsed_ms: float
    """nan when Megatron printed something that is not a number."""
    loss: Optional[float] = None
    global_batch_size: Optional[int] = None


def parse_iteration_line(line: str) -> Optional[IterationLine]:
    """The iteration line's numbers, or None if ``line`` is not an iteration line with a time."""
    match = ITERATION_RE.search(line)
    time = TIME_RE.search(line) if match else None
    if time is None:
        return None
    loss = LOSS_RE.search(line)
    batch = GLOBAL_BATCH_RE.search(line)
    return IterationLine(int(match.group(1)), int(match.group(2)), _float(time.group(1)),
                         _float(loss.group(1)) if loss else None, int(batch.group(1)) if batch else None)


def parse_argument_line(line: str) -> Optional[Tuple[str, int]]:
    """``(name, value)`` of an integer line of Megatron's argument dump (``  seq_length ..... 2048``)."""
    match = ARGUMENT_RE.search(line)
    return (match.group(1), int(match.group(2))) if match else None


@dataclass
class IterationRecord:
    iteration: int
    elapsed_ms: float
    loss: Optional[float] = None
    timers: Dict[str, Dict[int, float]] = field(default_factory=dict)
    """timer name -> {rank: ms}."""


@dataclass
class ParsedLog:
    iterations: List[IterationRecord]
    train_iters: Optional[int] = None
    auto_forward_groups: Optional[List[int]] = None
    auto_backward_groups: Optional[List[int]] = None

    def measured(self, warmup: int) -> List[IterationRecord]:
        """Iterations after the first ``warmup``."""
        return [it for it in self.iterations if it.iteration > warmup]


def parse_log(text: str) -> ParsedLog:
    """Parse Megatron log text (stdout + stderr of the whole job, ranks interleaved)."""
    iterations: List[IterationRecord] = []
    train_iters = None
    current: Optional[IterationRecord] = None
    timer_name: Optional[str] = None
    in_timers = False
    auto_f = auto_b = None
    for line in text.splitlines():
        found = parse_iteration_line(line)
        if found is not None and math.isfinite(found.elapsed_ms):
            loss = found.loss if found.loss is not None and math.isfinite(found.loss) else None
            current = IterationRecord(found.iteration, found.elapsed_ms, loss)
            train_iters = found.train_iters
            iterations.append(current)
            in_timers, timer_name = False, None
            continue
        if TIMER_HEADER_RE.search(line):
            in_timers, timer_name = current is not None, None
            continue
        plan = AUTO_PLAN_RE.search(line)
        if plan:
            auto_f = [int(x) for x in plan.group(1).split()]
            auto_b = [int(x) for x in plan.group(2).split()]
            continue
        if not in_timers:
            continue
        name = TIMER_NAME_RE.match(line)
        if name:
            timer_name = name.group(1)
            current.timers.setdefault(timer_name, {})
            continue
        rank = TIMER_RANK_RE.match(line)
        if rank and timer_name is not None:
            current.timers[timer_name][int(rank.group(1))] = float(rank.group(2))
            continue
        # Other ranks' lines (warnings etc.) may interleave with the block: skip them, keep the block open
        # until the next iteration line or timer header.
    _undo_first_iteration_accumulation(iterations)
    return ParsedLog(iterations, train_iters, auto_f, auto_b)


def _undo_first_iteration_accumulation(iterations: List[IterationRecord]) -> None:
    """Megatron does not reset its timers after the first iteration (``should_reset = not
    is_first_iteration``), so the block printed after the second iteration holds iterations 1 + 2:
    subtract the first block from it."""
    if len(iterations) < 2 or iterations[1].iteration != iterations[0].iteration + 1:
        return
    first, second = iterations[0], iterations[1]
    for name, ranks in second.timers.items():
        for rank, value in ranks.items():
            before = first.timers.get(name, {}).get(rank)
            if before is not None and value >= before:
                ranks[rank] = value - before
