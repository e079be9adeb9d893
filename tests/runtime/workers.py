"""Worker functions run on every rank by the runtime tests (through tests/megatron_harness.py)."""
from __future__ import annotations

from typing import Dict, List, Optional

from tests import megatron_harness as h


def make_pipemesh(forward_groups=None, backward_groups=None, recompute=None, sharding=(), recv_lookahead=1,
                  host_blocks=None, **options):
    """The PipeMesh schedule of these groups (None: Megatron's group size) and placement, with runtime ``options``."""
    from megatron.core import parallel_state

    from megatron_pipemesh.integration.parallel_state import get_pipemesh_p2p_groups
    from megatron_pipemesh.runtime import PipeMeshOptions, PipeMeshSchedule
    from megatron_pipemesh.schedule import ScheduleConfig
    from megatron_pipemesh.schedule.plan import RunPlan

    config = None
    if forward_groups or backward_groups:
        config = ScheduleConfig(parallel_state.get_pipeline_model_parallel_world_size(),
                                parallel_state.get_virtual_pipeline_model_parallel_world_size(),
                                sum(forward_groups or backward_groups), tuple(forward_groups or ()),
                                tuple(backward_groups or ()))
    plan = RunPlan(config, recompute or {}, tuple(sharding or ()), recv_lookahead=recv_lookahead,
                   host_blocks=host_blocks or {})
    return PipeMeshSchedule(plan, PipeMeshOptions(**options), p2p_groups=get_pipemesh_p2p_groups)


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


def stock_vs_pipemesh_split(pp: int, vp: int, microbatches: int, num_layers: int, split: Dict[str, object],
                            groups: Dict[str, Optional[List[List[int]]]]):
    """:func:`stock_vs_pipemesh` on a model whose layers Megatron places by ``split`` (TransformerConfig fields:
    ``pipeline_model_parallel_layout``, ``num_layers_in_first/last_pipeline_stage``); also returns the layers every
    chunk of this rank built (``layers``, per chunk)."""
    h.init_parallel(pp=pp, vp=vp)
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_attr_wrapped_model

    spec = h.TinyGPT(num_layers=num_layers, config_overrides=dict(split))
    model = h.build_model(spec)
    results = {"stock": h.run_schedule(get_forward_backward_func(), model, spec, microbatches)}
    for name, pair in groups.items():
        results[name] = h.run_schedule(make_pipemesh(*(pair or (None, None))), model, spec, microbatches)
    results["layers"] = [len(get_attr_wrapped_model(chunk, "decoder").layers) for chunk in model]
    return results


def single_rank_reference(num_layers: int, microbatches: int, replicas: int = 1):
    """The whole model on one rank through Megatron's no-pipelining schedule, on the micro-batches of
    ``replicas`` data-parallel replicas one after the other (what their averaged gradients must equal)."""
    h.init_parallel(pp=1)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec = h.TinyGPT(num_layers=num_layers)
    model = h.build_model(spec)
    data = [iter([h.make_batch(spec, j, k) for k in range(replicas) for j in range(microbatches)])]
    return h.run_schedule(get_forward_backward_func(), model, spec, microbatches * replicas, data_iterators=data)


def plan_mismatch():
    """Rank 0 is given other groups than rank 1: both must fail at start-up with a clear error."""
    import torch.distributed as dist

    h.init_parallel(pp=2, vp=2)
    spec = h.TinyGPT(num_layers=4)
    model = h.build_model(spec)
    groups = ([6, 2], [4, 4]) if dist.get_rank() == 0 else (None, None)
    _timed_failure(lambda: h.run_schedule(make_pipemesh(*groups), model, spec, 8))


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
    _timed_failure(lambda: schedule(forward_step_func=step, data_iterator=iterators, model=model,
                                    num_microbatches=8, seq_length=spec.seq_length,
                                    micro_batch_size=spec.micro_batch_size))


def _timed_failure(run) -> None:
    """Run the schedule; if it raises, first print how long it ran (start-up excluded) for the time bounds
    of tests/runtime/test_failures.py."""
    import time

    import torch.distributed as dist

    start = time.monotonic()
    try:
        run()
    except Exception:
        print(f"worker: rank {dist.get_rank()} failed after {time.monotonic() - start:.1f} s", flush=True)
        raise


# Recomputation and measured memory (tests/runtime/test_recompute.py, tests/planning/test_memory_model.py)
RECOMPUTE_LEVELS = ("none", "selective", "full")
PLACEMENTS = RECOMPUTE_LEVELS + ("host",)


def recompute_plan(name: str, pp: int, vp: int, microbatches: int):
    """Named placement plans keyed (pipeline rank, chunk, micro-batch) -> level; None = no plan."""
    if name in ("plain", "measured"):
        return None
    keys = [(r, c, j) for r in range(pp) for c in range(vp) for j in range(microbatches)]
    if name == "mixed":  # every level on every rank and chunk, varying with the micro-batch
        return {(r, c, j): RECOMPUTE_LEVELS[(r + c + j) % 3] for r, c, j in keys if (r + c + j) % 3}
    if name == "placed":  # every placement kind (host included) on every rank and chunk
        return {(r, c, j): PLACEMENTS[(r + c + j) % 4] for r, c, j in keys}
    if name in PLACEMENTS:
        return {key: name for key in keys}
    raise ValueError(name)


