"""Worker for tests/runtime/test_profiler.py (run on both ranks of a PP=2 pipeline through tests/megatron_harness.py):
the measured re-planner's micro-benchmarks with every point-to-point call and all-reduce recorded."""
from __future__ import annotations

from typing import Dict, List

from tests import megatron_harness as h


def measured_costs(chunk_params: int) -> Dict[str, object]:
    """``measure_costs`` as the re-planner calls it (integration/measured.py), with a data-parallel group of both
    ranks: which group each transfer ran on ('link F a->b', 'pipeline', 'other'), whether any went out batched, and
    the largest all-reduce."""
    h.init_parallel(pp=2)  # first: it prepares Megatron's import on CPU
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from megatron.core import parallel_state

    from megatron_pipemesh.integration.parallel_state import get_pipemesh_p2p_groups
    from megatron_pipemesh.runtime.profiler import measure_costs

    pp_group = parallel_state.get_pipeline_model_parallel_group()
    links = get_pipemesh_p2p_groups()
    names = {id(group): f"link {k[0]} {k[1]}->{k[2]}" for k, group in links.items()}
    names[id(pp_group)] = "pipeline"
    seen: Dict[str, List] = {"isend": [], "irecv": [], "batched": [], "all_reduce": []}

    def recording(name, func):
        def call(*args, **kwargs):  # (tensor, peer, group, tag) positionally from batch_isend_irecv
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            seen[name].append(names.get(id(group), "other"))
            return func(*args, **kwargs)
        return call

    real_batch, real_all_reduce = dist.batch_isend_irecv, dist.all_reduce
    real = {}
    for name in ("isend", "irecv"):
        wrapped = recording(name, getattr(dist, name))
        real[wrapped] = getattr(dist, name)
        setattr(dist, name, wrapped)
    c10d._check_op = lambda op: None  # P2POp accepts the recording wrappers

    def batch_isend_irecv(ops):
        seen["batched"].append([names.get(id(op.group), "other") for op in ops])
        for op in ops:  # torch picks the peer keyword by the function's identity
            op.op = real.get(op.op, op.op)
        return real_batch(ops)

    dist.batch_isend_irecv = batch_isend_irecv
    dist.all_reduce = lambda tensor, *a, **k: seen["all_reduce"].append(tensor.numel()) or \
        real_all_reduce(tensor, *a, **k)
    costs = measure_costs([], vpp=1, pp_group=pp_group, p2p_groups=links, dp_group=dist.group.WORLD, shape=(16, 2, 32),
                          dtype=torch.float32, device=torch.device("cpu"), chunk_params=chunk_params, grad_bytes=4,
                          distributed_optimizer=True)
    return {"seen": seen, "costs": costs, "rank": dist.get_rank()}
