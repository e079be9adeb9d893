"""Measured cost inputs for the planner: per-op compute times from the runtime's timers of the
first iterations (GPU times from CUDA events on CUDA, see :mod:`.stats`), plus short
micro-benchmarks of a pipeline transfer and a data-parallel all-reduce on the real process groups (the
per-link groups the runtime sends on; a bounded all-reduce buffer, scaled to the chunk's size).

Every rank measures locally; :func:`measure_costs` then gathers all ranks' numbers so that every
rank builds the same :class:`~megatron_pipemesh.planning.costs.OpCosts` (the planner is
deterministic, so all ranks pick the same plan without further agreement).
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .stats import RuntimeStats
from .transport import LinkKey


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def compute_medians(history: Sequence[RuntimeStats], vpp: int, pp_rank: int, pp: int) -> Dict[str, float]:
    """Median forward/backward compute per chunk-micro-batch, split into the first stage
    (embedding), the last stage (output layer and loss) and the others."""
    buckets: Dict[str, List[float]] = {}
    for stats in history:
        for record in stats.resolve().records:  # CUDA-event (GPU) times on CUDA, host times on CPU
            kind = record.op[0]
            if kind not in ("F", "B"):
                continue
            chunk = int(record.op[1:].split(".")[0])
            stage = chunk * pp + pp_rank
            where = "first" if stage == 0 else "last" if stage == pp * vpp - 1 else "middle"
            buckets.setdefault(f"{kind}_{where}", []).append(record.compute_s)
    return {key: _median(values) for key, values in buckets.items()}


def time_pipeline_transfer(shape, dtype, device, pp_group, p2p_groups: Mapping[LinkKey, object],
                           repeats: int = 5) -> float:
    """Median seconds to pass one activation to the next pipeline rank (all ranks at once), on the per-link
    groups the runtime sends on (:func:`..integration.parallel_state.get_pipemesh_p2p_groups`): each rank
    receives on the link from the previous rank and sends on the link to the next one, two communicators,
    so neither waits for the other (as in the runtime, where each link's transfers are ordered among
    themselves only). ``pp_group`` (Megatron's pipeline group) only lines the ranks up between repeats."""
    pp, rank = pp_group.size(), pp_group.rank()
    if pp < 2:
        return 0.0
    ranks = dist.get_process_group_ranks(pp_group)
    me, after, before = ranks[rank], ranks[(rank + 1) % pp], ranks[(rank - 1) % pp]
    outgoing, incoming = p2p_groups[("F", me, after)], p2p_groups[("F", before, me)]
    send = torch.ones(shape, dtype=dtype, device=device)
    recv = torch.empty(shape, dtype=dtype, device=device)
    times = []
    for _ in range(repeats + 1):
        dist.barrier(group=pp_group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        works = [dist.irecv(recv, src=before, group=incoming), dist.isend(send, dst=after, group=outgoing)]
        for work in works:
            work.wait()
        if device.type == "cuda":  # wall time of the transfer itself, not of its launch
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return _median(times[1:])


ALLREDUCE_SAMPLE_NUMEL = 1 << 22
"""Elements the all-reduce micro-benchmark moves at most (16 MiB in fp32): enough to be bandwidth-bound on the
links the planner targets, small enough to allocate mid-training on a tight plan; longer reductions are scaled."""


def time_allreduce(numel: int, dtype, device, group, repeats: int = 3,
                   sample_numel: int = ALLREDUCE_SAMPLE_NUMEL) -> float:
    """Median seconds of an all-reduce of ``numel`` elements over ``group`` (0 for one rank), measured on at most
    ``sample_numel`` elements and scaled linearly (a whole chunk's fp32 buffer would be GBs on 7-13B models)."""
    if group is None or group.size() == 1 or numel == 0:
        return 0.0
    sample = min(numel, sample_numel)
    buffer = torch.zeros(sample, dtype=dtype, device=device)
    times = []
    for _ in range(repeats + 1):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return _median(times[1:]) * numel / sample


def bucket_reductions(chunk) -> List[Tuple[object, int]]:
    """(group, elements) of each gradient buffer of a Megatron DDP ``chunk``, on the group its bucket groups reduce
    on: the buffer's ``data_parallel_group`` (``partition_buckets`` hands it to every bucket group as its collective
    group), which is Megatron's distributed-optimizer instance (a part of the data-parallel ranks with
    ``--num-distributed-optimizer-instances`` > 1), the data-parallel group with context parallelism, and for expert
    buffers the expert data-parallel one. Empty for a chunk without Megatron's buffers."""
    buffers = list(getattr(chunk, "buffers", None) or []) + list(getattr(chunk, "expert_parallel_buffers", None) or [])
    return [(buffer.data_parallel_group, buffer.grad_data.numel()) for buffer in buffers]


def measure_costs(history: Sequence[RuntimeStats], *, vpp: int, pp_group, p2p_groups: Mapping[LinkKey, object],
                  dp_group, shape, dtype, device, chunk_params: int, grad_bytes: int,
                  distributed_optimizer: bool,
                  reductions: Optional[Sequence[Tuple[object, int]]] = None) -> Dict[str, float]:
    """Measure on this rank, gather every rank's numbers and combine them identically everywhere
    (``p2p_groups``: the per-link groups the runtime sends on; ``reductions``: (group, elements) of each gradient
    buffer of the chunk, :func:`bucket_reductions`, timed one after another as a chunk's gradient sync runs them;
    without it, ``chunk_params`` elements on ``dp_group``).

    Returns seconds per chunk-micro-batch: forward, backward, first/last-stage extras, p2p
    transfer, data-parallel gradient reduction and parameter gather per chunk.
    """
    pp_rank, pp = pp_group.rank(), pp_group.size()
    local = compute_medians(history, vpp, pp_rank, pp)
    local["p2p_s"] = time_pipeline_transfer(shape, dtype, device, pp_group, p2p_groups)
    grad_dtype = torch.float32 if grad_bytes == 4 else torch.bfloat16
    if not reductions:
        reductions = [(dp_group, chunk_params)]
    allreduce = sum(time_allreduce(numel, grad_dtype, device, group) for group, numel in reductions)
    d = max(group.size() if group is not None else 1 for group, _ in reductions)
    # Ring reduce-scatter and all-gather each move half of an all-reduce's data.
    local["dp_reduce_s"] = allreduce / 2 if distributed_optimizer else allreduce
    local["dp_gather_s"] = allreduce / 2 * (2 / grad_bytes if grad_bytes else 1) if distributed_optimizer and d > 1 else 0.0
    gathered: List[Optional[Dict[str, float]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)

    def worst(key: str) -> float:
        return max((g.get(key, 0.0) for g in gathered if g), default=0.0)

    forward = worst("F_middle") or worst("F_first") or worst("F_last")
    backward = worst("B_middle") or worst("B_first") or worst("B_last")
    return {
        "forward_s": forward, "backward_s": backward,
        "first_stage_extra_s": max(0.0, worst("F_first") - forward),
        "last_stage_extra_s": max(0.0, worst("F_last") - forward),
        "p2p_s": worst("p2p_s"), "dp_reduce_s": worst("dp_reduce_s"), "dp_gather_s": worst("dp_gather_s"),
    }
