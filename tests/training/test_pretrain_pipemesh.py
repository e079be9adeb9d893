"""End-to-end Megatron pretraining with --pipeline-schedule pipemesh on CPU (PP=2, VP=2, gloo).

* the per-iteration losses and gradient norms (and validation losses) equal the stock schedule's;
* a run checkpointed under pipemesh resumes under pipemesh or default with the same trajectory.
"""
import json
import re
import sys
from pathlib import Path

import pytest

from megatron_pipemesh.integration.measured import load_profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megatron_harness as h  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ELASTIC = ["--pipeline-schedule", "pipemesh", "--forward-groups", "6", "2", "--backward-groups", "4", "4"]


@pytest.fixture(scope="module")
def base_args(tmp_path_factory):
    from megatron_pipemesh.data.prepare import default_corpus_dir, prepare_corpus

    work = tmp_path_factory.mktemp("pretrain")
    stats = prepare_corpus(default_corpus_dir(), work / "corpus")
    return work, stats["megatron_args"] + [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--train-iters", "6", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--eval-iters", "1", "--eval-interval", "3", "--log-interval", "1", "--num-workers", "0", "--seed", "1234",
        "--split", "98,1,1", "--data-cache-path", str(work / "cache"),
        "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1", "--clip-grad", "1.0",
        # Dropout draws random numbers in execution order; a different order of micro-batches draws
        # different masks (as any change of Megatron's group size does), so compare without it.
        "--hidden-dropout", "0", "--attention-dropout", "0",
    ]


def _train(args, timeout=180):
    cp = h.run_torchrun([str(REPO / "scripts" / "pretrain_gpt.py")] + args, nproc=2, timeout=timeout)
    assert cp.returncode == 0, h.failure_excerpt(cp.stdout, 6000)
    return cp.stdout


