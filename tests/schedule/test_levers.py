"""Memory levers: names, parsing, fields, the cost model's memory and time, the runtime's switches, and that
no other module compares lever names."""
import ast
import copy
import json
import pickle
from pathlib import Path

import pytest

from megatron_pipemesh.schedule.levers import (BASIC_LEVERS, CATEGORIES, DEVICE, FULL, HOST, KEPT, SELECTIVE, Lever,
                                               LeverError, LeverKind, RecomputeSwitches, runtime_lever)

CANONICAL = ["none", "host", "selective", "selective:layernorm", "selective:mlp", "selective:core_attn+layernorm",
             "selective:core_attn+mlp", "selective:layernorm+mlp", "selective:core_attn+layernorm+mlp", "full",
             "uniform:1", "uniform:3", "block:1", "block:2"]


@pytest.mark.parametrize("name", CANONICAL)
def test_canonical_names_round_trip(name):
    """A canonical name parses to the lever that prints as it, is interned, and survives pickle/copy/JSON."""
    lever = Lever.parse(name)
    assert lever == name and str(lever) == name and repr(lever) == repr(name) and f"{lever}" == name
    assert Lever.parse(lever) is lever and Lever.parse(str(lever)) is lever and Lever(name) is lever
    assert pickle.loads(pickle.dumps(lever)) is lever and copy.deepcopy(lever) is lever
    assert json.dumps({lever: [lever]}) == json.dumps({name: [name]})
    assert hash(lever) == hash(name) and {name: 1}[lever] == 1 and {lever: 1}[name] == 1


@pytest.mark.parametrize("text,name", [
    ("selective:core_attn", "selective"), ("selective:mlp+core_attn", "selective:core_attn+mlp"),
    ("selective:mlp+layernorm+core_attn", "selective:core_attn+layernorm+mlp"), ("selective:mlp+mlp", "selective:mlp"),
    ("uniform:02", "uniform:2"),
])
def test_other_spellings_parse_to_the_canonical_lever(text, name):
    assert Lever.parse(text) is Lever.parse(name)


def test_selective_names_module_sets_in_megatron_order():
    assert Lever.selective(["core_attn"]) is SELECTIVE
    assert Lever.selective(("mlp", "core_attn")) == "selective:core_attn+mlp"
    assert Lever.selective({"layernorm"}).modules == frozenset({"layernorm"})
    for bad in ((), ("attn",), ("core_attn", "moe")):
        with pytest.raises(LeverError, match="--recompute-modules .*use a non-empty subset of core_attn layernorm mlp "
                                             "for a dense GPT layer"):
            Lever.selective(bad)


def test_fields():
    """kind, modules, layers and the predicates of every kind."""
    rows = {  # name: kind, modules, layers, is_device, is_host, is_selective, recomputes, checkpoints, per_chunk
        "none": (LeverKind.DEVICE, set(), 0, True, False, False, False, False, False),
        "host": (LeverKind.HOST, set(), 0, False, True, False, False, False, False),
        "selective": (LeverKind.SELECTIVE, {"core_attn"}, 0, False, False, True, True, False, False),
        "selective:core_attn+mlp": (LeverKind.SELECTIVE, {"core_attn", "mlp"}, 0, False, False, True, True, False, False),
        "full": (LeverKind.FULL, set(), 1, False, False, False, True, True, False),
        "uniform:3": (LeverKind.UNIFORM, set(), 3, False, False, False, True, True, True),
        "block:2": (LeverKind.BLOCK, set(), 2, False, False, False, True, True, True),
    }
    for name, row in rows.items():
        lever = Lever.parse(name)
        assert (lever.kind, set(lever.modules), lever.layers, lever.is_device, lever.is_host, lever.is_selective,
                lever.recomputes, lever.checkpoints_layers, lever.per_chunk) == row, name
        assert lever.runtime_applicable is not lever.per_chunk
        assert lever.kept is (DEVICE if lever.is_host else lever)
        assert lever.category in CATEGORIES
    assert [Lever.parse(n).category for n in ("none", "host", "selective:mlp", "full", "block:2")] == list(CATEGORIES) + ["full"]
    assert (DEVICE, HOST, SELECTIVE, FULL) == ("none", "host", "selective", "full") and BASIC_LEVERS == ("none", "selective", "full")
    with pytest.raises(AttributeError, match="read-only"):
        FULL.layers = 2