def recompute_runs(runs: List[str], pp: int = 2, vp: int = 2, microbatches: int = 8,
                   forward_groups=(6, 2), backward_groups=(4, 4), spec_kwargs: Optional[Dict] = None,
                   config_overrides: Optional[Dict] = None, failing_host_copy: bool = False):
    """PipeMesh on the same model and data for each named run: 'plain' (no recompute plan, no meter),
    'measured' (meter only), or a recompute plan name ('mixed', 'none', 'selective', 'full') with the
    meter. Returns losses, grads and the memory statistics of each run, plus the recompute switches
    after the runs (they must be restored)."""
    h.init_parallel(pp=pp, vp=vp)
    spec = h.TinyGPT(num_layers=pp * vp, **(spec_kwargs or {}))
    config = h.make_config(spec, **(config_overrides or {}))
    model = h.build_model(spec, config=config)
    results = {}
    for name in runs:
        # '<plan>-outside': no meter in the runtime; one meter around the whole call, as the bench measures.
        outside = name.endswith("-outside")
        plan = recompute_plan(name.removesuffix("-outside"), pp, vp, microbatches)
        schedule = make_pipemesh(forward_groups, backward_groups, recompute=plan,
                                 measure_memory=name != "plain" and not outside)
        if outside:
            from megatron_pipemesh.runtime.memory import SavedTensorMeter, measuring, model_tensors

            meter = SavedTensorMeter(model_tensors(model))
            with meter.record("iteration"), measuring(meter):
                result = h.run_schedule(schedule, model, spec, microbatches)
            result.update(peak=meter.peak_bytes, peak_host=meter.peak_host_bytes, offloaded=dict(meter.offloaded_bytes))
            results[name] = result
            continue
        result = h.run_schedule(schedule, model, spec, microbatches)
        stats = schedule.last_stats
        result.update(summary=stats.summary(), peak=stats.peak_activation_bytes, saved=dict(stats.saved_bytes),
                      outputs=dict(stats.output_bytes), source=stats.memory_source, plan=plan,
                      peak_host=stats.peak_host_bytes, offloaded=dict(stats.offloaded_bytes))
        results[name] = result
    if failing_host_copy:
        results["failure"] = _failing_host_copy(model, spec, pp, vp, microbatches, forward_groups, backward_groups)
    attention = [m.checkpoint_core_attention for chunk in model for m in chunk.modules()
                 if hasattr(m, "checkpoint_core_attention")]
    results["restored"] = {"granularity": config.recompute_granularity, "method": config.recompute_method,
                           "num_layers": config.recompute_num_layers, "attention": attention}
    return results


def placement_runs(runs: List[str], budget_fraction: float, failing_host_copy: bool = False):
    """One launch for tests/runtime/test_offload_ranks.py: :func:`recompute_runs` (PP=2 V=2 m=8) and
    :func:`planned_under_budget` with 'auto' activation placement at ``budget_fraction``."""
    results = recompute_runs(runs, failing_host_copy=failing_host_copy)
    results["auto_placement"] = planned_under_budget(budget_fraction, placement="auto")
    return results


def _failing_host_copy(model, spec, pp, vp, microbatches, forward_groups, backward_groups) -> str:
    """Every rank's first OFFLOAD fails (the host buffer pool raises): return the runtime's error. Every pipeline
    rank but the first starts 2 s late, so the first rank has sent its first output and failed before the
    receiver posts: the failed call's send must still arrive (a dropped gloo send work is cancelled)."""
    import time

    import torch.distributed
    from megatron_pipemesh.runtime import PipeMeshRuntimeError
    from megatron_pipemesh.runtime.offload import HostBufferPool
    from megatron.core import parallel_state as ps

    def broken(self, nbytes):
        raise MemoryError(f"cannot allocate {nbytes} bytes of host memory")

    original, HostBufferPool.acquire = HostBufferPool.acquire, broken
    try:
        # no cross-rank plan check: its all-gather would let the late rank catch up before the first send
        schedule = make_pipemesh(forward_groups, backward_groups, recompute=recompute_plan("host", pp, vp, microbatches),
                                 p2p_timeout_s=5.0, check_plan_across_ranks=False)
        if ps.get_pipeline_model_parallel_rank() > 0:
            time.sleep(2.0)
        h.run_schedule(schedule, model, spec, microbatches)
    except PipeMeshRuntimeError as error:
        return str(error)
    finally:
        HostBufferPool.acquire = original
        # the next runs re-create the process groups: wait until every rank is done with this one
        torch.distributed.barrier()
    return "no error"


