"""The timeline engine (the simulator's inner loop): exact results recorded from the reference
engine, and its memoized compiled form never reused for edited programs."""
import hashlib

import pytest

from megatron_pipemesh.schedule import DeadlockError, LoweringOptions, OpKind, ScheduleConfig, lower
from megatron_pipemesh.schedule.timeline import execute


class _UnevenCosts:
    """Op-dependent durations (binary fractions, so sums are exact): ties and waits of every kind."""

    def compute(self, rank, op):
        return (1.0 if op.kind is OpKind.FORWARD else 2.0) + 0.25 * ((op.chunk * 7 + op.microbatch * 3 + rank) % 5)

    def transfer(self, src, dst, op):
        return 0.5 + 0.125 * ((op.microbatch + src) % 3), 0.0625 * (dst + 1)

    def data_parallel(self, rank, op):
        return 1.5 + 0.5 * op.chunk + (0.75 if op.kind is OpKind.PARAM_SYNC else 0.0)

    def host_copy(self, rank, op):
        return 0.375 + 0.125 * (op.microbatch % 4)


def canonical(timeline) -> str:
    """repr of (compute events per rank, comm events in time order, rank ends): the events, not the order in
    which an engine happened to record its communication."""
    comms = sorted(timeline.comms, key=lambda c: (c.start, c.end, c.src, c.dst, c.lane, str(c.op)))
    return repr((timeline.compute, comms, timeline.rank_end))


# Digest of canonical(timeline) and makespan, recorded with the greedy engine (commit 11df645's events, in
# time order): an engine rewrite must not change a single event.
RECORDED = [
    (ScheduleConfig(4, 2, 8), LoweringOptions(), "a1eb801a754e5b6d", 91.0625),
    (ScheduleConfig(4, 3, 12, (8, 4), (4, 8)), LoweringOptions(), "e4512e9355908893", 167.4375),
    (ScheduleConfig(2, 4, 6, (6,), (6,)), LoweringOptions(param_sync=False, align_grad_sync=False),
     "01c35a68bbe97c88", 103.0625),
    (ScheduleConfig(3, 2, 9, (6, 3), (3, 6)), LoweringOptions(recv_lookahead=2), "4b486bce2874470a", 88.5),
    (ScheduleConfig(2, 2, 8, (6, 2), (4, 4)),
     LoweringOptions(host_placement=((0, 0, 0), (0, 0, 1), (1, 1, 5), (0, 1, 2))), "b9bdce9bfeeb2ed3", 74.9375),
    (ScheduleConfig(4, 1, 8), LoweringOptions(), "04d5359ab848fbc0", 61.8125),
]


@pytest.mark.parametrize("config,options,digest,makespan", RECORDED)
def test_events_equal_the_recorded_reference(config, options, digest, makespan):
    """Any change of event order, start/end times, waits or lanes in the engine's fast loop."""
    for _ in range(2):  # the second run uses the memoized lowering and compiled form
        timeline = execute(lower(config, options), _UnevenCosts())
        text = canonical(timeline)
        assert (hashlib.sha256(text.encode()).hexdigest()[:16], timeline.makespan) == (digest, makespan)


def test_edited_programs_are_recompiled():
    """A stale compiled form reused for a schedule whose programs were edited after lowering."""
    config = ScheduleConfig(2, 2, 4)
    schedule = lower(config)
    execute(schedule)  # compiles and memoizes the lowered programs
    program = schedule.programs[1]
    forward = next(i for i, op in enumerate(program) if op.kind is OpKind.FORWARD and op.chunk == 1)
    schedule.programs[1] = [op for op in program if op.kind in (OpKind.RECV_FORWARD, OpKind.RECV_BACKWARD)] + \
        [program[forward]] + [op for i, op in enumerate(program)
                              if i != forward and op.kind not in (OpKind.RECV_FORWARD, OpKind.RECV_BACKWARD)]
    with pytest.raises(DeadlockError, match="rank 1"):
        execute(schedule)
    assert lower(config).programs[1] == program  # the memoized lowering was not edited either