def test_kept_table():
    """KEPT[level] is Lever.parse(level).kept, for levers and names."""
    assert KEPT["host"] is KEPT[HOST] is DEVICE and KEPT["none"] is DEVICE
    assert KEPT[FULL] is FULL and KEPT["selective:core_attn"] is SELECTIVE
    with pytest.raises(LeverError, match="unknown recompute level 'partial'"):
        KEPT["partial"]


# The messages PipeMesh printed before levers had a module of their own (tests elsewhere match parts of them).
PARSE_MESSAGE = ("unknown recompute level {!r}; use one of none, selective, full, 'host', 'selective:<modules joined "
                 "by +>' (modules from core_attn, layernorm, mlp), 'uniform:<k>' or 'block:<k>'")
RUNTIME_MESSAGE = ("unknown recompute level {!r}; use one of none, selective, full or 'selective:<modules joined by +>' "
                   "with modules from core_attn, layernorm, mlp (e.g. 'selective:core_attn+mlp')")


@pytest.mark.parametrize("text", ["partial", "", "none:1", "host:1", "full:2", "selective:", "selective:attn",
                                  "selective:core_attn+", "uniform", "uniform:0", "block:-1", "block:x", "uniform:²",
                                  None, 3, ["full"]])
def test_parse_errors(text):
    with pytest.raises(LeverError) as error:
        Lever.parse(text)
    assert str(error.value) == PARSE_MESSAGE.format(text)
    assert isinstance(error.value, ValueError)
    assert runtime_lever(text) is None


@pytest.mark.parametrize("text", ["partial", "uniform:2", "block:1", None, ["full"]])
def test_runtime_refuses_what_it_does_not_apply(text):
    with pytest.raises(LeverError) as error:
        Lever.parse_runtime(text)
    assert str(error.value) == RUNTIME_MESSAGE.format(text)
    assert runtime_lever(text) is None


def test_runtime_applies_device_host_selective_and_full():
    for name in ("none", "host", "selective", "selective:layernorm+mlp", "full"):
        assert Lever.parse_runtime(name) is Lever.parse(name) is runtime_lever(name)


def test_runtime_switches():
    """What the runtime sets in Megatron: every switch off for none and host, the modules for selective levers,
    full granularity with one layer per checkpoint (module switches off) for full."""
    assert DEVICE.switches == HOST.switches == RecomputeSwitches(None, None, None, frozenset())
    assert SELECTIVE.switches == RecomputeSwitches("selective", None, None, frozenset({"core_attn"}))
    assert Lever.parse("selective:core_attn+mlp").switches.modules == frozenset({"core_attn", "mlp"})
    assert FULL.switches == RecomputeSwitches("full", "uniform", 1, frozenset())
    assert FULL.switches.whole_layers and not SELECTIVE.switches.whole_layers
    with pytest.raises(LeverError, match="unknown recompute level 'block:2'"):
        Lever.parse("block:2").switches


TERMS = {"kept": 10.0, "layernorm": 1.0, "mlp": 4.0, "core_attn": 7.0}
"""One layer's saved bytes by the module whose recomputation frees them; 22 in all."""
CHECKPOINT = 2.0


@pytest.mark.parametrize("name,layer,chunk,transient", [
    ("none", 22, 66, 0), ("host", 22, 66, 0), ("selective", 15, 45, 7), ("selective:core_attn+mlp", 11, 33, 11),
    ("selective:layernorm", 21, 63, 1), ("full", 2, 6, 20),
    ("uniform:2", None, 4, 40), ("uniform:5", None, 2, 60), ("block:1", None, 46, 20), ("block:4", None, 6, 20),
])
def test_memory_methods(name, layer, chunk, transient):
    """Bytes per layer, per chunk of 3 layers, and re-created by the backward's recomputation (TERMS, CHECKPOINT)."""
    lever = Lever.parse(name)
    if layer is None:
        with pytest.raises(LeverError, match="per-chunk"):
            lever.layer_bytes(TERMS, CHECKPOINT)
    else:
        assert lever.layer_bytes(TERMS, CHECKPOINT) == layer
    assert lever.chunk_bytes(3, TERMS, CHECKPOINT) == chunk
    assert lever.transient_bytes(3, TERMS, CHECKPOINT) == transient
    assert lever.transient_bytes(0, TERMS, CHECKPOINT) == 0


