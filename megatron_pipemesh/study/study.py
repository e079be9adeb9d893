"""``pipemesh study``: PipeMesh auto against stock Megatron's whole option set, with the simulator.

Two regimes:

* ``commodity``: small devices (24/32/40 GB), TP 1-2 without sequence parallelism and TP 2 with
  it, 6.25-50 Gbit/s per device between nodes, DP 2-8, GPT 1.3B-13B, global batch 64-512: a
  representative subset (:data:`COMMODITY`; the full cross product has thousands of rows);
* ``datacentre``: the paper-scale rows (40/80 GB A100-class devices, TP 2-8 with sequence
  parallelism, 25-100 Gbit/s).

Per row:

* ``default``: Megatron's default command (:func:`..planning.stock.default_stock`: 1F1B and interleaved with
  the default group size g = p at every V, each with the first of none, selective, full block recomputation
  of the fewest layers that fits, no offloading; the best of those), and ``ratio_to_default`` = its time /
  PipeMesh's;
* ``best_stock``: the fastest stock setting that fits the device memory (:mod:`..planning.stock`: 1F1B and
  interleaved for every V and group size, every recomputation option Megatron offers, and on Transformer
  Engine rows Megatron's fine-grained activation offloading within :data:`HOST_MEMORY_GB`, modelled at least
  as favourably as Megatron runs it: :class:`..planning.stock.StockOffload`);
* ``pipemesh_auto``: PipeMesh's planner with activation placement (groups + per chunk-micro-batch
  placement: on the device, in host memory (offloaded after the forward, reloaded before the
  backward over the row's host link, :data:`.rows.HOST_LINK_GBPS`, within :data:`HOST_MEMORY_GB`), or
  recomputed at the levels its runtime applies: selective and full) for every V, the fastest fitting plan;
* ``pipemesh_recompute_only``: the same planner with recomputation as the only memory lever
  (``--pipemesh-activation-placement recompute-only``, the previous study's ``pipemesh_auto``);
* ``limit``: the communication-free limit at the same memory: depth-first (the least activation
  memory) with free pipeline and data-parallel communication and the planner's placement (the host
  link keeps its cost), best over V;
* ``ratio_to_best_stock`` = best stock time / PipeMesh time; ``fraction_of_limit`` = limit / PipeMesh;
* commodity rows: ``advice_best_layout``, what ``pipemesh plan --megatron-args`` would advise (PipeMesh or stock
  over every TP x PP x DP of the row's GPUs, micro-batch size, V and layer split:
  :func:`..planning.advice.search_layouts`), and
  ``advice_ratio_to_default`` = ``default``'s time / its time (median, min, max in the summary);
* ``tight_bound_s``: the least iteration of any exact synchronous schedule of the layout with the same costs,
  memory ignored (:func:`..planning.bounds.iteration_lower_bound`, best over V; also ``bound``), and
  ``fraction_of_tight_bound`` = it / PipeMesh; ``tight_bound_with_memory_s``: the same bound at PipeMesh's V
  with its plan's recomputation and exposed host copies added to each rank (what memory costs PipeMesh), and
  ``fraction_of_tight_bound_with_memory`` = it / PipeMesh.

Sharding (``pipemesh study --sharding``, off by default: it multiplies PipeMesh's search by the level
tuples tried). Without it both sides run the distributed optimizer (``optim``, ZeRO-1) everywhere.
With it:

* ``best_stock`` also tries the uniform levels Megatron offers beyond the distributed optimizer:
  Megatron-FSDP's ZeRO-2 / ZeRO-3 on every chunk (``--use-megatron-fsdp --data-parallel-sharding-strategy
  optim_grads|optim_grads_params --ckpt-format fsdp_dtensor``, :func:`..planning.stock.sharding_flags`). Megatron-FSDP
  gathers every layer's parameters before each micro-batch's forward and backward and reduce-scatters after
  every backward, ``no_sync`` notwithstanding (file:line in :class:`..planning.stock.MegatronFsdpSharding`). Stock gets
  the faster of two predictions, each at least as favourable as Megatron runs it: PipeMesh's span model
  (one gather per merged group span, one reduction per backward group: fewer collectives; the whole chunk
  held during a span), or Megatron-FSDP's per-micro-batch pattern with one FSDP unit's buffers (a layer)
  and a lower bound as time (compute and the data-parallel channel perfectly overlapped). Nothing in
  megatron-core 0.19.2 rejects it with pipeline or virtual pipeline parallelism (only ``--use-torch-fsdp2``
  is, ``training/arguments.py:997-1001``); it is CUDA-only (``mcore_fsdp_adapter.py:156``).
* ``pipemesh_auto`` chooses a level per chunk jointly with groups, recomputation and activation
  placement (:func:`pipemesh_sharded`: the level tuples of :func:`..planning.sharding.candidate_levels`, scope
  data-parallel), after the unsharded plan, which is the incumbent: a tuple is planned only where a
  candidate's time without any memory lever beats it (:func:`..planning.planner.plan_schedule`'s pruning).
* ``best_stock_unsharded`` / ``pipemesh_unsharded`` and ``ratio_without_sharding`` keep the ZeRO-1 view;
  ``limit`` also gets ZeRO-3 everywhere for free (communication is free in the limit).

Both ``best_stock`` and ``pipemesh_auto`` carry ``sharding``: the level (stock) or one level per chunk.

Assumptions shared by both sides: bf16 compute, fp32 main gradients (or bf16 with
``grad_reduce_in_bf16``), distributed optimizer, dropout 0.1, seq 2048, micro-batch 1, the local
layer spec unless the row says 'te', tied embeddings (Megatron's default: the embedding's gradient all-reduce
between the first and last stage), the row's GPUs per node (8 or 1) with a NIC of that many times the
per-device rate, shared max-min fairly by the data-parallel rings, pipeline links and embedding all-reduce
that leave the node (a lone transfer gets all of it; rings and links inside a node at
:data:`.rows.INTRA_NODE_GBPS`; commodity traffic staged through each GPU's host link,
:data:`.rows.NIC_VIA_HOST`), tensor-parallel collectives exposed on the compute stream, 10% memory margin.

``headroom``: best stock over the tight bound, an upper bound on every schedule's ratio to best stock in the row.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ..planning.advice import AdviceCluster, AdviceProblem, ParallelLayout, SearchLog, candidates, search_layouts
from ..planning.bounds import bound_for, iteration_lower_bound, virtual_sizes
from ..planning.clusters import costs_for
from ..planning.costs import GB, ClusterSpec, ModelSpec, ScheduleCosts, analytic_costs
from ..planning.planner import NoFeasiblePlan, PlannerOptions, fit_with_recompute, plan_schedule
from ..planning.planner_options import structured_options
from ..planning.pool import WorkerPool, jobs_here
from ..planning.sharding import ShardingModel, ShardingSpec, candidate_levels
from ..planning.stock import STOCK_SHARDING, activation_budget, best_stock, default_stock
from ..schedule.config import ScheduleConfig
from ..schedule.levers import DEVICE, RECOMPUTE_ONLY
from ..planning.memory import MEMORY_MARGIN
from .rows import (DEVICE_TFLOPS, GPT, HOST_LINK_GBPS, INTRA_NODE_GBPS, NIC_VIA_HOST, TARGET, StudyRow, row_node,
                   row_specs)

HOST_MEMORY_GB = 48.0
"""Host memory per device for offloaded activations (GiB): an 8-GPU commodity server with 768 GiB of RAM
(e.g. AWS g5.48xlarge) has 96 GiB per GPU; half of it is left to the data loader, the OS and the rest."""


LAYER_SPECS = ("te", "local")
"""The layer specs of the study's layouts: Transformer Engine (``te``, megatron-core's default
``--transformer-impl transformer_engine``, ``transformer_config.py:1220``: flash attention, fused norms, and
the only spec on which Megatron offers fine-grained activation offloading) and Megatron's ``local`` spec
(unfused attention that keeps the s x s scores: selective recomputation frees a lot for little time)."""


def _commodity() -> Tuple[StudyRow, ...]:
    rows = []
    # (model, TP, SP, PP, DP, global batch, memory): PP is the smallest that leaves room for activations.
    layouts = [("GPT-1.3B", 1, False, 4, 4, 64, 24), ("GPT-1.3B", 1, False, 4, 8, 256, 24),
               ("GPT-2.7B", 1, False, 4, 4, 64, 24), ("GPT-2.7B", 2, False, 4, 2, 64, 24),
               ("GPT-6.7B", 1, False, 4, 2, 64, 40), ("GPT-6.7B", 2, True, 4, 4, 64, 24),
               ("GPT-13B", 2, False, 4, 2, 64, 40), ("GPT-13B", 2, True, 4, 8, 128, 32)]
    # One GPU (one TP group) per VM: data parallelism crosses the Ethernet, PipeMesh's setting. Each with
    # Megatron's default layer spec (Transformer Engine) and with the local spec.
    for model, tp, sp, pp, dp, batch, memory in layouts:
        for gbps in (6.25, 25.0):
            for spec in LAYER_SPECS:
                rows.append(StudyRow("commodity", model, tp, pp, dp, batch, memory, gbps, sp, layer_spec=spec,
                                     gpus_per_node=1))
    # Bandwidth ladder and a bf16 gradient reduction on one layout.
    for gbps in (10.0, 50.0):
        rows.append(StudyRow("commodity", "GPT-2.7B", 1, 4, 4, 64, 24, gbps, gpus_per_node=1))
    rows.append(StudyRow("commodity", "GPT-2.7B", 1, 4, 4, 64, 24, 6.25, grad_reduce_in_bf16=True, gpus_per_node=1))
    # Transformer Engine's flash attention keeps no s x s scores: selective recomputation frees little and
    # full recomputation is the lever, where activation placement (host memory) competes with it.
    for model, tp in (("GPT-6.7B", 1), ("GPT-13B", 2)):
        rows.append(StudyRow("commodity", model, tp, 4, 2, 64, 24, 25.0, layer_spec="te", gpus_per_node=1))
    # 8-GPU servers: rings of TP x DP <= 8 GPUs reduce over PCIe inside the server; only GPT-13B TP2 DP8
    # (16 GPUs per stage) reduces across servers.
    for model, tp, sp, pp, dp, batch, memory in (layouts[2], layouts[4], layouts[7]):
        for spec in LAYER_SPECS:
            rows.append(StudyRow("commodity", model, tp, pp, dp, batch, memory, 6.25, sp, layer_spec=spec, gpus_per_node=8))
    rows.append(StudyRow("commodity", "GPT-6.7B", 1, 4, 2, 64, 24, 25.0, layer_spec="te", gpus_per_node=8))
    return tuple(rows)


COMMODITY: Tuple[StudyRow, ...] = _commodity()
"""The commodity subset. One GPU (or TP group) per VM: 8 layouts (every model, TP 1 / 2 / 2+SP, DP 2-8,
24/32/40 GB) x 6.25 and 25 Gbit/s x both :data:`LAYER_SPECS`, plus (local spec) 10 and 50 Gbit/s and a
--grad-reduce-in-bf16 row on the GPT-2.7B layout, and GPT-6.7B TP1 / GPT-13B TP2 on 24 GB with Transformer
Engine at 25 Gbit/s. 8-GPU servers: three layouts at 6.25 Gbit/s with both specs and the GPT-6.7B
Transformer Engine row on 24 GB. ``pipemesh headroom``
sweeps the whole cross product for the bound on any schedule's gain."""

