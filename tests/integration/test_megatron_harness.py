"""Demonstrates tests/megatron_harness.py: stock interleaved PP=2 x VP=2 equals no pipelining."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megatron_harness as h  # noqa: E402

pytest.importorskip("torch")
NUM_MICROBATCHES = 4


def worker(pp, vp, wrap_ddp=False):
    """Runs on every rank: one forward-backward of the tiny GPT with the stock schedule for (pp, vp)."""
    h.init_parallel(pp=pp, vp=vp)
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_no_pipelining,
        forward_backward_pipelining_with_interleaving,
    )

    spec = h.TinyGPT()
    model = h.build_model(spec, wrap_ddp=wrap_ddp)
    fb = forward_backward_pipelining_with_interleaving if pp > 1 else forward_backward_no_pipelining
    return h.run_schedule(fb, model, spec, NUM_MICROBATCHES)


@pytest.fixture(scope="module")
def reference():
    """The same global model and data through forward_backward_no_pipelining on one rank."""
    return h.merge_rank_results(h.run_worker(f"{__file__}:worker", nproc=1,
                                             kwargs={"pp": 1, "vp": None}, timeout=240))


@pytest.mark.parametrize("wrap_ddp", [False, True], ids=["plain", "megatron_ddp"])
def test_interleaved_pp2_vp2_matches_no_pipelining(reference, wrap_ddp):
    """Stock interleaved PP=2, VP=2 (plain and DDP) gives the no-pipelining schedule's losses and gradients."""
    ref = reference
    got = h.merge_rank_results(h.run_worker(f"{__file__}:worker", nproc=2,
                                            kwargs={"pp": 2, "vp": 2, "wrap_ddp": wrap_ddp},
                                            timeout=240))
    assert len(ref["losses"]) == NUM_MICROBATCHES
    assert got["losses"] == ref["losses"]
    diffs = h.compare_grads(got["grads"], ref["grads"])
    assert len(diffs) == len(ref["grads"]) > 10
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= 1e-6, (worst, diffs[worst])


def test_failure_excerpt_keeps_a_native_fault_far_from_the_end():
    """A rank's heap-corruption abort printed early survives the other ranks' long tracebacks in the message."""
    out = "\n".join(["setup"] * 10 + ["double free or corruption (out)", "Fatal Python error: Aborted",
                                      '  File "executor.py", line 300 in execute'] + ["[rank2]: traceback"] * 2000)
    excerpt = h.failure_excerpt(out, tail=200)
    assert "double free or corruption (out)" in excerpt and 'File "executor.py", line 300' in excerpt
    assert excerpt.endswith("[rank2]: traceback") and len(excerpt) < 2000
    assert not h.failure_excerpt("all fine\n" * 5).startswith("native fault")
