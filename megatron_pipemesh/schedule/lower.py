"""Lowering: compute programs -> programs with pipeline sends/receives and data-parallel syncs.

Placement rules (the runtime follows the program literally):

* ``RECV_*`` of a compute op is posted ``recv_lookahead`` compute ops before it (at the start for
  the first ones), so the transfer overlaps the preceding compute; the runtime waits on it just
  before the consumer runs. Receives of one channel are posted in consumer order, which equals
  the sender's send order (checked by :mod:`.validate`).
* ``SEND_*`` follows its producer immediately; sends never block the compute stream.
* ``PARAM_SYNC c``: chunks 0 and 1 at the start; chunk c >= 2 just before the forward whose index
  is the first forward of chunk c-1, so its gather overlaps the f_1 forwards of chunk c-1.
  With ``align_param_sync`` the point is moved r forwards earlier on rank r, as Megatron's
  ``align_param_gather`` does, so all pipeline ranks launch the collective at about the same time.
* ``GRAD_SYNC c``: just after chunk c's last backward (in the last backward group); with
  ``align_grad_sync`` r backwards later on rank r (Megatron's ``align_grad_reduce``), or at the
  end when that index does not exist.
* ``OFFLOAD c.j`` (for the chunk-micro-batches of ``host_placement`` on this rank): right after
  ``F c.j`` and its send, so the copy to host memory overlaps the following compute;
  ``RELOAD c.j``: ``reload_lookahead`` compute ops before ``B c.j`` (never before the op after
  ``F c.j``), so the copy back overlaps the preceding compute; the backward waits on it.
* Mixed sharding (``LoweringOptions.sharding``, a level per chunk): a ZeRO-3 (``optim_grads_params``)
  chunk has no PARAM_SYNC; ``GATHER c.k`` is launched ``gather_lookahead`` compute ops before the k-th
  gather span of the chunk (:func:`.spans.gather_spans`: its forward and backward groups, merged when
  they overlap) and ``RELEASE c.k`` follows the span's last compute op. A ZeRO-2/3 chunk gets
  ``REDUCE c.k`` after the last backward of each of its backward groups but the last (whose reduction
  is the chunk's GRAD_SYNC).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Dict, List, Mapping, Optional, Tuple

from .config import ScheduleConfig
from .levers import Lever
from .ops import Op, OpKind, parse_op
from .order import compute_programs, first_last_positions
from .spans import SHARD_LEVELS, gather_spans, group_spans


DEFAULT_RELOAD_LOOKAHEAD = 2
"""Compute ops between a RELOAD and its backward when nothing sizes it (the planner sizes it from the copy time)."""

LOOKAHEAD_LEAST = {"recv_lookahead": 0, "reload_lookahead": 1, "gather_lookahead": 0}
"""The fewest compute ops each lookahead may be: a receive or a gather may be posted right before the op that
needs it, a RELOAD at least one compute op before its backward (it cannot share the backward's slot)."""


def check_lookahead(name: str, value, error: type = ValueError) -> int:
    """``value`` when it is a valid lookahead ``name`` (:data:`LOOKAHEAD_LEAST`: an integer count of compute ops, at
    least the least), else ``error`` saying what is wrong."""
    least = LOOKAHEAD_LEAST[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise error(f"{name} {value!r} must be an integer >= {least} (compute ops)")
    return value


@dataclass(frozen=True)
class LoweringOptions:
    """How communication and data-parallel points are placed in the programs."""

    recv_lookahead: int = 1
    """Post a receive this many compute ops before its consumer (>= 1; 0 posts it right before)."""
    param_sync: bool = True
    """Emit PARAM_SYNC ops (used with a distributed optimizer and overlapped parameter gather)."""
    grad_sync: bool = True
    """Emit GRAD_SYNC ops (overlapped gradient reduction per chunk)."""
    align_param_sync: bool = True
    """Shift each rank's PARAM_SYNC r forwards earlier so pipeline ranks launch together (Megatron default)."""
    align_grad_sync: bool = True
    """Shift each rank's GRAD_SYNC r backwards later so pipeline ranks launch together (Megatron default)."""
    forward_only: bool = False
    """Evaluation program: forwards only, no backward and no data-parallel syncs."""
    host_placement: Tuple[Tuple[int, int, int], ...] = ()
    """(pipeline rank, chunk, micro-batch) whose saved activations go to host memory after the
    forward (OFFLOAD) and come back before the backward (RELOAD); ignored by evaluation programs."""
    reload_lookahead: int = DEFAULT_RELOAD_LOOKAHEAD
    """Launch a RELOAD this many compute ops before its backward (>= 1)."""
    sharding: Tuple[str, ...] = ()
    """Mixed sharding: a level per chunk ('optim', 'optim_grads', 'optim_grads_params'); empty: every chunk
    'optim' (or no sharding), no GATHER/RELEASE/REDUCE ops."""
    gather_lookahead: int = 1
    """Launch a ZeRO-3 GATHER this many compute ops before its span (>= 0)."""

    @property
    def zero3_chunks(self) -> Tuple[int, ...]:
        """Chunks whose parameters are sharded and gathered per span."""
        return tuple(c for c, level in enumerate(self.sharding) if level == "optim_grads_params")

    @property
    def zero2_chunks(self) -> Tuple[int, ...]:
        """Chunks whose gradients are sharded (reduced once per backward group)."""
        return tuple(c for c, level in enumerate(self.sharding) if level in ("optim_grads", "optim_grads_params"))

    def __post_init__(self) -> None:
        # JSON round-trips turn the keys into lists; keep one canonical, hashable, sorted form.
        object.__setattr__(self, "host_placement", tuple(sorted(tuple(int(x) for x in key) for key in self.host_placement)))
        object.__setattr__(self, "sharding", tuple(self.sharding))
        unknown = [level for level in self.sharding if level not in SHARD_LEVELS]
        if unknown:
            raise ValueError(f"unknown sharding level(s) {unknown}; levels are {', '.join(SHARD_LEVELS)}")


def host_placement_of(plan: Optional[Mapping[Tuple[int, int, int], str]]) -> Tuple[Tuple[int, int, int], ...]:
    """``LoweringOptions.host_placement`` of a per (pipeline rank, chunk, micro-batch) placement plan:
    every rank's host keys (all ranks lower, and compare, the same whole plan)."""
    return tuple(sorted(key for key, level in (plan or {}).items() if Lever.parse(level).is_host))


def input_source(config: ScheduleConfig, rank: int, op: Op) -> Optional[Tuple[int, int]]:
    """(peer rank, peer chunk) that produces the tensor ``op`` consumes, or None (no input).

    Forward consumes the previous stage's activation, backward the next stage's gradient.
    """
    stage = config.stage(rank, op.chunk)
    if op.kind is OpKind.FORWARD:
        return config.place(stage - 1) if stage > 0 else None
    return config.place(stage + 1) if stage < config.num_stages - 1 else None


def output_target(config: ScheduleConfig, rank: int, op: Op) -> Optional[Tuple[int, int]]:
    """(peer rank, peer chunk) that consumes the tensor ``op`` produces, or None."""
    stage = config.stage(rank, op.chunk)
    if op.kind is OpKind.FORWARD:
        return config.place(stage + 1) if stage < config.num_stages - 1 else None
    return config.place(stage - 1) if stage > 0 else None


_RECV = {OpKind.FORWARD: OpKind.RECV_FORWARD, OpKind.BACKWARD: OpKind.RECV_BACKWARD}
_SEND = {OpKind.FORWARD: OpKind.SEND_FORWARD, OpKind.BACKWARD: OpKind.SEND_BACKWARD}


@dataclass
class LoweredSchedule:
    """Per-rank programs ready to validate, simulate or run; plain data (JSON round-trips)."""

    config: ScheduleConfig
    options: LoweringOptions
    programs: List[List[Op]] = field(default_factory=list)

    def compute_order(self, rank: int) -> List[Op]:
        return [op for op in self.programs[rank] if op.kind.is_compute]

    def to_dict(self) -> dict:
        return {
            "pp": self.config.pp, "vpp": self.config.vpp, "microbatches": self.config.microbatches,
            "forward_groups": list(self.config.forward_groups), "backward_groups": list(self.config.backward_groups),
            "options": _options_dict(self.options),
            "programs": [[str(op) for op in program] for program in self.programs],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "LoweredSchedule":
        config = ScheduleConfig(data["pp"], data["vpp"], data["microbatches"],
                                tuple(data["forward_groups"]), tuple(data["backward_groups"]))
        return cls(config, LoweringOptions(**data.get("options", {})),
                   [[parse_op(text) for text in program] for program in data["programs"]])

    def digest(self) -> str:
        """Stable hash of the whole plan; ranks compare it at start-up."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


_SHARDING_DEFAULTS = {"sharding": (), "gather_lookahead": 1}


def _options_dict(options: LoweringOptions) -> dict:
    """The options as plain data; the sharding options are left out at their defaults so that plans
    without mixed sharding keep their digest."""
    data = asdict(options)
    for key, default in _SHARDING_DEFAULTS.items():
        if data[key] == default or data[key] == list(default):
            del data[key]
    return data


def lower(config: ScheduleConfig, options: LoweringOptions = LoweringOptions()) -> LoweredSchedule:
    """Build every rank's lowered program for ``config``."""
    for name in LOOKAHEAD_LEAST:
        check_lookahead(name, getattr(options, name))
    if options.sharding and len(options.sharding) != config.vpp:
        raise ValueError(f"sharding gives {len(options.sharding)} levels for {config.vpp} virtual chunks (one per chunk)")
    for key in options.host_placement:
        rank, chunk, microbatch = key
        if not (0 <= rank < config.pp and 0 <= chunk < config.vpp and 0 <= microbatch < config.microbatches):
            raise ValueError(f"host placement {key} (pipeline rank, chunk, micro-batch) is outside {config.describe()}: "
                             f"ranks 0..{config.pp - 1}, chunks 0..{config.vpp - 1}, micro-batches 0..{config.microbatches - 1}")
    return LoweredSchedule(config, options, [list(program) for program in _lowered_programs(config, options)])


@lru_cache(maxsize=256)
def _lowered_programs(config: ScheduleConfig, options: LoweringOptions) -> Tuple[Tuple[Op, ...], ...]:
    """The programs of :func:`lower`, memoized: planners and the study lower the same (config,
    options) many times. Ops are frozen, so every caller gets its own lists of shared ops (which
    also lets the timeline engine reuse its compiled form of them)."""
    positions = first_last_positions(config)
    return tuple(
        tuple(_lower_rank(config, options, rank, compute, positions))
        for rank, compute in enumerate(compute_programs(config, options.forward_only))
    )


def _lower_rank(config: ScheduleConfig, options: LoweringOptions, rank: int, compute: List[Op],
                positions: Dict[str, Dict[int, int]]) -> List[Op]:
    before: Dict[int, List[Op]] = {i: [] for i in range(len(compute) + 1)}  # ops placed before compute[i]
    after: Dict[int, List[Op]] = {i: [] for i in range(len(compute))}
    # Indices of the k-th forward / backward within this rank's compute program.
    forward_at = [i for i, op in enumerate(compute) if op.kind is OpKind.FORWARD]
    backward_at = [i for i, op in enumerate(compute) if op.kind is OpKind.BACKWARD]

    zero3 = () if options.forward_only else options.zero3_chunks
    if options.param_sync and not options.forward_only:
        for chunk in range(min(2, config.vpp)):
            if chunk not in zero3:
                before[0].append(Op(OpKind.PARAM_SYNC, chunk))
        for chunk in range(2, config.vpp):
            k = positions["first_forward"][chunk - 1] - (rank if options.align_param_sync else 0)
            if chunk not in zero3:
                before[forward_at[max(k, 0)]].append(Op(OpKind.PARAM_SYNC, chunk))
    for chunk in zero3:
        previous_release = -1
        for k, (first, last) in enumerate(gather_spans(config, compute, chunk, options.gather_lookahead)):
            before[max(first - options.gather_lookahead, previous_release + 1, 0)].append(Op(OpKind.GATHER, chunk, k))
            after[last].append(Op(OpKind.RELEASE, chunk, k))
            previous_release = last
    for chunk in (() if options.forward_only else options.zero2_chunks):
        for k, (_, last) in enumerate(group_spans(config, compute, chunk, OpKind.BACKWARD)[:-1]):
            after[last].append(Op(OpKind.REDUCE, chunk, k))

    peers: Dict[Tuple[OpKind, int], Tuple[Optional[Tuple[int, int]], Optional[Tuple[int, int]]]] = {}
    for index, op in enumerate(compute):
        placed = peers.get((op.kind, op.chunk))
        if placed is None:  # the same for every micro-batch of a chunk
            placed = peers[op.kind, op.chunk] = (input_source(config, rank, op), output_target(config, rank, op))
        source, target = placed
        if source is not None:
            post = max(index - options.recv_lookahead, 0)
            before[post].append(Op(_RECV[op.kind], op.chunk, op.microbatch, source[0]))
        if target is not None:
            after[index].append(Op(_SEND[op.kind], op.chunk, op.microbatch, target[0]))

    if options.host_placement and not options.forward_only:
        where = {op: i for i, op in enumerate(compute)}
        for _, chunk, microbatch in (key for key in options.host_placement if key[0] == rank):
            f, b = where[Op(OpKind.FORWARD, chunk, microbatch)], where[Op(OpKind.BACKWARD, chunk, microbatch)]
            after[f].append(Op(OpKind.OFFLOAD, chunk, microbatch))
            before[max(b - options.reload_lookahead, f + 1)].append(Op(OpKind.RELOAD, chunk, microbatch))

    tail: List[Op] = []
    if options.grad_sync and not options.forward_only:
        for chunk in sorted(positions["last_backward"], key=positions["last_backward"].get):
            k = positions["last_backward"][chunk] + (rank if options.align_grad_sync else 0)
            if k < len(backward_at):
                after[backward_at[k]].append(Op(OpKind.GRAD_SYNC, chunk))
            else:
                tail.append(Op(OpKind.GRAD_SYNC, chunk))

    program: List[Op] = []
    for index, op in enumerate(compute):
        program.extend(before[index])
        program.append(op)
        program.extend(after[index])
    program.extend(tail)
    return program