DATACENTRE: Tuple[StudyRow, ...] = (
    StudyRow("datacentre", "GPT-7B", 2, 4, 2, 64, 40, 25.0, True),
    StudyRow("datacentre", "GPT-13B", 4, 4, 2, 64, 40, 50.0, True),
    StudyRow("datacentre", "GPT-30B", 8, 4, 2, 64, 80, 100.0, True),
)
"""The paper-scale rows (32 micro-batches per replica, TP + sequence parallelism)."""


def _planner_options(pp: int, microbatches: int, placement: str = RECOMPUTE_ONLY) -> PlannerOptions:
    """The structured group family (first forward group and last backward group at multiples of p
    and m, depth-first in between, plus every stock group size): the exhaustive search over all
    group lists gains little and costs minutes per row. ``placement``: the activation placement mode."""
    return structured_options(pp, microbatches, placement, HOST_MEMORY_GB * GB if placement == "auto" else None)


def _costs_for(model: ModelSpec, cluster: ClusterSpec):
    """PipeMesh's analytic costs of a schedule, with every level its planner may choose."""
    return lambda config: costs_for(model, cluster, config)


def pipemesh_auto(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int, budget: float,
                  incumbent_s: float = float("inf"), placement: str = RECOMPUTE_ONLY):
    """PipeMesh's best plan over V with the ``placement`` mode (None if nothing fits or nothing beats
    ``incumbent_s``)."""
    best = None
    for vpp in sorted(virtual_sizes(model, pp), reverse=True):  # larger V first: usually faster, prunes more
        bound = best.result.iteration_s if best else incumbent_s
        try:
            plan, _ = plan_schedule(pp, vpp, microbatches, _costs_for(model, cluster), budget,
                                    _planner_options(pp, microbatches, placement), incumbent_s=bound)
        except NoFeasiblePlan:
            continue
        if best is None or plan.result.iteration_s < best.result.iteration_s:
            best = plan
    return best


