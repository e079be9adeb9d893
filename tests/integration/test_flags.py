"""PipeMesh's Megatron flags: parsing and validation against Megatron-validated args (pure)."""
import argparse
from types import SimpleNamespace

import pytest

from megatron_pipemesh.integration.flags import (PipeMeshArgumentError, add_pipemesh_arguments,
                                                  check_pipemesh_args, check_sharding_args)


def _args(**overrides):
    base = dict(pipeline_schedule="pipemesh", forward_groups=None, backward_groups=None, pipemesh_recv_lookahead=1,
                pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, global_batch_size=24,
                micro_batch_size=2, data_parallel_size=1, microbatch_group_size_per_vp_stage=None,
                rampup_batch_size=None, distributed_timeout_minutes=10, pipemesh_plan=None,
                pipemesh_memory_budget_gb=None, pipemesh_device_tflops=None, pipemesh_mfu=0.45, pipemesh_dp_gbps=25.0,
                pipemesh_p2p_gbps=25.0, num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32,
                vocab_size=128, tensor_model_parallel_size=1, bf16=False, fp16=False)
    base.update(overrides)
    return SimpleNamespace(**base)


def test_parser_accepts_groups_and_auto():
    """The PipeMesh flags parse group lists and 'auto', are added once, and reject 0 and unknown schedules."""
    parser = add_pipemesh_arguments(argparse.ArgumentParser())
    add_pipemesh_arguments(parser)  # idempotent
    ns = parser.parse_args(["--pipeline-schedule", "pipemesh", "--forward-groups", "8", "4", "--backward-groups", "auto"])
    assert ns.forward_groups == [8, 4] and ns.backward_groups == ["auto"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--forward-groups", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--pipeline-schedule", "fast"])


def test_valid_elastic_groups():
    """Valid elastic groups enable PipeMesh with exactly those groups and the default 600 s timeout."""
    settings = check_pipemesh_args(_args(forward_groups=[8, 4], backward_groups=[6, 6]))
    config = settings.plan.schedule
    assert settings.enabled and config.forward_groups == (8, 4) and config.backward_groups == (6, 6)
    assert settings.timeout_s == 600


def test_default_groups_follow_megatron_group_size():
    """Without group flags the groups follow --microbatch-group-size-per-virtual-pipeline-stage."""
    from megatron_pipemesh.integration.report import training_config
    args = _args(microbatch_group_size_per_vp_stage=6)
    settings = check_pipemesh_args(args)
    assert settings.plan.schedule is None and training_config(args, settings.plan).forward_groups == (6, 6)


def test_default_schedule_untouched_and_rejects_groups():
    """--pipeline-schedule default leaves PipeMesh off and rejects group flags."""
    assert not check_pipemesh_args(_args(pipeline_schedule="default")).enabled
    with pytest.raises(PipeMeshArgumentError, match="--forward-groups given with --pipeline-schedule default"):
        check_pipemesh_args(_args(pipeline_schedule="default", forward_groups=[12]))


@pytest.mark.parametrize("overrides, needle", [
    (dict(forward_groups=[4, 4], backward_groups=[4]), "--forward-groups 4 4 is invalid: the groups sum to 8"),
    (dict(forward_groups=[8, 4], backward_groups=[4]), "--backward-groups 4 is invalid"),
    (dict(forward_groups=[10, 2], backward_groups=[6, 6]), "smaller than the pipeline size p=4"),
    (dict(forward_groups=[4, 4, 4], backward_groups=[4, 8]), "prefix sum"),
    (dict(forward_groups=["auto"]), "needs --pipemesh-memory-budget-gb"),
    (dict(forward_groups=["auto"], backward_groups=[6, 6]), "mixes 'auto' and a list"),
    (dict(forward_groups=["auto"], pipemesh_memory_budget_gb=0.001, pipemesh_device_tflops=100.0), "no schedule fits"),
    (dict(pipemesh_plan="/nonexistent/plan.json"), "cannot read the plan"),
    (dict(forward_groups=["auto", 4]), "'auto' stands alone"),
    (dict(virtual_pipeline_model_parallel_size=None), "--num-virtual-stages-per-pipeline-rank 2"),
    (dict(pipeline_model_parallel_size=1), "--pipeline-model-parallel-size 1 is invalid"),
    (dict(rampup_batch_size=[8, 8, 100], forward_groups=[12]), "--rampup-batch-size"),
])
def test_invalid_settings_name_flag_rule_and_example(overrides, needle):
    """Each invalid setting raises PipeMeshArgumentError naming the flag and rule, with a hint or example."""
    with pytest.raises(PipeMeshArgumentError) as info:
        check_pipemesh_args(_args(**overrides))
    message = str(info.value)
    assert needle in message
    assert any(hint in message for hint in ("Example", "e.g.", "Drop", "What would fit", "Create one"))


