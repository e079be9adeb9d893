"""ZeRO-2 with several backward groups on Megatron's default path (``zero2_backward_groups``): every chunk's gradient
buffer is freed between groups, each group but the last reduce-scatters its gradients (``REDUCE c.k``) into a shard
accumulator, and the chunk's next backward first waits for that reduce-scatter (``runtime/sharding.py``,
``restore_grads``): the wait the simulator must price. Against the same plan without sharding, the gradients must be
the same.

One GPU gives each thread-rank a data-parallel group of one rank, whose reduce-scatter is done the moment it is
launched: a runtime that read the shard without waiting would pass. So the runtime's reduce-scatters complete late
here (:func:`late_reduce_scatters`): launched, they leave the shard poisoned and write it only when waited for, so a
missing or misplaced wait shows as NaN gradients. (Reduce-scatters between two real ranks need two GPUs for NCCL;
``tests/runtime/test_sharding.py`` runs them on two gloo ranks on CPU.)"""
from __future__ import annotations

import collections
import contextlib
import threading
from typing import Dict, Iterator, List, Optional, Sequence

from .common import TOLERANCE, rel_diff
from .megatron_path import MEGATRON_TOLERANCE, run_megatron_path, transformer_engine_version

ZERO2 = "optim_grads"


def planned_reduces(pp: int, vpp: int, microbatches: int, forward_groups: Sequence[int],
                    backward_groups: Sequence[int], sharding: Sequence[str]) -> List[int]:
    """``REDUCE`` ops per rank in one iteration of the lowered plan the runtime runs (Megatron's sync functions set)."""
    from megatron_pipemesh.schedule import ScheduleConfig
    from megatron_pipemesh.schedule.ops import OpKind
    from megatron_pipemesh.schedule.plan import RunPlan

    plan = RunPlan(ScheduleConfig(pp, vpp, microbatches, tuple(forward_groups), tuple(backward_groups)), {},
                   tuple(sharding))
    return [sum(1 for op in program if op.kind is OpKind.REDUCE)
            for program in plan.lower(param_sync=True, grad_sync=True).programs]


@contextlib.contextmanager
def counting_reductions() -> Iterator[Dict[str, collections.Counter]]:
    """While inside, count per thread-rank (thread name) the REDUCE ops the sharding runtime ran, the buckets they
    reduce-scattered, and the waits for a reduce-scatter in flight (``finish_reduce`` finding one pending)."""
    from megatron_pipemesh.runtime.sharding import ChunkSharding

    counts: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    lock = threading.Lock()
    reduce, finish = ChunkSharding.reduce, ChunkSharding.finish_reduce

    def counted_reduce(self):
        result = reduce(self)
        with lock:
            counts[threading.current_thread().name].update(reduce_ops=1, buckets_reduced=len(self.buckets))
        return result

    def counted_finish(self):
        waited = bool(self.pending)
        finish(self)
        if waited:
            with lock:
                counts[threading.current_thread().name].update(waits=1)

    ChunkSharding.reduce, ChunkSharding.finish_reduce = counted_reduce, counted_finish
    try:
        yield counts
    finally:
        ChunkSharding.reduce, ChunkSharding.finish_reduce = reduce, finish


class LateWork:
    """A reduce-scatter that completes late: launched, it keeps a copy of its input and poisons its output (NaN);
    the result is written when it is waited for, never before."""

    def __init__(self, output, data, op, group):
        self.output, self.data, self.op, self.group = output, data.clone(), op, group
        self.done = False
        output.fill_(float("nan"))

    def wait(self, timeout=None) -> bool:
        if not self.done:
            import torch.distributed as dist

            dist.reduce_scatter_tensor(self.output, self.data, op=self.op, group=self.group)
            self.done = True
            self.data = None
        return True