def pipemesh_sharded(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int, budget: float,
                     incumbent_s: float = float("inf"), placement: str = "auto", scope: str = "data-parallel"):
    """PipeMesh's best plan with mixed sharding: for every V (larger first) and every level tuple of
    :func:`..planning.sharding.candidate_levels` but ZeRO-1 everywhere (the unsharded plan, whose time is
    ``incumbent_s``), groups, recomputation and placement planned with the tuple's collectives and
    memory; a tuple whose candidates are all slower than the incumbent without any memory lever is
    skipped after those bare simulations. None if nothing beats ``incumbent_s``."""
    best = None
    for vpp in sorted(virtual_sizes(model, pp), reverse=True):
        for levels in candidate_levels(vpp):
            if set(levels) == {"optim"}:
                continue
            sharding = ShardingModel(model, cluster, ShardingSpec(levels, scope))
            bound = best.result.iteration_s if best else incumbent_s
            try:
                plan, _ = plan_schedule(pp, vpp, microbatches, _costs_for(model, cluster), budget,
                                        _planner_options(pp, microbatches, placement), incumbent_s=bound,
                                        sharding=sharding)
            except NoFeasiblePlan:
                continue
            if plan.result.iteration_s < bound:
                best = plan
    return best


FREE_GBPS = 1e9
"""A data-parallel link so fast that the limit's sharding collectives cost nothing (Gbit/s)."""


