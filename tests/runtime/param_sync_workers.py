"""Worker functions for the distributed-optimizer tests (run on every rank through tests/megatron_harness.py).

Each named run trains the same tiny GPT (same initial weights on every layout) for a few iterations with
one schedule and one optimizer, feeding each data-parallel replica its own micro-batches, and returns
per iteration the losses, the gradient norm and the log of parameter-gather events, plus the bytes of
parameters, gradients and optimizer state held by this rank.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from tests import megatron_harness as h
from tests.runtime.workers import make_pipemesh

#: DDP settings of ``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather`` (with
#: ``align_param_gather``, the command line's default); a small bucket size gives chunk 0 several buckets.
DISTOPT = {"use_distributed_optimizer": True, "overlap_param_gather": True, "align_param_gather": True,
           "bucket_size": 20000}


class ParamSyncLog:
    """Records, in order, each ``PARAM_SYNC`` call, each forward and each wait on a parameter all-gather.

    Events: ``("PARAM_SYNC", c)`` when the schedule calls ``param_sync_func[c]``; ``("F", c)`` when a
    forward of chunk c starts; ``("WAIT", c)`` when a forward pre-hook waits on an all-gather of chunk c
    that is in flight; ``("UNDISPATCHED", c)`` when a pre-hook finds a bucket whose all-gather nobody
    dispatched (Megatron then dispatches it itself, synchronously: the schedule missed its sync point).
    """

    def __init__(self, model, config):
        self.events: List[tuple] = []
        funcs = config.param_sync_func
        recorded = [self._record_sync(c, f) for c, f in enumerate(funcs if isinstance(funcs, list) else [funcs])]
        config.param_sync_func = recorded if isinstance(funcs, list) else recorded[0]
        for c, chunk in enumerate(model):
            chunk.module.register_forward_pre_hook(lambda *_, c=c: self.events.append(("F", c)))
            for group in chunk.bucket_groups:
                group.finish_param_sync = self._record_wait(c, group, group.finish_param_sync)

    def _record_sync(self, chunk, func):
        def call(*args, **kwargs):
            self.events.append(("PARAM_SYNC", chunk))
            return func(*args, **kwargs)
        return call

    def _record_wait(self, chunk, group, func):
        def call(*args, **kwargs):
            if not group.param_gather_dispatched:
                self.events.append(("UNDISPATCHED", chunk))
            elif group.param_gather_handle is not None:
                self.events.append(("WAIT", chunk))
            return func(*args, **kwargs)
        return call

    def take(self) -> List[tuple]:
        events, self.events = self.events, []
        return events


def _storage_bytes(tensors, seen: set) -> int:
    """Bytes of the distinct storages behind ``tensors`` not yet in ``seen`` (views count once)."""
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def state_bytes(model, optimizer) -> Dict[str, int]:
    """Bytes this rank holds for parameters, gradients (``main_grad`` buffers) and optimizer state.

    Distinct storages are counted once: parameters that are views of one DDP buffer count as the buffer;
    the distributed optimizer's fp32 shards are views of the parameters and add nothing; optimizer
    state counts every state tensor (Adam's moments and step).
    """
    import torch

    seen: set = set()
    params = [p for chunk in model for p in chunk.parameters()]
    out = {"params": _storage_bytes(params, seen),
           "grads": _storage_bytes([p.main_grad for p in params if getattr(p, "main_grad", None) is not None], seen)}
    states = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            states.append(group["params"])
        states.append([v for state in opt.optimizer.state.values() for v in state.values() if torch.is_tensor(v)])
    out["optimizer"] = sum(_storage_bytes(ts, seen) for ts in states)
    return out


def _replica_iterators(spec, microbatches: int, chunks: int, iteration: int):
    """Micro-batches of this data-parallel replica for ``iteration`` (distinct per replica and iteration)."""
    from megatron.core import parallel_state

    replica = parallel_state.get_data_parallel_rank()
    return [iter([h.make_batch(spec, iteration * microbatches + j, replica) for j in range(microbatches)])
            for _ in range(chunks)]


def train_runs(runs: Dict[str, Dict[str, Any]], pp: int = 2, vp: Optional[int] = 2, dp: int = 2,
               microbatches: int = 8, iterations: int = 3, num_layers: Optional[int] = None) -> Dict[str, Any]:
    """Each run: ``{"schedule": "stock" | [forward groups, backward groups] | None (PipeMesh depth-first),
    "distopt": bool}``; the model is rebuilt from the same weights for every run. Returns per run the
    losses, grad norms and gather events of every iteration, the state bytes after the first step, and
    for PipeMesh runs this rank's planned program."""
    h.init_parallel(pp=pp, vp=vp, dp=dp)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_pipemesh.schedule.lower import LoweringOptions

    spec = h.TinyGPT(num_layers=num_layers or pp * (vp or 1))
    results = {}
    for name, run in runs.items():
        config = h.make_config(spec)
        model = h.build_model(spec, config=config, wrap_ddp=True, overlap_grad_reduce=True,
                              ddp_options=DISTOPT if run["distopt"] else None)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0,
                            use_distributed_optimizer=run["distopt"], overlap_param_gather=run["distopt"]),
            model)
        log = ParamSyncLog(model, config) if run["distopt"] else None
        schedule = run["schedule"]
        fb = get_forward_backward_func() if schedule == "stock" else make_pipemesh(*(schedule or (None, None)))
        out: Dict[str, Any] = {"losses": [], "grad_norms": [], "events": []}
        for iteration in range(iterations):
            result = h.run_schedule(fb, model, spec, microbatches,
                                    data_iterators=_replica_iterators(spec, microbatches, len(model), iteration))
            _, grad_norm, _ = optimizer.step()
            out["losses"].append(result["losses"])
            out["grad_norms"].append(float(grad_norm))
            out["events"].append(log.take() if log else [])
            if iteration == 0:
                out["bytes"] = state_bytes(model, optimizer)
        if schedule != "stock":
            plan = fb.lowered(fb.plan.config_for(pp, vp, microbatches), LoweringOptions(param_sync=run["distopt"]))
            out["program"] = [(op.kind.value, op.chunk) for op in plan.programs[result["pp_rank"]]]
        out["pp_rank"], out["buckets"] = result["pp_rank"], [len(chunk.bucket_groups) for chunk in model]
        results[name] = out
    return results


def expected_events(program: List[tuple], buckets: List[int]) -> List[tuple]:
    """The gather events a rank must log for one iteration of ``program`` [(op kind, chunk)]: each
    ``PARAM_SYNC c`` where the plan puts it, each forward, and a wait on each of chunk c's buckets
    during its first forward."""
    events, started = [], set()
    for kind, chunk in program:
        if kind == "PARAM_SYNC":
            events.append(("PARAM_SYNC", chunk))
        elif kind == "F":
            events.append(("F", chunk))
            if chunk not in started:
                started.add(chunk)
                events.extend([("WAIT", chunk)] * buckets[chunk])
    return events

