"""PipeMeshConfig: one declaration from which every surface's flags are derived."""
import argparse
from pathlib import Path

import pytest

from megatron_pipemesh.config import (CostSettings, MeasurementSettings, PipeMeshConfig, PlacementSettings,
                                      ScheduleSettings, ShardingSettings, add_cli_arguments, add_megatron_arguments,
                                      bash_keys, env_keys, megatron_flag_names, setting_fields)

REPO = Path(__file__).resolve().parents[1]

FROZEN_FLAGS = (
    "--pipeline-schedule", "--forward-groups", "--backward-groups", "--pipemesh-recv-lookahead", "--pipemesh-plan",
    "--pipemesh-memory-budget-gb", "--pipemesh-device-tflops", "--pipemesh-mfu", "--pipemesh-dp-gbps",
    "--pipemesh-p2p-gbps", "--pipemesh-activation-placement", "--pipemesh-host-link-gbps",
    "--pipemesh-host-memory-gb", "--pipemesh-measure-iters", "--pipemesh-profile", "--pipemesh-measure-memory",
    "--pipemesh-print-schedule", "--pipemesh-sharding", "--pipemesh-shard-scope", "--pipemesh-ranks-per-node",
)


def test_flag_set_is_frozen():
    """The Megatron flags PipeMesh adds change only deliberately (update FROZEN_FLAGS and the README together)."""
    assert megatron_flag_names() == FROZEN_FLAGS


def test_every_field_has_a_docstring_and_help():
    """Each setting documents itself: a help text for its flag."""
    for _, f in setting_fields():
        assert f.metadata["help"].strip(), f.name


def test_megatron_flags_round_trip():
    """Flags produced from a config parse back into the same config."""
    config = PipeMeshConfig(ScheduleSettings(pipeline_schedule="pipemesh", forward_groups=(6, 2), backward_groups=(4, 4),
                                             recv_lookahead=2), CostSettings(dp_gbps=10.0),
                            PlacementSettings(activation_placement="auto", host_link_gbps=100.0, host_memory_gb=0.0),
                            MeasurementSettings(measure_memory=True),
                            ShardingSettings(levels=("optim", "optim_grads_params"), scope="node"))
    parser = add_megatron_arguments(argparse.ArgumentParser())
    assert PipeMeshConfig.from_args(parser.parse_args(config.megatron_flags())) == config
    assert PipeMeshConfig.from_args(parser.parse_args([])) == PipeMeshConfig()


def test_auto_must_stand_alone():
    """'auto' mixed with sizes is rejected with a message naming the flag."""
    parser = add_megatron_arguments(argparse.ArgumentParser())
    with pytest.raises(ValueError, match="--forward-groups 8 auto is invalid: 'auto' stands alone"):
        PipeMeshConfig.from_args(parser.parse_args(["--forward-groups", "8", "auto"]))


def test_cli_flags_are_derived_with_cli_defaults():
    """The `pipemesh` command's shared flags come from the same fields, with the planner's defaults."""
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, ("forward_groups", "device_tflops", "dp_gbps"))
    args = parser.parse_args(["--forward-groups", "8", "4"])
    assert args.forward_groups == [8, 4] and args.device_tflops == 312.0 and args.dp_gbps == 25.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--forward-groups", "auto"])
    with pytest.raises(KeyError):
        add_cli_arguments(parser, ("recv_lookahead",))


def test_launch_script_keys_are_generated_from_the_config():
    """scripts/lib/pipemesh_keys.sh is current (regenerate with `python -m megatron_pipemesh.config --bash`)."""
    assert (REPO / "scripts/lib/pipemesh_keys.sh").read_text() == bash_keys()
    assert env_keys()["FORWARD_GROUPS"] == "--forward-groups" and env_keys()["SCHEDULE"] == "--pipeline-schedule"


def test_run_plan_and_runtime_options_carry_the_settings(monkeypatch):
    """The runtime's plan and options are derived from the flags (lookahead, memory meter, groups, recompute)."""
    from megatron_pipemesh.integration import flags, install
    from tests.integration.test_flags import _args

    made = []
    monkeypatch.setattr(install, "_STATE", dict(install._STATE))  # activate() sets process-wide state: undone after
    monkeypatch.setattr("megatron_pipemesh.runtime.PipeMeshSchedule",
                        lambda plan, options, **_: made.append((plan, options)))
    args = _args(forward_groups=[4, 8], backward_groups=[4, 4, 4], pipemesh_recv_lookahead=3, pipemesh_measure_memory=True)
    install.activate(flags.check_pipemesh_args(args))
    (plan, options), = made
    assert (plan.recv_lookahead, options.measure_memory, plan.schedule.forward_groups, plan.schedule.backward_groups,
            options.p2p_timeout_s, plan.placement) == (3, True, (4, 8), (4, 4, 4), 600.0, {})


@pytest.mark.parametrize("argv,words", [
    (["--pipemesh-activation-placement", "host"], "invalid choice: 'host'"),
    (["--pipemesh-host-link-gbps", "0"], "expected a positive number, got '0'"),
    (["--pipemesh-host-link-gbps", "fast"], "expected a number, got 'fast'"),
    (["--pipemesh-host-memory-gb", "-1"], "expected a number >= 0, got '-1'"),
    (["--pipemesh-host-memory-gb", "nan"], "expected a number >= 0, got 'nan'"),
])
def test_placement_flags_reject_bad_values_at_parse_time(argv, words, capsys):
    """Bad activation-placement / host-link / host-memory values stop argument parsing with the flag named."""
    parser = add_megatron_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    err = capsys.readouterr().err
    assert argv[0] in err and words in err


def test_placement_flags_defaults_and_cli():
    """Defaults keep today's behaviour (recompute-only, link measured/defaulted, host memory unlimited)."""
    config = PipeMeshConfig.from_args(add_megatron_arguments(argparse.ArgumentParser()).parse_args([]))
    placement = config.placement
    assert (placement.activation_placement, placement.host_link_gbps, placement.host_memory_gb) == ("recompute-only", None,
                                                                                                    None)
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, ("activation_placement", "host_link_gbps", "host_memory_gb"))
    args = parser.parse_args(["--activation-placement", "auto", "--host-link-gbps", "64", "--host-memory-gb", "100"])
    assert (args.activation_placement, args.host_link_gbps, args.host_memory_gb) == ("auto", 64.0, 100.0)


def test_no_setting_is_declared_twice_in_one_group():
    """A second declaration of a field silently replaces the first (a dataclass keeps the last): none may exist."""
    import ast
    from pathlib import Path

    import megatron_pipemesh.config as config_module

    tree = ast.parse(Path(config_module.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names = [item.target.id for item in node.body if isinstance(item, ast.AnnAssign)]
            assert len(names) == len(set(names)), (node.name, sorted({n for n in names if names.count(n) > 1}))
