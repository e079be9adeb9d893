"""runtime/recompute.py finds a chunk's switch sites once: a recompute scope (one per compute op) costs O(switches),
not a walk of every module, and a changed module tree is walked again. Plain torch modules shaped like Megatron's."""
import types

import pytest
import torch


@pytest.fixture(scope="module")
def recompute():
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    from megatron_pipemesh.runtime import recompute

    return recompute


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.checkpoint_core_attention = False
        self.linear_qkv, self.linear_proj = torch.nn.Linear(4, 12), torch.nn.Linear(4, 4)


class Layer(torch.nn.Module):
    """TransformerLayer's switches, an attention and some plain modules (what a walk has to visit)."""

    def __init__(self):
        super().__init__()
        self.recompute_input_layernorm = self.recompute_pre_mlp_layernorm = self.recompute_mlp = False
        self.input_layernorm, self.pre_mlp_layernorm = torch.nn.LayerNorm(4), torch.nn.LayerNorm(4)
        self.self_attention = Attention()
        self.mlp = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])


def _chunk(layers: int = 6):
    chunk = torch.nn.Module()
    chunk.config = types.SimpleNamespace(fp8=None, fp4=None, enable_cuda_graph=False, cuda_graph_impl="none",
                                         cpu_offloading=False, recompute_granularity=None, recompute_method=None,
                                         recompute_num_layers=None)
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = torch.nn.ModuleList([Layer() for _ in range(layers)])
    wrapper = torch.nn.Module()
    wrapper.module = chunk  # like DDP / Float16Module
    return wrapper, chunk


@pytest.fixture
def walks(monkeypatch):
    """Counts ``Module.modules()`` walks started on any module."""
    counter = {"walks": 0}
    original = torch.nn.Module.modules

    def counting(self):
        counter["walks"] += 1
        return original(self)

    monkeypatch.setattr(torch.nn.Module, "modules", counting)
    return counter


def _attention_switches(chunk):
    return [layer.self_attention.checkpoint_core_attention for layer in chunk.decoder.layers]


def test_a_scope_per_op_does_not_walk_the_modules(recompute, walks):
    """Many ops on one chunk: at most one walk of its modules in all (the first scope finds the sites); the switches
    are set inside every scope and restored after it."""
    wrapper, chunk = _chunk()
    for _ in range(30):
        for level in ("selective", "none"):
            with recompute.recompute_scope(wrapper, level):
                assert all(_attention_switches(chunk)) is (level == "selective")
            assert not any(_attention_switches(chunk))
    assert walks["walks"] <= 1, f"{walks['walks']} walks of module.modules() for 60 scopes"


def test_a_changed_tree_is_walked_again(recompute):
    """Added layers (append: registration), replaced attentions (setattr), a layer list edited without registration
    (ModuleList.insert) and an explicit forget all reach the new modules' switches."""
    wrapper, chunk = _chunk(2)
    with recompute.recompute_scope(wrapper, "selective"):
        pass
    chunk.decoder.layers.append(Layer())
    chunk.decoder.layers[0].self_attention = Attention()
    with recompute.recompute_scope(wrapper, "selective"):
        assert _attention_switches(chunk) == [True, True, True]
    inserted = Layer()
    generation = recompute._GENERATION[0]
    torch.nn.ModuleList.insert(chunk.decoder.layers, 0, inserted)  # writes _modules directly: no registration hook
    assert recompute._GENERATION[0] == generation
    with recompute.recompute_scope(wrapper, "selective"):
        assert inserted.self_attention.checkpoint_core_attention
    assert not any(_attention_switches(chunk))
    hidden = Attention()
    chunk.decoder.layers[1]._modules["self_attention"] = hidden  # bypasses everything the cache watches
    recompute.forget_switch_sites(wrapper)
    with recompute.recompute_scope(wrapper, "selective"):
        assert hidden.checkpoint_core_attention
    assert not hidden.checkpoint_core_attention


def test_sites_are_cached_per_chunk_and_leave_with_it(recompute):
    """One entry per chunk module, weakly held: a chunk that is gone leaves no entry behind."""
    import gc
    import weakref

    wrapper, chunk = _chunk(1)
    sites = recompute.switch_sites(chunk)
    assert recompute.switch_sites(chunk) is sites and len(sites.attentions) == len(sites.layers) == 1
    entries, gone = len(recompute._SITES), weakref.ref(chunk)
    del wrapper, chunk, sites
    gc.collect()
    assert gone() is None and len(recompute._SITES) == entries - 1