def test_error_reports_how_m_was_derived():
    """Group errors show how m was derived from the batch flags."""
    with pytest.raises(PipeMeshArgumentError, match=r"--global-batch-size 24 / \(--micro-batch-size 2 x data-parallel size 1\) = 12"):
        check_pipemesh_args(_args(forward_groups=[8, 8], backward_groups=[8, 8]))


def test_auto_runs_the_planner_within_the_budget():
    """'auto' groups run the planner; its groups sum to m and the plan summary is given."""
    settings = check_pipemesh_args(_args(forward_groups=["auto"], backward_groups=["auto"],
                                         pipemesh_memory_budget_gb=1.0, pipemesh_device_tflops=1.0))
    assert sum(settings.plan.schedule.forward_groups) == 12 and sum(settings.plan.schedule.backward_groups) == 12
    assert "PipeMesh plan (auto" in settings.summary


def test_plan_file_round_trip(tmp_path):
    """A plan saved by `pipemesh plan --output` is loaded by --pipemesh-plan, and rejected for another p, V, m."""
    import json

    from megatron_pipemesh.command import main
    path = tmp_path / "plan.json"
    assert main(["plan", "--pp", "4", "--vpp", "2", "-m", "12", "--num-layers", "8", "--hidden-size", "64",
                 "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128", "--dp", "1",
                 "--memory-budget-gb", "1", "--output", str(path)]) == 0
    data = json.loads(path.read_text())
    settings = check_pipemesh_args(_args(pipemesh_plan=str(path)))
    assert list(settings.plan.schedule.forward_groups) == data["forward_groups"]
    with pytest.raises(PipeMeshArgumentError, match="was made for p, V, m"):
        check_pipemesh_args(_args(pipemesh_plan=str(path), global_batch_size=32))


