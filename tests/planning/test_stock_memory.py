"""The activation model of every stock recomputation option and layer variant against what
Megatron's own switches save, measured on the CPU tiny model (PP=1 whole model, fp32, local spec).

Megatron's real flags are set on the TransformerConfig (recompute_granularity, recompute_modules,
recompute_method, recompute_num_layers, num_query_groups, gated_linear_unit, RoPE); the saved
storages are read after the forward, so output-discarding checkpoints would count as freed.
Not measurable here: ``--recompute-modules layernorm`` (megatron-core 0.19.2's
``CheckpointWithoutOutput`` sets ``fp8 = fp8 is not None``, always true, and then needs Transformer
Engine's FP8GlobalStateManager, which this CPU machine does not have).
"""
from pathlib import Path

import dataclasses

import pytest

from megatron_pipemesh.planning.memory import ActivationShape, activation_bytes
from megatron_pipemesh.planning.stock_options import StockRecompute
from tests import megatron_harness as h

TOL = 0.001  # 0.1 %: the model states every saved tensor; the measured excess is 4-byte bookkeeping

RECOMPUTE = [
    StockRecompute(),
    StockRecompute("selective"),
    StockRecompute("selective", ("mlp",)),
    StockRecompute("selective", ("core_attn", "mlp")),
    StockRecompute("full", method="block", num_layers=1),
    StockRecompute("full", method="block", num_layers=3),
    StockRecompute("full", method="uniform", num_layers=1),
    StockRecompute("full", method="uniform", num_layers=3),
]
VARIANTS = {
    "rope": ({"position_embedding_type": "rope"}, {}, {"position_embedding": "rope"}),
    "gqa": ({}, {"num_query_groups": 2}, {"num_query_groups": 2}),
    "swiglu": ({}, {"gated_linear_unit": True, "activation_func": "silu"}, {"swiglu": True}),
}


def _config(option: StockRecompute) -> dict:
    out = {}
    if option.granularity != "none":
        out["recompute_granularity"] = option.granularity
    if option.modules:
        out["recompute_modules"] = list(option.modules)
    if option.method:
        out.update(recompute_method=option.method, recompute_num_layers=option.num_layers)
    return out


def _cases():
    cases = [("local", option, {}, _config(option), {}) for option in RECOMPUTE]
    for name, (spec, config, shape) in VARIANTS.items():
        for option in (StockRecompute(), StockRecompute("selective"), StockRecompute("selective", ("mlp",))):
            cases.append((name, option, spec, {**config, **_config(option)}, shape))
    return cases


@pytest.fixture(scope="module")
def measured():
    cases = _cases()
    worker = f"{Path(__file__).with_name('stock_workers.py')}:stock_recompute_memory"
    results = h.run_worker(worker, nproc=1, timeout=600,
                           kwargs={"cases": [{"spec": spec, "config": config} for _, _, spec, config, _ in cases]})[0]
    return [(case, saved, loss) for case, (_, saved, loss) in zip(cases, results)]


def test_every_stock_option_matches_megatrons_switches(measured):
    """Each stock recompute option's modelled bytes equal what Megatron's switch saves (within 0.1 %)."""
    spec = h.TinyGPT()
    wrong = []
    for (name, option, spec_kw, _, shape_kw), saved, _ in measured:
        tiny = dataclasses.replace(spec, **spec_kw)
        shape = ActivationShape(tiny.seq_length, tiny.micro_batch_size, tiny.hidden_size, tiny.num_attention_heads,
                                tiny.vocab_size, dtype_bytes=4, **{"position_embedding": tiny.position_embedding_type,
                                                                   **shape_kw})
        model = activation_bytes(shape, tiny.num_layers, option.level, first_stage=True, last_stage=True)
        if abs(model - saved) / saved > TOL:
            wrong.append((name, option.describe(), model, saved))
    assert not wrong, wrong


def test_recompute_options_keep_the_loss(measured):
    """Recomputation never changes the forward: the loss of every option equals no recomputation's."""
    by_variant = {}
    for (name, option, *_), _, loss in measured:
        by_variant.setdefault(name, []).append(loss)
    for name, losses in by_variant.items():
        assert max(losses) == pytest.approx(min(losses), rel=1e-6), name