def communication_free_limit(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int,
                             budget: float, sharding: bool = False) -> Optional[float]:
    """Depth-first with free communication and the planner's recomputation, best over V; with
    ``sharding`` also ZeRO-3 everywhere (free in the limit: it only frees memory)."""
    times = []
    free_cluster = dataclasses.replace(cluster, dp_gbps=FREE_GBPS, nic_gbps=None)
    for vpp in virtual_sizes(model, pp):
        config = ScheduleConfig.depth_first(pp, vpp, microbatches)
        free = dataclasses.replace(_costs_for(model, cluster)(config), p2p_s=0.0, dp_reduce_s=0.0, dp_gather_s=0.0,
                                   latency_s=0.0, first_stage_dp_s=0.0, last_stage_dp_s=0.0, embedding_allreduce_s=0.0)
        shardings = [None]
        if sharding:
            shardings.append(ShardingModel(model, free_cluster, ShardingSpec(("optim_grads_params",) * vpp)))
        for shard in shardings:
            plan = fit_with_recompute(config, free, budget, _planner_options(pp, microbatches, "auto"), shard)
            if plan.fits:
                times.append(plan.result.iteration_s)
    return min(times) if times else None


def run_row(row: StudyRow, sharding: bool = False) -> dict:
    """One row of the study; ``sharding``: stock's uniform levels and PipeMesh's mixed levels too."""
    row_started = time.process_time()
    model, cluster = row_specs(row)
    budget = row.memory_gb * GB * (1 - MEMORY_MARGIN)
    m = row.microbatches
    stock_budget = activation_budget(model, cluster, row.pp, budget)
    host = HOST_MEMORY_GB * GB
    stock = best_stock(model, cluster, row.pp, m, stock_budget, row.grad_reduce_in_bf16, ("optim",), host)
    alone = pipemesh_auto(model, cluster, row.pp, m, budget)
    # Placement adds levers to recomputation: the recompute-only plan is one of its plans, so only
    # candidates that may beat it are searched again.
    placed = pipemesh_auto(model, cluster, row.pp, m, budget, alone.result.iteration_s if alone else float("inf"), "auto")
    plan = placed if placed is not None and (alone is None or placed.result.iteration_s < alone.result.iteration_s) else alone
    out = {"regime": row.regime, "setting": row.describe(), "gpus_per_node": row.gpus_per_node, "model": row.model, "tp": row.tp,
           "sequence_parallel": row.sequence_parallel, "layer_spec": row.layer_spec, "pp": row.pp, "dp": row.dp, "microbatches": m,
           "global_batch": row.global_batch, "memory_gb": row.memory_gb, "gbps": row.gbps,
           "grad_reduce_in_bf16": row.grad_reduce_in_bf16}
    out["host_link_gbps"], out["host_memory_gb"] = cluster.host_link_gbps, HOST_MEMORY_GB
    out["pipemesh_recompute_only"] = _plan_row(alone)
    out["placement_speedup"] = alone.result.iteration_s / plan.result.iteration_s if (plan and alone) else None
    unsharded = plan
    if sharding:
        # Stock's uniform levels beyond ZeRO-1, and PipeMesh's mixed levels against the unsharded plan.
        out["best_stock_unsharded"] = _stock_row(stock)
        out["pipemesh_unsharded"] = _plan_row(plan)
        out["ratio_without_sharding"] = _ratio(stock, plan)
        stock = best_stock(model, cluster, row.pp, m, stock_budget, row.grad_reduce_in_bf16, STOCK_SHARDING, host)
        mixed = pipemesh_sharded(model, cluster, row.pp, m, budget, plan.result.iteration_s if plan else float("inf"))
        plan = mixed or plan
    limit = communication_free_limit(model, cluster, row.pp, m, budget, sharding)
    bound = iteration_lower_bound(model, cluster, row.pp, m)
    default = default_stock(model, cluster, row.pp, m, stock_budget, row.grad_reduce_in_bf16)
    out["bound"] = bound.to_dict()
    out["headroom"] = stock.iteration_s / bound.seconds if stock else None
    out["default"] = _stock_row(default)
    out["best_stock"] = _stock_row(stock)
    out["pipemesh_auto"] = _plan_row(plan)
    out["limit_iteration_s"] = limit
    pm = plan.result.iteration_s if plan else None
    out["ratio_to_default"] = _ratio(default, plan)
    out["ratio_to_best_stock"] = _ratio(stock, plan)
    out["fraction_of_limit"] = limit / pm if (pm and limit) else None
    if row.regime == "commodity":  # what `pipemesh plan --megatron-args` would advise instead of Megatron's default
        started = time.process_time()  # CPU seconds: what the row costs, however loaded the machine
        best_layout = advice_best_layout(row, model, cluster, unsharded)
        out["advice_best_layout"] = best_layout
        out["advice_ratio_to_default"] = (default.iteration_s / best_layout["iteration_s"]
                                          if (default and best_layout) else None)
        out["advice_cpu_s"] = time.process_time() - started
    out["tight_bound_s"] = bound.seconds
    out["fraction_of_tight_bound"] = bound.seconds / pm if pm else None
    with_memory = memory_bound(model, cluster, plan) if plan else None
    out["tight_bound_with_memory_s"] = with_memory
    out["fraction_of_tight_bound_with_memory"] = with_memory / pm if pm else None
    out["row_cpu_s"] = time.process_time() - row_started
    return out


