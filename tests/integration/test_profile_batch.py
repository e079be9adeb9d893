"""`integration/profile_batch.py`: the data loader timed in a one-process child (how rank 0 of a multi-rank profile
times it; the end-to-end runs are in tests/cli/test_profile.py and tests/integration/test_profile_links.py)."""
import pytest

from megatron_pipemesh.integration.profile_batch import measure_batch_s_apart

SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 257")


def test_the_child_times_every_size_from_inside_a_launch(monkeypatch):
    """Started from inside a (pretended) 4-rank launch whose rendezvous cannot be reached, the child is one process
    of its own all the same: it times each size asked."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "nowhere.invalid",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    found = measure_batch_s_apart(SMALL.split(), {1: 0.005, 2: 0.005}, 1, 1)
    assert sorted(found) == [1, 2] and all(seconds > 0 for seconds in found.values())


def test_a_failing_child_raises_the_builders_own_message():
    """A --data-path missing here: the child's error (naming the path) is raised, for the profile's note."""
    words = SMALL.replace("--mock-data", "--data-path /nonexistent/corpus_text_document").split()
    with pytest.raises(RuntimeError, match="/nonexistent/corpus_text_document"):
        measure_batch_s_apart(words, {2: 0.005}, 1, 1)
