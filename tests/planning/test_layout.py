"""Uneven layer splits (planning/layout.py): Megatron's own placement, its refusals, and the costs per stage."""
import dataclasses

import pytest

from megatron_pipemesh.planning.costs import ClusterSpec, ModelSpec, ScheduleCosts, analytic_costs
from megatron_pipemesh.planning.layout import (LAYOUT_FLAG, LayerSplit, LayoutError, balanced, layout_string,
                                               parse_layout, split_candidates)
from megatron_pipemesh.planning.simulator import simulate
from megatron_pipemesh.schedule.config import ScheduleConfig
from megatron_pipemesh.schedule.ops import Op, OpKind

SPLITS = [  # (p, V, layers, split)
    (4, 2, 12, LayerSplit(first=2, last=2)),
    (4, 1, 11, LayerSplit(last=2)),
    (4, 2, 16, LayerSplit(first=4)),
    (4, 2, 14, LayerSplit(embedding_counts=True, loss_counts=True)),
    (2, 2, 7, LayerSplit(loss_counts=True)),
    (4, 2, 8, LayerSplit()),
]


def _megatron_layers(pp, vpp, num_layers, split):
    """Layers per stage as megatron-core 0.19.2 builds them (get_num_layers_to_build, no process group needed)."""
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                               num_layers_in_first_pipeline_stage=split.first, num_layers_in_last_pipeline_stage=split.last,
                               account_for_embedding_in_pipeline_split=split.embedding_counts,
                               account_for_loss_in_pipeline_split=split.loss_counts)
    return tuple(get_num_layers_to_build(config, vp_stage=c if vpp > 1 else None, pp_rank=r)
                 for c in range(vpp) for r in range(pp))


@pytest.mark.parametrize("pp,vpp,num_layers,split", SPLITS)
def test_stage_layers_are_megatrons(pp, vpp, num_layers, split):
    """Every split flag places the layers on the stages exactly as Megatron builds them."""
    assert split.stage_layers(num_layers, pp, vpp) == _megatron_layers(pp, vpp, num_layers, split)


def test_layout_text_is_read_as_megatron_reads_it():
    """The shorthand (commas, (...)*n, x*n) expands as Megatron's parser expands it; E and L must sit at the ends."""
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    for text in ("Et|tt|tt|tL", "E(tt|)*2,t*3L", "E|t*4|(tt|)*2tL", "Ettt|tL"):
        theirs = tuple(stage.count(LayerType.decoder) for stage in PipelineParallelLayerLayout.parse_str_to_list(text))
        assert parse_layout(text) == theirs, text
    assert LayerSplit.of_layout("Et|tt|tt|tL").stage_layers(6, 2, 2) == (1, 2, 2, 1)
    assert layout_string((1, 2, 2, 1)) == "Et|tt|tt|tL" and layout_string((0, 3, 0)) == "E|ttt|L"
    for bad, words in (("tt|Et|tL", "'E' must open the first stage"), ("Et|tm|L", "multi-token"),
                       ("Ex|tL", "unknown layer character")):
        with pytest.raises(LayoutError, match=words):
            parse_layout(bad)


def test_refused_splits_name_the_flag_and_a_valid_example():
    """What Megatron refuses (or cannot build) is an error before any work, with a layout that would run."""
    with pytest.raises(LayoutError, match=r"--num-layers 10 does not split evenly .* --pipeline-model-parallel-layout "
                                          r'"Et\|tt\|tt\|t\|t\|t\|t\|tL"'):
        LayerSplit().stage_layers(10, 4, 2)
    # Megatron 0.19.2 divides by zero building first/last at p = 2 with V > 1: the same placement as a layout.
    with pytest.raises(LayoutError, match=r'divides by zero.*--pipeline-model-parallel-layout "Et\|tt\|t\|ttL"'):
        LayerSplit(first=2, last=4).stage_layers(6, 2, 2)
    with pytest.raises(LayoutError, match="--pipeline-model-parallel-layout has 4 stages but p x V = 2 x 3"):
        LayerSplit.of_layout("Et|tt|tt|tL").stage_layers(6, 2, 3)
    with pytest.raises(LayoutError, match="leave 5 layers for 2 middle pipeline ranks"):
        LayerSplit(first=1, last=2).stage_layers(8, 4, 1)
    with pytest.raises(LayoutError, match="cannot be combined"):
        LayerSplit(first=2, embedding_counts=True)
    assert LayerSplit.of_layout("Et|tt|tt|tL").virtual_sizes(6, 2) == [2]
    assert LayerSplit(first=2, last=2).virtual_sizes(12, 4) == [1, 2]
    assert LayerSplit().virtual_sizes(12, 2) == [1, 2, 3, 6]