ADVICE_CANDIDATES = 1
"""(layout, micro-batch size, V, split) candidates the study's advice simulates at most per row and side (PipeMesh,
stock), the least bound first: each costs
seconds (1.3B) to half a minute (13B at PP16 and 64 micro-batches), the bound leaves dozens below the incumbent on
the large rows, and the commodity study must stay within 20 minutes with two jobs (with 3, the GPT-13B TP2 40 GB row's
advice took 87 CPU-seconds, its whole row 123). The least-bound candidate was the full search's best on the GPT-1.3B
row and 2.4% slower than it on the GPT-13B row. The best layout found is a real plan, so the ratio is a floor of the
full search's (``advice_complete`` says whether the search ended by the bound)."""


def advice_cluster(row: StudyRow) -> AdviceCluster:
    """The cluster of ``row`` as ``pipemesh plan --megatron-args`` describes one, from the row's own words (the
    assumptions :func:`.rows.row_specs` prices): its nodes (a TP group never spans one), their NIC, the row's device,
    host memory and links."""
    node = row_node(row)
    return AdviceCluster(nodes=row.tp * row.pp * row.dp // node, gpus_per_node=node, nic_gbps=node * row.gbps,
                         intra_node_gbps=INTRA_NODE_GBPS[row.regime], device_memory_gb=row.memory_gb,
                         device_tflops=DEVICE_TFLOPS.get(int(row.memory_gb), 312.0), host_memory_gb=HOST_MEMORY_GB,
                         host_link_gbps=HOST_LINK_GBPS.get(int(row.memory_gb), 100.0),
                         nic_via_host=row.regime in NIC_VIA_HOST)


def advice_best_layout(row: StudyRow, model: ModelSpec, cluster: ClusterSpec, plan) -> Optional[dict]:
    """What the advice (``pipemesh plan --megatron-args``) finds for ``row``'s GPUs: the faster of PipeMesh's and
    stock's best over every TP x PP x DP (PP = 1 for stock), micro-batch size, V and layer split
    (:func:`..planning.advice.search_layouts`), PipeMesh started from ``plan``, its plan for the row's own layout
    (an even split at the row's micro-batch size, so one of the candidates): only a candidate whose bound is below a
    side's best time is simulated for it, :data:`ADVICE_CANDIDATES` at most per side. None if nothing fits anywhere."""
    problem = AdviceProblem(model, ParallelLayout(row.tp, row.pp, row.dp), plan.config.vpp if plan else 1,
                            row.global_batch, None, sequence_parallel=row.sequence_parallel, distributed_optimizer=True,
                            grad_reduce_in_bf16=row.grad_reduce_in_bf16)
    advice = advice_cluster(row)
    log = SearchLog()
    found = search_layouts(problem, advice, candidates(problem, advice),
                           pm_incumbent_s=plan.result.iteration_s if plan else float("inf"), log=log,
                           max_simulated=ADVICE_CANDIDATES)
    complete = {"advice_simulated": log.simulated["pipemesh"] + log.simulated["stock"],
                "advice_complete": log.stopped_by is None}
    rows = [found_row for found_row in found if found_row is not None and found_row.fits]
    best = min(rows, key=lambda found_row: found_row.iteration_s) if rows else None
    if best is not None and (plan is None or best.iteration_s < plan.result.iteration_s):
        return {**complete, "kind": "stock" if best.stock is not None else "pipemesh",
                "layout": best.layout.describe(), "tp": best.layout.tp, "pp": best.layout.pp, "dp": best.layout.dp,
                "vpp": best.vpp, "micro_batch_size": best.micro_batch_size or model.micro_batch_size,
                "stage_layers": list(best.stage_layers), "describe": best.describe(), "iteration_s": best.iteration_s}
    if plan is None:
        return None
    return {**complete, "kind": "pipemesh", "layout": problem.layout.describe(), "tp": row.tp, "pp": row.pp,
            "dp": row.dp, "vpp": plan.config.vpp, "micro_batch_size": model.micro_batch_size,
            "stage_layers": list(model.stage_layers(row.pp, plan.config.vpp)),
            "describe": f"the row's layout: {plan.config.group_flags()}", "iteration_s": plan.result.iteration_s}


