"""Validation of lowered programs before anything runs.

Checks, in order: every compute op exactly once per rank; each backward after its own forward;
every receive posted before its consumer and with the right peer, every send after its producer;
send/receive matching per directed link (same tensors, same order on both ends); data-parallel
points consistent (a chunk's parameter gather launched before its first forward, each chunk's
gradient sync exactly once, after its last backward); host copies consistent (exactly the
chunk-micro-batches of the lowering's ``host_placement`` are offloaded once, after their forward, and
reloaded once, after the offload and before their backward); mixed-sharding ops consistent (a ZeRO-3
chunk's compute ops run only between a GATHER and its RELEASE, gathers and releases alternate and are
numbered in order, REDUCE only for ZeRO-2/3 chunks after one of their backwards); and deadlock freedom
by a dry run.
Errors print the offending rank, step and that rank's order with the step marked.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Set, Tuple

from .lower import LoweredSchedule, input_source, output_target
from .ops import B, F, Op, OpKind, format_ops
from .timeline import ScheduleError, Timeline, execute


def _fail(schedule: LoweredSchedule, rank: int, step: int, what: str) -> ScheduleError:
    program = schedule.programs[rank]
    return ScheduleError(f"invalid schedule ({schedule.config.describe()}): rank {rank}, step {step}: {what}\n"
                         f"rank {rank}: {format_ops(program, step)}")


def validate(schedule: LoweredSchedule) -> Timeline:
    """Raise :class:`ScheduleError` (or its subclass DeadlockError) unless the schedule is sound.

    Returns the dry-run timeline (unit costs) as a by-product.
    """
    cfg = schedule.config
    if len(schedule.programs) != cfg.pp:
        raise ScheduleError(f"expected {cfg.pp} rank programs, got {len(schedule.programs)}")
    expected = Counter([F(c, j) for c in range(cfg.vpp) for j in range(cfg.microbatches)])
    if not schedule.options.forward_only:
        expected.update(B(c, j) for c in range(cfg.vpp) for j in range(cfg.microbatches))
    sends: Dict[Tuple[int, int, OpKind], List[Tuple[int, Op]]] = {}
    recvs: Dict[Tuple[int, int, OpKind], List[Tuple[int, Op]]] = {}
    for rank in range(cfg.pp):
        _check_compute_set(schedule, rank, expected)
        state = _RankState.of(schedule, rank)
        for step, op in enumerate(schedule.programs[rank]):
            _check_op(schedule, state, step, op, sends, recvs)
        _check_rank_end(schedule, state)
    _check_links(schedule, sends, recvs)
    return execute(schedule)


def _check_compute_set(schedule: LoweredSchedule, rank: int, expected: Counter) -> None:
    """Every compute op of the configuration exactly once on ``rank``."""
    program = schedule.programs[rank]
    seen = Counter(op for op in program if op.kind.is_compute)
    for op in (seen - expected):
        step = [i for i, x in enumerate(program) if x == op][-1]
        what = "runs more than once" if op in expected else "is not part of this configuration"
        raise _fail(schedule, rank, step, f"{op} {what}")
    missing = expected - seen
    if missing:
        raise _fail(schedule, rank, len(program) - 1, f"compute ops never run: {format_ops(sorted(missing))}")


@dataclass
class _RankState:
    """What one rank's program has done up to the step being checked."""

    rank: int
    param_chunks: Set[int]
    """Chunks with a PARAM_SYNC anywhere in the program."""
    last_backward: Dict[int, int]
    """Per chunk: the step of its last backward (-1: none)."""
    zero3: Set[int]
    zero2: Set[int]
    done: Set[Op] = field(default_factory=set)
    """Compute ops run so far."""
    posted: Set[Op] = field(default_factory=set)
    """Compute ops whose input receive is posted."""
    param_launched: Set[int] = field(default_factory=set)
    host_state: Dict[Tuple[int, int], str] = field(default_factory=dict)
    gathered: Dict[int, int] = field(default_factory=dict)
    """ZeRO-3 chunk -> index k of its open GATHER."""
    spans_done: Counter = field(default_factory=Counter)
    """ZeRO-3 chunk -> gather spans launched so far."""
    reduces: Counter = field(default_factory=Counter)

    @classmethod
    def of(cls, schedule: LoweredSchedule, rank: int) -> "_RankState":
        program = schedule.programs[rank]
        last_backward = {c: -1 for c in range(schedule.config.vpp)}
        for index, x in enumerate(program):
            if x.kind is OpKind.BACKWARD:
                last_backward[x.chunk] = index
        return cls(rank, {op.chunk for op in program if op.kind is OpKind.PARAM_SYNC}, last_backward,
                   set(schedule.options.zero3_chunks), set(schedule.options.zero2_chunks))