def single_chunk_memory(shapes: List[Dict], dtypes: List[str]):
    """One whole-model chunk (PP=1; first and last stage), one forward+backward per level under the
    meter, for each TinyGPT shape and dtype ('fp32', 'bf16' through Megatron's Float16Module).
    Returns [(shape, dtype, level, saved bytes, loss, grads)]."""
    h.init_parallel(pp=1)
    import torch
    from megatron.core.transformer.module import Float16Module

    from megatron_pipemesh.runtime.memory import SavedTensorMeter
    from megatron_pipemesh.runtime.recompute import recompute_scope

    out = []
    for shape in shapes:
        spec = h.TinyGPT(**shape)
        for dtype in dtypes:
            overrides = {}
            if dtype == "bf16":
                overrides = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
            config = h.make_config(spec, **overrides)
            chunk = h.build_model(spec, config=config)[0]
            if dtype == "bf16":
                chunk = Float16Module(config, chunk)
            batch = h.make_batch(spec, 0)
            for level in RECOMPUTE_LEVELS:
                meter = SavedTensorMeter([*chunk.parameters(), *chunk.buffers()])
                chunk.zero_grad()
                with recompute_scope(chunk, level), meter.record("F"):
                    losses = chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                                   labels=batch["labels"])
                    loss = (losses.float() * batch["loss_mask"]).sum()  # saves the mask, like loss_func
                with recompute_scope(chunk, level):
                    loss.backward()
                meter.release("F")
                grads = {n: p.grad.detach().float().clone() for n, p in chunk.named_parameters()}
                out.append((shape, dtype, level, meter.saved_bytes["F"], float(loss), grads, meter.live_bytes))
    return out


def planned_under_budget(budget_fraction: float, pp: int = 2, vp: int = 2, microbatches: int = 8,
                         placement: str = "recompute-only"):
    """Plan groups + recomputation (``placement`` 'auto': and host placement) for a budget below the
    no-recompute peak (memory model of planning/memory.py for this model), run the plan with the meter,
    and return measured peaks and losses next to a plain run's."""
    h.init_parallel(pp=pp, vp=vp)
    from megatron_pipemesh.planning.costs import OpCosts
    from megatron_pipemesh.planning.memory import ActivationShape, chunk_bytes
    from megatron_pipemesh.planning.planner import plan_schedule

    spec = h.TinyGPT(num_layers=pp * vp)
    model = h.build_model(spec)
    plain_schedule = make_pipemesh(measure_memory=True)
    plain = h.run_schedule(plain_schedule, model, spec, microbatches)
    plain_peak = plain_schedule.last_stats.peak_activation_bytes
    shape = ActivationShape(seq_length=spec.seq_length, micro_batch_size=spec.micro_batch_size,
                            hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
                            vocab_size=spec.vocab_size, dtype_bytes=4)

    def stage_bytes(stage, level):
        return chunk_bytes(shape, spec.num_layers, pp, vp, stage % pp, stage // pp, level, keep_outputs=True)

    levels = ("none", "selective", "full")
    middle = {lv: stage_bytes(1, lv) for lv in levels}
    costs = OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0,
                    activation_bytes=middle,
                    first_stage_activation_bytes={lv: stage_bytes(0, lv) - middle[lv] for lv in levels},
                    last_stage_activation_bytes={lv: stage_bytes(pp * vp - 1, lv) - middle[lv] for lv in levels},
                    recompute_s={"none": 0.0, "selective": 0.1, "full": 1.0}, static_bytes=tuple(0.0 for _ in range(pp)))
    import torch.distributed as dist

    from megatron_pipemesh.planning.simulator import simulate
    from megatron_pipemesh.schedule.config import ScheduleConfig

    unplanned = max(r.peak_memory_bytes for r in simulate(ScheduleConfig.depth_first(pp, vp, microbatches), costs).ranks)
    budget = budget_fraction * unplanned
    from megatron_pipemesh.planning.planner import PlannerOptions

    best, _ = plan_schedule(pp, vp, microbatches, lambda cfg: costs, budget, PlannerOptions(activation_placement=placement))
    schedule = make_pipemesh(best.config.forward_groups, best.config.backward_groups,
                             recompute={k: v for k, v in best.placement.items() if v != "none"}, measure_memory=True,
                             host_blocks=best.run_plan().host_blocks)
    planned = h.run_schedule(schedule, model, spec, microbatches)
    pool = schedule._offloader.pool if schedule._offloader is not None else None
    mine = best.result.ranks[dist.get_rank() % pp]
    return {"plain": plain, "planned": planned, "budget": budget, "unplanned_model_peak": unplanned,
            "measured_peak": schedule.last_stats.peak_activation_bytes,
            "predicted_peak": mine.peak_memory_bytes, "predicted_host_peak": mine.peak_host_bytes,
            "measured_host_peak": schedule.last_stats.peak_host_bytes,
            "predicted_block_peak": mine.peak_pinned_bytes, "measured_block_peak": schedule.last_stats.peak_block_bytes,
            "plain_measured_peak": plain_peak,
            "pool": None if pool is None else {"reserved": pool.reserved, "late_allocations": pool.late_allocations,
                                               "bytes": pool.allocated_bytes},
            "recomputed": sum(1 for v in best.placement.values() if v not in ("none", "host")),
            "hosted": sum(1 for v in best.placement.values() if v == "host"),
            "groups": (best.config.forward_groups, best.config.backward_groups)}
