"""Uneven layer splits under the PipeMesh runtime (CPU, gloo, V=2): Megatron's --pipeline-model-parallel-layout at
PP=2 and PP=4 and --decoder-first/last-pipeline-num-layers at PP=4 give the stock schedule's losses and gradients
(which equal one rank running the whole model: the split moves layers, not weights)."""
import pytest

from tests import megatron_harness as h
from tests.runtime.test_executor import _check

GROUPS_PP2 = {"depth-first": None, "elastic": [[6, 2], [4, 4]], "breadth-first": [[8], [8]]}
GROUPS_PP4 = {"depth-first": None, "elastic": [[8, 4], [6, 6]]}


def _run(pp, microbatches, num_layers, split, groups):
    results = h.run_worker("tests.runtime.workers:stock_vs_pipemesh_split", nproc=pp, timeout=300,
                           kwargs={"pp": pp, "vp": 2, "microbatches": microbatches, "num_layers": num_layers,
                                   "split": split, "groups": groups})
    layers = [r.pop("layers") for r in results]
    reference = h.run_worker("tests.runtime.workers:single_rank_reference", nproc=1,
                             kwargs={"num_layers": num_layers, "microbatches": microbatches})[0]
    _check(results, reference)
    # Per stage s = chunk * p + rank, as the planner reads the same flags.
    return tuple(layers[s % pp][s // pp] for s in range(2 * pp))


def test_layout_pp2_matches_stock():
    """--pipeline-model-parallel-layout "Et|tt|tt|tL" at PP=2, V=2 (one layer on the embedding and the loss stages)."""
    layers = _run(2, 8, 6, {"pipeline_model_parallel_layout": "Et|tt|tt|tL"}, GROUPS_PP2)
    assert layers == (1, 2, 2, 1)


def test_layout_pp4_matches_stock():
    """A PP=4, V=2 layout with a loss stage that holds no transformer layer."""
    from megatron_pipemesh.planning.layout import parse_layout

    layout = "Et|ttt|tt|t|tt|t|tt|L"
    layers = _run(4, 12, 12, {"pipeline_model_parallel_layout": layout}, GROUPS_PP4)
    assert layers == parse_layout(layout) == (1, 3, 2, 1, 2, 1, 2, 0)


def test_first_last_pp4_matches_stock():
    """--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2 at PP=4, V=2, 12 layers."""
    from megatron_pipemesh.planning.layout import LayerSplit

    layers = _run(4, 12, 12, {"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 2},
                  GROUPS_PP4)
    assert layers == LayerSplit(first=2, last=2).stage_layers(12, 4, 2) == (1, 2, 2, 1, 1, 2, 2, 1)