def _check_op(schedule: LoweredSchedule, state: _RankState, step: int, op: Op, sends, recvs) -> None:
    """One op of a rank's program against what the program has done before it."""
    rank = state.rank
    if op.kind.is_compute:
        _check_compute_op(schedule, state, step, op)
    elif op.kind.is_p2p:
        _check_p2p_op(schedule, state, step, op, sends, recvs)
    elif op.kind is OpKind.PARAM_SYNC:
        state.param_launched.add(op.chunk)
    elif op.kind is OpKind.GRAD_SYNC:
        if step < state.last_backward[op.chunk]:
            raise _fail(schedule, rank, step, f"{op} launches before the last backward of chunk {op.chunk} "
                                              f"(step {state.last_backward[op.chunk]})")
    elif op.kind.is_host:
        _check_host_op(schedule, rank, step, op, state.done, state.host_state)
    elif op.kind.is_shard:
        _check_shard_op(schedule, rank, step, op, state.done, state.zero3, state.zero2, state.gathered,
                        state.spans_done, state.reduces)


def _check_compute_op(schedule: LoweredSchedule, state: _RankState, step: int, op: Op) -> None:
    """A backward after its forward and its reload; any compute op after its input's receive is posted, a forward
    after its chunk's parameter gather, a ZeRO-3 chunk's op inside a gathered span."""
    rank = state.rank
    if op.kind is OpKind.BACKWARD and F(op.chunk, op.microbatch) not in state.done:
        raise _fail(schedule, rank, step, f"{op} runs before its forward {F(op.chunk, op.microbatch)}")
    if input_source(schedule.config, rank, op) is not None and op not in state.posted:
        raise _fail(schedule, rank, step, f"{op} runs but the receive of its input was never posted before it")
    if op.kind is OpKind.FORWARD and op.chunk not in state.param_launched and op.chunk in state.param_chunks:
        raise _fail(schedule, rank, step, f"{op} runs before the parameter gather of chunk {op.chunk} was launched")
    if op.chunk in state.zero3 and not schedule.options.forward_only and op.chunk not in state.gathered:
        raise _fail(schedule, rank, step, f"{op} runs while the parameters of ZeRO-3 chunk {op.chunk} are not "
                                          f"gathered (no GATHER{op.chunk}.k open before it)")
    if op.kind is OpKind.BACKWARD and state.host_state.get((op.chunk, op.microbatch)) == "offloaded":
        raise _fail(schedule, rank, step, f"{op} runs while its activations are on the host: "
                                          f"RELOAD{op.chunk}.{op.microbatch} must come before it")
    state.done.add(op)


