"""Mixed-sharding mechanism (runtime/sharding.py) on stand-ins of Megatron's DDP buffers, in one process
(a one-rank gloo group): storage freed and brought back with every view intact, shards kept, gradient
reductions accumulated and folded into the last one; the node scope's group check. The 4-rank end-to-end
checks are tests/training/test_pretrain_distopt.py."""
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_pipemesh.runtime.sharding import (ChunkSharding, ProgramSharding, add_step_observer, node_group_error,
                                                remove_step_observer)
from megatron_pipemesh.schedule.ops import Op, OpKind


@pytest.fixture(scope="module", autouse=True)
def world():
    if dist.is_initialized():
        yield
        return
    store = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    if os.path.exists(store):
        os.remove(store)


class _BucketGroup:
    """The parts of Megatron's bucket group the mechanism uses."""

    def __init__(self, buckets):
        self.buckets = buckets
        self.ddp_config = SimpleNamespace(overlap_param_gather=True, overlap_grad_reduce=True, average_in_collective=False)
        self.calls = []
        self.param_gather_handle = None
        self.grad_reduce_finished = False

    def start_param_sync(self):
        for bucket in self.buckets:  # Megatron's all-gather of each rank's slice (one rank: a copy onto itself)
            dist.all_gather_into_tensor(bucket.param_data, bucket.param_data.clone())
        self.calls.append("start_param_sync")

    def finish_param_sync(self, skip_next_bucket_dispatch=False):
        self.calls.append("finish_param_sync")

    def start_grad_sync(self, force_all_reduce=False):
        """Megatron's: scale each bucket by its factor, then reduce-scatter it (one rank: onto itself)."""
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
            dist.reduce_scatter_tensor(bucket.grad_data, bucket.grad_data.clone())
        self.calls.append(("start_grad_sync", [bucket.gradient_scaling_factor for bucket in self.buckets]))


def _ddp(numel=12):
    param_data, grad_data = torch.arange(numel, dtype=torch.float32), torch.zeros(numel)
    buffer = SimpleNamespace(param_data=param_data, grad_data=grad_data, data_parallel_group=dist.group.WORLD)
    bucket = SimpleNamespace(param_data=param_data, grad_data=grad_data, gradient_scaling_factor=0.5,
                             params_with_extra_main_grads=[])
    buffer.buckets = [bucket]
    weight = param_data[:8].view(2, 4)  # a parameter: a view of the buffer, as Megatron's
    ddp = SimpleNamespace(buffers=[buffer], expert_parallel_buffers=[], bucket_groups=[_BucketGroup([bucket])],
                          expert_parallel_bucket_groups=[], ddp_config=SimpleNamespace(num_distributed_optimizer_instances=1))
    return ddp, weight


def test_release_and_gather_keep_views_and_values():
    """ZeRO-3: released storage is 0 bytes (the shard is held in its own tensor), GATHER brings the buffer back,
    the parameter view sees the same values, and the shard tensor's storage is freed while the buffer has it."""
    ddp, weight = _ddp()
    state = ChunkSharding(1, ddp, "optim_grads_params")
    before = weight.clone()
    state.release_params()
    assert ddp.buffers[0].param_data.untyped_storage().nbytes() == 0
    assert state.held_bytes() == 3 * 12 * 4  # the shard (one rank: all of it), the gradient buffer, the accumulator
    assert state.gather() == 12 * 4
    state.wait_gather()
    assert torch.equal(weight, before) and state.param_shards[0].untyped_storage().nbytes() == 0
    assert ddp.bucket_groups[0].calls == ["start_param_sync", "finish_param_sync"]


def test_group_reductions_ride_the_last_one():
    """ZeRO-2: a REDUCE scales and reduces the first group's gradients into the accumulator and frees the buffer;
    the next backward gets a zeroed buffer; the last group's start_grad_sync scales the buffer, adds the accumulator
    into the rank's slot before Megatron's own reduction (which then scales by 1, so the accumulator also rides
    Megatron's inter-instance all-reduce), once per iteration, and restores the factor."""
    ddp, _ = _ddp()
    state = ChunkSharding(0, ddp, "optim_grads")
    grads = ddp.buffers[0].grad_data
    grads += 2.0                       # first backward group
    assert state.reduce() == 12 * 4
    state.finish_reduce()
    assert grads.untyped_storage().nbytes() == 0 and torch.equal(state.grad_accum[0], torch.full((12,), 1.0))
    state.restore_grads()              # second backward group
    assert torch.equal(grads, torch.zeros(12))
    grads += 3.0
    group = ddp.bucket_groups[0]
    group.start_grad_sync()            # Megatron's last reduction (its hooks or GRAD_SYNC)
    assert torch.equal(grads, torch.full((12,), 2.5)) and group.calls[-1] == ("start_grad_sync", [1.0])
    assert ddp.buffers[0].buckets[0].gradient_scaling_factor == 0.5 and torch.equal(state.grad_accum[0], torch.zeros(12))
    grads.fill_(4.0)
    group.start_grad_sync()            # the next iteration without a REDUCE: Megatron's reduction alone
    assert torch.equal(grads, torch.full((12,), 2.0)) and group.calls[-1] == ("start_grad_sync", [0.5])


