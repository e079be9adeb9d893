"""Lowering: compute programs -> programs with pipeline sends/receives and data-parallel syncs.

Placement rules (the runtime follows the program literally):

* ``RECV_*`` of a compute op is posted ``recv_lookahead`` compute ops before it (at the start for
  the first ones), so the transfer overlaps the preceding compute; the runtime waits on it just
  before the consumer runs. With ``megatron_p2p`` (stock rows) it is posted where Megatron's schedules post it
  (:func:`_megatron_post`). Receives of one channel are posted in consumer order, which equals
  the sender's send order (checked by :mod:`.validate`).
* ``SEND_*`` follows its producer immediately. With ``send_wait`` "none" (PipeMesh's runtime) a send never
  holds the compute stream; with "posted" / "delivered" (Megatron's schedules, which wait on each send before
  the next compute) the rank's next compute op waits until the receiver has posted the receive / the transfer
  has ended (:data:`SEND_WAITS`).
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
from collections import defaultdict
import json
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Dict, List, Mapping, Optional, Tuple

from .config import ScheduleConfig
from .levers import Lever
from .ops import Op, OpKind, parse_op
from .order import compute_programs, first_last_positions
from .spans import SHARD_LEVELS, gather_spans, group_spans, shards_gradients, shards_parameters


DEFAULT_RELOAD_LOOKAHEAD = 2
"""Compute ops between a RELOAD and its backward when nothing sizes it (the planner sizes it from the copy time)."""

SEND_WAITS = ("none", "posted", "delivered")
"""What a SEND holds the sender's next compute op for (``LoweringOptions.send_wait``): nothing; the receiver's
posted receive (gloo: a send waits for its receiver's ready notice, then the socket buffer takes the bytes); the
transfer's end (NCCL: the stream waits for the send kernel)."""

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
    grad_sync_at_end: bool = False
    """Every GRAD_SYNC after the rank's last compute op, in the order of the chunks' last backwards (Megatron
    without --overlap-grad-reduce: ``finalize_model_grads`` reduces every bucket after the backward)."""
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
    megatron_p2p: bool = False
    """Post receives where Megatron's schedules do (:func:`_megatron_post`) and, in the warm-up, hold the next
    compute op until the receives posted after a forward have arrived (Megatron's warm-up exchanges block);
    ``recv_lookahead`` then plays no part. For Megatron's own schedules (every rank runs the same order)."""
    notices_behind_data: bool = False
    """A receive's ready notice reaches the sender on the connection that carries the receiver's own transfers to
    that sender, behind the one in flight, and the sender's transfer starts only once it has arrived (gloo's tcp
    pair is a rendezvous; Megatron's batched p2p, and its unbatched one beyond two stages, puts both directions of a
    rank pair on one communicator, where PipeMesh's runtime gives every link and direction its own)."""
    send_wait: str = "none"
    """What a rank's next compute op waits for after its sends (:data:`SEND_WAITS`): "none" for PipeMesh's runtime,
    "posted" / "delivered" for Megatron's schedules (they wait on each send before the next compute) on gloo /
    NCCL."""

    @property
    def zero3_chunks(self) -> Tuple[int, ...]:
        """Chunks whose parameters are sharded and gathered per span."""
        return tuple(c for c, level in enumerate(self.sharding) if shards_parameters(level))

    @property
    def zero2_chunks(self) -> Tuple[int, ...]:
        """Chunks whose gradients are sharded (reduced once per backward group)."""
        return tuple(c for c, level in enumerate(self.sharding) if shards_gradients(level))

    def __post_init__(self) -> None:
        # JSON round-trips turn the keys into lists; keep one canonical, hashable, sorted form.
        object.__setattr__(self, "host_placement", tuple(sorted(tuple(int(x) for x in key) for key in self.host_placement)))
        object.__setattr__(self, "sharding", tuple(self.sharding))
        if self.send_wait not in SEND_WAITS:
            raise ValueError(f"send_wait {self.send_wait!r} is not one of {', '.join(SEND_WAITS)}")
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


_QUIET_DEFAULTS = {"sharding": (), "gather_lookahead": 1, "send_wait": "none", "megatron_p2p": False,
                   "notices_behind_data": False, "grad_sync_at_end": False}
"""Options a plan file leaves out at these values, so that plans written before them keep their digest."""


def _options_dict(options: LoweringOptions) -> dict:
    """The options as plain data, less :data:`_QUIET_DEFAULTS` at their defaults."""
    data = asdict(options)
    for key, default in _QUIET_DEFAULTS.items():
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


@dataclass
class _Slots:
    """One rank's compute program with the ops placed around it so far: ``before[i]`` run just before compute op
    i, ``after[i]`` just after it, ``tail`` after the last. Each lowering pass appends to them; the program is
    read once every pass has run (:meth:`program`), so the passes' order is the order of ops in one slot."""

    config: ScheduleConfig
    options: LoweringOptions
    rank: int
    compute: List[Op]
    positions: Dict[str, Dict[int, int]]
    """:func:`.order.first_last_positions` of the config (the same for every rank)."""
    before: Dict[int, List[Op]] = field(default_factory=lambda: defaultdict(list))
    after: Dict[int, List[Op]] = field(default_factory=lambda: defaultdict(list))
    tail: List[Op] = field(default_factory=list)

    def at(self, kind: OpKind) -> List[int]:
        """Indices of the k-th op of ``kind`` within the compute program."""
        return [i for i, op in enumerate(self.compute) if op.kind is kind]

    @property
    def training(self) -> bool:
        return not self.options.forward_only

    def program(self) -> List[Op]:
        out: List[Op] = []
        before, after = self.before.get, self.after.get  # most slots hold nothing: no list is made for them
        for index, op in enumerate(self.compute):
            placed = before(index)
            if placed:
                out.extend(placed)
            out.append(op)
            placed = after(index)
            if placed:
                out.extend(placed)
        return out + self.tail


def _place_param_syncs(slots: _Slots) -> None:
    """PARAM_SYNC c: chunks 0 and 1 at the start, chunk c >= 2 before the first forward of chunk c-1 (r forwards
    earlier on rank r when aligned); none for ZeRO-3 chunks, which gather per span."""
    options, config = slots.options, slots.config
    if not (options.param_sync and slots.training):
        return
    zero3, forward_at = options.zero3_chunks, slots.at(OpKind.FORWARD)
    for chunk in range(min(2, config.vpp)):
        if chunk not in zero3:
            slots.before[0].append(Op(OpKind.PARAM_SYNC, chunk))
    for chunk in range(2, config.vpp):
        k = slots.positions["first_forward"][chunk - 1] - (slots.rank if options.align_param_sync else 0)
        if chunk not in zero3:
            slots.before[forward_at[max(k, 0)]].append(Op(OpKind.PARAM_SYNC, chunk))


def _place_gathers(slots: _Slots) -> None:
    """ZeRO-3 chunks: GATHER c.k ``gather_lookahead`` compute ops before its span (never before the previous
    span's RELEASE), RELEASE c.k after the span's last op."""
    options = slots.options
    for chunk in (options.zero3_chunks if slots.training else ()):
        previous_release = -1
        for k, (first, last) in enumerate(gather_spans(slots.config, slots.compute, chunk, options.gather_lookahead)):
            slots.before[max(first - options.gather_lookahead, previous_release + 1, 0)].append(Op(OpKind.GATHER, chunk, k))
            slots.after[last].append(Op(OpKind.RELEASE, chunk, k))
            previous_release = last


def _place_reduces(slots: _Slots) -> None:
    """ZeRO-2/3 chunks: REDUCE c.k after each backward group but the last (whose reduction is the GRAD_SYNC)."""
    for chunk in (slots.options.zero2_chunks if slots.training else ()):
        for k, (_, last) in enumerate(group_spans(slots.config, slots.compute, chunk, OpKind.BACKWARD)[:-1]):
            slots.after[last].append(Op(OpKind.REDUCE, chunk, k))


def _place_p2p(slots: _Slots) -> None:
    """Each compute op's RECV ``recv_lookahead`` compute ops before it (at the start for the first ones), or with
    ``megatron_p2p`` where Megatron posts it, and its SEND right after it."""
    config, rank = slots.config, slots.rank
    peers: Dict[Tuple[OpKind, int], Tuple[Optional[Tuple[int, int]], Optional[Tuple[int, int]]]] = {}
    megatron = _megatron_post(config, rank, slots.compute) if slots.options.megatron_p2p else None
    for index, op in enumerate(slots.compute):
        placed = peers.get((op.kind, op.chunk))
        if placed is None:  # the same for every micro-batch of a chunk
            placed = peers[op.kind, op.chunk] = (input_source(config, rank, op), output_target(config, rank, op))
        source, target = placed
        if source is not None:
            if megatron is not None:
                post = megatron[index]
            else:
                post = max(index - slots.options.recv_lookahead, 0)
            slots.before[post].append(Op(_RECV[op.kind], op.chunk, op.microbatch, source[0]))
        if target is not None:
            slots.after[index].append(Op(_SEND[op.kind], op.chunk, op.microbatch, target[0]))


def _megatron_post(config: ScheduleConfig, rank: int, compute: List[Op]) -> List[int]:
    """Per compute op, the slot (``before`` index) where Megatron's schedules post its receive.

    Without virtual stages (``forward_backward_pipelining_without_interleaving``, batched blocking exchanges) right
    before the op. Interleaved (``forward_backward_pipelining_with_interleaving``): each forward's exchange posts the
    receive of the rank's next forward, each backward's the next backward's (right before the first of each); on
    the leading rank of a direction (the first in forwards, the last in backwards) the input that wraps around
    from the other end is received aligned with the producer instead (``recv_tensor_from_previous_stage``): the
    tensor the other end makes in its j-th op of that direction is received with this rank's (j + p - 1)-th, every
    rank running its ops of a direction in one order."""
    if config.vpp == 1:
        return list(range(len(compute)))
    p = config.pp
    posts = []
    seen: Dict[OpKind, List[int]] = {OpKind.FORWARD: [], OpKind.BACKWARD: []}  # direction -> compute indices so far
    order = {kind: {(op.chunk, op.microbatch): j for j, op in enumerate(o for o in compute if o.kind is kind)}
             for kind in (OpKind.FORWARD, OpKind.BACKWARD)}
    for index, op in enumerate(compute):
        done = seen[op.kind]
        forward = op.kind is OpKind.FORWARD
        leading = rank == (0 if forward else p - 1)
        wraps = leading and (op.chunk > 0 if forward else op.chunk < config.vpp - 1)
        if wraps:
            producer = order[op.kind][(op.chunk - 1 if forward else op.chunk + 1, op.microbatch)]
            k = producer + p - 1  # received with this rank's k-th op of the direction (after it)
            post = done[k] + 1 if k < len(done) else index
        else:
            post = done[-1] + 1 if done else index
        posts.append(min(post, index))
        done.append(index)
    return posts


def _place_host_copies(slots: _Slots) -> None:
    """This rank's host-placed chunk-micro-batches: OFFLOAD right after the forward (and its send), RELOAD
    ``reload_lookahead`` compute ops before the backward (never before the op after the forward)."""
    options = slots.options
    if not (options.host_placement and slots.training):
        return
    where = {op: i for i, op in enumerate(slots.compute)}
    for _, chunk, microbatch in (key for key in options.host_placement if key[0] == slots.rank):
        f, b = where[Op(OpKind.FORWARD, chunk, microbatch)], where[Op(OpKind.BACKWARD, chunk, microbatch)]
        slots.after[f].append(Op(OpKind.OFFLOAD, chunk, microbatch))
        slots.before[max(b - options.reload_lookahead, f + 1)].append(Op(OpKind.RELOAD, chunk, microbatch))


def _place_grad_syncs(slots: _Slots) -> None:
    """GRAD_SYNC c after chunk c's last backward (r backwards later on rank r when aligned; at the end when that
    backward does not exist, or with ``grad_sync_at_end``)."""
    options = slots.options
    if not (options.grad_sync and slots.training):
        return
    last_backward, backward_at = slots.positions["last_backward"], slots.at(OpKind.BACKWARD)
    for chunk in sorted(last_backward, key=last_backward.get):
        k = last_backward[chunk] + (slots.rank if options.align_grad_sync else 0)
        if k < len(backward_at) and not options.grad_sync_at_end:
            slots.after[backward_at[k]].append(Op(OpKind.GRAD_SYNC, chunk))
        else:
            slots.tail.append(Op(OpKind.GRAD_SYNC, chunk))


_PASSES = (_place_param_syncs, _place_gathers, _place_reduces, _place_p2p, _place_host_copies, _place_grad_syncs)
"""The lowering passes in order: within one slot, ops appear in the order of the passes that placed them."""


def _lower_rank(config: ScheduleConfig, options: LoweringOptions, rank: int, compute: List[Op],
                positions: Dict[str, Dict[int, int]]) -> List[Op]:
    """One rank's lowered program: its compute program with every pass of :data:`_PASSES` placing its ops."""
    slots = _Slots(config, options, rank, compute, positions)
    for place in _PASSES:
        place(slots)
    return slots.program()