def _check_p2p_op(schedule: LoweredSchedule, state: _RankState, step: int, op: Op, sends, recvs) -> None:
    """A receive names its tensor's producer and is posted before its consumer runs; a send names the consumer
    and follows its producer. Both are recorded per directed link for :func:`_check_links`."""
    rank, compute = state.rank, op.compute
    is_recv = op.kind in (OpKind.RECV_FORWARD, OpKind.RECV_BACKWARD)
    peer = (input_source if is_recv else output_target)(schedule.config, rank, compute)
    if peer is None or peer[0] != op.peer:
        raise _fail(schedule, rank, step, f"{op} names peer {op.peer}, but the {'producer' if is_recv else 'consumer'} "
                                          f"of this tensor is {'nothing' if peer is None else f'rank {peer[0]}'}")
    if is_recv:
        if compute in state.done:
            raise _fail(schedule, rank, step, f"{op} is posted after its consumer {compute} ran")
        state.posted.add(compute)
        recvs.setdefault((op.peer, rank, compute.kind), []).append((step, compute))
    else:
        if compute not in state.done:
            raise _fail(schedule, rank, step, f"{op} sends the output of {compute} before it ran")
        sends.setdefault((rank, op.peer, compute.kind), []).append((step, Op(compute.kind, peer[1], compute.microbatch)))


def _check_rank_end(schedule: LoweredSchedule, state: _RankState) -> None:
    """At the program's end: every gather released, exactly the placed chunk-micro-batches offloaded and reloaded,
    and one data-parallel sync of each kind per chunk where the options ask for them."""
    rank = state.rank
    last = len(schedule.programs[rank]) - 1
    if state.gathered:
        chunk = sorted(state.gathered)[0]
        raise _fail(schedule, rank, last, f"GATHER{chunk}.{state.gathered[chunk]} is never released")
    host_state = state.host_state
    placed = {(c, j) for r, c, j in schedule.options.host_placement if r == rank} if not schedule.options.forward_only else set()
    for key in sorted(placed | set(host_state)):
        what = ("is offloaded but not in the lowering's host_placement" if key not in placed else
                "is placed on the host but never offloaded" if host_state.get(key) is None else
                "is offloaded but never reloaded" if host_state.get(key) == "offloaded" else "")
        if what:
            raise _fail(schedule, rank, last, f"chunk {key[0]} micro-batch {key[1]} {what}")
    _check_dp_counts(schedule, rank, OpKind.GRAD_SYNC, schedule.options.grad_sync)
    _check_dp_counts(schedule, rank, OpKind.PARAM_SYNC, schedule.options.param_sync, skip=state.zero3)


def _check_host_op(schedule: LoweredSchedule, rank: int, step: int, op: Op, done: set,
                   host_state: Dict[Tuple[int, int], str]) -> None:
    """OFFLOAD after its forward and once; RELOAD after the offload, before the backward, once."""
    key = (op.chunk, op.microbatch)
    state = host_state.get(key)
    if op.kind is OpKind.OFFLOAD:
        if F(*key) not in done:
            raise _fail(schedule, rank, step, f"{op} offloads the activations of {F(*key)} before it ran")
        if state is not None:
            raise _fail(schedule, rank, step, f"{op} offloads chunk {key[0]} micro-batch {key[1]} a second time")
        host_state[key] = "offloaded"
    else:
        if state != "offloaded":
            raise _fail(schedule, rank, step, f"{op} reloads activations that are not on the host "
                                              f"({'never offloaded' if state is None else 'already reloaded'})")
        if B(*key) in done:
            raise _fail(schedule, rank, step, f"{op} reloads after its backward {B(*key)} ran")
        host_state[key] = "reloaded"


