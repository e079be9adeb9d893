"""Measured costs inside training: re-plan ``--forward-groups auto`` from the first iterations.

With ``--pipemesh-measure-iters N`` the run starts on the analytic plan, times its first N
training iterations (per-op compute from the runtime's timers, plus short transfer and
all-reduce benchmarks on the real groups), prints what it measured, saves it to
``--pipemesh-profile`` (if given) and switches to the plan the measured costs give. A later run
with an existing ``--pipemesh-profile`` file plans from it at start-up and measures nothing.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Optional

from ..planning.costs import OpCosts
from ..planning.planner import NoFeasiblePlan, plan_schedule

TIME_FIELDS = ("forward_s", "backward_s", "first_stage_extra_s", "last_stage_extra_s", "p2p_s", "dp_reduce_s", "dp_gather_s")


def with_measured_times(costs: OpCosts, measured: Dict[str, float]) -> OpCosts:
    """Analytic memory terms, measured times (recompute cost scaled by the measured/analytic forward)."""
    scale = measured["forward_s"] / costs.forward_s if costs.forward_s else 1.0
    recompute = {level: value * scale for level, value in costs.recompute_s.items()}
    return dataclasses.replace(costs, recompute_s=recompute, latency_s=0.0,
                               **{key: float(measured[key]) for key in TIME_FIELDS})


def load_profile(path: str) -> Dict[str, float]:
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    missing = [key for key in TIME_FIELDS if key not in data]
    if missing:
        raise ValueError(f"--pipemesh-profile {path} lacks {missing}; delete it to measure again")
    return {key: float(data[key]) for key in TIME_FIELDS}


class MeasuredReplanner:
    """Callable wrapper around the PipeMesh schedule that re-plans once from measured costs."""

    def __init__(self, schedule, make_schedule, analytic_costs_for, budget_bytes: float, pp: int, vpp: int,
                 microbatches: int, measure_iters: int, profile_path: Optional[str], grad_bytes: int,
                 distributed_optimizer: bool):
        self.schedule, self.make_schedule, self.analytic_costs_for = schedule, make_schedule, analytic_costs_for
        self.budget_bytes, self.pp, self.vpp, self.microbatches = budget_bytes, pp, vpp, microbatches
        self.measure_iters, self.profile_path = measure_iters, profile_path
        self.grad_bytes, self.distributed_optimizer = grad_bytes, distributed_optimizer
        self.history: List = []
        self.measured: Optional[Dict[str, float]] = None

    @property
    def options(self):
        return self.schedule.options

    @property
    def last_stats(self):
        return self.schedule.last_stats

    def __call__(self, **kwargs):
        result = self.schedule(**kwargs)
        if not kwargs.get("forward_only") and self.measured is None:
            self.history.append(self.schedule.last_stats)
            if len(self.history) >= self.measure_iters:
                self._replan(kwargs)
        return result

    def _replan(self, kwargs) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        from ..runtime.profiler import measure_costs

        model = kwargs["model"]
        config = get_model_config(model[0])
        cp = parallel_state.get_context_parallel_world_size()
        seq = kwargs["seq_length"] // cp
        if config.sequence_parallel:
            seq //= parallel_state.get_tensor_model_parallel_world_size()
        device = next(model[0].parameters()).device
        chunk_params = max(sum(p.numel() for p in chunk.parameters()) for chunk in model)
        self.measured = measure_costs(
            self.history[1:] or self.history, vpp=self.vpp, pp_group=parallel_state.get_pipeline_model_parallel_group(),
            dp_group=parallel_state.get_data_parallel_group(), shape=(seq, kwargs["micro_batch_size"], config.hidden_size),
            dtype=config.pipeline_dtype, device=device, chunk_params=chunk_params, grad_bytes=self.grad_bytes,
            distributed_optimizer=self.distributed_optimizer)
        rank0 = dist.get_rank() == 0
        if rank0:
            print("PipeMesh measured costs (s per chunk-micro-batch): "
                  + ", ".join(f"{k} {v:.6f}" for k, v in self.measured.items()), flush=True)
            if self.profile_path:
                with open(self.profile_path, "w", encoding="utf-8") as handle:
                    json.dump(self.measured, handle, indent=1)
        try:
            best, _ = plan_schedule(self.pp, self.vpp, self.microbatches,
                                    lambda cfg: with_measured_times(self.analytic_costs_for(cfg), self.measured),
                                    self.budget_bytes)
        except NoFeasiblePlan as error:
            if rank0:
                print(f"PipeMesh: keeping the analytic plan; the measured costs give no plan: {error}", flush=True)
            return
        self.schedule = self.make_schedule(best.config, dict(best.recompute))
        if rank0:
            print(f"PipeMesh plan (measured): {best.summary()}", flush=True)
