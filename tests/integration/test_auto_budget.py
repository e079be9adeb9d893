"""--forward-groups auto with the budget read from each device: ranks agree on the minimum free memory."""
from collections import namedtuple
from types import SimpleNamespace

import pytest

from megatron_pipemesh.integration import auto_plan as auto
from megatron_pipemesh.integration.measured import MeasuredReplanner
from megatron_pipemesh.planning.costs import analytic_costs
from megatron_pipemesh.planning.planner import NoFeasiblePlan

MIB = 2 ** 20
Resolved = namedtuple("Resolved", "plan summary replan")
"""What auto_plan returns: the plan, its summary line, its re-planning inputs."""


def _args(**overrides):
    base = dict(pipemesh_device_tflops=1.0, pipemesh_memory_budget_gb=None, pipemesh_mfu=0.45, pipemesh_dp_gbps=25.0,
                pipemesh_p2p_gbps=25.0, pipemesh_profile=None, pipemesh_measure_iters=0, num_layers=8, hidden_size=256,
                num_attention_heads=4, seq_length=256, micro_batch_size=2, vocab_size=128,
                tensor_model_parallel_size=1, data_parallel_size=1, bf16=False, fp16=False)
    base.update(overrides)
    return SimpleNamespace(**base)


def _resolve(monkeypatch, free_mib):
    monkeypatch.setattr(auto, "_device_defaults", lambda args: (None, free_mib * MIB / 2 ** 30))
    return Resolved(*auto.auto_plan(_args(), 4, 2, 12))


class FakeWorld:
    """all_gather_object over ranks whose budgets are given; this process is rank ``rank``."""

    def __init__(self, monkeypatch, budgets, rank=0):
        import torch.distributed as dist

        self.budgets = budgets
        monkeypatch.setattr(dist, "get_world_size", lambda: len(budgets))
        monkeypatch.setattr(dist, "get_rank", lambda: rank)
        monkeypatch.setattr(dist, "all_gather_object", self.all_gather_object)

    def all_gather_object(self, out, value):
        out[:] = [b * MIB for b in self.budgets]


class StandInSchedule:
    """Stands in for PipeMeshSchedule; remembers which schedule it continued from."""

    def __init__(self):
        self.previous = None

    def __call__(self, **kwargs):
        return "ran"

    def continue_from(self, previous):
        self.previous = previous
        return self


def _replanner(resolved):
    made = []

    def make_schedule(plan):
        config, recompute = plan.schedule, plan.placement
        made.append((config.forward_groups, config.backward_groups, sum(1 for v in recompute.values() if v != "none")))
        return StandInSchedule()
    replanner = MeasuredReplanner(StandInSchedule(), make_schedule, resolved.plan, resolved.replan)
    return replanner, made


def test_device_budget_is_agreed_on_at_the_first_call(monkeypatch):
    """A rank that read 1000 MiB free re-plans for the 100 MiB another rank read (the plan that rank made),
    once, at the first call; an explicit --pipemesh-memory-budget-gb needs no agreement."""
    rich, poor = _resolve(monkeypatch, 1000), _resolve(monkeypatch, 100)
    assert rich.replan.agree_on_budget and (rich.plan.schedule, rich.plan.placement) != (poor.plan.schedule,
                                                                                          poor.plan.placement)
    FakeWorld(monkeypatch, [1000, 100])
    replanner, made = _replanner(rich)
    start_up = replanner.schedule
    assert replanner() == "ran" and replanner() == "ran"
    assert replanner.schedule.previous is start_up  # transfer tags continue across the swap
    assert made == [(poor.plan.schedule.forward_groups, poor.plan.schedule.backward_groups,
                     sum(1 for v in poor.plan.placement.values() if v != "none"))]
    assert replanner.budget_bytes == 100 * MIB
    explicit = Resolved(*auto.auto_plan(_args(pipemesh_memory_budget_gb=1.0), 4, 2, 12))
    assert explicit.replan is None


def test_equal_budgets_keep_the_plan(monkeypatch):
    """Ranks that read the same free memory keep their start-up plan (no re-planning)."""
    resolved = _resolve(monkeypatch, 1000)
    FakeWorld(monkeypatch, [1000, 1000, 1000])
    replanner, made = _replanner(resolved)
    replanner()
    assert made == []


def test_no_plan_for_the_minimum_names_the_rank(monkeypatch):
    """When the smallest budget admits no plan, every rank fails naming that rank and the way out."""
    resolved = _resolve(monkeypatch, 1000)
    FakeWorld(monkeypatch, [1000, 5], rank=0)
    replanner, _ = _replanner(resolved)
    with pytest.raises(NoFeasiblePlan, match=r"rank 1\).*--pipemesh-memory-budget-gb"):
        replanner()


def test_plan_prices_the_collectives_of_the_backend_megatron_uses(monkeypatch):
    """Megatron's --distributed-backend decides (gloo's reduce-scatter is an all-reduce); without it, NCCL with
    CUDA and gloo without."""
    args = _args(data_parallel_size=2, use_distributed_optimizer=True)
    monkeypatch.setattr(auto, "_on_cuda", lambda: False)
    assert auto.model_and_cluster(args, auto.DeviceRate(1.0, 1.0))[1].collectives == "gloo"
    monkeypatch.setattr(auto, "_on_cuda", lambda: True)
    assert auto.model_and_cluster(args, auto.DeviceRate(1.0, 1.0))[1].collectives == "nccl"
    assert auto.model_and_cluster(_args(distributed_backend="gloo"), auto.DeviceRate(1.0, 1.0))[1].collectives == "gloo"
    monkeypatch.setattr(auto, "_on_cuda", lambda: False)
    assert auto.model_and_cluster(_args(distributed_backend="nccl"), auto.DeviceRate(1.0, 1.0))[1].collectives == "nccl"


def test_without_a_rate_auto_plans_at_the_measured_cpu_rate_and_ranks_agree_on_the_slowest(monkeypatch):
    """No --pipemesh-device-tflops and no CUDA: the plan uses this CPU's measured matmul rate (at MFU 1, an achieved
    rate), says so, and at the first call a rank that measured a faster rate re-plans with the slowest one."""
    monkeypatch.setattr(auto, "measured_cpu_tflops", lambda: 0.04)
    monkeypatch.setattr(auto, "_device_defaults", lambda args: (None, None))
    plan, summary, replan = auto.auto_plan(_args(pipemesh_device_tflops=None, pipemesh_memory_budget_gb=1.0), 4, 2, 12)
    assert "analytic costs at a measured CPU matmul rate of 40.0 GFLOP/s" in summary
    assert replan.agree_on_rate and (replan.cluster.device_tflops, replan.cluster.mfu) == (0.04, 1.0)
    FakeWorld(monkeypatch, [1, 1])  # budgets agree
    import torch.distributed as dist
    monkeypatch.setattr(dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), [mine, mine / 100]))
    made = []

    def make_schedule(new):
        made.append(new)
        return StandInSchedule()
    replanner = MeasuredReplanner(StandInSchedule(), make_schedule, plan, replan)
    replanner()
    replanner()
    assert replanner.cluster.device_tflops == pytest.approx(0.0004) and len(made) == 1
    slow = analytic_costs(replan.model, replanner.cluster, plan.schedule)
    fast = analytic_costs(replan.model, replan.cluster, plan.schedule)
    assert slow.forward_s == pytest.approx(100 * fast.forward_s)
