"""Schedule configuration: pipeline size, virtual chunks, micro-batches and the two group lists.

Groups generalize Megatron's ``microbatch_group_size_per_vp_stage`` (one size for both
directions) into two independent lists (PipeMesh's ``--forward-groups`` / ``--backward-groups``):

* depth-first  = groups of p (Megatron's default interleaved 1F1B),
* breadth-first = one group of m (all micro-batches through a chunk before the next one),
* uniform g    = Megatron with ``microbatch_group_size_per_vp_stage = g`` (last group takes the remainder),
* elastic      = any two lists that pass :func:`check_groups`.

The rules are checked before anything runs; a broken rule raises :class:`ScheduleConfigError`,
whose message names the flag, the values, the rule and a valid example.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

FORWARD_FLAG = "--forward-groups"
BACKWARD_FLAG = "--backward-groups"


class ScheduleConfigError(ValueError):
    """Invalid schedule configuration; the message is one paragraph meant for the user."""

    def __init__(self, flag: str, values: object, rule: str, example: str):
        self.flag, self.values, self.rule, self.example = flag, values, rule, example
        super().__init__(f"{flag} {_fmt(values)} is invalid: {rule}. Example of a valid setting: {example}")


def _fmt(values: object) -> str:
    if isinstance(values, (list, tuple)):
        return " ".join(str(v) for v in values)
    return str(values)


def uniform_groups(microbatches: int, group_size: int) -> List[int]:
    """Megatron's grouping for ``microbatch_group_size_per_vp_stage = group_size``.

    Mirrors ``get_schedule_table``: groups of ``group_size``; the group that would reach the end
    takes all remaining micro-batches.
    """
    groups, start = [], 0
    while start < microbatches:
        size = microbatches - start if start + group_size >= microbatches else group_size
        groups.append(size)
        start += size
    return groups


def depth_first_groups(microbatches: int, pp: int) -> List[int]:
    """Groups of p; when m is not a multiple of p the remainder joins the last group (Megatron
    rejects such m for its interleaved schedule; PipeMesh runs it with one larger last group)."""
    groups = uniform_groups(microbatches, pp)
    if len(groups) > 1 and groups[-1] < pp:
        tail = groups.pop()  # (popping inside `groups[-2] += ...` would index the shortened list)
        groups[-1] += tail
    return groups


@dataclass(frozen=True)
class ScheduleConfig:
    """One pipeline schedule: who runs what, in which order (PipeMesh notation of the contract)."""

    pp: int
    """Pipeline-parallel size p (number of pipeline ranks)."""
    vpp: int
    """Virtual chunks per rank V (Megatron's virtual pipeline size); rank r holds stage c*p + r."""
    microbatches: int
    """Micro-batches per iteration per data-parallel replica, m."""
    forward_groups: Tuple[int, ...] = field(default=())
    """Forward (enqueue) group sizes f_1..f_k, summing to m; empty means depth-first (groups of p)."""
    backward_groups: Tuple[int, ...] = field(default=())
    """Backward (dequeue) group sizes b_1..b_l, summing to m; empty means the forward groups."""

    def __post_init__(self) -> None:
        forward = tuple(self.forward_groups) or tuple(depth_first_groups(self.microbatches, max(self.pp, 1)))
        backward = tuple(self.backward_groups) or forward
        object.__setattr__(self, "forward_groups", forward)
        object.__setattr__(self, "backward_groups", backward)
        check_groups(self.pp, self.vpp, self.microbatches, forward, backward)

    # Presets ---------------------------------------------------------------------------------
    @classmethod
    def depth_first(cls, pp: int, vpp: int, microbatches: int) -> "ScheduleConfig":
        """Megatron's default interleaved 1F1B: groups of p in both directions (see :func:`depth_first_groups`)."""
        groups = tuple(depth_first_groups(microbatches, pp))
        return cls(pp, vpp, microbatches, groups, groups)

    @classmethod
    def breadth_first(cls, pp: int, vpp: int, microbatches: int) -> "ScheduleConfig":
        """One group of m: every micro-batch through a chunk before the next chunk."""
        return cls(pp, vpp, microbatches, (microbatches,), (microbatches,))

    @classmethod
    def uniform(cls, pp: int, vpp: int, microbatches: int, group_size: int) -> "ScheduleConfig":
        """Megatron with ``microbatch_group_size_per_vp_stage = group_size`` in both directions."""
        if not 1 <= group_size <= microbatches:
            valid = pp if microbatches % pp == 0 else microbatches
            raise ScheduleConfigError(
                "--microbatch-group-size-per-virtual-pipeline-stage", group_size,
                f"a group size must lie in [p={pp}, m={microbatches}]",
                f"--microbatch-group-size-per-virtual-pipeline-stage {valid}")
        groups = tuple(uniform_groups(microbatches, group_size))
        return cls(pp, vpp, microbatches, groups, groups)

    # Derived facts ---------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def stage(self, rank: int, chunk: int) -> int:
        """Global pipeline stage of ``chunk`` on ``rank`` (Megatron's interleaved placement)."""
        return chunk * self.pp + rank

    def place(self, stage: int) -> Tuple[int, int]:
        """(rank, chunk) holding a global stage."""
        return stage % self.pp, stage // self.pp

    def group_flags(self) -> str:
        """The command-line flags that select these groups."""
        return f"{FORWARD_FLAG} {_fmt(self.forward_groups)} {BACKWARD_FLAG} {_fmt(self.backward_groups)}"

    def describe(self) -> str:
        return f"p={self.pp} V={self.vpp} m={self.microbatches} {self.group_flags()}"

    def preset_name(self) -> Optional[str]:
        """'depth-first', 'breadth-first', 'uniform-g' or None (free elastic lists)."""
        f, b = list(self.forward_groups), list(self.backward_groups)
        if f != b:
            return None
        if f == [self.microbatches] and self.microbatches != self.pp:
            return "breadth-first"
        if f == depth_first_groups(self.microbatches, self.pp):
            return "depth-first"
        if f == uniform_groups(self.microbatches, f[0]):
            return f"uniform-{f[0]}"
        return None


def _example(pp: int, microbatches: int) -> str:
    """A valid elastic setting for these sizes, quoted in error messages."""
    if microbatches >= 2 * pp:
        rest = microbatches - pp
        return f"{FORWARD_FLAG} {rest} {pp} {BACKWARD_FLAG} {pp} {rest}"
    return f"{FORWARD_FLAG} {microbatches} {BACKWARD_FLAG} {microbatches}"


def check_groups(pp: int, vpp: int, microbatches: int, forward: Sequence[int], backward: Sequence[int]) -> None:
    """Raise :class:`ScheduleConfigError` unless the lists make a runnable, bubble-bounded schedule.

    Rules (each is checked in this order and named in the error):

    1. p >= 2, V >= 1, m >= 1 (the schedule is a pipeline schedule), or p = V = 1: no pipeline (Megatron's
       ``forward_backward_no_pipelining``, F B F B ..., which stock rows price; PipeMesh itself needs p >= 2);
    2. every group is a positive integer;
    3. each list sums to m;
    4. every group has at least p micro-batches, and m >= p: a smaller group starves rank 0, which
       waits for the last rank's looped-back output (Megatron's ``[PP, M]`` rule, per group);
    5. queue non-underflow: b_1+..+b_i <= f_1+..+f_i for every i, so no backward group dequeues
       micro-batches that have not been enqueued by the forward groups so far.

    The dependency and deadlock checks of the built program follow in :mod:`.validate`.
    """
    example = _example(pp, microbatches)
    if pp < 2 and not (pp == 1 and vpp == 1):
        raise ScheduleConfigError("--pipeline-model-parallel-size", pp,
                                  "PipeMesh schedules need at least 2 pipeline ranks", "--pipeline-model-parallel-size 2")
    if vpp < 1:
        raise ScheduleConfigError("--num-virtual-stages-per-pipeline-rank", vpp,
                                  "the number of virtual chunks per rank must be at least 1", "--num-virtual-stages-per-pipeline-rank 2")
    if microbatches < pp:
        raise ScheduleConfigError("micro-batches per iteration (global batch / (micro batch * data-parallel size))", microbatches,
                                  f"there must be at least p={pp} micro-batches so that every pipeline rank has work", f"{pp} or more micro-batches")
    for flag, groups in ((FORWARD_FLAG, forward), (BACKWARD_FLAG, backward)):
        if not groups or any((not isinstance(g, int)) or isinstance(g, bool) or g < 1 for g in groups):
            raise ScheduleConfigError(flag, list(groups), "every group must be a positive integer", example)
        if sum(groups) != microbatches:
            raise ScheduleConfigError(flag, list(groups),
                                      f"the groups sum to {sum(groups)} but there are m={microbatches} micro-batches per iteration; they must sum to m",
                                      example)
        small = [g for g in groups if g < pp]
        if small:
            raise ScheduleConfigError(flag, list(groups),
                                      f"group(s) {_fmt(small)} are smaller than the pipeline size p={pp}; every group needs at least p micro-batches, "
                                      "otherwise rank 0 starves waiting for the last rank", example)
    enqueued = dequeued = 0
    for index in range(max(len(forward), len(backward))):
        enqueued += forward[index] if index < len(forward) else 0
        dequeued += backward[index] if index < len(backward) else 0
        if dequeued > enqueued:
            raise ScheduleConfigError(
                f"{FORWARD_FLAG} {_fmt(forward)} {BACKWARD_FLAG}", list(backward),
                f"the first {index + 1} backward group(s) dequeue {dequeued} micro-batches but the first {index + 1} forward group(s) "
                f"enqueue only {enqueued}; every prefix sum of the backward groups must not exceed that of the forward groups",
                example)