def _log(stdout):
    """{iteration: (lm loss, grad norm)} and the list of validation losses."""
    train = {int(i): (float(loss), float(norm)) for i, loss, norm in re.findall(
        r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+) \|.*?grad norm: ([0-9.]+)", stdout)}
    valid = [float(v) for v in re.findall(r"validation loss at iteration \d+ \| lm loss value: ([0-9.Ee+-]+)", stdout)]
    return train, valid


@pytest.fixture(scope="module")
def uninterrupted(base_args):
    _, args = base_args
    return _log(_train(args + ELASTIC))


def test_pipemesh_matches_default_schedule(base_args, uninterrupted):
    """Six iterations under PipeMesh log the same values as under the default schedule, and the loss falls."""
    _, args = base_args
    default = _log(_train(args))
    assert sorted(uninterrupted[0]) == [1, 2, 3, 4, 5, 6]
    assert uninterrupted == default
    losses = [uninterrupted[0][i][0] for i in range(1, 7)]
    assert losses[-1] < losses[0]


# The first half of the checkpoint test runs ELASTIC's groups from a plan file that places activations
# on the host (OFFLOAD/RELOAD) and recomputes others: the trajectory must not change.
HOST_PLAN = {(0, 0, 0): "host", (0, 0, 1): "host", (0, 0, 2): "host", (1, 0, 0): "host", (0, 1, 5): "selective",
             (1, 1, 1): "full"}


def _host_plan_file(work) -> str:
    path = work / "host_plan.json"
    path.write_text(json.dumps({"pp": 2, "vpp": 2, "microbatches": 8, "forward_groups": [6, 2], "backward_groups": [4, 4],
                                "recompute": [{"rank": r, "chunk": c, "microbatch": j, "level": level}
                                              for (r, c, j), level in HOST_PLAN.items()]}))
    return str(path)


def test_plan_file_of_pipemesh_plan_round_trips_and_trains(base_args, uninterrupted):
    """`pipemesh plan --output` for this model under a tight budget writes a plan with recomputation that reads back
    byte-identically and trains with --pipemesh-plan on the stock schedule's losses."""
    from megatron_pipemesh.command import main
    from megatron_pipemesh.schedule.plan import RunPlan

    work, args = base_args
    path = work / "planned.json"
    assert main(["plan", "--pp", "2", "--vpp", "2", "-m", "8", "--num-layers", "4", "--hidden-size", "64",
                 "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2", "--vocab-size", "512",
                 "--dp", "1", "--dtype", "fp32", "--memory-budget-gb", "0.006", "--output", str(path)]) == 0
    text = path.read_text()
    plan = RunPlan.from_json(text)
    assert plan.to_json() == text and plan.recomputed
    out = _train(args + ["--pipeline-schedule", "pipemesh", "--pipemesh-plan", str(path)])
    assert _log(out) == uninterrupted
    assert f"PipeMesh plan from {path}: {plan.describe()}" in out


def test_checkpoint_under_pipemesh_resumes_under_pipemesh_and_default(base_args, uninterrupted):
    """A PipeMesh checkpoint (written by a run with host-placed activations, same losses) resumes identically
    under PipeMesh and the default schedule."""
    work, args = base_args
    ckpt = str(work / "ckpt")
    out = _train(args + ["--pipeline-schedule", "pipemesh", "--pipemesh-plan", _host_plan_file(work),
                         "--pipemesh-measure-memory", "--save", ckpt, "--save-interval", "3", "--exit-interval", "3"])
    first = _log(out)
    assert sorted(first[0]) == [1, 2, 3]
    assert first[0] == {i: uninterrupted[0][i] for i in (1, 2, 3)}  # host placement leaves the trajectory
    plan_line = next(line for line in out.splitlines() if line.startswith("PipeMesh plan:"))
    assert re.search(r"\| host 3 \([0-9.]+ MiB\) 1 \([0-9.]+ MiB\) per rank \|", plan_line), plan_line
    assert "recompute full 1, selective 1 of 32" in plan_line
    hosts = [line for line in out.splitlines() if "PipeMesh [iteration" in line]
    assert hosts and all(re.search(r"\| peak host MiB [0-9.]*[1-9][0-9.]* [0-9.]*[1-9]", line) for line in hosts), hosts
    resumed_pipemesh = _log(_train(args + ELASTIC + ["--load", ckpt]))
    resumed_default = _log(_train(args + ["--load", ckpt]))
    assert resumed_pipemesh == resumed_default
    assert sorted(resumed_pipemesh[0]) == [4, 5, 6]
    for i in (4, 5, 6):  # gradient norms pin the model and data of each iteration
        assert resumed_pipemesh[0][i][1] == uninterrupted[0][i][1]
    # Megatron logs a different 'lm loss' for the second iteration after a resume whatever the
    # schedule (the stock schedule shows the same value); the other iterations must agree exactly.
    for i in (4, 6):
        assert resumed_pipemesh[0][i][0] == uninterrupted[0][i][0]


def test_auto_plan_without_a_device_rate_plans_at_the_measured_cpu_rate(base_args, uninterrupted):
    """--forward-groups auto on CPU without --pipemesh-device-tflops plans with each rank's measured matmul rate, says
    so in the plan line, and the ranks agree on the slowest rate before the first iteration (same losses)."""
    _, args = base_args
    out = _train(args + ["--pipeline-schedule", "pipemesh", "--forward-groups", "auto", "--backward-groups", "auto",
                         "--pipemesh-memory-budget-gb", "1"])
    assert re.search(r"PipeMesh plan \(auto, analytic costs at a measured CPU matmul rate of [0-9.]+ GFLOP/s", out), out
    assert re.search(r"PipeMesh plan: .*\[analytic costs at a measured CPU matmul rate of [0-9.]+ GFLOP/s\]", out)
    assert _log(out) == uninterrupted


def test_auto_plan_measures_replans_and_keeps_the_losses(base_args, uninterrupted):
    """auto: analytic plan at start-up, measured re-plan after 2 iterations, profile reused later;
    the switch of plan mid-run does not change the training trajectory."""
    work, args = base_args
    profile = work / "profile.json"
    auto = ["--pipeline-schedule", "pipemesh", "--forward-groups", "auto", "--backward-groups", "auto",
            "--pipemesh-memory-budget-gb", "2", "--pipemesh-device-tflops", "0.05", "--pipemesh-profile", str(profile)]
    # 'auto' activation placement: the ranks' host memory shares are rank-local, agreed on at the first call
    out = _train(args + auto + ["--pipemesh-measure-iters", "2", "--pipemesh-activation-placement", "auto"])
    assert "PipeMesh plan (auto, analytic costs" in out and "activation placement auto, host link 200 Gbit/s" in out
    assert "PipeMesh measured costs" in out and "PipeMesh plan (measured)" in out
    assert _log(out) == uninterrupted
    measured = load_profile(str(profile)).run_times  # the profile format, the run's times under run_times
    assert measured["forward_s"] > 0 and measured["backward_s"] > 0 and measured["p2p_s"] > 0
    again = _train(args + auto)
    assert f"measured costs from {profile}" in again
    assert _log(again) == uninterrupted
