"""What a user sees in Megatron's training log under PipeMesh (and under the metered stock schedule)."""
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megatron_harness as h  # noqa: E402

from megatron_pipemesh.integration.report import parse_interval_line  # noqa: E402
from megatron_pipemesh.schedule.config import ScheduleConfig  # noqa: E402
from megatron_pipemesh.schedule.lower import LoweringOptions, lower  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    work = tmp_path_factory.mktemp("log")
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
            "--train-iters", "4", "--lr", "1e-3", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "2",
            "--num-workers", "0", "--seed", "1234", "--data-cache-path", str(work / "cache"),
            "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--pipemesh-measure-memory"]


def _train(argv):
    cp = h.run_torchrun([str(REPO / "scripts" / "pretrain_gpt.py")] + argv, nproc=2, timeout=420)
    assert cp.returncode == 0, h.failure_excerpt(cp.stdout, 6000)
    return cp.stdout


def _intervals(stdout):
    return [f for f in map(parse_interval_line, stdout.splitlines()) if f]


def test_pipemesh_run_prints_plan_picture_and_interval_figures(args):
    """One plan line with the digest the runtime runs, the picture, and per-rank figures every log interval."""
    out = _train(args + ["--pipeline-schedule", "pipemesh", "--forward-groups", "6", "2", "--backward-groups", "4", "4",
                         "--pipemesh-print-schedule"])
    plans = [line for line in out.splitlines() if line.startswith("PipeMesh plan:")]
    assert len(plans) == 1, plans
    digest = lower(ScheduleConfig(2, 2, 8, (6, 2), (4, 4)), LoweringOptions(param_sync=False, grad_sync=False)).digest()
    assert plans[0].startswith(f"PipeMesh plan: p=2 V=2 m=8 | --forward-groups 6 2 --backward-groups 4 4 | digest {digest} |")
    assert re.search(r"predicted peak activation MiB per rank [0-9.]+ [0-9.]+ \| predicted iteration [0-9.]+ ms "
                     r"\(depth-first [0-9.]+ ms, breadth-first [0-9.]+ ms\)", plans[0])
    assert "PipeMesh schedule (F = 1, B = 2 time units" in out and re.search(r"^rank 1 \| ", out, re.M)
    figures = _intervals(out)
    assert [f["iteration"] for f in figures] == [2, 4]
    for f in figures:
        assert len(f["pipeline wait"]) == 2 and len(f["data-parallel wait"]) == 2
        assert all(p > 0 for p in f["peak activation"]) and len(f["peak activation"]) == 2
    # the first forward group of 6 keeps more micro-batches alive on rank 0 than on rank 1
    assert figures[-1]["peak activation"][0] > figures[-1]["peak activation"][1]


def test_stock_schedule_is_metered_the_same_way(args):
    """With --pipemesh-measure-memory the stock schedule reports its measured peak (no PipeMesh plan line)."""
    out = _train(args)
    assert "PipeMesh plan:" not in out
    figures = _intervals(out)
    assert [f["iteration"] for f in figures] == [2, 4]
    assert "pipeline wait" not in figures[0] and all(p > 0 for p in figures[0]["peak activation"])
