"""gpu_check_lib/zero_groups.py: ZeRO-2 with several backward groups runs the plan's REDUCE ops, waits for their
reduce-scatters, and keeps the gradients; a reduction that loses a group's gradients fails the check. The check
passing, with the same facts: tests/scripts/test_gpu_check.py."""
from __future__ import annotations

import textwrap

from .child import printed, run_child

_RUN = """
    import json
    from gpu_check_lib import common, zero_groups
    device = common.setup(cpu_only=True)
    result = zero_groups.check_zero2_backward_groups(device, "gloo", timeout_s=20.0)
    print("result", json.dumps({k: v for k, v in result.items() if k != "runs"}, default=str))
"""


def test_planned_reduces_counts_every_group_but_the_last_per_chunk():
    """Four backward groups on two chunks: three REDUCE ops per chunk on every rank (the last group's reduction is
    Megatron's own grad sync); without sharding none."""
    proc = run_child("""
        from gpu_check_lib import zero_groups
        print("zero2", zero_groups.planned_reduces(2, 2, 8, (4, 4), (2, 2, 2, 2), ("optim_grads",) * 2))
        print("plain", zero_groups.planned_reduces(2, 2, 8, (4, 4), (2, 2, 2, 2), ()))
    """, timeout=120)
    assert "zero2 [6, 6]" in proc.stdout and "plain [0, 0]" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_zero2_check_fails_when_a_group_reduction_loses_its_gradients():
    """A REDUCE that reduce-scatters a zeroed buffer (the group's gradients dropped, as a reduction racing the
    buffer's reuse would) changes the first iteration's grad norm: the check must fail."""
    proc = run_child(textwrap.dedent("""
        from megatron_pipemesh.runtime.sharding import ChunkSharding
        reduce = ChunkSharding.reduce
        def losing(self):
            self.restore_grads()
            for bucket in self.buckets:
                bucket.grad_data.zero_()
            return reduce(self)
        ChunkSharding.reduce = losing
    """) + textwrap.dedent(_RUN), timeout=300)
    result = printed(proc)
    assert result["status"] == "fail" and result["first_iteration_rel_grad_norm_diff"] > 1e-3, result


def test_zero2_check_fails_when_the_runtime_does_not_wait_for_its_reduce_scatters():
    """A runtime that adds a REDUCE's shard to the accumulator without waiting for its reduce-scatter: with one rank
    per data-parallel group the real reduce-scatter is done at once and that passed; the check's late-completing
    works leave the shard poisoned until waited for, so the check must fail (NaN grad norm, no wait counted)."""
    proc = run_child(textwrap.dedent("""
        from megatron_pipemesh.runtime.sharding import ChunkSharding
        class NotWaited:  # the runtime's wait on a reduce-scatter, removed
            def wait(self):
                pass
        finish = ChunkSharding.finish_reduce
        def no_wait(self):
            self.pending = [(NotWaited(), index) for _, index in self.pending]
            finish(self)
        ChunkSharding.finish_reduce = no_wait
    """) + textwrap.dedent(_RUN), timeout=300)
    result = printed(proc)
    assert result["status"] == "fail" and not result["reduce_scatters_waited"], result
    assert result["late_reduce_scatters"]["waited"] == 0 < result["late_reduce_scatters"]["launched"]
    assert not result["first_iteration_rel_grad_norm_diff"] <= 1e-5  # NaN: the poisoned shard reached the gradients
