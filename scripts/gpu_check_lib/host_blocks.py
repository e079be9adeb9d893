"""A plan with host placement sizes the pinned pool before the first call (``host_blocks``): every rank's pool is
allocated up front from the plan's blocks, and no OFFLOAD allocates a pinned block late (a ``cudaHostAlloc`` inside
an iteration, while posted NCCL receives spin on the device)."""
from __future__ import annotations

from typing import Dict, Tuple

from .executor import mixed_placement, run_pipeline
from .meter_offload import simulated


def planned_blocks(pp: int, vpp: int, microbatches: int, forward_groups, backward_groups, placement: Dict,
                   layers_per_stage: int, hidden: int, heads: int, seq: int, mbs: int,
                   vocab: int) -> Dict[Tuple[int, int], int]:
    """(rank, chunk) -> the pinned block each host-placed chunk-micro-batch of that chunk takes, as the planner puts
    them in a plan (``RunPlan.host_blocks``: the simulator's, from the activation model)."""
    result = simulated(pp, vpp, microbatches, forward_groups, backward_groups, placement, layers_per_stage, hidden,
                       heads, seq, mbs, vocab)
    return {(rank.rank, chunk): size for rank in result.ranks for chunk, size in rank.host_blocks.items()}


def pool_as_planned(pp: int, vpp: int, microbatches: int, forward_groups, backward_groups, placement: Dict,
                    blocks: Dict[Tuple[int, int], int]) -> list:
    """Per rank, the bytes of the pool the runtime reserves from ``blocks`` (``schedule/host_blocks.py`` on the
    lowered program the executor runs)."""
    from megatron_pipemesh.schedule import ScheduleConfig
    from megatron_pipemesh.schedule.host_blocks import pool_blocks, pool_bytes
    from megatron_pipemesh.schedule.plan import RunPlan

    plan = RunPlan(ScheduleConfig(pp, vpp, microbatches, tuple(forward_groups), tuple(backward_groups)), placement,
                   host_blocks=blocks)
    programs = plan.lower(param_sync=False, grad_sync=False).programs
    return [pool_bytes(pool_blocks(program, {c: b for (r, c), b in blocks.items() if r == rank}))
            for rank, program in enumerate(programs)]


def check_host_blocks(device, pp: int = 2, vpp: int = 2, microbatches: int = 8, forward_groups=(6, 2),
                      backward_groups=(4, 4), layers_per_stage: int = 2, hidden: int = 128, heads: int = 4,
                      seq: int = 64, mbs: int = 2, vocab: int = 512) -> dict:
    """Every placement kind on every rank (:func:`~.executor.mixed_placement`) with the plan's ``host_blocks``, two
    calls: losses and gradients as the whole model's, and on every rank the pool reserved before the first call
    (as many bytes as the plan's blocks need) with no block allocated late. Pinned on CUDA; on CPU the pool's blocks
    are ordinary host memory, reserved and handed out by the same code."""
    shape = dict(layers_per_stage=layers_per_stage, hidden=hidden, heads=heads, seq=seq, mbs=mbs, vocab=vocab)
    placement = mixed_placement(pp, vpp, microbatches)
    blocks = planned_blocks(pp, vpp, microbatches, forward_groups, backward_groups, placement, **shape)
    run = run_pipeline(device, "nccl", pp=pp, vpp=vpp, layers_per_stage=layers_per_stage, microbatches=microbatches,
                       forward_groups=forward_groups, backward_groups=backward_groups, mbs=mbs, seq=seq, vocab=vocab,
                       hidden=hidden, placement=placement, host_blocks=blocks, warmup=True)
    planned = pool_as_planned(pp, vpp, microbatches, forward_groups, backward_groups, placement, blocks)
    ranks = [{"planned_pool_bytes": planned[rank], "pool_bytes": run.get("host_pool_bytes", [0] * pp)[rank],
              "pool_blocks": run.get("host_pool_allocations", [0] * pp)[rank],
              "late_allocations": run.get("host_pool_late_allocations", [0] * pp)[rank]} for rank in range(pp)]
    record = {"pinned": device.type == "cuda", "host_blocks": {f"{r}.{c}": size for (r, c), size in blocks.items()},
              "ranks": ranks, "run": run}
    if run["status"] != "pass":
        return {**record, "status": "fail", "reason": "the run with host placement failed (see run)"}
    reserved = all(r["planned_pool_bytes"] > 0 and r["pool_bytes"] == r["planned_pool_bytes"] for r in ranks)
    on_time = all(r["late_allocations"] == 0 for r in ranks)
    record.update(pool_reserved_as_planned=reserved, no_late_allocation=on_time)
    return {**record, "status": "pass" if reserved and on_time else "fail"}