@pytest.mark.parametrize("name,seconds", [
    ("none", 0.0), ("host", 0.0), ("selective", 3 * 0.5), ("selective:core_attn+mlp", 3 * 0.75),
    ("full", 6.0), ("uniform:2", 6.0), ("block:1", 2.0), ("block:5", 6.0),
])
def test_recompute_seconds(name, seconds):
    """Extra backward seconds of a 3-layer chunk whose forward takes 6 s (core_attn 0.5 s, mlp 0.25 s a layer)."""
    assert Lever.parse(name).recompute_seconds(3, 6.0, {"core_attn": 0.5, "mlp": 0.25, "layernorm": 0.125}) == seconds


# What the cost model computed before levers had a module of their own (megatron_pipemesh at 1510226): per shape and
# lever, activation_bytes of a 3-layer chunk (middle, first, last stage) and transient_bytes; analytic_costs' recompute_s.
PREVIOUS = {
    "local": {
        "none": [516997120.0, 519127040.0, 783370240.0, 0.0], "host": [516997120.0, 519127040.0, 783370240.0, 0.0],
        "selective": [114343936.0, 116473856.0, 380717056.0, 134217728.0],
        "selective:mlp": [466665472.0, 468795392.0, 733038592.0, 16777216.0],
        "selective:core_attn+mlp": [64012288.0, 66142208.0, 330385408.0, 150994944.0],
        "selective:layernorm": [504365056.0, 506494976.0, 770738176.0, 4210688.0],
        "full": [7340032.0, 9469952.0, 273713152.0, 169885696.0],
        "uniform:2": [5242880.0, 7372800.0, 271616000.0, 339771392.0],
        "block:1": [347111424.0, 349241344.0, 613484544.0, 169885696.0]},
    "te_gqa_rope_sp": {
        "none": [127647744.0, 127664128.0, 337922048.0, 0.0], "host": [127647744.0, 127664128.0, 337922048.0, 0.0],
        "selective": [127451136.0, 127467520.0, 337725440.0, 65536.0],
        "selective:mlp": [52150272.0, 52166656.0, 262424576.0, 25165824.0],
        "selective:core_attn+mlp": [51953664.0, 51970048.0, 262227968.0, 25231360.0],
        "selective:layernorm": [127647744.0, 127664128.0, 337922048.0, 0.0],
        "full": [6815744.0, 6832128.0, 217090048.0, 40452096.0],
        "uniform:2": [4718592.0, 4734976.0, 214992896.0, 80904192.0],
        "block:1": [87719936.0, 87736320.0, 297994240.0, 40452096.0]},
    "recompute_s": {
        "none": 0.0, "selective": 0.00036709122188034184, "selective:mlp": 0.0007341824437606837,
        "selective:core_attn+mlp": 0.0011012736656410256, "selective:layernorm": 3.3554432e-05,
        "full": 0.0014683648875213676, "uniform:2": 0.0014683648875213676, "block:1": 0.0004894549625071226},
}


def test_cost_model_numbers_unchanged():
    """The memory model and the analytic costs, now computed by the levers' methods, give the same numbers."""
    from megatron_pipemesh.planning.costs import ClusterSpec, ModelSpec, analytic_costs
    from megatron_pipemesh.planning.memory import ActivationShape, activation_bytes, transient_bytes
    from megatron_pipemesh.schedule.config import ScheduleConfig

    shapes = {
        "local": ActivationShape(seq_length=1024, micro_batch_size=2, hidden_size=512, num_attention_heads=8,
                                 vocab_size=32000, attention_dropout=0.1, hidden_dropout=0.1),
        "te_gqa_rope_sp": ActivationShape(seq_length=2048, micro_batch_size=1, hidden_size=1024, num_attention_heads=16,
                                          vocab_size=50304, tp=2, sequence_parallel=True, norm_stat_bytes=4,
                                          layer_spec="te", num_query_groups=4, swiglu=True, position_embedding="rope"),
    }
    for name, shape in shapes.items():
        for level, expected in PREVIOUS[name].items():
            got = [activation_bytes(shape, 3, level), activation_bytes(shape, 3, level, first_stage=True),
                   activation_bytes(shape, 3, level, last_stage=True), transient_bytes(shape, 3, level)]
            assert got == expected, (name, level)
    model = ModelSpec(num_layers=12, hidden_size=1024, num_attention_heads=16, seq_length=2048, linear_bias=False)
    costs = analytic_costs(model, ClusterSpec(), ScheduleConfig.depth_first(2, 2, 4), list(PREVIOUS["recompute_s"]))
    # The forward is now priced as its GEMMs and its attention core apart (FP8 runs only the GEMMs faster): the same
    # numbers to the last bit or two of a double.
    assert costs.recompute_s == pytest.approx(PREVIOUS["recompute_s"], rel=1e-13)
    assert all(type(level) is Lever for level in costs.recompute_s)


