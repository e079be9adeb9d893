"""The advice's rows without a pipeline (PP = 1, with the distributed optimizer and the overlap flags added where the
command has none)
and with another micro-batch size: their flags, as ``pipemesh plan --megatron-args`` writes them, train unchanged
with ``torchrun --nproc-per-node 2 scripts/pretrain_gpt.py`` on CPU (gloo). The rows are built from the advice's own
candidates (whichever would win), so that both kinds are always trained.
"""
import math
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megatron_harness as h  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
from tests.training.test_advice_rows import TINY  # noqa: E402  (the tiny GPT of the advice-row tests)
CLUSTER = ["--nodes", "1", "--gpus-per-node", "2", "--device-memory-gib", "1", "--nic-gbps", "0.25"]


def _rows():
    """(flags of a PP = 1 stock row at micro-batch 4 with the distributed optimizer and both overlap flags added,
    flags of a PipeMesh row at PP 2, V 2 and micro-batch 1)."""
    from megatron_pipemesh.cli.megatron_args import build_advice_parser, problem_and_cluster, row_flags
    from megatron_pipemesh.planning import advice as adv
    from megatron_pipemesh.planning import advice_search as search

    args = build_advice_parser().parse_args(CLUSTER + ["--megatron-args", TINY])
    user, problem, cluster, rate = problem_and_cluster(args, shlex.split(TINY))
    found = adv.candidates(problem, cluster)
    flat = next(c for c in found if c.layout.pp == 1 and c.micro_batch_size == 4 and c.stock_sharding == ("optim",)
                and c.added_flags == adv.OVERLAP_FLAGS)
    stock = search.stock_candidate(flat, problem, cluster)
    piped = next(c for c in found if c.layout.pp == 2 and c.vpp == 2 and c.micro_batch_size == 1 and c.split.even)
    plan = search.plan_candidate(piped, cluster)
    assert stock is not None and plan is not None
    return (row_flags(user, search.stock_row("best_layout_stock", flat, stock, cluster), problem, cluster, rate),
            row_flags(user, search.plan_row("best_layout", piped, plan), problem, cluster, rate))


def _losses(flags):
    from megatron_pipemesh.bench.logparse import parse_log

    cp = h.run_torchrun([str(REPO / "scripts" / "pretrain_gpt.py")] + list(flags), nproc=2, timeout=240)
    assert cp.returncode == 0, h.failure_excerpt(cp.stdout, 6000)
    return [it.loss for it in parse_log(cp.stdout).iterations]


def test_rows_without_a_pipeline_and_with_another_micro_batch_size_train():
    flat, piped = _rows()
    words = shlex.split(TINY)
    assert flat.count("--pipeline-model-parallel-size") == 1
    assert flat[flat.index("--pipeline-model-parallel-size") + 1] == "1"
    assert "--num-virtual-stages-per-pipeline-rank" not in flat and "--use-distributed-optimizer" in flat
    assert "--overlap-grad-reduce" in flat and "--overlap-param-gather" in flat
    assert flat[flat.index("--micro-batch-size") + 1] == "4" and flat.count("--micro-batch-size") == 1
    assert flat.index("--micro-batch-size") == words.index("--micro-batch-size")  # replaced in place
    assert piped[piped.index("--micro-batch-size") + 1] == "1" and piped.count("--micro-batch-size") == 1
    assert piped[piped.index("--pipeline-schedule") + 1] == "pipemesh"
    for flags in (flat, piped):
        losses = _losses(flags)
        assert len(losses) == 2 and all(math.isfinite(x) and 0 < x < 10 for x in losses), flags