def test_node_group_check_names_the_rank():
    """The node scope's start-up check: an instance must be exactly the data-parallel ranks of this rank's node."""
    assert node_group_error(5, 2, [4, 5, 6, 7], [4, 5]) is None
    assert node_group_error(2, 8, [0, 1, 2, 3], [0, 1, 2, 3]) is None  # a node holds the whole group
    error = node_group_error(5, 2, [1, 3, 5, 7], [5, 7])  # a rank order with pipeline stages between DP ranks
    assert "rank 5 (node 2 of 2 ranks)" in error and "[5, 7]" in error and "[5]" in error


def test_step_observers_see_each_step_done():
    """An observer runs after program start, before every op and after every GATHER / RELEASE / REDUCE (seeing
    the step's effect: the gathered buffer back, the released one gone), once however often added, never after
    the program's end, and not at all once removed."""
    ddp, _ = _ddp()
    program = ProgramSharding([ddp], ("optim_grads_params",), {0: ChunkSharding(0, ddp, "optim_grads_params")})
    seen = []

    def observer():
        seen.append(ddp.buffers[0].param_data.untyped_storage().nbytes())

    add_step_observer(observer)
    add_step_observer(observer)
    try:
        program.begin()
        program.run(Op(OpKind.GATHER, 0, 0))
        program.before(Op(OpKind.FORWARD, 0, 0))
        program.run(Op(OpKind.RELEASE, 0, 0))
        program.end()
    finally:
        remove_step_observer(observer)
    assert seen == [0, 12 * 4, 12 * 4, 0]
    program.begin()
    assert len(seen) == 4
    remove_step_observer(observer)  # not registered: nothing to do
    program.end()


def test_program_counts_and_waits():
    """A program releases at its start, waits for the gather before a compute op of the chunk, counts bytes."""
    ddp0, _ = _ddp()
    ddp1, weight = _ddp()
    program = ProgramSharding([ddp0, ddp1], ("optim", "optim_grads_params"),
                              {1: ChunkSharding(1, ddp1, "optim_grads_params")})
    program.begin(measure=True)
    assert ddp1.buffers[0].param_data.untyped_storage().nbytes() == 0
    assert ddp1.buffers[0].grad_data.untyped_storage().nbytes() == 0
    assert program.resident_bytes == 2 * 12 * 4 + 12 * 4 + 12 * 4  # chunk 0 whole; chunk 1 shard + accumulator
    program.before(Op(OpKind.PARAM_SYNC, 0))
    program.run(Op(OpKind.GATHER, 1, 0))
    program.before(Op(OpKind.FORWARD, 1, 0))
    assert ddp1.bucket_groups[0].calls[-1] == "finish_param_sync" and weight[0, 1] == 1.0
    program.before(Op(OpKind.BACKWARD, 1, 0))
    assert ddp1.buffers[0].grad_data.untyped_storage().nbytes() == 12 * 4
    program.run(Op(OpKind.RELEASE, 1, 0))
    program.end()
    assert ddp1.buffers[0].param_data.untyped_storage().nbytes() == 12 * 4
    assert program.traffic == {("gather", 0): 48, ("gather", 1): 48}


@pytest.mark.parametrize("level", ["optim_grads", "optim_grads_params"])
def test_each_buffer_shards_over_its_own_group(level):
    """Two ranks, a dense buffer sharded over both and an expert buffer over its expert data-parallel group (one
    rank: each rank holds its own experts): ZeRO-3 keeps and gathers each buffer's shard over its own group, and
    the ZeRO-2 reductions reduce-scatter each bucket on its own group (expert gradients are not summed across
    the ranks), folded into Megatron's final reduction."""
    from tests import megatron_harness as h

    results = h.run_worker("tests.runtime.sharding_workers:expert_and_dense", nproc=2, kwargs={"level": level})
    for rank, got in enumerate(results):
        experts = [100.0 * (rank + 1) + i for i in range(6)]
        if level == "optim_grads_params":
            assert got["shards"] == [[4.0 * rank + i for i in range(4)], experts], (rank, got)
            assert got["gathered"] == [[float(i) for i in range(8)], experts], (rank, got)
        # Dense: (1 + 2) x 0.5 summed over both ranks; experts: this rank's own 10 (rank + 1) x 0.5.
        assert got["accumulated"] == [[1.5] * 4, [5.0 * (rank + 1)] * 6], (rank, got)
        assert got["reduced"] == [[3.0] * 4, [10.0 * (rank + 1)] * 6], (rank, got)