# Lever names compared outside schedule/levers.py ---------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
NAMES = {kind.value for kind in LeverKind}
LEVER_CONSTANTS = {"DEVICE", "HOST", "SELECTIVE", "FULL"}

ALLOWED = [  # (file, text on the flagged line): comparisons of other vocabularies that share a word with the levers
    ("megatron_pipemesh/planning/stock.py", "granularity"),  # Megatron's --recompute-granularity / --recompute-method
    ("megatron_pipemesh/planning/stock_options.py", "granularity"),  # the same flags, where they are declared
    ("megatron_pipemesh/bench/report.py", "recompute.granularity =="),  # the same flag of a stock row
    ("megatron_pipemesh/integration/megatron_command.py", "granularity =="),  # the same flag of a user's command
    ("megatron_pipemesh/runtime/recompute.py", '"cuda_graph_impl", "none") != "none"'),  # Megatron's --cuda-graph-impl
    ("megatron_pipemesh/runtime/unsupported.py", 'v not in (None, "none")'),  # the same flag
    ("megatron_pipemesh/planning/simulator.py", 'waited_on == "host"'),  # the timeline's wait cause (schedule/timeline.py)
    ("megatron_pipemesh/planning/rank_model.py", 'waited_on == "host"'),  # the same
]


def _is_name(node) -> bool:
    """A lever name ('full', 'selective:mlp', ...) or one of the lever constants (DEVICE, HOST, ...)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.partition(":")[0] in NAMES
    return isinstance(node, ast.Name) and node.id in LEVER_CONSTANTS


def _names_in(node) -> bool:
    return _is_name(node) or (isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(_is_name, node.elts)))


def lever_comparisons(root: Path = ROOT):
    """(file, line number, line) of every comparison with a lever name (==, !=, in, not in, is) and every
    startswith / endswith / partition / split with one, in megatron_pipemesh/ and scripts/ but levers.py."""
    found = []
    for path in sorted([*root.joinpath("megatron_pipemesh").rglob("*.py"), *root.joinpath("scripts").rglob("*.py")]):
        relative = path.relative_to(root).as_posix()
        if relative == "megatron_pipemesh/schedule/levers.py":
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Compare):
                hit = any(map(_names_in, [node.left, *node.comparators]))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                hit = node.func.attr in ("startswith", "endswith", "partition", "split") and any(map(_names_in, node.args))
            else:
                continue
            if hit:
                found.append((relative, node.lineno, lines[node.lineno - 1].strip()))
    return found


def test_no_lever_name_comparisons_outside_levers():
    """Every other module asks a Lever (is_host, recomputes, kept, ...) instead of comparing names; the allow-list
    holds only other vocabularies that use the same words, and each entry is still needed."""
    found = lever_comparisons()
    allowed = lambda file, line: any(file == f and text in line for f, text in ALLOWED)  # noqa: E731
    assert [hit for hit in found if not allowed(hit[0], hit[2])] == []
    assert [entry for entry in ALLOWED if not any(f == entry[0] and entry[1] in line for f, _, line in found)] == []


def test_the_scan_finds_comparisons(tmp_path):
    """The scan flags the forms it looks for (and not docstrings or dict keys)."""
    package = tmp_path / "megatron_pipemesh"
    package.mkdir()
    package.joinpath("bad.py").write_text(
        '"""level == "full" in a docstring."""\n'
        'a = level == "full"\n'
        'b = level in ("none", "host")\n'
        'c = level.startswith("selective")\n'
        'd = "selective:mlp" != level\n'
        'e = level == HOST\n'
        'f = {"none": 0.0}\n')
    assert [line for _, line, _ in lever_comparisons(tmp_path)] == [2, 3, 4, 5, 6]