def _check_shard_op(schedule: LoweredSchedule, rank: int, step: int, op: Op, done: set, zero3: set, zero2: set,
                    gathered: Dict[int, int], spans_done: Counter, reduces: Counter) -> None:
    """GATHER/RELEASE alternate per ZeRO-3 chunk with consecutive span numbers; REDUCE of a ZeRO-2/3 chunk
    follows one of its backwards, numbered in order."""
    chunk, k = op.chunk, op.microbatch
    if op.kind is OpKind.REDUCE:
        if chunk not in zero2:
            raise _fail(schedule, rank, step, f"{op} reduces chunk {chunk}, whose gradients are not sharded "
                                              f"(level {_level(schedule, chunk)})")
        if not any(x.kind is OpKind.BACKWARD and x.chunk == chunk for x in done):
            raise _fail(schedule, rank, step, f"{op} launches before any backward of chunk {chunk}")
        if k != reduces[chunk]:
            raise _fail(schedule, rank, step, f"{op} is out of order: expected REDUCE{chunk}.{reduces[chunk]}")
        reduces[chunk] += 1
        return
    if chunk not in zero3:
        raise _fail(schedule, rank, step, f"{op} for chunk {chunk}, whose parameters are not sharded "
                                          f"(level {_level(schedule, chunk)})")
    if op.kind is OpKind.GATHER:
        if chunk in gathered:
            raise _fail(schedule, rank, step, f"{op} gathers chunk {chunk} again before RELEASE{chunk}.{gathered[chunk]}")
        if k != spans_done[chunk]:
            raise _fail(schedule, rank, step, f"{op} is out of order: expected GATHER{chunk}.{spans_done[chunk]}")
        gathered[chunk] = k
        spans_done[chunk] += 1
    else:
        if gathered.get(chunk) != k:
            raise _fail(schedule, rank, step, f"{op} releases parameters that are not gathered under that number")
        del gathered[chunk]


def _level(schedule: LoweredSchedule, chunk: int) -> str:
    levels = schedule.options.sharding
    return levels[chunk] if chunk < len(levels) else "optim (no sharding option)"


def _check_dp_counts(schedule: LoweredSchedule, rank: int, kind: OpKind, enabled: bool, skip=()) -> None:
    """Exactly one sync of ``kind`` per chunk when the options ask for them (none for the ``skip``
    chunks, which gather per span), none otherwise."""
    program = schedule.programs[rank]
    counts = Counter(op.chunk for op in program if op.kind is kind)
    for chunk in range(schedule.config.vpp):
        wanted = 1 if enabled and not schedule.options.forward_only and chunk not in skip else 0
        if counts.get(chunk, 0) != wanted:
            steps = [i for i, op in enumerate(program) if op.kind is kind and op.chunk == chunk]
            count = counts.get(chunk, 0)
            what = ("is missing (expected once per chunk)" if count == 0 else
                    f"appears more than once ({count} times)" if wanted else "appears although the lowering options disable it")
            raise _fail(schedule, rank, steps[-1] if steps else len(program) - 1, f"{kind.value}{chunk} {what}")
    extra = sorted(set(counts) - set(range(schedule.config.vpp)))
    if extra:
        raise _fail(schedule, rank, len(program) - 1, f"{kind.value} for chunk(s) {extra} that do not exist")


def _check_links(schedule: LoweredSchedule, sends, recvs) -> None:
    """Each directed link carries the same tensors in the same order at both ends.

    Both sides are recorded as the consumer op on the receiving rank.
    """
    for link in sorted(set(sends) | set(recvs), key=lambda k: (k[0], k[1], k[2].value)):
        src, dst, kind = link
        sent = [op for _, op in sends.get(link, [])]
        received = [op for _, op in recvs.get(link, [])]
        if sent == received:
            continue
        index = next(i for i in range(max(len(sent), len(received)))
                     if i >= len(sent) or i >= len(received) or sent[i] != received[i])
        a = sent[index] if index < len(sent) else "nothing"
        b = received[index] if index < len(received) else "nothing"
        step = recvs[link][index][0] if index < len(received) else len(schedule.programs[dst]) - 1
        direction = "activation" if kind is OpKind.FORWARD else "gradient"
        raise _fail(schedule, dst, step,
                    f"{direction} link rank {src} -> rank {dst}: transfer #{index} is sent for {a} but received for {b}; "
                    f"both ends must use the same order\nrank {src}: {format_ops(schedule.programs[src])}")
