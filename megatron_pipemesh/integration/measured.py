"""Measured costs inside training: re-plan ``--forward-groups auto`` from the first iterations.

With ``--pipemesh-measure-iters N`` the run starts on the analytic plan, times its first N
training iterations (per-op compute from the runtime's timers, plus short transfer and
all-reduce benchmarks on the real groups), prints what it measured, saves it to
``--pipemesh-profile`` (if given) and switches to the plan the measured costs give. A later run
with an existing ``--pipemesh-profile`` file plans from it at start-up and measures nothing.

When the ``auto`` budget was read from the device (no ``--pipemesh-memory-budget-gb``), the same
wrapper makes the ranks agree on the minimum free memory over all ranks at the first call; likewise
for the inputs of ``--pipemesh-activation-placement auto`` that each rank found itself (the host link
measured at start-up, the machine's host memory share): all ranks re-plan with the minimum of each.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from ..planning.clusters import MEASURED_TIME_FIELDS
from ..planning.costs import ClusterSpec, ModelSpec
from ..planning.planner import NoFeasiblePlan
from ..planning.profile import Profile, ProfileError, load, shape_of
from ..planning.request import PlanRequest
from ..planning.resolve import Resolution, resolve
from ..schedule.plan import RunPlan
from .host_memory import HostShare, check_plan_fits_host

TIME_FIELDS = MEASURED_TIME_FIELDS
"""The per-op times a profile file holds."""


def load_profile(path: str) -> Profile:
    """The profile at ``path``: written by ``pipemesh profile`` (per-layer measurements), by a run's
    ``--pipemesh-measure-iters`` (:attr:`~..planning.profile.Profile.run_times`), or an older run's flat per-op times;
    :class:`~..planning.profile.ProfileError` (a ValueError) naming what is wrong."""
    try:
        return load(path)
    except ProfileError as error:
        raise ProfileError(f"--pipemesh-profile: {error}") from error


def save_run_times(path: str, measured: Dict[str, float], model: ModelSpec, dtype: str, device_kind: str) -> None:
    """Write a run's measured per-op times to ``path`` in the profile format, keeping the per-layer measurements of a
    profile already there (``pipemesh profile`` of the same command)."""
    import os

    profile = Profile(device_kind=device_kind, shape=shape_of(model, dtype),
                      notes=("per-op times of a training run (--pipemesh-measure-iters)",))
    if os.path.exists(path):
        try:
            profile = load(path)
        except ProfileError:
            pass  # unreadable: replaced by this run's times
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(dataclasses.replace(profile, run_times=dict(measured)).to_json())


@dataclass(frozen=True)
class Replanning:
    """What the measured re-planner needs to plan again inside training (see :class:`MeasuredReplanner`): the run's
    request, and which of its inputs the ranks agree on or measure."""

    request: PlanRequest
    """The start-up request (model, cluster, budget and placement options as this rank found them)."""
    measure_iters: int = 0
    """Training calls timed before re-planning from measured costs (0: none)."""
    profile_path: Optional[str] = None
    """Where the measured costs are saved (--pipemesh-profile)."""
    agree_on_budget: bool = False
    """The budget was read from this rank's free memory: re-plan for the minimum over ranks."""
    agree_on_host: bool = False
    """The host link or host budget was found by this rank: re-plan with the minimum over ranks."""
    agree_on_rate: bool = False
    """The device rate was measured by this rank (its CPU's matmul rate): re-plan with the slowest over ranks."""
    host_fit: Optional[HostShare] = None
    """This rank's share of its node's host memory, where a plan made elsewhere (``--pipemesh-plan``) places
    activations on the host: at the first call, before any pinned block is allocated, every rank checks the plan
    against the smallest share over the ranks, so that all refuse together or none does (a refusal decided by each
    rank's own reading would let some exit while the rest wait for them in a collective)."""

    @property
    def model(self) -> ModelSpec:
        return self.request.model

    @property
    def cluster(self) -> ClusterSpec:
        return self.request.cluster


