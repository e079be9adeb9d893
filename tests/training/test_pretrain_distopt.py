"""End-to-end pretraining with Megatron's distributed optimizer on CPU: PP=2 x DP=2 (4 ranks, gloo), V=2.

With ``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather`` (and the default
``align_param_gather``), ``--pipeline-schedule pipemesh --forward-groups 6 2 --backward-groups 4 4`` logs the
per-iteration losses, grad norms and validation losses of ``--pipeline-schedule default``, and both equal a
run without the distributed optimizer (so every step's updated parameter shards were all-gathered).
The real data loader gives each data-parallel replica its own samples.

Mixed sharding (issue 11) rides on the same runs: the PipeMesh run names ``--pipemesh-sharding optim`` (ZeRO-1
everywhere, which is the distributed optimizer, plus the runtime's memory/traffic report), and one more run
shards chunk 1 fully (``optim optim_grads_params``). The node scope runs as four one-rank "nodes" (four torchrun
launches with a static rendezvous on 127.0.0.1, so each rank reads LOCAL_WORLD_SIZE=1): Megatron's hierarchical
distributed optimizer with two instances per stage, degenerate in memory (a node holds one data-parallel rank)
but with the per-group reductions folded into the cross-node all-reduce. The non-degenerate PP=2 x DP=4 case
(8 ranks, nodes of 2) takes about two minutes here; docs/sharding.md has its numbers.

Megatron's GPU code path on the same runs: host placement chosen by ``--pipemesh-activation-placement auto`` under a
tight budget, with ``--overlap-grad-reduce``, the distributed optimizer and ZeRO-3 (the commands leave Megatron's
default gradient-accumulation fusion alone: the CPU layer decides whether it runs), and Megatron's
``--overlap-param-gather-with-optimizer-step``, whose optimizer step starts the first chunk's all-gather itself,
with that chunk at ZeRO-3.
"""
import ast
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_harness as h  # noqa: E402
from test_pretrain_pipemesh import ELASTIC, REPO, _log, base_args  # noqa: E402,F401 (base_args: fixture)

DISTOPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def _train(args, env=None):
    cp = h.run_torchrun([str(REPO / "scripts" / "pretrain_gpt.py")] + args, nproc=4, timeout=300, env=env)
    assert cp.returncode == 0, h.failure_excerpt(cp.stdout, 6000)
    return cp.stdout


INFLIGHT = {"PYTHONPATH": f"{REPO / 'tests' / 'inflight'}{os.pathsep}{REPO}"}
"""Ranks with tests/inflight_storage.py's check on: a storage freed or moved under an in-flight collective is reported."""


def _assert_no_storage_moved_in_flight(out: str) -> None:
    from inflight_storage import SUMMARY, VIOLATION

    assert VIOLATION not in out, out[out.index(VIOLATION):][:3000]
    summaries = re.findall(re.escape(SUMMARY) + r" rank (\d+) (\d+) waits, (\d+) violations", out)
    assert sorted(int(rank) for rank, _, _ in summaries) == [0, 1, 2, 3] and all(int(w) > 0 for _, w, _ in summaries)


@pytest.fixture(scope="module")
def args(base_args):
    _, common = base_args
    # 16 micro-batches of 2 in a global batch of 32 = 8 per data-parallel replica (the groups sum to 8).
    common = list(common)
    common[common.index("--global-batch-size") + 1] = "32"
    common[common.index("--train-iters") + 1] = "4"
    common[common.index("--eval-interval") + 1] = "2"
    return common


REPORT = re.compile(r"PipeMesh sharding rank (\d+) \(pipeline rank \d+\) \[([a-z_ ]+)\]: .*? measured (\d+) B, "
                    r"predicted (\d+) B .*?gathered (\{.*?\}) B \(simulator (\{.*?\})\), reduced (\{.*?\}) B "
                    r"\(simulator (\{.*?\})\), all-reduced across nodes (\{.*?\}) B \(simulator (\{.*?\})\)")


STARTUP = re.compile(r"predicted weights\+grads\+optimizer MiB per pipeline rank ([0-9. ]+) \(optim everywhere")


def _reports(stdout):
    """rank -> (levels, measured, predicted, gathered, simulated gathers, reduced, simulated reductions, all-reduced
    across nodes, simulated)."""
    return {int(m[0]): (m[1], int(m[2]), int(m[3]), *(ast.literal_eval(x) for x in m[4:]))
            for m in REPORT.findall(stdout)}


