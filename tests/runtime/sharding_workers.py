"""Worker for tests/runtime/test_sharding.py's two-group check (run on every rank through tests/megatron_harness.py):
mixed sharding on stand-ins of a Megatron DDP chunk with a dense buffer sharded over all data-parallel ranks and
an expert buffer over the expert data-parallel group, here one rank (expert parallelism = data parallelism)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List

import torch
import torch.distributed as dist


def _slot(tensor: torch.Tensor, group) -> torch.Tensor:
    numel = tensor.numel() // group.size()
    return tensor[group.rank() * numel:(group.rank() + 1) * numel]


class _BucketGroup:
    """Megatron's bucket group as the mechanism uses it: its collectives run on its buffer's group."""

    def __init__(self, bucket, group):
        self.buckets, self.group = [bucket], group
        self.ddp_config = SimpleNamespace(overlap_param_gather=True)
        self.param_gather_handle = None

    def start_param_sync(self):
        for bucket in self.buckets:
            mine = _slot(bucket.param_data, self.group).clone()
            dist.all_gather_into_tensor(bucket.param_data, mine, group=self.group)

    def finish_param_sync(self, skip_next_bucket_dispatch=False):
        pass

    def start_grad_sync(self, force_all_reduce=False):
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
            dist.reduce_scatter_tensor(_slot(bucket.grad_data, self.group), bucket.grad_data.clone(), group=self.group)


class _Bucket:
    """Megatron's bucket (compared by identity, as Megatron's objects are)."""

    def __init__(self, param_data: torch.Tensor):
        self.param_data, self.grad_data = param_data, torch.zeros_like(param_data)
        self.gradient_scaling_factor = 0.5
        self.params_with_extra_main_grads: list = []


def _buffer(param_data: torch.Tensor, group):
    bucket = _Bucket(param_data)
    return SimpleNamespace(param_data=param_data, grad_data=bucket.grad_data, data_parallel_group=group,
                           buckets=[bucket]), _BucketGroup(bucket, group)


def expert_and_dense(level: str) -> Dict[str, List[float]]:
    """ZeRO-3 release + gather, then ZeRO-2 group reduction folded into the final one, on a dense buffer of 8
    (identical on both ranks) and an expert buffer of 6 (each rank its own experts); returns what each rank
    holds at each step."""
    from megatron_pipemesh.runtime.sharding import ChunkSharding

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    experts = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # every rank creates every group
    dense, dense_group = _buffer(torch.arange(8, dtype=torch.float32), dist.group.WORLD)
    expert, expert_group = _buffer(100.0 * (rank + 1) + torch.arange(6, dtype=torch.float32), experts)
    ddp = SimpleNamespace(buffers=[dense], bucket_groups=[dense_group], expert_parallel_buffers=[expert],
                          expert_parallel_bucket_groups=[expert_group])
    state = ChunkSharding(0, ddp, level)
    out: Dict[str, List[float]] = {}
    if state.zero3:
        state.release_params()
        out["shards"] = [shard.tolist() for shard in state.param_shards]
        state.gather()
        state.wait_gather()
        out["gathered"] = [dense.param_data.tolist(), expert.param_data.tolist()]
    state.release_grads()
    state.restore_grads()                 # first backward group
    dense.grad_data += rank + 1
    expert.grad_data += 10.0 * (rank + 1)
    state.reduce()
    state.finish_reduce()
    out["accumulated"] = [accum.tolist() for accum in state.grad_accum]
    state.restore_grads()                 # second backward group, then the chunk's final reduction
    dense.grad_data += rank + 1
    expert.grad_data += 10.0 * (rank + 1)
    dense_group.start_grad_sync()
    expert_group.start_grad_sync()
    out["reduced"] = [_slot(dense.grad_data, dist.group.WORLD).tolist(), expert.grad_data.tolist()]
    dist.destroy_process_group()
    return out
