"""Host placement of activations in the schedule layer: where the lowering puts OFFLOAD / RELOAD,
what validation refuses, and how the timeline engine charges the host link."""
import json

import pytest

from megatron_pipemesh.schedule import (B, F, LoweredSchedule, LoweringOptions, Op, OpKind, ScheduleConfig, lower,
                                        validate)
from megatron_pipemesh.schedule.timeline import ScheduleError, UnitCosts, execute

CFG = ScheduleConfig(2, 2, 8, (6, 2), (4, 4))
PLACED = ((0, 0, 0), (0, 0, 1), (1, 1, 5), (0, 1, 2))


def _lowered(placement=PLACED, **kw) -> LoweredSchedule:
    return lower(CFG, LoweringOptions(host_placement=placement, **kw))


def test_offload_follows_forward_and_reload_precedes_backward():
    """OFFLOAD c.j right after F c.j (and its send); RELOAD reload_lookahead compute ops before B c.j."""
    schedule = _lowered(reload_lookahead=2)
    validate(schedule)
    for rank, chunk, mb in PLACED:
        program = schedule.programs[rank]
        compute = [op for op in program if op.kind.is_compute]
        off, rel = program.index(Op(OpKind.OFFLOAD, chunk, mb)), program.index(Op(OpKind.RELOAD, chunk, mb))
        f, b = program.index(F(chunk, mb)), program.index(B(chunk, mb))
        assert f < off < rel < b
        assert all(not op.kind.is_compute for op in program[f + 1:off])  # nothing computes in between
        # Two compute ops (or as many as exist after the forward) lie between the reload and the backward.
        between = [op for op in program[rel:b] if op.kind.is_compute]
        assert len(between) == min(2, compute.index(B(chunk, mb)) - compute.index(F(chunk, mb)) - 1)
    untouched = [op for program in lower(CFG).programs for op in program]
    assert not any(op.kind.is_host for op in untouched)


def test_placement_round_trips_and_changes_the_digest():
    """host_placement is part of the plan: JSON round-trip keeps it, the digest tells plans apart."""
    schedule = _lowered()
    again = LoweredSchedule.from_dict(json.loads(json.dumps(schedule.to_dict())))
    assert again.programs == schedule.programs and again.options == schedule.options
    assert again.digest() == schedule.digest() != lower(CFG).digest()
    assert _lowered(reload_lookahead=3).digest() != schedule.digest()


def test_host_placement_of_a_plan():
    """The lowering's placement is exactly the plan's 'host' keys of every rank, sorted."""
    from megatron_pipemesh.schedule.lower import host_placement_of
    plan = {(1, 1, 5): "host", (0, 0, 0): "host", (0, 1, 1): "full", (1, 0, 0): "none", (0, 0, 1): "host"}
    assert host_placement_of(plan) == ((0, 0, 0), (0, 0, 1), (1, 1, 5))
    assert host_placement_of(None) == ()


def test_evaluation_programs_ignore_placement():
    programs = _lowered(forward_only=True).programs
    assert not any(op.kind.is_host for program in programs for op in program)


def test_bad_placement_is_refused_before_lowering():
    with pytest.raises(ValueError, match=r"host placement \(0, 2, 0\).*chunks 0..1"):
        _lowered(((0, 2, 0),))
    with pytest.raises(ValueError, match="reload_lookahead 0 must be an integer >= 1"):
        _lowered(reload_lookahead=0)


def _edit(schedule, rank, fn):
    data = schedule.to_dict()
    data["programs"][rank] = fn(data["programs"][rank])
    return LoweredSchedule.from_dict(data)


@pytest.mark.parametrize("name,fn,words", [
    ("reload dropped", lambda p: [x for x in p if x != "RELOAD0.1"], "B0.1 runs while its activations are on the host"),
    ("offload dropped", lambda p: [x for x in p if x != "OFFLOAD0.1"], "RELOAD0.1 reloads activations that are not on the host"),
    ("both dropped", lambda p: [x for x in p if x not in ("OFFLOAD0.1", "RELOAD0.1")], "micro-batch 1 is placed on the host but never offloaded"),
    ("offload before forward", lambda p: ["OFFLOAD0.1"] + [x for x in p if x != "OFFLOAD0.1"], "before it ran"),
    ("reload after backward", lambda p: [x for x in p if x != "RELOAD0.1"] + ["RELOAD0.1"],
     "B0.1 runs while its activations are on the host"),
    ("both after backward", lambda p: [x for x in p if x not in ("OFFLOAD0.1", "RELOAD0.1")] + ["OFFLOAD0.1", "RELOAD0.1"],
     "reloads after its backward B0.1"),
    ("unplanned offload", lambda p: p[:p.index("F0.3") + 1] + ["OFFLOAD0.3", "RELOAD0.3"] + p[p.index("F0.3") + 1:],
     "not in the lowering's host_placement"),
])
def test_validate_rejects_host_corruption(name, fn, words):
    """Each corrupted program is refused with a message naming the op and the rank."""
    with pytest.raises(ScheduleError, match="rank 0") as err:
        validate(_edit(_lowered(), 0, fn))
    assert words in str(err.value)


class _HostCosts(UnitCosts):
    def __init__(self, copy: float):
        super().__init__()
        self.copy = copy

    def host_copy(self, rank, op):
        return self.copy


def test_engine_charges_the_host_link():
    """Free copies change nothing; slow copies delay exactly the backwards whose reload is late."""
    base = execute(lower(CFG))
    free = execute(_lowered(), _HostCosts(0.0))
    assert free.makespan == base.makespan
    lanes = {e.lane for e in free.comms}
    assert {"d2h", "h2d"} <= lanes
    slow = execute(_lowered(), _HostCosts(50.0))
    assert slow.makespan > base.makespan
    waits = [e for events in slow.compute for e in events if e.waited_on == "host"]
    assert waits and all(e.op.kind is OpKind.BACKWARD and (e.rank, e.op.chunk, e.op.microbatch) in PLACED for e in waits)
    # A reload never starts before its offload has finished, and each direction serves one copy at a time.
    copies = {(e.src, e.op.kind, e.op.chunk, e.op.microbatch): e for e in slow.comms if e.lane in ("d2h", "h2d")}
    for (rank, kind, chunk, mb), e in copies.items():
        if kind is OpKind.RELOAD:
            assert e.start >= copies[(rank, OpKind.OFFLOAD, chunk, mb)].end
    for lane in ("d2h", "h2d"):
        for rank in range(CFG.pp):
            spans = sorted((e.start, e.end) for e in slow.comms if e.lane == lane and e.src == rank)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


class _ComputeStreamCopies(_HostCosts):
    host_copies_on_compute = True


def test_copies_on_the_compute_stream_hold_it():
    """CPU ranks copy on their own thread: each OFFLOAD / RELOAD runs between the compute ops around it in program
    order and delays everything after it on that rank, however idle a host link would be."""
    copy = 0.375
    hidden = execute(_lowered(), _HostCosts(copy))
    held = execute(_lowered(), _ComputeStreamCopies(copy))
    assert hidden.makespan == execute(lower(CFG)).makespan  # on a host link of their own these copies hide
    assert held.makespan > hidden.makespan
    for rank in range(CFG.pp):
        compute = sorted((e.start, e.end) for e in held.compute[rank])
        copies = sorted((e.start, e.end) for e in held.comms if e.lane in ("d2h", "h2d") and e.src == rank)
        assert len(copies) == 2 * sum(1 for r, _, _ in PLACED if r == rank)
        assert all(end - start == copy for start, end in copies)
        spans = sorted(compute + copies)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # one stream: nothing overlaps a copy
