"""Per-rank compute programs: the forward/backward sequences and their 1F1B merge.

Forward sequence (same on every rank): for each forward group, for c = 0..V-1, for each
micro-batch j of the group: ``F c.j``. Backward sequence: for each backward group, for
c = V-1..0, for each j of the group: ``B c.j``.

Merge (1F1B): rank r runs W_r forwards, then alternates one forward and one backward, then runs
the remaining backwards. W_r = (V-1)*f_1 + 2*(p-r-1) (Megatron's interleaved warm-up with the
first forward group in place of the group size), raised so that every backward's own forward has
already run on that rank, capped at m*V. With V = 1 the warm-up is Megatron's non-interleaved
p-r-1 (stock 1F1B), so the same code also yields that baseline.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, List, NamedTuple, Sequence, Tuple

from .config import ScheduleConfig
from .ops import B, F, Op

Slot = Tuple[int, int]  # (chunk, micro-batch)


def _grouped(groups: Sequence[int], chunks: Sequence[int]) -> List[Slot]:
    slots: List[Slot] = []
    start = 0
    for size in groups:
        for chunk in chunks:
            slots.extend((chunk, j) for j in range(start, start + size))
        start += size
    return slots


def forward_sequence(config: ScheduleConfig) -> List[Slot]:
    """(chunk, micro-batch) of every forward, in execution order (identical on all ranks)."""
    return _grouped(config.forward_groups, range(config.vpp))


def backward_sequence(config: ScheduleConfig) -> List[Slot]:
    """(chunk, micro-batch) of every backward, in execution order (identical on all ranks)."""
    return _grouped(config.backward_groups, range(config.vpp - 1, -1, -1))


def base_warmup(config: ScheduleConfig, rank: int) -> int:
    """Megatron's warm-up rule with the first forward group as the group size (before raising)."""
    if config.vpp == 1:
        return config.pp - rank - 1
    return (config.vpp - 1) * config.forward_groups[0] + 2 * (config.pp - rank - 1)


def warmup(config: ScheduleConfig, rank: int) -> int:
    """Number of forwards rank ``rank`` runs before its first backward.

    Raised above :func:`base_warmup` where needed: in the steady phase the k-th backward runs
    after W + k + 1 forwards, so W >= index_in_forward_sequence(B_k) - k for every k.
    """
    return sequences(config).warmups[rank]


Step = Tuple[bool, int, int]
"""One compute op as plain data: (is a forward, chunk, micro-batch)."""


class Sequences(NamedTuple):
    """What every rank's compute order is made of (:func:`sequences`)."""

    forwards: Tuple[Step, ...]
    """The forward sequence (identical on all ranks)."""
    backwards: Tuple[Step, ...]
    """The backward sequence (identical on all ranks)."""
    warmups: Tuple[int, ...]
    """Per rank: the forwards it runs before its first backward (:func:`warmup`)."""


@lru_cache(maxsize=128)
def sequences(config: ScheduleConfig) -> Sequences:
    """The forward and backward sequences of ``config`` and every rank's warm-up, computed once per config: a rank's
    order is its warm-up forwards, then one forward and one backward in turn, then the backwards left
    (:func:`rank_steps`); planners read thousands of orders of a few configs."""
    forwards = forward_sequence(config)
    backwards = backward_sequence(config)
    position = {slot: index for index, slot in enumerate(forwards)}
    needed = max(position[slot] - k for k, slot in enumerate(backwards))
    total = config.microbatches * config.vpp
    warmups = tuple(min(max(base_warmup(config, rank), needed), total) for rank in range(config.pp))
    return Sequences(tuple((True, c, j) for c, j in forwards), tuple((False, c, j) for c, j in backwards), warmups)


def rank_steps(config: ScheduleConfig, rank: int, forward_only: bool = False) -> List[Step]:
    """The compute ops of one rank in execution order as :data:`Step` (warm-up, 1F1B steady state, cool-down);
    ``forward_only`` (evaluation) runs the forward sequence alone, as Megatron does."""
    forwards, backwards, warmups = sequences(config)
    if forward_only:
        return list(forwards)
    w = warmups[rank]
    steady = len(forwards) - w
    program = list(forwards[:w])
    for k in range(steady):
        program.append(forwards[w + k])
        program.append(backwards[k])
    program.extend(backwards[steady:])
    return program


def compute_program(config: ScheduleConfig, rank: int, forward_only: bool = False) -> List[Op]:
    """The compute ops of one rank in execution order (:func:`rank_steps` as ops)."""
    return [F(c, j) if forward else B(c, j) for forward, c, j in rank_steps(config, rank, forward_only)]


def compute_programs(config: ScheduleConfig, forward_only: bool = False) -> List[List[Op]]:
    """:func:`compute_program` for every rank, rank 0 first."""
    return [compute_program(config, rank, forward_only) for rank in range(config.pp)]


def first_last_positions(config: ScheduleConfig) -> Dict[str, Dict[int, int]]:
    """Index in the forward sequence of each chunk's first forward and in the backward sequence
    of each chunk's last backward (these place the data-parallel sync points)."""
    first: Dict[int, int] = {}
    for index, (chunk, _) in enumerate(forward_sequence(config)):
        first.setdefault(chunk, index)
    last: Dict[int, int] = {}
    for index, (chunk, _) in enumerate(backward_sequence(config)):
        last[chunk] = index
    return {"first_forward": first, "last_backward": last}
