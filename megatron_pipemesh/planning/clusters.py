"""Every :class:`.costs.ClusterSpec` the package builds, and the costs priced on one: each surface describes its
cluster in its own words, and this module is where those words become the planner's one cluster type.

* :func:`flat_cluster`: a cluster of links given per device (the ``pipemesh show/simulate/plan`` flags, and
  Megatron's args at run time with PipeMesh's cost flags);
* :func:`nic_cluster`: nodes behind one NIC each (``pipemesh plan --megatron-args`` and the study's rows);
* :func:`bench_network_cluster`: the memory-fair bench's shaped network;
* :func:`costs_for`: the planner's per-op costs of a model on a cluster for one schedule (analytic, with measured
  times where a profile has them).

Pure: no torch.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

from ..schedule.config import ScheduleConfig
from .costs import ClusterSpec, ModelSpec, OpCosts, analytic_costs, planning_levels
from .defaults import DEFAULT_HOST_LINK_GBPS, MFU
from .profile import RUN_TIME_FIELDS, Profile, apply_profile

PLANNING_CLUSTER = ClusterSpec()
"""The planning defaults of every field (the ``pipemesh`` command's defaults and examples)."""

MEASURED_TIME_FIELDS = RUN_TIME_FIELDS
"""The per-op times a measured profile (``--pipemesh-profile``) holds."""


def flat_cluster(*, tp: int, dp: int, device_tflops: float, mfu: float = MFU, dp_gbps: float, p2p_gbps: float,
                 sequence_parallel: bool = False, distributed_optimizer: bool = True,
                 host_link_gbps: Optional[float] = None, collectives: str = PLANNING_CLUSTER.collectives,
                 device_memory_gb: float = PLANNING_CLUSTER.device_memory_gb,
                 latency_us: float = PLANNING_CLUSTER.latency_us, host_copies_on_compute: bool = False,
                 devices_per_node: Optional[int] = None, overlap_grad_reduce: bool = True,
                 overlap_param_gather: bool = True, cp: int = 1, cp_comm: str = "p2p",
                 fp8_tflops: Optional[float] = None) -> ClusterSpec:
    """A cluster whose data-parallel and pipeline links are given per device (no shared NIC); ``host_link_gbps``
    None: :data:`.defaults.DEFAULT_HOST_LINK_GBPS`; ``devices_per_node`` None: the planning default (8)."""
    return ClusterSpec(tp=tp, dp=dp, device_tflops=device_tflops, mfu=mfu, device_memory_gb=device_memory_gb,
                       dp_gbps=dp_gbps, p2p_gbps=p2p_gbps, latency_us=latency_us, sequence_parallel=sequence_parallel,
                       distributed_optimizer=distributed_optimizer,
                       devices_per_node=devices_per_node or PLANNING_CLUSTER.devices_per_node,
                       host_link_gbps=DEFAULT_HOST_LINK_GBPS if host_link_gbps is None else host_link_gbps,
                       host_copies_on_compute=host_copies_on_compute, collectives=collectives,
                       overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
                       cp=cp, cp_comm=cp_comm, fp8_tflops=fp8_tflops)


def nic_cluster(*, tp: int, dp: int, devices_per_node: int, nic_gbps: float, link_gbps: float,
                intra_node_gbps: float, device_tflops: float, device_memory_gb: float, host_link_gbps: float,
                nic_via_host: bool, sequence_parallel: bool, distributed_optimizer: bool = True, mfu: float = MFU,
                latency_us: float = PLANNING_CLUSTER.latency_us, host_copies_on_compute: bool = False,
                collectives: str = PLANNING_CLUSTER.collectives, shared_cores: Optional[int] = None,
                pinned_cores: bool = False, overlap_grad_reduce: bool = True,
                overlap_param_gather: bool = True, nic_burst_bytes: float = 0.0, cp: int = 1, cp_comm: str = "p2p",
                fp8_tflops: Optional[float] = None, ep: int = 1, etp: Optional[int] = None,
                alltoall_intra_gbps: Optional[float] = None) -> ClusterSpec:
    """Nodes of ``devices_per_node`` devices behind one NIC of ``nic_gbps`` each way, shared max-min fairly by
    every transfer leaving a node; ``link_gbps``: the data-parallel and pipeline rate per device where no NIC is
    shared; ``shared_cores`` / ``pinned_cores``: every rank on one host of that many CPU cores
    (:attr:`.costs.ClusterSpec.shared_cores`: the bench's emulated nodes when its ranks outnumber the cores);
    ``nic_burst_bytes``: :attr:`.costs.ClusterSpec.nic_burst_bytes`; ``cp``, ``cp_comm``, ``fp8_tflops``, ``ep``,
    ``etp``: context parallelism, the FP8 rate and expert parallelism (:class:`.costs.ClusterSpec`)."""
    return ClusterSpec(tp=tp, dp=dp, device_tflops=device_tflops, mfu=mfu, device_memory_gb=device_memory_gb,
                       dp_gbps=link_gbps, p2p_gbps=link_gbps, latency_us=latency_us,
                       sequence_parallel=sequence_parallel, distributed_optimizer=distributed_optimizer,
                       devices_per_node=devices_per_node, nic_gbps=nic_gbps, host_link_gbps=host_link_gbps,
                       intra_node_gbps=intra_node_gbps, nic_via_host=nic_via_host,
                       host_copies_on_compute=host_copies_on_compute, collectives=collectives,
                       shared_cores=shared_cores, pinned_cores=pinned_cores,
                       overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
                       nic_burst_bytes=nic_burst_bytes, cp=cp, cp_comm=cp_comm, fp8_tflops=fp8_tflops, ep=ep, etp=etp,
                       alltoall_intra_gbps=alltoall_intra_gbps)


def bench_network_cluster(dp: int, gbps: float, per_rank: bool, collectives: str, **fields) -> ClusterSpec:
    """The memory-fair bench's network (``fields``: the rest of the cluster). ``per_rank``: every rank its own node
    whose NIC (``gbps`` each way) its pipeline sends, ring and embedding all-reduce share max-min fairly; else one
    token bucket for all: pipeline links at ``gbps``, a ring at ``gbps`` / d, each on a link of its own."""
    if per_rank:
        return ClusterSpec(dp=dp, dp_gbps=gbps, p2p_gbps=gbps, nic_gbps=gbps, devices_per_node=1,
                           collectives=collectives, **fields)
    return ClusterSpec(dp=dp, dp_gbps=gbps / dp, p2p_gbps=gbps, collectives=collectives, **fields)


def with_measured_times(costs: OpCosts, measured: Dict[str, float]) -> OpCosts:
    """Analytic memory terms, measured times (recompute cost scaled by the measured/analytic forward)."""
    scale = measured["forward_s"] / costs.forward_s if costs.forward_s else 1.0
    recompute = {level: value * scale for level, value in costs.recompute_s.items()}
    # An uneven split's stages scale the measured chunk (the slowest middle one, as the analytic chunk is the largest).
    stages = tuple(dataclasses.replace(stage, recompute_s={level: value * scale for level, value in stage.recompute_s.items()})
                   for stage in costs.stages)
    # A run's stage extras are forward times whose backward is twice them (the runtime measures forwards only).
    return dataclasses.replace(costs, recompute_s=recompute, latency_s=0.0, stages=stages,
                               first_stage_backward_extra_s=None, last_stage_backward_extra_s=None,
                               **{key: float(measured[key]) for key in MEASURED_TIME_FIELDS})


def costs_for(model: ModelSpec, cluster: ClusterSpec, config: ScheduleConfig,
              measured: Optional[Dict[str, float]] = None, profile: Optional[Profile] = None,
              levels: Optional[Sequence[str]] = None) -> OpCosts:
    """The planner's costs of ``model`` on ``cluster`` for ``config``: analytic at ``levels`` (None: the levels the
    planner chooses from), with a ``profile``'s measured layer, embedding, output, optimizer and activation costs
    (:func:`.profile.apply_profile`) and then a run's ``measured`` per-op times in place of the analytic ones when
    given."""
    costs = analytic_costs(model, cluster, config, planning_levels(model) if levels is None else levels)
    if profile is not None:
        costs = apply_profile(costs, profile, model, cluster, model.stage_layers(config.pp, config.vpp))
    return with_measured_times(costs, measured) if measured else costs