def _close(a, b, rel: float) -> bool:
    """Two logs (_log) with the same iterations whose values agree within ``rel``."""
    (train_a, valid_a), (train_b, valid_b) = a, b
    if sorted(train_a) != sorted(train_b) or len(valid_a) != len(valid_b):
        return False
    pairs = [(x, y) for i in train_a for x, y in zip(train_a[i], train_b[i])] + list(zip(valid_a, valid_b))
    return all(abs(x - y) <= rel * max(abs(x), abs(y)) for x, y in pairs)


@pytest.fixture(scope="module")
def default(args):
    """The stock schedule's log with the distributed optimizer (one run shared by the tests of this module)."""
    return _log(_train(args + DISTOPT))


def test_pipemesh_with_distributed_optimizer_matches_default(args, default):
    """Same per-iteration losses and grad norms (and validation losses): pipemesh = default = no distopt; with
    chunk 1 at ZeRO-3 the losses stay the same while each rank holds less for parameters + gradients + optimizer
    state (measured within 10% of the model), and the bytes gathered/reduced per iteration equal the simulator's."""
    zero1_out = _train(args + DISTOPT + ELASTIC + ["--pipemesh-sharding", "optim"])
    mixed_out = _train(args + DISTOPT + ELASTIC + ["--pipemesh-sharding", "optim", "optim_grads_params"])
    pipemesh, mixed = _log(zero1_out), _log(mixed_out)
    plain = _log(_train(args + ["--overlap-grad-reduce"]))
    assert sorted(pipemesh[0]) == [1, 2, 3, 4] and len(pipemesh[1]) == 2
    assert pipemesh == default
    # Megatron's distributed optimizer and its plain DDP path are two stock code paths: equal to the contract's
    # fp32 tolerance (relative 1e-6; a validation loss differs in its 7th digit here), not bit for bit.
    assert _close(pipemesh, plain, 1e-6)
    assert mixed == default
    zero1, zero3 = _reports(zero1_out), _reports(mixed_out)
    assert sorted(zero1) == sorted(zero3) == [0, 1, 2, 3]
    for rank in range(4):
        assert zero1[rank][0] == "optim optim" and zero3[rank][0] == "optim optim_grads_params"
        for levels, measured, predicted, gathered, sim_gathered, reduced, sim_reduced, cross, _ in (zero1[rank], zero3[rank]):
            assert abs(measured / predicted - 1) < 0.10, (rank, levels, measured, predicted)
            assert gathered == sim_gathered and reduced == sim_reduced, (rank, levels)
            assert set(cross.values()) == {0}  # one distributed-optimizer instance: nothing crosses nodes
        assert zero3[rank][1] < zero1[rank][1]
        # Chunk 1 (ZeRO-3) is gathered once per merged group span (3 on pipeline rank 0, 2 on rank 1), reduced per
        # backward group (2); chunk 0 (ZeRO-1) once each.
        # The start-up plan line's prediction (analytic model shape, not the buffers) is within 10% too.
        for out, reports in ((zero1_out, zero1), (mixed_out, zero3)):
            startup = [float(x) * 1024 ** 2 for x in STARTUP.search(out)[1].split()]
            assert abs(reports[rank][1] / startup[rank // 2] - 1) < 0.10, (rank, reports[rank][0], startup)
        chunk1 = zero1[rank][3][1]
        assert zero3[rank][3][1] == (3 if rank < 2 else 2) * chunk1 and zero3[rank][5][1] == 2 * chunk1


def test_node_scope_matches_default(args, default):
    """--pipemesh-shard-scope node on four one-rank nodes (LOCAL_WORLD_SIZE=1 from torchrun): ZeRO-2 chunk 0 and
    ZeRO-3 chunk 1 train with the stock schedule's losses; each rank holds what the node-scope model predicts, and
    the bytes gathered and reduced in the node and all-reduced across nodes equal the simulator's."""
    cp = h.run_torchrun_nodes([str(REPO / "scripts" / "pretrain_gpt.py")] + args + DISTOPT + ELASTIC
                              + ["--pipemesh-sharding", "optim_grads", "optim_grads_params", "--pipemesh-shard-scope", "node"],
                              nnodes=4, nproc_per_node=1)
    assert cp.returncode == 0, h.failure_excerpt(cp.stdout, 6000)
    train, valid = _log(cp.stdout)
    default_train, default_valid = default
    assert train == default_train
    assert valid == pytest.approx(default_valid, rel=1e-6)  # the per-group reductions sum in another order
    reports = _reports(cp.stdout)
    assert sorted(reports) == [0, 1, 2, 3]
    startup = [float(x) * 1024 ** 2 for x in STARTUP.search(cp.stdout)[1].split()]
    assert "scope node, ranks per node: 1" in cp.stdout
    for rank, (levels, measured, predicted, gathered, sim_gathered, reduced, sim_reduced, cross, sim_cross) in reports.items():
        assert levels == "optim_grads optim_grads_params"
        assert abs(measured / predicted - 1) < 0.10 and abs(measured / startup[rank // 2] - 1) < 0.10, (rank, measured)
        assert (gathered, reduced, cross) == (sim_gathered, sim_reduced, sim_cross), rank
        # One all-reduce per chunk and iteration of the node shard (here the whole gradient buffer), the
        # per-group reductions (2 backward groups) inside the node.
        assert all(cross[c] > 0 and reduced[c] == 2 * cross[c] for c in (0, 1)), (rank, reduced, cross)


# A budget under the unplaced peak (5.7 MiB of activations + 1.3 MiB of model state per rank): 'auto' places
# chunk-micro-batches of every rank on the host (their copies hide behind the compute), recomputing nothing.
HOST_PLACED = ["--pipemesh-activation-placement", "auto", "--pipemesh-memory-budget-gb", "0.0055",
               "--pipemesh-device-tflops", "0.05"]
PLAN_HOST = re.compile(r"\| host (\d+) \(([0-9.]+) MiB\) (\d+) \(([0-9.]+) MiB\) per rank \|")
PEAK_HOST = re.compile(r"PipeMesh \[iteration \d+\] per rank: .*\| peak host MiB ([0-9. ]+)$", re.M)


def _assert_host_placed(out: str) -> None:
    """The plan line reports host chunk-micro-batches on both pipeline ranks and every rank's measured host peak is
    the planned one (nothing else, a parameter buffer say, went to the host)."""
    plan = PLAN_HOST.search(out)
    assert plan and int(plan[1]) > 0 and int(plan[3]) > 0, out[-3000:]
    planned = [float(plan[2]), float(plan[4])]
    for line in PEAK_HOST.findall(out):
        measured = [float(x) for x in line.split()]
        assert all(abs(m - planned[rank // 2]) <= 0.1 * planned[rank // 2] for rank, m in enumerate(measured)), line


@pytest.mark.parametrize("sharding", [["optim"], ["optim", "optim_grads_params"]])
def test_host_placement_with_ddp_overlap_and_zero3_matches_default(args, default, sharding):
    """Host-placed chunk-micro-batches under DDP with --overlap-grad-reduce and the distributed optimizer, chunk 1
    at ZeRO-1 or ZeRO-3: the stock schedule's losses, grad norms and validation losses. (With the fusion on, saved
    weights reach Megatron's backward as the Parameters themselves: under default saved-tensor hooks they lost
    main_grad's bookkeeping and DDP's hook asserted 'param.grad being None is not safe'.)"""
    out = _train(args + DISTOPT + ELASTIC + HOST_PLACED + ["--pipemesh-sharding", *sharding], env=INFLIGHT)
    assert _log(out) == default
    _assert_host_placed(out)
    _assert_no_storage_moved_in_flight(out)


def test_optimizer_step_gather_into_a_zero3_first_chunk_matches_default(args):
    """--overlap-param-gather-with-optimizer-step: Megatron's optimizer step starts chunk 0's all-gather, chunk 0 is
    ZeRO-3 (and host placement on): the program's start waits for that gather and uses it, so no storage is freed
    under it and the first GATHER does not trip Megatron's assertion on a gather in flight; same log as the stock
    schedule with the flag (which needs --ckpt-format torch)."""
    flag = DISTOPT + ["--overlap-param-gather-with-optimizer-step", "--ckpt-format", "torch"]
    stock = _log(_train(args + flag))
    out = _train(args + flag + ELASTIC + HOST_PLACED + ["--pipemesh-sharding", "optim_grads_params", "optim"])
    assert _log(out) == stock
    _assert_host_placed(out)
