"""Features of Megatron's interleaved schedule that PipeMesh would ignore are refused with a clear error."""
from types import SimpleNamespace

import pytest

from megatron_pipemesh.integration.flags import PipeMeshArgumentError, check_pipemesh_args
from megatron_pipemesh.runtime.unsupported import UNSUPPORTED, check_model_config, unsupported_message
from megatron_pipemesh.runtime.executor import PipeMeshRuntimeError

ENABLED = {"cuda_graph_impl": "transformer_engine", "overlap_moe_expert_parallel_comm": True,
           "fine_grained_activation_offloading": True, "moe_paged_stash": True,
           "num_microbatches_with_partial_activation_checkpoints": 3, "variable_seq_lengths": True}
DEFAULTS = {"cuda_graph_impl": "none", "overlap_moe_expert_parallel_comm": False,
            "fine_grained_activation_offloading": False, "moe_paged_stash": False,
            "num_microbatches_with_partial_activation_checkpoints": None, "variable_seq_lengths": False}


def _args(**changes):
    base = dict(pipeline_schedule="pipemesh", forward_groups=None, backward_groups=None, pipemesh_recv_lookahead=1,
                pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, global_batch_size=16,
                micro_batch_size=2, data_parallel_size=1, distributed_timeout_minutes=10, **DEFAULTS)
    base.update(changes)
    return SimpleNamespace(**base)


def test_table_covers_every_feature_tested():
    """Each refused feature has an entry (so the parametrised cases below cover the whole table)."""
    assert {item.attribute for item in UNSUPPORTED} == set(ENABLED)


@pytest.mark.parametrize("attribute", sorted(ENABLED))
def test_each_feature_is_refused_at_validation_naming_flag_reason_and_fix(attribute):
    """check_pipemesh_args (the validation Megatron's validate_args runs) refuses the feature."""
    item = next(i for i in UNSUPPORTED if i.attribute == attribute)
    with pytest.raises(PipeMeshArgumentError) as info:
        check_pipemesh_args(_args(**{attribute: ENABLED[attribute]}))
    text = str(info.value)
    assert item.flag in text and "not supported by --pipeline-schedule pipemesh" in text and "Instead:" in text


@pytest.mark.parametrize("attribute", sorted(ENABLED))
def test_each_feature_is_refused_on_the_model_config(attribute):
    """Programs that build TransformerConfig themselves get the same refusal at the schedule's first call."""
    with pytest.raises(PipeMeshRuntimeError):
        check_model_config(SimpleNamespace(**{**DEFAULTS, attribute: ENABLED[attribute]}))


def test_defaults_and_the_default_schedule_pass():
    """Megatron's defaults are accepted; with --pipeline-schedule default nothing is refused."""
    assert unsupported_message(_args()) is None
    check_model_config(SimpleNamespace(**DEFAULTS))
    assert check_pipemesh_args(_args(pipeline_schedule="default", cuda_graph_impl="local")).enabled is False


ZERO2 = dict(pipemesh_sharding=["optim", "optim_grads"], use_distributed_optimizer=True)


def _flags_args(**changes):
    from tests.integration.test_flags import _args as flags_args
    return flags_args(**changes)


@pytest.mark.parametrize("changes, flag, lever", [
    (dict(nccl_ub=True, **ZERO2), "--use-nccl-ub", "ZeRO-2/3 chunks"),
    (dict(defer_embedding_wgrad_compute=True, pipemesh_activation_placement="auto", pipemesh_memory_budget_gb=1.0),
     "--defer-embedding-wgrad-compute", "host placement"),
])
def test_conflicting_combinations_are_refused_at_parse_time(changes, flag, lever):
    """--use-nccl-ub with ZeRO-2/3 chunks (their buffers' storage is re-allocated outside Megatron's NCCL pool) and
    --defer-embedding-wgrad-compute with host placement (the output layer's deferred inputs stay on the device):
    refused before planning, naming both sides and why."""
    with pytest.raises(PipeMeshArgumentError) as info:
        check_pipemesh_args(_flags_args(**changes))
    text = str(info.value)
    assert flag in text and lever in text and "Instead:" in text


def test_each_side_alone_is_accepted():
    """ZeRO-1 keeps its buffers whole (fine with --use-nccl-ub); without host placement the deferred wgrad is fine."""
    assert check_pipemesh_args(_flags_args(nccl_ub=True, pipemesh_sharding=["optim"], use_distributed_optimizer=True))
    assert check_pipemesh_args(_flags_args(nccl_ub=False, **ZERO2)).plan.sharding == ("optim", "optim_grads")
    assert check_pipemesh_args(_flags_args(defer_embedding_wgrad_compute=True))
    assert check_pipemesh_args(_flags_args(pipemesh_activation_placement="auto", pipemesh_memory_budget_gb=1.0))


def test_plan_files_are_checked_for_the_levers_they_hold(tmp_path):
    """A plan file decides the levers: ZeRO-2 levels in it are refused with --use-nccl-ub, host placement in it with
    --defer-embedding-wgrad-compute."""
    from megatron_pipemesh.schedule.config import ScheduleConfig
    from megatron_pipemesh.schedule.plan import RunPlan

    config = ScheduleConfig(4, 2, 12, (12,), (12,))
    sharded, placed = tmp_path / "sharded.json", tmp_path / "placed.json"
    sharded.write_text(RunPlan(config, sharding=("optim", "optim_grads")).to_json())
    placed.write_text(RunPlan(config, {(3, 1, 0): "host"}).to_json())
    with pytest.raises(PipeMeshArgumentError, match="--use-nccl-ub with ZeRO-2/3"):
        check_pipemesh_args(_flags_args(pipemesh_plan=str(sharded), nccl_ub=True, use_distributed_optimizer=True))
    with pytest.raises(PipeMeshArgumentError, match="--defer-embedding-wgrad-compute with host placement"):
        check_pipemesh_args(_flags_args(pipemesh_plan=str(placed), defer_embedding_wgrad_compute=True))
    assert check_pipemesh_args(_flags_args(pipemesh_plan=str(placed))).plan.host_placement == ((3, 1, 0),)


def test_combinations_are_refused_at_the_first_call_for_configs_built_by_code():
    """Programs that build their configs themselves: the schedule's first call refuses deferred embedding wgrad with a
    host-placing plan, and the sharding runtime refuses a ZeRO-2/3 chunk whose DDP buffers live in the NCCL pool."""
    from megatron_pipemesh.runtime.sharding import ShardingRuntime
    from megatron_pipemesh.schedule.config import ScheduleConfig
    from megatron_pipemesh.schedule.plan import RunPlan

    plan = RunPlan(ScheduleConfig(2, 2, 4, (4,), (4,)), {(1, 1, 0): "host"})
    with pytest.raises(PipeMeshRuntimeError, match="--defer-embedding-wgrad-compute with host placement"):
        check_model_config(SimpleNamespace(**DEFAULTS, defer_embedding_wgrad_compute=True), plan)
    check_model_config(SimpleNamespace(**DEFAULTS, defer_embedding_wgrad_compute=True), RunPlan())
    ddp = SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=True, nccl_ub=True))
    with pytest.raises(ValueError, match="--use-nccl-ub with ZeRO-2/3"):
        ShardingRuntime(("optim", "optim_grads_params")).program([ddp, ddp])
