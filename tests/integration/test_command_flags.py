"""integration/command_flags.py: a row's flags are the user's with only the changed ones replaced."""
from megatron_pipemesh.integration.command_flags import (REPLACED, pipemesh_flags, replace_flags, stock_flags,
                                                         without)
from megatron_pipemesh.planning.layout import LayerSplit
from megatron_pipemesh.planning.stock_options import StockOffload, StockRecompute, StockSetting
from megatron_pipemesh.schedule.config import ScheduleConfig

USER = ["--num-layers", "8", "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp",
        "--pipeline-model-parallel-size=2", "--bf16", "--num-layers-per-virtual-pipeline-stage", "2", "--lr", "-1e-3"]


def test_without_drops_a_flag_with_all_its_values_and_keeps_the_rest_in_order():
    assert without(USER, ["--recompute-modules", "--pipeline-model-parallel-size"]) == [
        "--num-layers", "8", "--recompute-granularity", "selective", "--bf16",
        "--num-layers-per-virtual-pipeline-stage", "2", "--lr", "-1e-3"]


def test_stock_row_flags():
    """V, group (only when not Megatron's default p), recomputation, offloading; an uneven split's layout sets V."""
    setting = StockSetting(4, 2, 16, 8, StockRecompute("full", method="block", num_layers=1), offload=None)
    flags = replace_flags(USER, REPLACED, stock_flags(setting, 1, LayerSplit()))
    assert flags == ["--num-layers", "8", "--bf16", "--lr", "-1e-3", "--tensor-model-parallel-size", "1",
                     "--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank", "2",
                     "--microbatch-group-size-per-virtual-pipeline-stage", "8", "--recompute-granularity", "full",
                     "--recompute-method", "block", "--recompute-num-layers", "1"]
    default_group = stock_flags(StockSetting(2, 2, 8, None, offload=StockOffload(0.5)), 2, LayerSplit.of_layout("Et|tt|tt|tL"))
    assert "--microbatch-group-size-per-virtual-pipeline-stage" not in default_group
    assert "--num-virtual-stages-per-pipeline-rank" not in default_group  # the layout's four stages over p = 2 set V
    assert default_group[-2:] == ["--pipeline-model-parallel-layout", "Et|tt|tt|tL"]
    assert "--activation-offload-fraction" in default_group


def test_pipemesh_row_flags_with_and_without_placement():
    config = ScheduleConfig(2, 2, 8, (4, 4), (2, 6))
    plain = pipemesh_flags(config, 1, LayerSplit(), grad_reduce_in_bf16=False)
    assert plain == ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                     "--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "pipemesh",
                     "--forward-groups", "4", "4", "--backward-groups", "2", "6"]
    placed = pipemesh_flags(config, 1, LayerSplit(first=2, last=2), True, budget_gb=21.6)
    assert placed[placed.index("--pipemesh-activation-placement") + 1] == "auto"
    assert placed[placed.index("--pipemesh-memory-budget-gb") + 1] == "21.600"
    assert placed[placed.index("--pipemesh-host-memory-gb") + 1] == "0"  # no host memory given: recompute only
    assert "--grad-reduce-in-bf16" in placed and "--decoder-first-pipeline-num-layers" in placed


def test_every_flag_a_row_writes_replaces_the_users():
    """A row's own flags are all in REPLACED, so a user's value never stays beside the row's (two --forward-groups,
    two budgets); PipeMesh's come from config.py's ``recommended`` settings, where the flags are declared."""
    config = ScheduleConfig(2, 2, 8, (4, 4), (2, 6))
    stock = StockSetting(4, 2, 16, 8, StockRecompute("selective"), offload=StockOffload(0.5))
    rows = [pipemesh_flags(config, 1, LayerSplit(first=2, last=2), True, budget_gb=21.6, device_tflops=10.0),
            stock_flags(stock, 1, LayerSplit.of_layout("Et|tt|tt|tL"))]
    for flags in rows:
        assert {word for word in flags if word.startswith("--")} <= set(REPLACED)


def test_set_value_replaces_a_flags_value_in_place_or_appends_it():
    """A row that changes the micro-batch size changes its value where the command has it (every spelling given,
    ``--flag=value`` too), the other flags in their places; a command without the flag gets it appended."""
    from megatron_pipemesh.integration.command_flags import set_value

    flags = ["--num-layers", "4", "--micro-batch-size", "2", "--bf16"]
    assert set_value(flags, ["--micro-batch-size"], "8") == ["--num-layers", "4", "--micro-batch-size", "8", "--bf16"]
    assert set_value(["--micro-batch-size=2", "--bf16"], ["--micro-batch-size"], "4") == [
        "--micro-batch-size", "4", "--bf16"]
    assert set_value(["--bf16"], ["--micro-batch-size"], "4") == ["--bf16", "--micro-batch-size", "4"]


def test_a_row_without_a_pipeline_sets_pp_1_and_no_virtual_stage_or_group_flag():
    """PP = 1 (stock, data parallel alone): PP 1 replaces the command's pipeline flags; the distributed optimizer
    (sharding level optim) is added where the row takes it."""
    user = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
            "--microbatch-group-size-per-virtual-pipeline-stage", "4", "--lr", "1e-3"]
    flags = replace_flags(user, REPLACED, stock_flags(StockSetting(1, 1, 8), 1, LayerSplit()))
    assert flags == ["--lr", "1e-3", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    added = stock_flags(StockSetting(1, 1, 8, sharding="optim"), 1, LayerSplit())
    assert added == ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                     "--use-distributed-optimizer"]
