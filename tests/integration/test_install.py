"""install() against the real megatron-core 0.19.2 argument parser and schedule getters."""
import subprocess
import sys
import textwrap

import pytest

from tests.megatron_harness import REPO_ROOT

TINY = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "24",
        "--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank", "2",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--mock-data", "--train-iters", "1"]


def _parse(extra, world_size=4):
    code = textwrap.dedent(f"""
        import sys
        import megatron_pipemesh
        megatron_pipemesh.install()
        megatron_pipemesh.install()  # idempotent
        from megatron.training.arguments import parse_and_validate_args
        sys.argv = ["pretrain_gpt.py"] + {TINY + extra!r}
        args = parse_and_validate_args()
        import torch.distributed as dist
        assert not dist.is_initialized()
        from megatron_pipemesh.integration.install import reported_schedule
        from megatron.training import training
        from megatron.core import pipeline_parallel
        schedule = reported_schedule()
        groups = None if schedule is None else schedule.plan.schedule  # None: Megatron's group size
        print("schedule", args.pipeline_schedule, None if groups is None else groups.forward_groups,
              None if groups is None else groups.backward_groups)
        routed = training.get_forward_backward_func(pp_size=4, vp_size=2)
        print("routed", type(routed).__name__, pipeline_parallel.get_forward_backward_func(pp_size=4, vp_size=2) is routed)
        print("no-vp", training.get_forward_backward_func(pp_size=4, vp_size=None).__name__)
    """)
    env = {"WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0", "PYTHONPATH": str(REPO_ROOT),
           "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_pipemesh_flags_parse_and_route_schedule():
    """After install() PipeMesh flags parse and interleaved runs (only) are routed to PipeMeshSchedule."""
    proc = _parse(["--pipeline-schedule", "pipemesh", "--forward-groups", "8", "4", "--backward-groups", "6", "6"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "schedule pipemesh (8, 4) (6, 6)" in proc.stdout
    assert "routed PipeMeshSchedule True" in proc.stdout
    assert "no-vp forward_backward_pipelining_without_interleaving" in proc.stdout


def test_default_schedule_is_megatron():
    """Without PipeMesh flags Megatron's own schedule function is returned."""
    proc = _parse([])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "schedule default None None" in proc.stdout
    assert "routed function" in proc.stdout


def test_bad_groups_exit_2_at_parse_time_with_one_paragraph():
    """Invalid groups exit 2 at argument parsing with a one-line message and an example, no traceback."""
    proc = _parse(["--pipeline-schedule", "pipemesh", "--forward-groups", "4", "4", "--backward-groups", "4"])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    message = [line for line in proc.stderr.splitlines() if line.startswith("megatron_pipemesh: error:")]
    assert message and "--forward-groups 4 4 is invalid" in message[0] and "Example of a valid setting" in message[0]
    assert "Traceback" not in proc.stderr


# Wrappers in isolation: fake "originals" stand in for a megatron-core patch release's functions.
def _fake_parallel_state(pp, vp):
    from types import SimpleNamespace
    return SimpleNamespace(get_pipeline_model_parallel_world_size=lambda: pp,
                           get_virtual_pipeline_model_parallel_world_size=lambda: vp)


def test_getter_keeps_explicit_vp_none_and_passes_new_keywords(monkeypatch):
    """An explicit vp_size=None stays Megatron's non-interleaved schedule, both-None reads parallel_state,
    and a keyword argument unknown to 0.19.2 reaches the wrapped getter."""
    from megatron_pipemesh.integration import install

    calls = []

    def original(pp_size=None, vp_size=None, schedule_pg_collection=None, new_option="default"):
        calls.append((pp_size, vp_size, new_option))
        return "megatron"
    monkeypatch.setitem(install._STATE, "schedule", "pipemesh")
    monkeypatch.setitem(install._STATE, "args", None)  # no --pipemesh-measure-memory: stock is returned unmetered
    getter = install.wrap_getter(original, _fake_parallel_state(4, 2))
    assert getter() == "pipemesh"
    assert getter(pp_size=4, vp_size=None) == "megatron"
    assert getter(pp_size=4, vp_size=2, new_option="x") == "pipemesh"
    assert getter(4, None, None, "y") == "megatron" and calls[-1] == (4, None, "y")
    assert install.wrap_getter(original, _fake_parallel_state(4, None))() == "megatron"
    monkeypatch.setitem(install._STATE, "schedule", None)
    assert getter(pp_size=4, vp_size=2) == "megatron"


def test_parse_and_validate_wrappers_pass_new_arguments(monkeypatch):
    """parse_args / validate_args wrappers forward arguments a newer signature adds."""
    import argparse

    from megatron_pipemesh.integration import install

    def original_parse(extra_args_provider=None, ignore_unknown_args=False, new_option=None):
        parser = extra_args_provider(argparse.ArgumentParser())
        args = parser.parse_args(["--pipeline-schedule", "default"])
        args.new_option, args.yaml_cfg = new_option, None
        return args
    args = install.wrap_parse_args(original_parse)(None, new_option=5)
    assert args.pipeline_schedule == "default" and args.new_option == 5

    seen = {}

    def original_validate(args, defaults={}, new_option=None):
        seen["new_option"] = new_option
        return args
    monkeypatch.setattr(install, "_activate_from", lambda args: seen.setdefault("activated", args))
    assert install.wrap_validator(original_validate)(args, {}, new_option=7) is args
    assert seen == {"new_option": 7, "activated": args}


def _pipemesh_parser():
    import argparse

    from megatron_pipemesh.integration.flags import add_pipemesh_arguments
    return add_pipemesh_arguments(argparse.ArgumentParser())


def test_yaml_settings_are_read_converted_and_merged():
    """With --yaml-cfg PipeMesh's settings come from YAML keys (converted like flags), else from the
    command line, else defaults; a conflicting command-line flag is an error."""
    from types import SimpleNamespace

    import pytest

    from megatron_pipemesh.integration.flags import PipeMeshArgumentError
    from megatron_pipemesh.integration.install import merge_yaml_settings

    parser = _pipemesh_parser()
    args = SimpleNamespace(yaml_cfg="run.yaml", pipeline_schedule="pipemesh", forward_groups=[6, 2],
                           backward_groups="4 4")
    merge_yaml_settings(args, parser, ["--pipemesh-recv-lookahead", "2"])
    assert (args.pipeline_schedule, args.forward_groups, args.backward_groups) == ("pipemesh", [6, 2], [4, 4])
    assert args.pipemesh_recv_lookahead == 2 and args.pipemesh_mfu == 0.45
    cli_only = SimpleNamespace(yaml_cfg="run.yaml")
    merge_yaml_settings(cli_only, parser, ["--pipeline-schedule", "pipemesh", "--forward-groups", "auto"])
    assert cli_only.pipeline_schedule == "pipemesh" and cli_only.forward_groups == ["auto"]
    with pytest.raises(PipeMeshArgumentError, match="--forward-groups is given on the command line"):
        merge_yaml_settings(SimpleNamespace(yaml_cfg="run.yaml", forward_groups=[6, 2]), parser,
                            ["--forward-groups", "4", "4"])
    with pytest.raises(PipeMeshArgumentError, match="key pipeline_schedule"):
        merge_yaml_settings(SimpleNamespace(yaml_cfg="run.yaml", pipeline_schedule="fast"), parser, [])


def test_yaml_cfg_activates_pipemesh_through_megatrons_parser():
    """parse_and_validate_args with --yaml-cfg (Megatron skips validate_args then) still activates
    PipeMesh from the YAML's settings. PyYAML is absent here, so Megatron's load_yaml/validate_yaml are
    replaced by stand-ins returning what they would: the YAML namespace, then a flattened one."""
    code = textwrap.dedent("""
        import sys
        from types import SimpleNamespace
        from megatron_pipemesh.integration.bootstrap import prepare_megatron_import
        prepare_megatron_import()
        from megatron.training import yaml_arguments
        yaml_arguments.load_yaml = lambda path: SimpleNamespace(
            yaml_cfg=path, pipeline_schedule="pipemesh", forward_groups=[8, 4], backward_groups=[6, 6],
            model_parallel=SimpleNamespace(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
            micro_batch_size=2, global_batch_size=24, use_checkpoint_args=False, disable_msc_deprecated=False,
            enable_msc=False)
        def validate_yaml(args, defaults={}):
            flat = SimpleNamespace(**{k: v for k, v in vars(args).items() if k != "model_parallel"},
                                   **vars(args.model_parallel))
            flat.data_parallel_size = 1
            return flat
        yaml_arguments.validate_yaml = validate_yaml
        import megatron_pipemesh
        megatron_pipemesh.install()
        from megatron.training import arguments
        arguments.set_global_variables = lambda args: None
        sys.argv = ["pretrain_gpt.py", "--yaml-cfg", "run.yaml"]
        arguments.parse_and_validate_args()
        from megatron_pipemesh.integration.install import reported_schedule
        schedule = reported_schedule()
        print("yaml schedule", schedule.plan.schedule.forward_groups, schedule.plan.schedule.backward_groups)
    """)
    env = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "yaml schedule (8, 4) (6, 6)" in proc.stdout


def test_version_gate_accepts_warns_and_refuses():
    """0.19.x runs silently; a newer megatron-core (Megatron-LM main says 0.20.0) runs with a warning naming the
    tested versions; an older one is refused with the reason."""
    from megatron_pipemesh.integration.install import TESTED, check_version

    assert check_version("0.19.2") is None and check_version("0.19.0") is None and check_version("0.19.3") is None
    warning = check_version("0.20.0")
    assert "0.20.0 is newer than the supported 0.19.x" in warning
    assert all(version in warning for version in TESTED) and "Megatron-LM main" in warning
    assert "0.21.0rc1 is newer" in check_version("0.21.0rc1")
    with pytest.raises(RuntimeError, match="needs megatron-core >= 0.19 but found 0.18.1: older releases lack"):
        check_version("0.18.1")