def memory_bound(model: ModelSpec, cluster: ClusterSpec, plan) -> float:
    """The tight bound at ``plan``'s V with its recomputation and exposed host copies added per rank: the limit
    of any schedule that paid what this plan pays for memory."""
    config = plan.config
    costs = ScheduleCosts(config, analytic_costs(model, cluster, config, levels=(DEVICE,)))
    extra = [r.recompute_s + r.exposed_host_s for r in plan.result.ranks]
    return bound_for(config, costs, extra).seconds


def _ratio(stock, plan) -> Optional[float]:
    return stock.iteration_s / plan.result.iteration_s if (stock and plan) else None


def _stock_row(stock) -> Optional[dict]:
    """The study's view of a stock result: schedule, V, g, recomputation, sharding level (and, for ZeRO-2/3,
    which prediction of :class:`..planning.stock.MegatronFsdpSharding` gave it), flags, time."""
    if stock is None:
        return None
    setting = stock.setting
    return {"schedule": setting.schedule, "vpp": setting.vpp, "group_size": setting.effective_group_size,
            "recompute": setting.recompute.describe(), "sharding": setting.sharding, "fsdp_model": stock.fsdp_model,
            "offload_fraction": setting.offload.fraction if setting.offload else None,
            "flags": setting.flags(), "iteration_s": stock.iteration_s}


def _plan_row(plan) -> Optional[dict]:
    """The study's view of a plan: V, groups, recomputation and host placement, sharding levels, time."""
    if plan is None:
        return None
    d = plan.to_dict()
    return {"vpp": plan.config.vpp, "forward_groups": d["forward_groups"], "backward_groups": d["backward_groups"],
            "recompute_share": plan.recompute_share, "recompute_counts": d["recompute_counts"],
            "host_counts": [c["host"] for c in d["placement_counts"]], "peak_host_gb": d["peak_host_gb"],
            "exposed_host_s": plan.result.exposed_host_s,
            "sharding": d.get("sharding", ["optim"] * plan.config.vpp), "iteration_s": plan.result.iteration_s}


def run_study(rows: Sequence[StudyRow] = COMMODITY + DATACENTRE, sharding: bool = False, jobs: int = 1) -> List[dict]:
    """:func:`run_row` of every row, in order (``jobs`` worker processes, :class:`..planning.pool.WorkerPool`; the rows
    are independent, and each row's advice searches inside its row's worker)."""
    jobs = jobs_here(jobs)
    if jobs <= 1 or len(rows) <= 1:
        return [run_row(row, sharding) for row in rows]

    # Longest first, so that no worker is left with a long row while the others are idle: a row's search
    # grows with its micro-batches and its model (32 micro-batches cost 24-450 CPU-s a row, 16 at most 25).
    def size(row: StudyRow) -> int:
        model = GPT[row.model]
        return model.num_layers * model.layer_params()

    order = sorted(range(len(rows)), key=lambda i: (-rows[i].microbatches, -size(rows[i]), i))
    with WorkerPool(min(jobs, len(rows))) as pool:
        done = pool.map(run_row, [rows[i] for i in order], [sharding] * len(rows))
    out: List[dict] = [{}] * len(rows)
    for i, result in zip(order, done):
        out[i] = result
    return out


def _median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else math.nan


def _targets(rows: Sequence[dict]) -> Tuple[float, float, float]:
    """(share >= :data:`.rows.TARGET`, median ratio to best stock, median fraction of the limit) of ``rows``
    (each with a ratio)."""
    ratios = [r["ratio_to_best_stock"] for r in rows]
    share = sum(x >= TARGET for x in ratios) / len(ratios) if ratios else math.nan
    return share, _median(ratios), _median(r["fraction_of_limit"] for r in rows if r["fraction_of_limit"])


