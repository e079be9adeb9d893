"""Two gloo ranks: link groups made by install()'s initializer (timeout, warm-up), clean recovery from an
exception inside the schedule, and profiler ranges around every op."""
import pytest

from tests import megatron_harness as h


@pytest.fixture(scope="module")
def results():
    return h.run_worker("tests.runtime.gpu_path_workers:failing_iteration", nproc=2, timeout=240)


def test_link_groups_carry_the_distributed_timeout_and_are_warmed_up(results):
    """install()'s initialize_model_parallel makes the 4 link groups of a rank with the distributed
    timeout (3 min here) and sends/receives once on each before any schedule call."""
    for rank, result in enumerate(results):
        peer = 1 - rank
        assert set(result["link_timeouts"].values()) == {180.0}
        assert sorted(result["link_timeouts"]) == sorted([f"F {rank}->{peer}", f"F {peer}->{rank}",
                                                         f"B {rank}->{peer}", f"B {peer}->{rank}"])
        assert sorted(result["warmed"]) == sorted(result["link_timeouts"])


def test_exception_leaves_megatron_usable_and_the_next_iteration_matches(results):
    """forward_step raising mid-iteration: the error surfaces, no_sync is exited, the forward-backward timer
    is stopped, the abandoned receives are counted, and the next iteration gives the same losses and
    gradients as the iteration before the failure (stale receives cannot take its data)."""
    assert "injected failure in chunk 0 micro-batch 2" in results[0]["error"]
    assert "injected failure in chunk 0 micro-batch 1" in results[1]["error"]
    for result in results:
        assert result["after_failure"]["timer_running"] is False
        assert result["after_failure"]["no_sync_depth"] == 0
        assert result["timer_events"] == [("start", "forward-backward"), ("stop", "forward-backward")]
    assert sum(r["after_failure"]["abandoned_receives"] for r in results) >= 1
    first = h.merge_rank_results([r["first"] for r in results])
    third = h.merge_rank_results([r["third"] for r in results])
    assert first["losses"] and third["losses"] == first["losses"]
    assert max(h.compare_grads(third["grads"], first["grads"]).values()) == 0.0


def test_profiler_trace_shows_every_op_of_the_plan(results):
    """A torch.profiler trace holds one 'PipeMesh <op>' range per op of the rank's program."""
    for result in results:
        assert result["ranges"] == sorted({f"PipeMesh {op}" for op in result["program"]})
        assert any(name.startswith("PipeMesh RECV_F") for name in result["ranges"])
        assert "PipeMesh F1.3" in result["ranges"]