class MeasuredReplanner:
    """Callable wrapper around the PipeMesh schedule that re-plans from facts only known in training.

    * ``agree_on_budget``: the start-up plan used this rank's free device memory, which differs between
      ranks; at the first call (reached by every rank, with process groups) the ranks exchange their
      budgets and, if they differ, all re-plan for the minimum, so ranks near a threshold agree instead
      of failing the plan-digest check.
    * ``agree_on_host``: the same for the host-link bandwidth and host memory budget of 'auto' activation
      placement (measured or read per rank).
    * ``host_fit``: a plan file's host placement against the smallest host share over the ranks (all refuse
      together, before the first call allocates its pinned blocks).
    * ``measure_iters`` > 0: after that many training calls, re-plan once from measured costs.

    Each re-plan resolves the start-up request with what the ranks agreed on or measured
    (:func:`..planning.resolve.resolve`), so the new plan keeps its lowering settings.
    """

    def __init__(self, schedule, make_schedule: Callable[[RunPlan], object], base: RunPlan, inputs: Replanning):
        # make_schedule(plan) -> a PipeMeshSchedule running ``plan``; ``base``: the start-up plan (running now).
        self.schedule, self.make_schedule, self.base = schedule, make_schedule, base
        self.inputs = inputs
        self.request = inputs.request
        self.agree_on_budget, self.agree_on_host, self.agree_on_rate = (inputs.agree_on_budget, inputs.agree_on_host,
                                                                        inputs.agree_on_rate)
        self.host_fit = inputs.host_fit
        self.history: List = []

    @property
    def cluster(self) -> ClusterSpec:
        return self.request.cluster

    @property
    def budget_bytes(self) -> float:
        return self.request.budget_bytes

    def _switch_to(self, resolution: Resolution) -> None:
        """Run the resolved plan from the next call on (the new schedule continues the old one's transfer tags)."""
        self.schedule = self.make_schedule(resolution.plan).continue_from(self.schedule)

    @property
    def options(self):
        return self.schedule.options

    @property
    def last_stats(self):
        return self.schedule.last_stats

    def __call__(self, **kwargs):
        if self.agree_on_budget:
            self.agree_on_budget = False
            self._agree_on_budget()
        if self.agree_on_host:
            self.agree_on_host = False
            self._agree_on_host()
        if self.agree_on_rate:
            self.agree_on_rate = False
            self._agree_on_rate()
        if self.host_fit is not None:
            self._check_host_fit()
        result = self.schedule(**kwargs)
        measure_iters = self.inputs.measure_iters
        if measure_iters and not kwargs.get("forward_only") and len(self.history) < measure_iters:
            self.history.append(self.schedule.last_stats)
            if len(self.history) >= measure_iters:
                self._replan(kwargs)
        return result

    def _agree_on_budget(self) -> None:
        import torch.distributed as dist

        budgets: List[Optional[float]] = [None] * dist.get_world_size()
        dist.all_gather_object(budgets, float(self.budget_bytes))
        low, high = min(budgets), max(budgets)
        if low == high:
            return
        rank0 = dist.get_rank() == 0
        try:
            best = self._plan(budget_bytes=low)
        except NoFeasiblePlan as error:
            raise NoFeasiblePlan(f"--forward-groups auto: the smallest free-memory budget over all ranks "
                                 f"({low / 2**30:.2f} GiB, rank {budgets.index(low)}) admits no plan: {error}. Free "
                                 "memory on that device or give --pipemesh-memory-budget-gb") from error
        self._switch_to(best)
        if rank0:
            print(f"PipeMesh plan (auto, budget = minimum free memory over ranks {low / 2**30:.2f} GiB; ranks ranged "
                  f"up to {high / 2**30:.2f} GiB): {best.chosen.summary()}", flush=True)

    def _plan(self, **changes) -> Resolution:
        """The start-up request resolved again with ``changes`` (agreed inputs, measured times), which it keeps."""
        self.request = dataclasses.replace(self.request, **changes)
        return resolve(self.request)

    def _agree_on_host(self) -> None:
        """All ranks re-plan with the slowest host link and the smallest host budget when they differ."""
        import torch.distributed as dist

        mine = (self.cluster.host_link_gbps, self.request.planner.host_budget_bytes)
        found: List = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
        links = [f[0] for f in found if f[0] is not None]
        budgets = [f[1] for f in found if f[1] is not None]
        agreed = (min(links) if links else None, min(budgets) if budgets else None)
        if all(tuple(f) == agreed for f in found):
            return
        best = self._plan(cluster=dataclasses.replace(self.cluster, host_link_gbps=agreed[0]),
                          planner=dataclasses.replace(self.request.planner, host_budget_bytes=agreed[1]))
        self._switch_to(best)
        if dist.get_rank() == 0:
            host = "unlimited" if agreed[1] is None else f"{agreed[1] / 2**30:.1f} GiB"
            print(f"PipeMesh plan (auto, host link {agreed[0]} Gbit/s and host memory {host} per rank = the minimum "
                  f"over ranks): {best.chosen.summary()}", flush=True)

    def _check_host_fit(self) -> None:
        """Every rank checks the plan against the smallest host share over the ranks (raises ValueError on each)."""
        import torch.distributed as dist

        shares: List[Optional[HostShare]] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, self.host_fit)
        self.host_fit = None
        rank, smallest = min(enumerate(shares), key=lambda item: item[1].bytes)
        check_plan_fits_host(self.base, f"--pipemesh-plan {self.request.plan_file}", smallest,
                             where=f"rank {rank}'s node (the smallest share over the {len(shares)} ranks)")

    def _agree_on_rate(self) -> None:
        """All ranks re-plan with the slowest measured device rate when they differ."""
        import torch.distributed as dist

        rates: List[Optional[float]] = [None] * dist.get_world_size()
        dist.all_gather_object(rates, float(self.cluster.device_tflops))
        low, high = min(rates), max(rates)
        if low == high:
            return
        best = self._plan(cluster=dataclasses.replace(self.cluster, device_tflops=low))
        self._switch_to(best)
        if dist.get_rank() == 0:
            print(f"PipeMesh plan (auto, CPU matmul rate = the slowest over ranks {low * 1e3:.1f} GFLOP/s; ranks ranged "
                  f"up to {high * 1e3:.1f} GFLOP/s): {best.chosen.summary()}", flush=True)

    def _replan(self, kwargs) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        from ..runtime.profiler import bucket_reductions, measure_costs
        from .parallel_state import get_pipemesh_p2p_groups

        model = kwargs["model"]
        config = get_model_config(model[0])
        cp = parallel_state.get_context_parallel_world_size()
        seq = kwargs["seq_length"] // cp
        if config.sequence_parallel:
            seq //= parallel_state.get_tensor_model_parallel_world_size()
        device = next(model[0].parameters()).device
        largest = max(model, key=lambda chunk: sum(p.numel() for p in chunk.parameters()))
        chunk_params = sum(p.numel() for p in largest.parameters())
        measured = measure_costs(
            self.history[1:] or self.history, vpp=self.request.vpp, pp_group=parallel_state.get_pipeline_model_parallel_group(),
            p2p_groups=get_pipemesh_p2p_groups(), dp_group=parallel_state.get_data_parallel_group(),
            shape=(seq, kwargs["micro_batch_size"], config.hidden_size), dtype=config.pipeline_dtype, device=device,
            chunk_params=chunk_params, grad_bytes=self.request.model.grad_bytes,
            distributed_optimizer=self.cluster.distributed_optimizer,
            reductions=bucket_reductions(largest))  # the groups Megatron's bucket groups reduce on
        rank0 = dist.get_rank() == 0
        if rank0:
            print("PipeMesh measured costs (s per chunk-micro-batch): "
                  + ", ".join(f"{k} {v:.6f}" for k, v in measured.items()), flush=True)
            if self.inputs.profile_path:
                dtype = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(getattr(config, "params_dtype", None)), "fp32")
                save_run_times(self.inputs.profile_path, measured, self.request.model, dtype, device.type)
        try:
            best = self._plan(measured=measured)  # on the budget agreed on, if any
        except NoFeasiblePlan as error:
            if rank0:
                print(f"PipeMesh: keeping the analytic plan; the measured costs give no plan: {error}", flush=True)
            return
        self._switch_to(best)
        if rank0:
            print(f"PipeMesh plan (measured): {best.chosen.summary()}", flush=True)
