"""``--pipemesh-shard-scope node`` runs on Megatron's hierarchical distributed optimizer
(``--num-distributed-optimizer-instances``); this module holds the one upstream fix it needs.

megatron-core 0.19.2 reduces the gradients twice per iteration when there are several
distributed-optimizer instances, ``--overlap-grad-reduce`` is on and the bucket group is still in its
"first batch" (its backward hooks have not recorded which gradients arrive on the last micro-batch,
which under the interleaved schedule, whose backward hooks run inside ``no_sync``, lasts for the whole
run): the schedule's ``grad_sync_func`` starts the reduction, and ``finish_grad_sync`` starts it again
(``distributed/param_and_grad_buffer.py:809-810``). The guard that makes that second start a no-op
(``:603-606``) tests ``grad_reduce_handle``, which the multi-instance path never sets: it reduces
synchronously on its communication stream (``:677-680``, ``:785-790``). So every bucket is
reduce-scattered, scaled and all-reduced across instances a second time (measured on 8 gloo ranks,
PP=2 x DP=4, V=2, stock interleaved schedule: grad norm 2.520 instead of 4.030 and diverging losses).

:func:`start_grad_sync_once_per_iteration` makes ``start_grad_sync`` of such a bucket group start
at most once between two ``reset()`` calls (Megatron's ``zero_grad_buffer`` at the start of each
iteration): the rule of ``:603-606`` without the handle. Applied only while the node scope is active;
a single-instance run is never affected (its own guard holds). Host-side bookkeeping only (a Python
flag per bucket group), so nothing changes on CUDA streams.
"""
from __future__ import annotations

import functools

_STARTED = "_pipemesh_grad_sync_started"


def start_grad_sync_once_per_iteration() -> None:
    """Patch Megatron's bucket groups so that, with several distributed-optimizer instances and overlapped
    gradient reduction, a second ``start_grad_sync`` before the next ``reset()`` is a no-op (idempotent)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as BucketGroup

    if getattr(BucketGroup.start_grad_sync, "_pipemesh_once", False):
        return
    start, reset = BucketGroup.start_grad_sync, BucketGroup.reset

    @functools.wraps(start)
    def start_grad_sync(self, *args, **kwargs):
        config = self.ddp_config
        if config.num_distributed_optimizer_instances > 1 and config.overlap_grad_reduce:
            if getattr(self, _STARTED, False):
                return None
            setattr(self, _STARTED, True)
        return start(self, *args, **kwargs)

    @functools.wraps(reset)
    def reset_(self, *args, **kwargs):
        setattr(self, _STARTED, False)
        return reset(self, *args, **kwargs)

    start_grad_sync._pipemesh_once = True
    BucketGroup.start_grad_sync = start_grad_sync
    BucketGroup.reset = reset_