def summary(rows: Sequence[dict]) -> Dict[str, float]:
    """The issue's targets over the commodity rows: share >= 1.15x, minimum ratio, median fraction of limit
    (with ``--sharding`` over the sharded comparison), plus the ZeRO-1 ratio and the rows sharding changed."""
    commodity = [r for r in rows if r["regime"] == "commodity" and r["ratio_to_best_stock"]]
    ratios = [r["ratio_to_best_stock"] for r in commodity]
    every = [r["ratio_to_best_stock"] for r in rows if r["ratio_to_best_stock"]]
    speedups = [r["placement_speedup"] for r in rows if r["regime"] == "commodity" and r.get("placement_speedup")]
    share, median_ratio, median_fraction = _targets(commodity)
    return {"commodity_rows": len(commodity),
            "median_placement_speedup_commodity": _median(speedups),
            "max_placement_speedup_commodity": max(speedups) if speedups else math.nan,
            "share_at_least_1_15x": share,
            "min_ratio_all_rows": min(every) if every else math.nan,
            "median_ratio_commodity": median_ratio,
            "max_ratio_commodity": max(ratios) if ratios else math.nan,
            "median_fraction_of_limit_commodity": median_fraction,
            # No schedule can reach 1.15x best stock in a row whose headroom is below 1.15.
            "share_headroom_at_least_1_15": (sum(r.get("headroom", 0) >= TARGET for r in commodity) / len(commodity)
                                             if commodity else math.nan),
            "median_headroom_commodity": _median(r["headroom"] for r in commodity if r.get("headroom")),
            "min_ratio_commodity": min(ratios) if ratios else math.nan,
            **_against_default_and_bound(commodity, "commodity"), **_advice_summary(commodity),
            **_spec_summary(commodity), **_sharding_summary(commodity)}


def _against_default_and_bound(rows: Sequence[dict], name: str) -> Dict[str, float]:
    """Median and range of the ratio to Megatron's default command, and the median fractions of the tight bound
    (without and with PipeMesh's memory costs), over ``rows``."""
    default = [r["ratio_to_default"] for r in rows if r.get("ratio_to_default")]
    return {f"median_ratio_to_default_{name}": _median(default),
            f"min_ratio_to_default_{name}": min(default) if default else math.nan,
            f"max_ratio_to_default_{name}": max(default) if default else math.nan,
            f"median_fraction_of_tight_bound_{name}": _median(r["fraction_of_tight_bound"] for r in rows
                                                              if r.get("fraction_of_tight_bound")),
            f"median_fraction_of_tight_bound_with_memory_{name}": _median(
                r["fraction_of_tight_bound_with_memory"] for r in rows if r.get("fraction_of_tight_bound_with_memory"))}


def _advice_summary(commodity: Sequence[dict]) -> Dict[str, float]:
    """Median and range over the commodity rows of ``advice_ratio_to_default``: the advice's best row against
    Megatron's default command for the row's layout."""
    ratios = [r["advice_ratio_to_default"] for r in commodity if r.get("advice_ratio_to_default")]
    return {"median_advice_ratio_to_default_commodity": _median(ratios),
            "min_advice_ratio_to_default_commodity": min(ratios) if ratios else math.nan,
            "max_advice_ratio_to_default_commodity": max(ratios) if ratios else math.nan}


def _spec_summary(commodity: Sequence[dict]) -> Dict[str, float]:
    """Per layer spec (rows carry it since the study runs both): rows and :func:`_targets`."""
    out: Dict[str, float] = {}
    for spec in LAYER_SPECS:
        rows = [r for r in commodity if r.get("layer_spec", "local") == spec]
        if not rows:
            continue
        out[f"{spec}_rows"] = len(rows)
        (out[f"{spec}_share_at_least_1_15x"], out[f"{spec}_median_ratio"],
         out[f"{spec}_median_fraction_of_limit"]) = _targets(rows)
        out.update(_against_default_and_bound(rows, spec))
    return out


def _sharding_summary(commodity: Sequence[dict]) -> Dict[str, float]:
    """With ``--sharding``: the commodity rows' ratio without sharding, and how many rows sharding changed
    (a stock level above ZeRO-1, or a PipeMesh plan with a chunk above ZeRO-1)."""
    sharded = [r for r in commodity if "ratio_without_sharding" in r]
    if not sharded:
        return {}
    stock = sum((r["best_stock"] or {}).get("sharding") not in (None, "optim") for r in sharded)
    pipemesh = sum(any(level != "optim" for level in (r["pipemesh_auto"] or {}).get("sharding", ())) for r in sharded)
    return {"median_ratio_without_sharding_commodity": _median(r["ratio_without_sharding"] for r in sharded
                                                               if r["ratio_without_sharding"]),
            "rows_stock_sharded": stock, "rows_pipemesh_sharded": pipemesh}


def _plan_cell(pm: Optional[dict], placement: bool) -> str:
    if pm is None:
        return "OOM"
    cell = (f"V={pm['vpp']}; {' '.join(map(str, pm['forward_groups']))} / {' '.join(map(str, pm['backward_groups']))}; "
            f"recompute {100 * pm['recompute_share']:.1f}% time")
    if placement:
        hosts = pm.get("host_counts") or []
        cell += (f"; host {'/'.join(map(str, hosts))} per rank, {max(pm.get('peak_host_gb') or [0.0]):.1f} GiB"
                 if any(hosts) else "; no host")
    return cell


