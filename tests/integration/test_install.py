"""install() against the real megatron-core 0.19.2 argument parser and schedule getters."""
import subprocess
import sys
import textwrap

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
        from megatron_pipemesh.integration.install import active_schedule
        from megatron.training import training
        from megatron.core import pipeline_parallel
        schedule = active_schedule()
        print("schedule", args.pipeline_schedule, None if schedule is None else schedule.options.forward_groups,
              None if schedule is None else schedule.options.backward_groups)
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