@pytest.mark.parametrize("overrides, message", [
    (dict(pipemesh_sharding=["optim", "optim", "optim"], use_distributed_optimizer=True), "one per virtual chunk"),
    (dict(pipemesh_sharding=["optim"]), "needs --use-distributed-optimizer"),
    (dict(pipemesh_sharding=["optim"], use_distributed_optimizer=True, use_megatron_fsdp=True), "one --data-parallel-sharding-strategy"),
    (dict(pipemesh_sharding=["optim", "optim_grads_params"], use_distributed_optimizer=True), "needs --overlap-param-gather"),
    (dict(pipemesh_sharding=["optim_grads"], use_distributed_optimizer=True, pipeline_schedule="default"), "needs --pipeline-schedule pipemesh"),
    (dict(pipemesh_sharding=["optim_grads"], use_distributed_optimizer=True, num_distributed_optimizer_instances=2),
     "use --pipemesh-shard-scope node"),
    (dict(pipemesh_sharding=["optim_grads"], use_distributed_optimizer=True, pipemesh_shard_scope="node",
          pipemesh_ranks_per_node=3, data_parallel_size=4, world_size=16), "split into nodes of 3"),
    (dict(pipemesh_sharding=["optim_grads"], use_distributed_optimizer=True, pipemesh_shard_scope="node",
          pipemesh_ranks_per_node=3, data_parallel_size=4, world_size=15), "multiple of the data-parallel ranks per node"),
    (dict(pipemesh_sharding=["optim_grads"], use_distributed_optimizer=True, pipemesh_shard_scope="node",
          pipemesh_ranks_per_node=6, data_parallel_size=4, world_size=24, pipeline_model_parallel_size=6),
     "cuts through the data-parallel groups"),
    (dict(pipemesh_sharding=["optim_grads"], use_distributed_optimizer=True, pipemesh_shard_scope="node",
          pipemesh_ranks_per_node=2, data_parallel_size=4, world_size=16, num_distributed_optimizer_instances=4),
     "sets it to the nodes a data-parallel group of 4 spans"),
    (dict(pipemesh_sharding=["optim_grads"], use_distributed_optimizer=True, pipemesh_shard_scope="node",
          pipemesh_ranks_per_node=2, data_parallel_size=4, world_size=16, use_tp_pp_dp_mapping=True), "--use-tp-pp-dp-mapping"),
    (dict(pipemesh_sharding=["optim_grads"], use_distributed_optimizer=True, pipemesh_shard_scope="node",
          pipemesh_ranks_per_node=0), "must be >= 1"),
    (dict(pipemesh_sharding=["optim_grads"], use_distributed_optimizer=True,
          ddp_param_name_patterns_for_fp32_local_accumulation=["*bias"]), "separate fp32 main gradients"),
    (dict(pipemesh_sharding=["optim", "optim_grads_params"], use_distributed_optimizer=True, overlap_param_gather=True,
          save="/tmp/ckpt"), "--save is not supported"),
    (dict(pipemesh_sharding=["optim", "optim_grads_params"], use_distributed_optimizer=True, overlap_param_gather=True,
          log_params_norm=True), "--log-params-norm is not supported"),
    (dict(pipemesh_sharding=["auto"], use_distributed_optimizer=True), "jointly with the groups"),
    (dict(pipemesh_shard_scope="node"), "without --pipemesh-sharding"),
])
def test_sharding_flags_are_checked_before_work(overrides, message):
    """Wrong level count, missing distributed optimizer, FSDP, unexecuted levels and a lone scope fail at parse time."""
    with pytest.raises(PipeMeshArgumentError, match=message):
        check_pipemesh_args(_args(**overrides))


def test_node_scope_becomes_megatrons_instances(monkeypatch):
    """--pipemesh-shard-scope node sets --num-distributed-optimizer-instances to the nodes a data-parallel group
    spans (in the one step after validation, apply_megatron_options), from the flag, LOCAL_WORLD_SIZE or
    SLURM_NTASKS_PER_NODE; none of them is an error naming the fix."""
    from megatron_pipemesh.integration.flags import apply_megatron_options, detect_ranks_per_node
    node = dict(pipemesh_sharding=["optim", "optim_grads_params"], use_distributed_optimizer=True, overlap_param_gather=True,
                pipemesh_shard_scope="node", data_parallel_size=4, world_size=16, num_distributed_optimizer_instances=1,
                global_batch_size=64)
    args = _args(pipemesh_ranks_per_node=2, **node)
    settings = check_pipemesh_args(args)
    assert args.num_distributed_optimizer_instances == 1  # the check writes nothing into Megatron's args
    apply_megatron_options(args, settings)
    assert args.num_distributed_optimizer_instances == 2 and settings.ranks_per_node == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # a node holds a whole data-parallel group: one instance
    args = _args(pipemesh_ranks_per_node=None, **node)
    settings = check_pipemesh_args(args)
    apply_megatron_options(args, settings)
    assert settings.ranks_per_node == 8 and args.num_distributed_optimizer_instances == 1
    assert check_pipemesh_args(_args(pipemesh_sharding=["optim"], use_distributed_optimizer=True)).ranks_per_node is None
    assert detect_ranks_per_node(None, {"SLURM_NTASKS_PER_NODE": "4(x2)"}) == (4, "SLURM_NTASKS_PER_NODE")
    assert detect_ranks_per_node(3, {"LOCAL_WORLD_SIZE": "8"}) == (3, "--pipemesh-ranks-per-node")
    with pytest.raises(PipeMeshArgumentError, match="different numbers of ranks"):
        detect_ranks_per_node(None, {"SLURM_NTASKS_PER_NODE": "4,2"})
    with pytest.raises(PipeMeshArgumentError, match="--pipemesh-ranks-per-node 8"):
        detect_ranks_per_node(None, {})


