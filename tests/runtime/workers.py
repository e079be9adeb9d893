"""Worker functions run on every rank by the runtime tests (through tests/megatron_harness.py)."""
from __future__ import annotations

from typing import Dict, List, Optional

from tests import megatron_harness as h


def make_pipemesh(forward_groups=None, backward_groups=None, **options):
    from megatron_pipemesh.integration.parallel_state import get_pipemesh_p2p_groups
    from megatron_pipemesh.runtime import PipeMeshOptions, PipeMeshSchedule

    return PipeMeshSchedule(
        PipeMeshOptions(tuple(forward_groups) if forward_groups else None,
                        tuple(backward_groups) if backward_groups else None, **options),
        p2p_groups=get_pipemesh_p2p_groups)


def stock_vs_pipemesh(pp: int, vp: int, microbatches: int, groups: Dict[str, Optional[List[List[int]]]],
                      dp: int = 1, ddp: bool = False, overlap_grad_reduce: bool = False,
                      forward_only: bool = False):
    """Same model, same data: the stock interleaved schedule, then PipeMesh with each named
    (forward, backward) group pair (None = depth-first default). Returns every result."""
    h.init_parallel(pp=pp, vp=vp, dp=dp)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec = h.TinyGPT(num_layers=pp * vp)
    model = h.build_model(spec, wrap_ddp=ddp, overlap_grad_reduce=overlap_grad_reduce)
    results = {"stock": h.run_schedule(get_forward_backward_func(), model, spec, microbatches, forward_only=forward_only)}
    for name, pair in groups.items():
        schedule = make_pipemesh(*(pair or (None, None)))
        result = h.run_schedule(schedule, model, spec, microbatches, forward_only=forward_only)
        result["stats"] = schedule.last_stats.summary()
        result["digest"] = schedule.last_stats.plan_digest
        results[name] = result
    return results


def single_rank_reference(num_layers: int, microbatches: int):
    """The whole model on one rank through Megatron's no-pipelining schedule."""
    h.init_parallel(pp=1)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec = h.TinyGPT(num_layers=num_layers)
    model = h.build_model(spec)
    return h.run_schedule(get_forward_backward_func(), model, spec, microbatches)


def plan_mismatch():
    """Rank 0 is given other groups than rank 1: both must fail at start-up with a clear error."""
    import torch.distributed as dist

    h.init_parallel(pp=2, vp=2)
    spec = h.TinyGPT(num_layers=4)
    model = h.build_model(spec)
    groups = ([6, 2], [4, 4]) if dist.get_rank() == 0 else (None, None)
    h.run_schedule(make_pipemesh(*groups), model, spec, 8)


def faulty_peer(mode: str, timeout_s: float = 5.0):
    """Rank 1 stalls ('stuck') or dies ('killed') in its first forward; rank 0 must not hang."""
    import os
    import time

    import torch.distributed as dist

    h.init_parallel(pp=2, vp=2)
    spec = h.TinyGPT(num_layers=4)
    model = h.build_model(spec)
    step = h.forward_step_func
    if dist.get_rank() == 1:
        def step(data_iterator, model):
            if mode == "killed":
                os._exit(17)
            time.sleep(120)
    schedule = make_pipemesh(p2p_timeout_s=timeout_s)
    iterators = h.make_data_iterators(spec, 8, 2)
    schedule(forward_step_func=step, data_iterator=iterators, model=model, num_microbatches=8,
             seq_length=spec.seq_length, micro_batch_size=spec.micro_batch_size)