def levels_cell(levels) -> str:
    """Sharding levels, runs of one level written once with a count: 'optim, optim_grads x3'."""
    if not levels:
        return "n/a"
    if isinstance(levels, str):
        return levels
    runs: List[List] = []
    for level in levels:
        if runs and runs[-1][0] == level:
            runs[-1][1] += 1
        else:
            runs.append([level, 1])
    return ", ".join(level if count == 1 else f"{level} x{count}" for level, count in runs)


def _stock_cell(st: Optional[dict]) -> str:
    if st is None:
        return "OOM"
    return (f"{'1F1B' if st['vpp'] == 1 else 'V=%d g=%d' % (st['vpp'], st['group_size'])}, {st['recompute']}"
            + ("" if not st.get("offload_fraction") else f", offload x{st['offload_fraction']:g}"))


def markdown(rows: Sequence[dict]) -> str:
    sharded = any("ratio_without_sharding" in r for r in rows)
    extra = " ratio without sharding |" if sharded else ""
    auto = "PipeMesh with placement and mixed sharding" if sharded else "PipeMesh with placement"
    lines = ["| regime | setting | m | Megatron default | s | best stock | s | PipeMesh recompute-only (V; groups; "
             f"recompute) | s | {auto} (V; groups; recompute; host chunk-micro-batches) | s | placement speed-up | "
             "sharding: stock / PipeMesh | ratio to default | ratio to best stock |" + extra + " limit s | "
             "fraction of limit | tight bound s | fraction of tight bound | with PipeMesh's memory costs |",
             "|" + "---|" * (20 + sharded)]
    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    for r in rows:
        st, pm, alone, default = r["best_stock"], r["pipemesh_auto"], r.get("pipemesh_recompute_only"), r.get("default")
        shard_cell = f"{levels_cell(st and st.get('sharding'))} / {levels_cell(pm and pm.get('sharding'))}"
        without = f" {fmt(r.get('ratio_without_sharding'), '.3f')} |" if sharded else ""
        lines.append(f"| {r['regime']} | {r['setting']} | {r['microbatches']} | {_stock_cell(default)} | "
                     f"{fmt(default and default['iteration_s'], '.3f')} | {_stock_cell(st)} | "
                     f"{fmt(st and st['iteration_s'], '.3f')} | {_plan_cell(alone, False)} | "
                     f"{fmt(alone and alone['iteration_s'], '.3f')} | {_plan_cell(pm, True)} | "
                     f"{fmt(pm and pm['iteration_s'], '.3f')} | {fmt(r.get('placement_speedup'), '.3f')} | "
                     f"{shard_cell} | {fmt(r.get('ratio_to_default'), '.3f')} | {fmt(r['ratio_to_best_stock'], '.3f')} |"
                     f"{without} {fmt(r['limit_iteration_s'], '.3f')} | {fmt(r['fraction_of_limit'], '.3f')} | "
                     f"{fmt(r.get('tight_bound_s'), '.3f')} | {fmt(r.get('fraction_of_tight_bound'), '.3f')} | "
                     f"{fmt(r.get('fraction_of_tight_bound_with_memory'), '.3f')} |")
    return "\n".join(lines)


def cmd_study(args) -> int:
    """Entry point of ``pipemesh study``."""
    import json

    rows = COMMODITY + DATACENTRE
    if args.regime != "all":
        rows = tuple(r for r in rows if r.regime == args.regime)
    if args.only:
        rows = tuple(r for r in rows if args.only in r.describe())
    if args.limit:
        rows = rows[:args.limit]
    results = run_study(rows, args.sharding, jobs_here(args.jobs))
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(markdown(results))
        print()
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary(results).items()))
    return 0


def add_study_parser(sub) -> None:
    """Register ``pipemesh study`` on the CLI's subparsers."""
    study = sub.add_parser("study", help="simulated study: PipeMesh auto vs stock Megatron's whole option set")
    study.add_argument("--json", action="store_true", help="print a JSON list of rows")
    study.add_argument("--regime", choices=("all", "commodity", "datacentre"), default="all",
                       help="which rows to run (default all)")
    study.add_argument("--limit", type=int, default=0, help="run only the first N rows (0 = all)")
    study.add_argument("--only", metavar="TEXT", default="",
                       help="run only the rows whose setting contains TEXT (e.g. 'GPT-13B TP2 ' or '40GB')")
    study.add_argument("--sharding", action="store_true",
                       help="also sharding: stock with Megatron's uniform levels (distributed optimizer, Megatron-FSDP "
                            "ZeRO-2/3), PipeMesh with a level per chunk chosen with its plan (default off: ZeRO-1 on "
                            "both sides; several times slower)")
    study.add_argument("--jobs", type=int, default=0, help="rows simulated in parallel (default: one per core)")
    study.set_defaults(func=cmd_study)


if __name__ == "__main__":  # pragma: no cover
    print(markdown(run_study()))
