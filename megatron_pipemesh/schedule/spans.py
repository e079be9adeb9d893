"""Group spans of a chunk on one rank: where a sharded (ZeRO-3) chunk must hold its gathered
parameters and where a ZeRO-2/3 chunk reduces the gradients of a backward group.

A chunk's forward group g is the run of its forwards ``F c.j`` with j in group g (in the
compute program they may interleave with backwards of other chunks in the 1F1B steady state);
likewise for backward groups. The chunk's parameters are needed from the first to the last
compute op of each group: its *span* (compute-op indices, inclusive). Spans that overlap, or whose
gap is too small to release and prefetch again (at most ``lookahead`` compute ops), merge into one,
so each merged span costs exactly one gather and one release. Pure: no torch.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from .config import ScheduleConfig
from .ops import Op, OpKind

ZERO_STAGE = {"optim": 1, "optim_grads": 2, "optim_grads_params": 3}
"""Megatron's sharding level names (``--data-parallel-sharding-strategy``) and the ZeRO stage each is."""

SHARD_LEVELS = tuple(ZERO_STAGE)
"""The sharding levels, one per chunk in ``LoweringOptions.sharding``."""

OPTIM, OPTIM_GRADS, OPTIM_GRADS_PARAMS = SHARD_LEVELS
"""ZeRO-1 (optimizer state sharded), ZeRO-2 (and gradients), ZeRO-3 (and parameters)."""


def shards_gradients(level: str) -> bool:
    """Whether a chunk at ``level`` keeps only its gradient shard (ZeRO-2 and 3: a REDUCE per backward group)."""
    return ZERO_STAGE[level] >= ZERO_STAGE[OPTIM_GRADS]


def shards_parameters(level: str) -> bool:
    """Whether a chunk at ``level`` keeps only its parameter shard (ZeRO-3: a GATHER before each span)."""
    return ZERO_STAGE[level] >= ZERO_STAGE[OPTIM_GRADS_PARAMS]

Span = Tuple[int, int]
"""(index of the first, index of the last) compute op of the span in the rank's compute program."""


def group_index(groups: Sequence[int], microbatch: int) -> int:
    """Index of the group (of sizes ``groups``) that holds ``microbatch``."""
    end = 0
    for index, size in enumerate(groups):
        end += size
        if microbatch < end:
            return index
    raise ValueError(f"micro-batch {microbatch} is outside groups {list(groups)}")


def group_spans(config: ScheduleConfig, compute: Sequence[Op], chunk: int, kind: OpKind) -> List[Span]:
    """Span of every forward (``kind`` FORWARD) or backward group of ``chunk`` in ``compute``, in order."""
    groups = config.forward_groups if kind is OpKind.FORWARD else config.backward_groups
    spans: dict = {}
    for index, op in enumerate(compute):
        if op.kind is kind and op.chunk == chunk:
            g = group_index(groups, op.microbatch)
            first, _ = spans.get(g, (index, index))
            spans[g] = (first, index)
    return [spans[g] for g in sorted(spans)]


def gather_spans(config: ScheduleConfig, compute: Sequence[Op], chunk: int, lookahead: int) -> List[Span]:
    """Merged spans during which a ZeRO-3 ``chunk`` holds its gathered parameters.

    Forward and backward group spans are merged when they overlap or when the next span's
    prefetch (``lookahead`` compute ops before its first op) would come before the previous
    span's release (right after its last op)."""
    spans = sorted(group_spans(config, compute, chunk, OpKind.FORWARD)
                   + group_spans(config, compute, chunk, OpKind.BACKWARD))
    merged: List[Span] = []
    for first, last in spans:
        if merged and first - merged[-1][1] <= lookahead:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged
