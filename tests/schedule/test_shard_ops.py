"""Mixed-sharding ops in the schedule layer: where the lowering puts GATHER / RELEASE / REDUCE, what
validation refuses, and how the timeline engine charges and waits on the gathers."""
import json
import random

import pytest

from megatron_pipemesh.planning.sharding import chunk_traffic
from megatron_pipemesh.schedule import LoweredSchedule, LoweringOptions, Op, OpKind, ScheduleConfig, lower, validate
from megatron_pipemesh.schedule.ops import parse_op
from megatron_pipemesh.schedule.timeline import ScheduleError, UnitCosts, execute

CFG = ScheduleConfig(2, 2, 8, (6, 2), (4, 4))
MIXED = ("optim", "optim_grads_params")


def _ops(schedule, rank, kind, chunk):
    return [op for op in schedule.programs[rank] if op.kind is kind and op.chunk == chunk]


def test_gathers_wrap_every_use_of_a_zero3_chunk():
    """Each compute op of the ZeRO-3 chunk lies between GATHER c.k and RELEASE c.k; no PARAM_SYNC for it;
    one gather per merged group span (the count the memory/traffic model uses)."""
    schedule = lower(CFG, LoweringOptions(sharding=MIXED))
    validate(schedule)
    for rank, program in enumerate(schedule.programs):
        assert _ops(schedule, rank, OpKind.PARAM_SYNC, 1) == [] and len(_ops(schedule, rank, OpKind.PARAM_SYNC, 0)) == 1
        gathers = _ops(schedule, rank, OpKind.GATHER, 1)
        assert len(gathers) == chunk_traffic(CFG, rank, 1, "optim_grads_params", 1, 2, 2, 2, 4).gathers
        open_span = None
        for index, op in enumerate(program):
            if op.kind is OpKind.GATHER:
                open_span = op.microbatch
                # prefetched: exactly one compute op before the span's first op of chunk 1 (or at the start)
                later = [x for x in program[index:] if x.kind.is_compute]
                assert later[0].chunk != 1 or index == 0 or later[1].chunk == 1
            elif op.kind is OpKind.RELEASE:
                assert op.microbatch == open_span
                open_span = None
            elif op.kind.is_compute and op.chunk == 1:
                assert open_span is not None, (rank, index, op)
        assert not _ops(schedule, rank, OpKind.GATHER, 0)


def test_reduce_after_each_backward_group_but_the_last():
    """A ZeRO-2 chunk reduces after each of its backward groups; the last reduction stays its GRAD_SYNC."""
    schedule = lower(CFG, LoweringOptions(sharding=("optim_grads", "optim")))
    validate(schedule)
    for rank, program in enumerate(schedule.programs):
        (reduce,) = _ops(schedule, rank, OpKind.REDUCE, 0)
        before = [op for op in program[:program.index(reduce)] if op.kind is OpKind.BACKWARD and op.chunk == 0]
        assert [op.microbatch for op in before] == [0, 1, 2, 3]  # the first backward group (4) of chunk 0
        assert len(_ops(schedule, rank, OpKind.GRAD_SYNC, 0)) == 1 and not _ops(schedule, rank, OpKind.REDUCE, 1)


def test_plans_without_sharding_keep_their_digest_and_text():
    """Off by default: no new ops, no new keys in the plan dict (old digests stay valid); on: round-trips."""
    plain = lower(CFG)
    assert "sharding" not in plain.to_dict()["options"] and "gather_lookahead" not in plain.to_dict()["options"]
    assert not any(op.kind.is_shard for program in plain.programs for op in program)
    mixed = lower(CFG, LoweringOptions(sharding=MIXED))
    again = LoweredSchedule.from_dict(json.loads(json.dumps(mixed.to_dict())))
    assert again.programs == mixed.programs and again.digest() == mixed.digest() != plain.digest()
    assert str(parse_op("GATHER1.2")) == "GATHER1.2" and parse_op("REDUCE0.0").kind.is_shard


@pytest.mark.parametrize("mutate, message", [
    (lambda p: [op for op in p if not (op.kind is OpKind.GATHER and op.microbatch == 0)], "not gathered"),
    (lambda p: [op for op in p if not (op.kind is OpKind.RELEASE and op.microbatch == 1)], "again before RELEASE"),
    (lambda p: p + [Op(OpKind.REDUCE, 1, 5)], "out of order"),
    (lambda p: p + [Op(OpKind.GATHER, 0, 0), Op(OpKind.RELEASE, 0, 0)], "not sharded"),
])
def test_validation_refuses_broken_sharding(mutate, message):
    """Missing gathers, unreleased spans, misnumbered reduces and ops for unsharded chunks are errors."""
    schedule = lower(CFG, LoweringOptions(sharding=MIXED))
    schedule.programs[0] = mutate(list(schedule.programs[0]))
    with pytest.raises(ScheduleError, match=message):
        validate(schedule)


def test_random_configs_validate_with_any_levels():
    """Every level mix on random groups lowers to a valid, deadlock-free schedule."""
    rng = random.Random(11)
    levels = ("optim", "optim_grads", "optim_grads_params")
    for _ in range(25):
        pp, vpp = rng.randint(2, 4), rng.randint(2, 3)
        m = rng.randint(pp, 4 * pp)

        def groups():
            sizes = [pp] * rng.randint(1, m // pp)
            for _ in range(m - sum(sizes)):
                sizes[rng.randrange(len(sizes))] += 1
            return tuple(sizes)

        forward, backward = rng.choice([(groups(),) * 2, ((m,), groups())])  # breadth-first forward: any backward
        config = ScheduleConfig(pp, vpp, m, forward, backward)
        validate(lower(config, LoweringOptions(sharding=tuple(rng.choice(levels) for _ in range(vpp)),
                                               gather_lookahead=rng.randint(0, 2))))


def test_timeline_waits_on_gathers_and_charges_the_dp_channel():
    """With a slow data-parallel channel the ZeRO-3 chunk's first forward waits for its GATHER ('param')."""
    schedule = lower(CFG, LoweringOptions(sharding=MIXED))
    timeline = execute(schedule, UnitCosts(dp=5.0))
    gathers = [c for c in timeline.comms if c.op.kind is OpKind.GATHER and c.src == 0]
    first_f1 = next(e for e in timeline.compute[0] if e.op == Op(OpKind.FORWARD, 1, 0))
    assert first_f1.start >= gathers[0].end and first_f1.waited_on == "param"
    assert len([c for c in timeline.comms if c.lane == "release" and c.src == 0]) == len(gathers)
