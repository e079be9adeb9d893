"""`integration/profile_siblings.py`: the other cores computing while the profile times."""
import os

import pytest

from megatron_pipemesh.integration.profile_siblings import busy_siblings

SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 257")

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@needs_two_cores
def test_inside_the_block_this_process_has_one_core_and_a_sibling_computes_on_the_next():
    """This process is pinned to its first core, the sibling computes on the second (it burns CPU there), and
    after the block the affinity is back and the sibling gone."""
    import time

    allowed = os.sched_getaffinity(0)
    first, second = sorted(allowed)[:2]
    with busy_siblings(SMALL.split(), 1) as cores:
        assert cores == [second] and os.sched_getaffinity(0) == {first}
        children = [int(pid) for pid in open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()]
        assert len(children) == 1 and os.sched_getaffinity(children[0]) == {second}
        before = _cpu_seconds(children[0])
        time.sleep(1.0)
        assert _cpu_seconds(children[0]) - before > 0.5  # computing, not waiting
    assert os.sched_getaffinity(0) == allowed
    assert not os.path.exists(f"/proc/{children[0]}") or open(f"/proc/{children[0]}/stat").read().split()[2] == "Z"


@needs_two_cores
def test_a_sibling_that_cannot_start_raises_its_own_error_and_the_affinity_is_restored():
    allowed = os.sched_getaffinity(0)
    with pytest.raises(RuntimeError, match="the sibling computing on core .* failed: .*hidden"):
        with busy_siblings(SMALL.replace("--hidden-size 64", "--hidden-size 62").split(), 1):
            pass
    assert os.sched_getaffinity(0) == allowed


def test_no_siblings_asked_changes_nothing():
    allowed = os.sched_getaffinity(0)
    with busy_siblings(SMALL.split(), 0) as cores:
        assert cores == [] and os.sched_getaffinity(0) == allowed