def test_sharding_levels_accepted():
    """One level for all chunks is expanded per chunk (also with the stock schedule)."""
    from megatron_pipemesh.config import PipeMeshConfig
    settings = check_pipemesh_args(_args(pipemesh_sharding=["optim"], use_distributed_optimizer=True))
    assert settings.plan.sharding == ("optim", "optim")
    stock = _args(pipeline_schedule="default", pipemesh_sharding=["optim"], use_distributed_optimizer=True)
    assert check_sharding_args(stock, PipeMeshConfig.from_args(stock)) == ("optim", "optim")
    mixed = check_pipemesh_args(_args(pipemesh_sharding=["optim", "optim_grads_params"], use_distributed_optimizer=True,
                                      overlap_param_gather=True))
    assert mixed.plan.sharding == ("optim", "optim_grads_params")


def test_plan_file_carries_the_sharding_levels(tmp_path):
    """`pipemesh plan --sharding ... --output` saves the levels; --pipemesh-plan applies them (with their rules)
    and refuses different --pipemesh-sharding levels."""
    from megatron_pipemesh.command import main
    path = tmp_path / "plan.json"
    assert main(["plan", "--pp", "4", "--vpp", "2", "-m", "12", "--num-layers", "8", "--hidden-size", "64",
                 "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128", "--dp", "2",
                 "--memory-budget-gb", "1", "--sharding", "optim", "optim_grads", "--output", str(path)]) == 0
    settings = check_pipemesh_args(_args(pipemesh_plan=str(path), use_distributed_optimizer=True, data_parallel_size=2,
                                         global_batch_size=48))
    assert settings.plan.sharding == ("optim", "optim_grads") and "sharding optim optim_grads" in settings.summary
    with pytest.raises(PipeMeshArgumentError, match="needs --use-distributed-optimizer"):
        check_pipemesh_args(_args(pipemesh_plan=str(path), data_parallel_size=2, global_batch_size=48))
    with pytest.raises(PipeMeshArgumentError, match="disagree"):
        check_pipemesh_args(_args(pipemesh_plan=str(path), use_distributed_optimizer=True, data_parallel_size=2,
                                  global_batch_size=48, pipemesh_sharding=["optim"]))


def test_sharding_auto_plans_levels_with_the_groups():
    """--pipemesh-sharding auto with auto groups and a budget: the planner picks levels per chunk (checked by the
    same rules as given levels) and the summary names them."""
    settings = check_pipemesh_args(_args(pipemesh_sharding=["auto"], use_distributed_optimizer=True,
                                         overlap_param_gather=True, forward_groups=["auto"], backward_groups=["auto"],
                                         pipemesh_memory_budget_gb=1.0, data_parallel_size=2, global_batch_size=48,
                                         pipemesh_device_tflops=10.0))
    levels = settings.plan.sharding
    assert len(levels) == 2 and set(levels) <= {"optim", "optim_grads", "optim_grads_params"}
    assert f"sharding {' '.join(levels)}" in settings.summary


def test_saved_tensor_meter_with_fused_wgrad_and_overlapped_reduction_is_refused():
    """Without CUDA --pipemesh-measure-memory counts saved tensors with default saved-tensor hooks, which hand
    Megatron's fused-wgrad backward a copy of each weight (DDP's --overlap-grad-reduce hook then asserts): refused at
    parse time naming the way out; fine with either the fusion or the overlap off."""
    meter = dict(pipemesh_measure_memory=True, gradient_accumulation_fusion=True, overlap_grad_reduce=True)
    with pytest.raises(PipeMeshArgumentError, match="--pipemesh-measure-memory without CUDA") as info:
        check_pipemesh_args(_args(**meter))
    assert "--no-gradient-accumulation-fusion" in str(info.value)
    assert check_pipemesh_args(_args(**dict(meter, gradient_accumulation_fusion=False))).enabled
    assert check_pipemesh_args(_args(**dict(meter, overlap_grad_reduce=False))).enabled