class _MegatronHandles(_BucketGroup):
    """A bucket group with Megatron's handle rules: ``start_param_sync`` asserts no gather is in flight and leaves
    one (async), ``finish_param_sync`` waits for it."""

    def start_param_sync(self, force_sync=False):
        assert self.param_gather_handle is None  # param_and_grad_buffer.py:400
        self.param_gather_handle = [dist.all_gather_into_tensor(b.param_data, b.param_data.clone(), async_op=True)
                                    for b in self.buckets]
        self.calls.append("start_param_sync")

    def finish_param_sync(self, skip_next_bucket_dispatch=False):
        for work in self.param_gather_handle or ():
            work.wait()
        self.param_gather_handle = None
        self.calls.append("finish_param_sync")


def test_a_gather_launched_by_the_optimizer_step_is_finished_and_used():
    """--overlap-param-gather-with-optimizer-step: Megatron's optimizer step starts the first chunk's all-gather
    itself. The program's start waits for it (never frees storage a gather writes) and keeps the gathered buffer
    for the first GATHER, which launches nothing; later GATHERs launch again."""
    ddp, weight = _ddp()
    group = ddp.bucket_groups[0] = _MegatronHandles(ddp.bucket_groups[0].buckets)
    state = ChunkSharding(0, ddp, "optim_grads_params")
    program = ProgramSharding([ddp], ("optim_grads_params",), {0: state})
    before = weight.clone()
    group.start_param_sync()           # the optimizer step of the previous iteration
    program.begin()
    assert group.param_gather_handle is None and group.calls == ["start_param_sync", "finish_param_sync"]
    assert ddp.buffers[0].param_data.untyped_storage().nbytes() == 12 * 4
    program.run(Op(OpKind.GATHER, 0, 0))
    assert group.calls[-1] == "finish_param_sync" and torch.equal(weight, before)  # launched nothing
    program.before(Op(OpKind.FORWARD, 0, 0))
    program.run(Op(OpKind.RELEASE, 0, 0))
    assert ddp.buffers[0].param_data.untyped_storage().nbytes() == 0
    program.run(Op(OpKind.GATHER, 0, 1))
    program.before(Op(OpKind.FORWARD, 0, 1))
    assert group.calls[-2:] == ["start_param_sync", "finish_param_sync"] and torch.equal(weight, before)
    assert program.traffic == {("gather", 0): 2 * 12 * 4}
    program.end()
    program.begin()                    # no gather in flight: released as usual
    assert ddp.buffers[0].param_data.untyped_storage().nbytes() == 0
    program.end()


@pytest.mark.parametrize("level", ["optim", "optim_grads", "optim_grads_params"])
def test_prediction_counts_every_buffer_with_its_own_group_and_dtype(level):
    """The predicted report prices each buffer with its own group and element sizes: a bf16 and an fp32 dense
    buffer sharded over 4 ranks of a data-parallel group of 8 (two instances), and an expert buffer sharded over
    its expert data-parallel group of 2 (one instance) -- not the first dense buffer's numbers for all of them."""
    from megatron_pipemesh.planning.sharding import bytes_per_param, chunk_traffic
    from megatron_pipemesh.runtime.sharding import predicted_report
    from megatron_pipemesh.schedule.config import ScheduleConfig

    group = lambda n: SimpleNamespace(size=lambda: n)  # noqa: E731

    def buffer(numel, dtype, shard):
        return SimpleNamespace(param_data=torch.zeros(numel, dtype=dtype), grad_data=torch.zeros(numel),
                               data_parallel_group=group(shard))

    dense = [buffer(64, torch.bfloat16, 4), buffer(16, torch.float32, 4)]
    expert = [buffer(32, torch.bfloat16, 2)]
    ddp = SimpleNamespace(buffers=dense, expert_parallel_buffers=expert, dp_cp_group=group(8), expt_dp_group=group(2))
    config = ScheduleConfig(2, 2, 4, (2, 2), (2, 2))
    program = ProgramSharding([ddp, ddp], (level, level), {})
    got = predicted_report(program, config, pp_rank=1)
    want_held, want = 0.0, {"gather": 0.0, "reduce": 0.0, "cross": 0.0}
    for numel, w, shard, dp in ((64, 2, 4, 8), (16, 4, 4, 8), (32, 2, 2, 2)):
        want_held += 2 * numel * bytes_per_param(level, shard, w, 4).resident
        traffic = chunk_traffic(config, 1, 1, level, numel, dp, shard, w, 4)
        want["gather"] += traffic.gathers * traffic.gather_bytes
        want["reduce"] += traffic.reduces * traffic.reduce_bytes
        want["cross"] += traffic.cross_node_bytes
    assert got["held"] == pytest.approx(want_held)
    for what in ("gather", "reduce", "cross"):
        assert got[what][1] == pytest.approx(want[what]), what
    assert got["cross"][1] == pytest.approx((64 * 4 + 16 * 4) / 4)  # the expert buffer crosses no instance