def test_split_candidates_take_layers_off_the_end_stages():
    """The advice's splits for one (p, V): the even one first, then fewer layers on the last stage (and stage 0),
    given to the middle stages; every candidate places all the layers and runs as a layout."""
    candidates = split_candidates(24, 4, 1)
    assert candidates[0].even
    layers = [c.stage_layers(24, 4, 1) for c in candidates]
    assert layers[:3] == [(6, 6, 6, 6), (5, 7, 6, 6), (6, 7, 6, 5)]
    assert all(sum(split) == 24 and split[-1] <= 6 and split[0] <= 6 for split in layers)
    assert balanced(10, 4, 2) == (1, 2, 2, 1, 1, 1, 1, 1)
    assert [c.flags() for c in split_candidates(4, 2, 1)] == [[]]  # two stages: nothing in between to take layers
    assert candidates[1].flags() == [LAYOUT_FLAG, "Ettttt|ttttttt|tttttt|ttttttL"]


MODEL = ModelSpec(num_layers=16, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=51200)
CLUSTER = ClusterSpec(dp=2, device_tflops=100, dp_gbps=10, p2p_gbps=10)


def test_uneven_costs_follow_the_layer_counts():
    """Per stage the forward, backward, recomputation, activations and data-parallel volume scale with its layers;
    a stage with one layer more takes one layer's time more, and the simulated compute per rank says so."""
    config = ScheduleConfig.depth_first(4, 2, 8)
    even = analytic_costs(MODEL, CLUSTER, config, levels=("none", "full"))
    # Ranks 0 and 3 hold 1 layer per chunk, ranks 1 and 2 hold 3 (even: 2 everywhere).
    uneven_model = dataclasses.replace(MODEL, layer_split=LayerSplit(first=2, last=2))
    uneven = analytic_costs(uneven_model, CLUSTER, config, levels=("none", "full"))
    assert uneven_model.stage_layers(4, 2) == (1, 3, 3, 1, 1, 3, 3, 1)
    one_layer = even.forward_s / 2
    assert uneven.forward_s == pytest.approx(3 * one_layer)  # the scalars describe the largest chunk
    a, b = ScheduleCosts(config, even), ScheduleCosts(config, uneven)
    forward = Op(OpKind.FORWARD, 0, 0)
    assert b.compute(1, forward) - b.compute(0, forward) == pytest.approx(2 * one_layer)
    assert b.compute(1, forward) == pytest.approx(a.compute(1, forward) + one_layer)
    assert b.compute(1, Op(OpKind.BACKWARD, 0, 0)) == pytest.approx(a.compute(1, Op(OpKind.BACKWARD, 0, 0)) + 2 * one_layer)
    assert b.bytes_at(1, 0, "none") > a.bytes_at(1, 0, "none") > b.bytes_at(2, 0, "none") - b.bytes_at(0, 1, "none")
    assert b.stage_costs(0, 0).recompute_s["full"] == pytest.approx(b.stage_costs(1, 0).recompute_s["full"] / 3)
    reduction = Op(OpKind.GRAD_SYNC, 1)
    assert b.data_parallel(1, reduction) == pytest.approx(1.5 * a.data_parallel(1, reduction))
    assert sum(uneven.static_bytes) == pytest.approx(sum(even.static_bytes))
    assert uneven.static_bytes[1] > even.static_bytes[1] and uneven.static_bytes[0] < even.static_bytes[0]
    busy_even = [r.busy_s for r in simulate(config, even).ranks]
    busy = [r.busy_s for r in simulate(config, uneven).ranks]
    # Rank 1 runs m V = 16 chunk-micro-batches of one layer more, forward and backward (3 forwards' time per layer).
    assert busy[1] - busy_even[1] == pytest.approx(16 * 3 * one_layer)
    assert busy[0] - busy_even[0] == pytest.approx(-16 * 3 * one_layer)
    assert busy[3] - busy_even[3] == pytest.approx(-16 * 3 * one_layer)


def test_stock_planner_and_bound_take_an_uneven_split():
    """With a layout, the program-order peaks equal the simulated ones per stage kind, stock searches only the
    layout's V, the planner fits it, and the tight bound is never beaten."""
    from megatron_pipemesh.planning.bounds import bound_for, virtual_sizes
    from megatron_pipemesh.planning.planner import plan_schedule
    from megatron_pipemesh.planning.stock import best_stock, order_peaks, uniform_plan

    model = dataclasses.replace(MODEL, num_layers=6, layer_split=LayerSplit.of_layout("Et|tt|tt|tL"))
    assert virtual_sizes(model, 2) == [2]
    levels = ["none", "selective", "block:1", "uniform:2", "full"]
    for config in (ScheduleConfig.depth_first(2, 2, 8), ScheduleConfig(2, 2, 8, (6, 2), (4, 4))):
        costs = analytic_costs(model, CLUSTER, config, levels=levels)
        peaks = order_peaks(config, costs, levels)
        for level in levels:
            simulated = simulate(config, costs, uniform_plan(config, level))
            assert peaks[level] == pytest.approx(tuple(r.peak_activation_bytes for r in simulated.ranks)), level
            assert bound_for(config, ScheduleCosts(config, costs)).seconds <= simulated.iteration_s * (1 + 1e-9)
    stock = best_stock(model, CLUSTER, 2, 8, float("inf"))
    assert stock.setting.vpp == 2
    plan, _ = plan_schedule(2, 2, 8, lambda cfg: analytic_costs(model, CLUSTER, cfg, levels=levels), 8 * 1024 ** 3)
    assert plan.fits and plan.result.iteration_s <= stock.iteration_s * (1 + 1e-9)
