"""`integration/profile_batch.py`: the data loader timed in a one-process child (how rank 0 of a multi-rank profile
times it; the end-to-end runs are in tests/cli/test_profile.py and tests/integration/test_profile_links.py)."""
import pytest

from megatron_pipemesh.integration.profile_batch import MIN_REPEATS, measure_batch_s_apart
from megatron_pipemesh.integration.profile_timing import ProfileSettings

SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 257")


def test_the_child_times_every_size_from_inside_a_launch(monkeypatch):
    """Started from inside a (pretended) 4-rank launch whose rendezvous cannot be reached, the child is one process
    of its own all the same: it times each size asked."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "nowhere.invalid",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    found = measure_batch_s_apart(SMALL.split(), {1: 0.005, 2: 0.005}, ProfileSettings(warmup=1, max_seconds=0.0))
    assert sorted(found) == [1, 2]
    for timed in found.values():  # at least the fewest batches, each one's time kept for the profile's spread
        assert len(timed.columns[0]) == MIN_REPEATS and all(seconds > 0 for seconds in timed.columns[0])


def test_the_loader_is_timed_until_its_median_is_stable():
    """With a time cap, batches are taken until the median is stable (or the cap): more than the fewest where the
    hand-over's spread needs them, never a silent fixed count."""
    found = measure_batch_s_apart(SMALL.split(), {1: 0.005}, ProfileSettings(warmup=1, stable_within=0.001, stable_floor_s=0.0,
                                                                              max_seconds=1.0))
    assert len(found[1].columns[0]) > MIN_REPEATS and found[1].stable is False


def test_a_failing_child_raises_the_builders_own_message():
    """A --data-path missing here: the child's error (naming the path) is raised, for the profile's note."""
    words = SMALL.replace("--mock-data", "--data-path /nonexistent/corpus_text_document").split()
    with pytest.raises(RuntimeError, match="/nonexistent/corpus_text_document"):
        measure_batch_s_apart(words, {2: 0.005}, ProfileSettings(warmup=1, max_seconds=0.0))
