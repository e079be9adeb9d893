"""Worker functions for tests/runtime/test_transport.py: the executor on thread-ranks over the loopback transport
(one process) and, for comparison, on gloo ranks (one process each)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Dict, List, Optional

from tests import megatron_harness as h

FAIL_TIMEOUT_S = 1.0
"""p2p timeout of the failing runs (gloo policy: rank 0's wait for rank 1's output times out after it)."""
HOST_TIMEOUT_S = 3.0
"""Loopback host timeout of the failing runs (NCCL policy: rank 0's untimed wait fails after it)."""


def gloo_pipeline(pp: int, vp: int, microbatches: int, forward_groups: List[int], backward_groups: List[int]):
    """PipeMesh on ``pp`` gloo ranks (h.build_model's layout and weights)."""
    from tests.runtime.workers import make_pipemesh

    h.init_parallel(pp=pp, vp=vp)
    spec = h.TinyGPT(num_layers=pp * vp)
    model = h.build_model(spec)
    return h.run_schedule(make_pipemesh(forward_groups, backward_groups), model, spec, microbatches)


def _global_name(name: str, first_layer: int) -> str:
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{first_layer + int(index)}.{rest}"
    return name


def _stage_models(spec: h.TinyGPT, stages: int):
    """One one-layer GPTModel per pipeline stage, set from its parameters' global names as h.build_model sets
    them: the weights of any pp x vp layout of ``stages`` stages, built in one process."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    models = []
    for stage in range(stages):
        # No DDP wrapper, so no main_grad: the fused wgrad would have nowhere to accumulate (as h.build_model).
        config = h.make_config(spec, num_layers=1, gradient_accumulation_fusion=False)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=spec.vocab_size, max_sequence_length=spec.seq_length, pre_process=stage == 0,
                         post_process=stage == stages - 1, share_embeddings_and_output_weights=False,
                         position_embedding_type=spec.position_embedding_type)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(h._init_value(_global_name(name, stage), tuple(p.shape), spec.seed))
        models.append(model)
    return models


@contextlib.contextmanager
def _counting_dist_transfers(counts: Dict[str, int]):
    """Count calls of torch.distributed's point-to-point functions and object all-gather (the loopback runs must
    make none)."""
    import torch.distributed as dist

    names = ("isend", "irecv", "batch_isend_irecv", "all_gather_object")
    originals = {name: getattr(dist, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _loopback_run(spec, pp: int, vp: int, microbatches: int, forward_groups, backward_groups, backend: str,
                  fail: bool) -> Dict:
    """PipeMesh on ``pp`` thread-ranks over a loopback world; with ``fail``, rank 1's first forward raises, then
    each rank left with broken links calls the schedule once more."""
    from megatron.core.pipeline_parallel import schedules as mcore

    from megatron_pipemesh.runtime import PipeMeshOptions, PipeMeshSchedule
    from megatron_pipemesh.integration.cpu_compat import CudaToCpuMode, cpu_compat_active
    from megatron_pipemesh.runtime.loopback import LoopbackWorld, megatron_in_threads, run_ranks
    from megatron_pipemesh.schedule import ScheduleConfig
    from megatron_pipemesh.schedule.plan import RunPlan

    models = _stage_models(spec, pp * vp)
    world = LoopbackWorld(pp, backend, host_timeout_s=HOST_TIMEOUT_S if fail else 60.0)
    base = mcore._build_default_pg_collection()
    collection = SimpleNamespace(pp=world.pipeline_group, tp=base.tp, cp=base.cp)

    def failing_step(data_iterator, model):
        raise ValueError("injected failure in rank 1's first forward")

    def rank_main(transport):
        with CudaToCpuMode() if cpu_compat_active() else contextlib.nullcontext():  # torch modes are per thread
            return rank_calls(transport)

    def rank_calls(transport):
        rank = transport.rank()
        chunks = [models[c * pp + rank] for c in range(vp)]
        plan = RunPlan(ScheduleConfig(pp, vp, microbatches, tuple(forward_groups), tuple(backward_groups)))
        schedule = PipeMeshSchedule(plan, PipeMeshOptions(p2p_timeout_s=FAIL_TIMEOUT_S if fail else 60.0),
                                    transport=transport)

        def call():
            return schedule(forward_step_func=failing_step if fail and rank == 1 else h.forward_step_func,
                            data_iterator=h.make_data_iterators(spec, microbatches, vp, replica=0), model=chunks,
                            num_microbatches=microbatches, seq_length=spec.seq_length,
                            micro_batch_size=spec.micro_batch_size, pg_collection=collection)
        if not fail:
            return {"losses": [[float(x) for x in d["lm loss"].view(-1)] for d in call()]}
        result = {}
        shape = (spec.seq_length, spec.micro_batch_size, spec.hidden_size)
        try:
            call()
        except Exception as error:  # noqa: BLE001 - the test inspects what each rank saw
            result["error"] = f"{type(error).__name__}: {error}"
        sends = schedule.abandoned_sends
        result.update(abandoned_receives=schedule.abandoned_receives, broken_links=list(transport.broken_links),
                      abandoned_sends=len(sends), sends_in_flight=sum(not s.work.is_completed() for s in sends),
                      sends_holding_outputs=sum(tuple(s.tensor.shape) == shape for s in sends))
        if transport.broken_links:  # refused before any transfer, so no peer is needed
            try:
                call()
            except Exception as error:  # noqa: BLE001
                result["next_call"] = f"{type(error).__name__}: {error}"
        return result

    counts: Dict[str, int] = {}
    with megatron_in_threads(), _counting_dist_transfers(counts):
        results, errors = run_ranks(world, rank_main)
    out = {"ranks": [results.get(r) for r in range(pp)], "errors": {r: repr(e) for r, e in errors.items()},
           "dist_calls": counts, "waits": len(world.waits), "timed_waits": sum(1 for args in world.waits if args)}
    if not fail:
        out["grads"] = {_global_name(name, stage): None if p.grad is None else p.grad.detach().clone()
                        for stage, model in enumerate(models) for name, p in model.named_parameters()}
    return out


def loopback_runs(pp: int, vp: int, microbatches: int, forward_groups: List[int], backward_groups: List[int],
                  backends: Optional[List[str]] = None):
    """Every loopback run of the tests in one process (a world of one gloo rank for Megatron's parallel state): a
    clean run and a failing run per backend, and the whole model on Megatron's no-pipelining schedule."""
    h.init_parallel(pp=1)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec = h.TinyGPT(num_layers=pp * vp)
    runs = {}
    for backend in backends or ("gloo", "nccl"):
        for fail in (False, True):
            runs[f"{backend}{'-failing' if fail else ''}"] = _loopback_run(
                spec, pp, vp, microbatches, forward_groups, backward_groups, backend, fail)
    whole = h.build_model(spec)
    data = [iter([h.make_batch(spec, j) for j in range(microbatches)])]
    runs["reference"] = h.run_schedule(get_forward_backward_func(), whole, spec, microbatches, data_iterators=data)
    return runs