@contextlib.contextmanager
def late_reduce_scatters() -> Iterator[List[LateWork]]:
    """While inside, the sharding runtime's asynchronous reduce-scatters (its ``REDUCE`` ops) complete late
    (:class:`LateWork`); yields the works launched. Megatron's own gradient reductions are untouched."""
    import torch.distributed as dist

    from megatron_pipemesh.runtime import sharding

    launched: List[LateWork] = []
    lock = threading.Lock()

    class Late:
        def __getattr__(self, name):
            return getattr(dist, name)

        @staticmethod
        def reduce_scatter_tensor(output, data, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if not async_op:
                return dist.reduce_scatter_tensor(output, data, op=op, group=group)
            work = LateWork(output, data, op, group)
            with lock:
                launched.append(work)
            return work

    real = sharding.dist
    sharding.dist = Late()
    try:
        yield launched
    finally:
        sharding.dist = real


def check_zero2_backward_groups(device, backend: str, pp: int = 2, vpp: int = 2, microbatches: int = 8,
                                forward_groups=(4, 4), backward_groups=(2, 2, 2, 2), iterations: int = 3,
                                te: Optional[str] = None, timeout_s: float = 60.0) -> dict:
    """ZeRO-2 on every chunk with four backward groups (three REDUCE ops per chunk and iteration, Megatron's bucketing
    on chunk 0) against the same groups without sharding, both on Megatron's default path
    (:func:`~.megatron_path.run_megatron_path`), the sharded run's reduce-scatters completing late
    (:func:`late_reduce_scatters`). Every run must finish; the first iteration's losses must agree exactly and its
    grad norm to :data:`~.common.TOLERANCE` (the accumulated shards are the gradients; only the order of fp32
    additions may differ), later ones within bf16's margin; every rank must run the plan's REDUCE ops and wait for
    their reduce-scatters (at most one wait per REDUCE: several may be finished by one wait), every one launched."""
    if te is None and device.type == "cuda":
        te = transformer_engine_version()
    sharding = (ZERO2,) * vpp
    common = dict(pp=pp, vpp=vpp, microbatches=microbatches, forward_groups=forward_groups,
                  backward_groups=backward_groups, iterations=iterations, te=te, timeout_s=timeout_s)
    plain = run_megatron_path(device, backend, host=False, **common)
    record = {"backend": backend, "device": str(device), "sharding": list(sharding),
              "backward_groups": list(backward_groups), "runs": {"plain": plain}}
    if plain.get("errors"):
        return {**record, "status": "fail"}
    with counting_reductions() as counts, late_reduce_scatters() as late:
        zero2 = run_megatron_path(device, backend, host=False, sharding=sharding, **common)
    record["runs"]["zero2"] = zero2
    record["late_reduce_scatters"] = {"launched": len(late), "waited": sum(work.done for work in late)}
    if zero2.get("errors"):
        return {**record, "status": "fail"}
    planned = planned_reduces(pp, vpp, microbatches, forward_groups, backward_groups, sharding)
    ranks = []
    for rank in range(pp):
        seen = counts.get(f"pipemesh-rank{rank}", collections.Counter())
        ranks.append({"planned_reduce_ops": planned[rank] * iterations, "reduce_ops": seen["reduce_ops"],
                      "buckets_reduced": seen["buckets_reduced"], "reduce_waits": seen["waits"]})
    reduces_ran = all(r["planned_reduce_ops"] > 0 and r["reduce_ops"] == r["planned_reduce_ops"] for r in ranks)
    late = record["late_reduce_scatters"]
    waited = all(0 < r["reduce_waits"] <= r["reduce_ops"] for r in ranks) and 0 < late["launched"] == late["waited"]
    first_loss = max(rel_diff(a, b) for a, b in zip(zero2["losses"][0], plain["losses"][0]))
    later = max(rel_diff(a, b) for x, y in zip(zero2["losses"], plain["losses"]) for a, b in zip(x, y))
    # The grad norms carry the gradients' comparison: a run without them (no clipping) cannot pass.
    pairs = list(zip(zero2["grad_norms"], plain["grad_norms"]))
    if not pairs or any(a is None or b is None for a, b in pairs):
        return {**record, "status": "fail", "ranks": ranks, "reason": "the optimizer reported no grad norm"}
    first_norm = rel_diff(*pairs[0])
    norms = max(rel_diff(a, b) for a, b in pairs)
    ok = (reduces_ran and waited and first_loss <= TOLERANCE and first_norm <= TOLERANCE
          and later <= MEGATRON_TOLERANCE and norms <= MEGATRON_TOLERANCE)
    return {**record, "status": "pass" if ok else "fail", "ranks": ranks, "reduces_as_planned": reduces_ran,
            "reduce_scatters_waited": waited, "first_iteration_max_rel_loss_diff": first_loss,
            "first_iteration_rel_grad_norm_diff": first_norm, "max_rel_loss_diff": later,
            "max_rel_grad_norm_diff": norms}
