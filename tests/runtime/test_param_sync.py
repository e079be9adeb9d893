"""PARAM_SYNC under Megatron's distributed optimizer with overlapped, aligned parameter gathers (CPU, gloo).

PP=2 x DP=2 (4 ranks), each replica with its own data, three training steps: PipeMesh gives the losses
and gradient norms of the stock interleaved schedule and of plain Adam without the distributed optimizer
(which proves every step's updated parameter shards were gathered), every ``PARAM_SYNC c`` of the plan
dispatches chunk c's all-gathers at the plan's point, and the first forward of chunk c waits on each of
them while it is in flight; no forward finds an all-gather nobody dispatched.
"""
import pytest

from tests import megatron_harness as h
from tests.runtime.param_sync_workers import expected_events

TOL = 1e-6
ITERATIONS = 3


def _train(vp, runs):
    return h.run_worker("tests.runtime.param_sync_workers:train_runs", nproc=4, timeout=300,
                        kwargs={"runs": runs, "pp": 2, "vp": vp, "dp": 2, "microbatches": 8, "iterations": ITERATIONS})


@pytest.fixture(scope="module")
def vp2():
    return _train(2, {"plain-adam": {"schedule": "stock", "distopt": False},
                      "stock": {"schedule": "stock", "distopt": True},
                      "elastic": {"schedule": [[6, 2], [4, 4]], "distopt": True}})


@pytest.fixture(scope="module")
def vp4():
    return _train(4, {"stock": {"schedule": "stock", "distopt": True},
                      "depth-first": {"schedule": None, "distopt": True},
                      "elastic": {"schedule": [[6, 2], [4, 4]], "distopt": True}})


def _assert_same_training(results, reference):
    for rank in results:
        for name, got in rank.items():
            want = rank[reference]
            assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=TOL), (name, rank[name]["pp_rank"])
            for it in range(ITERATIONS):
                flat = [v for pair in got["losses"][it] for v in pair]
                assert flat == pytest.approx([v for pair in want["losses"][it] for v in pair], rel=TOL), (name, it)
    last_stage = [rank[reference]["losses"][0] for rank in results if rank[reference]["losses"][0]]
    assert len(last_stage) == 2 and last_stage[0] != last_stage[1], "each replica must see its own data"


def _assert_gathers_follow_plan(results, name):
    for rank in results:
        run = rank[name]
        want = expected_events(run["program"], run["buckets"])
        assert ("PARAM_SYNC", 0) in want and all(n >= 1 for n in run["buckets"])
        for it, events in enumerate(run["events"]):
            assert events == want, (name, run["pp_rank"], it)


def test_distopt_pipemesh_equals_stock_and_plain_adam(vp2):
    """Losses and grad norms of 3 steps: PipeMesh elastic = stock = plain Adam (all-gathers deliver the update)."""
    _assert_same_training(vp2, "plain-adam")


def test_param_sync_dispatches_at_the_start_and_first_forward_waits_vp2(vp2):
    """V=2: both chunks' gathers are dispatched before any compute and waited in each chunk's first forward."""
    _assert_gathers_follow_plan(vp2, "elastic")
    for rank in vp2:
        run = rank["elastic"]
        assert run["program"][:2] == [("PARAM_SYNC", 0), ("PARAM_SYNC", 1)]
        for events in run["events"]:
            assert events[:2] == [("PARAM_SYNC", 0), ("PARAM_SYNC", 1)]
            assert events[2:3 + run["buckets"][0]] == [("F", 0)] + [("WAIT", 0)] * run["buckets"][0]
        assert all(("UNDISPATCHED", c) not in events for c in (0, 1) for events in rank["stock"]["events"])
    # Chunk 0 of pipeline rank 0 (embedding) has several buckets: every one is gathered and waited.
    assert max(rank["elastic"]["buckets"][0] for rank in vp2) > 1


def test_param_sync_points_follow_plan_and_megatron_vp4(vp4):
    """V=4: PipeMesh dispatches chunks 2, 3 mid-forward where its plan says; depth-first = stock's points."""
    _assert_same_training(vp4, "stock")
    _assert_gathers_follow_plan(vp4, "elastic")
    _assert_gathers_follow_plan(vp4, "depth-first")
    for rank in vp4:
        assert rank["depth-first"]["events"] == rank["stock"]["events"]
        for events in rank["elastic"]["events"]:  # chunks 2, 3: launched mid-forward, before they are needed
            for chunk in (2, 3):
                assert events.index(("F", 0)) < events.index(("PARAM_SYNC", chunk)) < events.index(("F", chunk))
