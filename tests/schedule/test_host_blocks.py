"""The pinned blocks a rank's program holds at once (schedule/host_blocks.py)."""
from megatron_pipemesh.schedule.config import ScheduleConfig
from megatron_pipemesh.schedule.host_blocks import pool_blocks, pool_bytes
from megatron_pipemesh.schedule.lower import LoweringOptions, lower
from megatron_pipemesh.schedule.ops import Op, OpKind


def test_blocks_are_the_most_keys_of_each_size_held_at_once():
    """OFFLOAD takes a block, RELOAD gives it back; per size, the peak count in program order."""
    program = [Op(OpKind.OFFLOAD, 0, 0), Op(OpKind.OFFLOAD, 0, 1), Op(OpKind.OFFLOAD, 1, 0), Op(OpKind.RELOAD, 0, 0),
               Op(OpKind.OFFLOAD, 0, 2), Op(OpKind.RELOAD, 1, 0), Op(OpKind.RELOAD, 0, 1), Op(OpKind.RELOAD, 0, 2),
               Op(OpKind.OFFLOAD, 1, 1), Op(OpKind.RELOAD, 1, 1)]
    assert pool_blocks(program, {0: 4096, 1: 8192}) == {4096: 2, 8192: 1}
    assert pool_blocks(program, {0: 4096, 1: 4096}) == {4096: 3}
    assert pool_blocks(program, {1: 8192}) == {8192: 1}  # chunk 0's size unknown: not counted
    assert pool_bytes({4096: 2, 8192: 1}) == 16384


def test_a_lowered_program_with_host_placement():
    """On a lowered schedule: every host-placed key of the rank is counted while it is on the host."""
    config = ScheduleConfig(2, 2, 4, (4,), (4,))
    placed = ((0, 0, 0), (0, 0, 1), (0, 0, 2), (1, 0, 0))
    schedule = lower(config, LoweringOptions(host_placement=placed))
    rank0 = pool_blocks(schedule.programs[0], {0: 1 << 20})
    assert rank0 == {1 << 20: max(_held(schedule.programs[0]))} and 1 <= rank0[1 << 20] <= 3
    assert pool_blocks(schedule.programs[1], {0: 1 << 20}) == {1 << 20: 1}


def _held(program):
    held, out = 0, []
    for op in program:
        if op.kind is OpKind.OFFLOAD:
            held += 1
        elif op.kind is OpKind.RELOAD:
            held -= 1
        out.append(held)
    return out
