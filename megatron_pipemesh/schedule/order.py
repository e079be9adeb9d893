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

from typing import Dict, List, Sequence, Tuple

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
    total = config.microbatches * config.vpp
    position = {slot: index for index, slot in enumerate(forward_sequence(config))}
    needed = max(position[slot] - k for k, slot in enumerate(backward_sequence(config)))
    return min(max(base_warmup(config, rank), needed), total)


def compute_program(config: ScheduleConfig, rank: int, forward_only: bool = False) -> List[Op]:
    """The compute ops of one rank in execution order (warm-up, 1F1B steady state, cool-down).

    ``forward_only`` (evaluation) runs the forward sequence alone, as Megatron does.
    """
    forwards = [F(c, j) for c, j in forward_sequence(config)]
    if forward_only:
        return forwards
    backwards = [B(c, j) for c, j in backward_sequence(config)]
    w = warmup(config, rank)
    program = forwards[:w]
    steady = len(forwards) - w
    for k in range(steady):
        program.append(forwards[w + k])
        program.append(backwards[k])
    program.extend(backwards[steady:])
    return program


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
