"""End-to-end pretraining of a mixture-of-experts GPT (4 experts, top-2, the all-to-all dispatcher) on CPU with
``pipemesh-pretrain-gpt``'s MoE flags: under ``--pipeline-schedule pipemesh`` every logged iteration's loss, grad
norm and validation loss equals the stock schedule's, on 4 ranks (PP 2 x DP 2 with EP 2: each replica its own data
and two of the experts), with the distributed optimizer and mixed sharding levels (chunk 1's dense and expert
parameters fully sharded, ZeRO-3, the experts over the expert data-parallel group), and on 2 ranks (PP 2, the
experts on each stage: EP 2 with PP 2 needs 4 ranks)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_harness as h  # noqa: E402
from test_pretrain_pipemesh import ELASTIC, REPO, _log, base_args  # noqa: E402,F401 (base_args: fixture)

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear"]
DISTOPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def _train(args, nproc):
    cp = h.run_torchrun([str(REPO / "scripts" / "pretrain_gpt.py")] + args, nproc=nproc, timeout=300)
    assert cp.returncode == 0, h.failure_excerpt(cp.stdout, 6000)
    return cp.stdout


@pytest.fixture(scope="module")
def args(base_args):
    _, common = base_args
    common = list(common)
    common[common.index("--global-batch-size") + 1] = "32"  # 8 micro-batches of 2 per replica at DP 2
    common[common.index("--train-iters") + 1] = "3"
    common[common.index("--eval-interval") + 1] = "3"
    return common + MOE


def test_ep2_on_four_ranks_matches_the_stock_schedule(args):
    ep = args + ["--expert-model-parallel-size", "2"]
    default = _log(_train(ep, 4))
    assert sorted(default[0]) == [1, 2, 3] and default[1]
    assert _log(_train(ep + ELASTIC, 4)) == default
    sharded = _log(_train(ep + DISTOPT + ELASTIC + ["--pipemesh-sharding", "optim", "optim_grads_params"], 4))
    assert sharded == _log(_train(ep + DISTOPT, 4))


def test_two_ranks_match_the_stock_schedule(args):
    two = list(args)
    two[two.index("--global-batch-size") + 1] = "16"
    assert _log(_train(two + ELASTIC, 2)) == _log(_train(two, 2))
