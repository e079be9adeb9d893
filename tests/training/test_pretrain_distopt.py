"""End-to-end pretraining with Megatron's distributed optimizer on CPU: PP=2 x DP=2 (4 ranks, gloo), V=2.

With ``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather`` (and the default
``align_param_gather``), ``--pipeline-schedule pipemesh --forward-groups 6 2 --backward-groups 4 4`` logs the
per-iteration losses, grad norms and validation losses of ``--pipeline-schedule default``, and both equal a
run without the distributed optimizer (so every step's updated parameter shards were all-gathered).
The real data loader gives each data-parallel replica its own samples.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_harness as h  # noqa: E402
from test_pretrain_pipemesh import ELASTIC, REPO, _log, base_args  # noqa: E402,F401 (base_args: fixture)

DISTOPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def _train(args):
    cp = h.run_torchrun([str(REPO / "scripts" / "pretrain_gpt.py")] + args, nproc=4, timeout=300)
    assert cp.returncode == 0, cp.stdout[-6000:]
    return cp.stdout


@pytest.fixture(scope="module")
def args(base_args):
    _, common = base_args
    # 16 micro-batches of 2 in a global batch of 32 = 8 per data-parallel replica (the groups sum to 8).
    common = list(common)
    common[common.index("--global-batch-size") + 1] = "32"
    common[common.index("--train-iters") + 1] = "4"
    common[common.index("--eval-interval") + 1] = "2"
    return common


def test_pipemesh_with_distributed_optimizer_matches_default(args):
    """Same per-iteration losses and grad norms (and validation losses): pipemesh = default = no distopt."""
    pipemesh = _log(_train(args + DISTOPT + ELASTIC))
    default = _log(_train(args + DISTOPT))
    plain = _log(_train(args + ["--overlap-grad-reduce"]))
    assert sorted(pipemesh[0]) == [1, 2, 3, 4] and len(pipemesh[1]) == 2
    assert pipemesh == default
    assert pipemesh == plain
