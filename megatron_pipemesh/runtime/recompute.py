"""Per (chunk, micro-batch) activation recomputation through Megatron's own machinery.

:func:`recompute_scope` sets, for the duration of one forward (or backward) of one model chunk, the
switches megatron-core 0.19.2 reads at call time:

* ``Attention.checkpoint_core_attention`` (``transformer/attention.py:392``, set at construction
  from ``recompute_granularity == 'selective'`` and ``'core_attn' in recompute_modules``, read in
  ``Attention.forward`` as ``if self.checkpoint_core_attention and self.training``,
  ``attention.py:1544``): the attention core (QK^T, softmax, dropout, attention over V) runs under
  ``tensor_parallel.checkpoint`` and is recomputed in the backward — ``--recompute-modules core_attn``;
* ``TransformerLayer.recompute_input_layernorm`` / ``recompute_pre_mlp_layernorm``
  (``transformer/transformer_layer.py:447-448``, set at construction from ``'layernorm' in
  recompute_modules`` where the norm is a separate module, read at ``transformer_layer.py:632/681``
  and ``:765/977``): the norms run under ``CheckpointWithoutOutput`` and their outputs are
  recomputed by a hook — ``--recompute-modules layernorm``;
* ``TransformerLayer.recompute_mlp`` (``transformer_layer.py:449``, set from ``'mlp' in
  recompute_modules`` for dense layers, read at ``transformer_layer.py:882``): the MLP runs under
  ``tensor_parallel.checkpoint`` — ``--recompute-modules mlp``;
* ``config.recompute_granularity == 'full'`` (read in ``TransformerBlock.forward``,
  ``transformer/transformer_block.py:624``) with ``recompute_method='uniform'`` and
  ``recompute_num_layers=1``: every layer keeps only its input and is recomputed in the backward —
  Megatron's ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``.

Levers (:class:`megatron_pipemesh.schedule.levers.Lever`, whose ``switches`` say what to set): ``'none'``
and ``'host'`` (every switch off; the offloader moves a host chunk-micro-batch), ``'selective'``
(core_attn), ``'selective:<m1>+<m2>'`` with modules from ``core_attn``, ``layernorm``, ``mlp`` (exactly
those switches on), ``'full'`` (the selective switches off inside the fully recomputed layers, as
Megatron's construction leaves them under full granularity). Everything is restored on exit; the
config object is shared by every chunk of the rank, which is safe because one op runs at a time. The
runtime enters the same scope around the op's backward, so the recomputation that runs inside
``backward_step`` takes the same path as the forward did (the full-recompute replay re-enters the
layers, which read the switches again).

Cost: a scope runs around every compute op, forward and backward, so it costs O(switches), not
O(modules): the switch sites of each chunk are found by one walk of its modules and cached
(:func:`switch_sites`; walked again after any submodule registration or a change of the decoder's layer
list), and only switches whose value changes are written (and restored). On the CPU test GPT (4 layers,
69 modules) one scope took ~0.32 ms of host time with a walk per switch kind, ~0.013 ms cached; at
24 layers ~2 ms and ~0.03 ms.

Supported: Megatron's local spec and Transformer Engine specs in 16/32-bit (both go through the
same switches; the TE case is untested here). Refused with ``NotImplementedError``: FP8/FP4 (TE's
quantized checkpointing keeps extra state), CUDA graphs, CPU offloading, chunks whose decoder is
not a ``TransformerBlock`` (full) or whose layers lack the switches a level needs, and two
megatron-core 0.19.2 defects that no switch avoids:

* ``layernorm`` without Transformer Engine: ``CheckpointWithoutOutput.__init__`` sets
  ``self.fp8 = fp8 is not None`` (``tensor_parallel/random.py:740``), always true, so its recompute
  hook calls TE's ``activation_recompute_forward`` / ``fp8_autocast`` (``random.py:783-786``),
  imported only when TE is installed (``random.py:86-91``): a NameError in the backward;
* ``mlp`` where the MLP returns its output bias (``add_bias_linear``, the GPT default): the MLP's
  ``linear_fc2`` has ``skip_bias_add`` and returns its bias *Parameter* itself
  (``tensor_parallel/layers.py:1485``); as an output of ``CheckpointFunction``
  (``transformer_layer.py:896``) the parameter's history is rebased onto that node, so the
  recomputation in ``CheckpointFunction.backward`` (``random.py:656``) returns the same parameter,
  whose backward re-enters ``CheckpointFunction.backward`` without end (on CPU each reentrant level
  starts a thread: it looks like a hang). Not CPU-specific; stock ``--recompute-modules mlp`` has it
  too. Use ``--disable-bias-linear`` (then the level works) or another level.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterator, Optional, Tuple

import torch

from ..schedule.levers import Lever


def parse_runtime_level(level: str) -> Tuple[str, FrozenSet[str]]:
    """(kind name, recomputed modules) of a lever this runtime applies (:meth:`Lever.parse_runtime`), for
    callers of the tuple form."""
    lever = Lever.parse_runtime(level)
    return lever.kind.value, lever.modules


def unwrap(model_chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside Megatron's DDP / FSDP / Float16Module wrappers (anything with ``.module``)."""
    module = model_chunk
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


@dataclass(frozen=True)
class SwitchSites:
    """Where one chunk module keeps Megatron's call-time recompute switches (found once, see :func:`switch_sites`)."""

    attentions: Tuple[torch.nn.Module, ...]
    """Modules with ``checkpoint_core_attention`` (attention modules, the TransformerBlock excluded)."""
    layers: Tuple[torch.nn.Module, ...]
    """Modules with TransformerLayer's ``recompute_mlp`` / ``recompute_input_layernorm`` switches."""
    input_norm_separate: Tuple[bool, ...]
    """Per layer: its ``input_layernorm`` is a module of its own (not an ``IdentityOp``), so Megatron would set
    ``recompute_input_layernorm`` there."""
    pre_mlp_norm_separate: Tuple[bool, ...]
    """Per layer: the same for ``pre_mlp_layernorm`` / ``recompute_pre_mlp_layernorm``."""
    dense: Tuple[bool, ...]
    """Per layer: not an MoE layer (Megatron sets ``recompute_mlp`` only for dense layers)."""
    mlp_returns_bias_parameter: bool
    """Some layer's MLP returns its bias Parameter (``skip_bias_add``): the 'mlp' module is refused."""
    decoder: Optional[torch.nn.Module]
    """The chunk's decoder (None without one)."""
    decoder_layers: Tuple[int, ...]
    """``id`` of each module in the decoder's layer list when the sites were found (checked on every use)."""
    generation: int
    """:data:`_GENERATION` when the sites were found."""
    _assignments: Dict[FrozenSet[str], Tuple[Tuple[torch.nn.Module, str, bool], ...]] = field(
        default_factory=dict, compare=False, repr=False)

    def assignments(self, modules: FrozenSet[str]) -> Tuple[Tuple[torch.nn.Module, str, bool], ...]:
        """(module, switch, value) of every switch for the recomputed ``modules``, where Megatron's construction
        would set it ('layernorm' only for a separate norm module, 'mlp' only for dense layers); per module set once."""
        found = self._assignments.get(modules)
        if found is None:
            core_attn, layernorm, mlp = "core_attn" in modules, "layernorm" in modules, "mlp" in modules
            found = tuple((m, "checkpoint_core_attention", core_attn) for m in self.attentions) + tuple(
                item for layer, input_norm, pre_mlp_norm, dense in zip(
                    self.layers, self.input_norm_separate, self.pre_mlp_norm_separate, self.dense)
                for item in ((layer, "recompute_input_layernorm", layernorm and input_norm),
                             (layer, "recompute_pre_mlp_layernorm", layernorm and pre_mlp_norm),
                             (layer, "recompute_mlp", mlp and dense)))
            self._assignments[modules] = found
        return found


def _set_switch(module: torch.nn.Module, name: str, value) -> None:
    """``setattr`` for a switch. A bool attribute is stored as ``nn.Module.__setattr__`` would store it (its last
    branch, ``object.__setattr__``) without that method's parameter/buffer/module checks, a few microseconds each
    on every switch of every op; anything else goes through ``setattr``."""
    if isinstance(value, bool) and isinstance(getattr(module, name, None), bool):
        object.__setattr__(module, name, value)
    else:
        setattr(module, name, value)


_GENERATION = [0]
"""Bumped whenever any module anywhere registers a submodule (``Module.__setattr__`` / ``add_module``): cached
sites older than that are found again."""
_SITES: "weakref.WeakKeyDictionary[torch.nn.Module, SwitchSites]" = weakref.WeakKeyDictionary()
"""Chunk module -> its switch sites (weak: a chunk that is gone takes its entry with it)."""
_WATCHING = []


def _module_registered(module, name, submodule) -> None:
    _GENERATION[0] += 1


def _watch_registrations() -> None:
    """Install the global module-registration hook once (on first use, not at import)."""
    if not _WATCHING:
        _WATCHING.append(torch.nn.modules.module.register_module_module_registration_hook(_module_registered))


def _decoder_layer_ids(decoder: Optional[torch.nn.Module]) -> Tuple[int, ...]:
    """``id`` of each entry of the decoder's layer list (the cache holds the layers it found: their ids stay theirs)."""
    layers = getattr(decoder, "layers", None) if decoder is not None else None
    try:
        return tuple(id(layer) for layer in layers)
    except TypeError:  # no layer list
        return ()


def _find_sites(module: torch.nn.Module) -> SwitchSites:
    """One walk over ``module.modules()``: every switch site and what decides its value."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlock

    attentions, layers = [], []
    for m in module.modules():
        if hasattr(m, "checkpoint_core_attention") and not isinstance(m, TransformerBlock):
            attentions.append(m)
        if hasattr(m, "recompute_mlp") and hasattr(m, "recompute_input_layernorm"):
            layers.append(m)
    decoder = getattr(module, "decoder", None)
    return SwitchSites(
        attentions=tuple(attentions), layers=tuple(layers),
        input_norm_separate=tuple(not isinstance(getattr(layer, "input_layernorm", None), IdentityOp)
                                  for layer in layers),
        pre_mlp_norm_separate=tuple(not isinstance(getattr(layer, "pre_mlp_layernorm", None), IdentityOp)
                                    for layer in layers),
        dense=tuple(not getattr(layer, "is_moe_layer", False) for layer in layers),
        mlp_returns_bias_parameter=any(_mlp_returns_bias_parameter(layer) for layer in layers),
        decoder=decoder, decoder_layers=_decoder_layer_ids(decoder), generation=_GENERATION[0])


def switch_sites(module: torch.nn.Module) -> SwitchSites:
    """The switch sites of the (unwrapped) chunk ``module``, found by one walk of its modules and cached per module.

    A recompute scope runs around every compute op, so it must cost O(switches), not O(modules). The cache is
    found again when it may be stale: after any submodule registration in the process (a global
    ``register_module_module_registration_hook``: assigning, adding or replacing a submodule anywhere), when the
    chunk's ``decoder`` or the modules of its layer list changed (also edits that bypass registration, such as
    ``ModuleList.insert``), or after :func:`forget_switch_sites`. Other edits that bypass registration (writing a
    module's ``_modules`` dict directly outside the layer list) need :func:`forget_switch_sites`."""
    _watch_registrations()
    sites = _SITES.get(module)
    if (sites is None or sites.generation != _GENERATION[0] or getattr(module, "decoder", None) is not sites.decoder
            or _decoder_layer_ids(sites.decoder) != sites.decoder_layers):
        sites = _SITES[module] = _find_sites(module)
    return sites


def forget_switch_sites(module: Optional[torch.nn.Module] = None) -> None:
    """Drop the cached switch sites of ``module`` (every module's when None), e.g. after editing its tree by hand."""
    if module is None:
        _SITES.clear()
    else:
        _SITES.pop(unwrap(module), None)


def _has_transformer_engine() -> bool:
    from megatron.core.tensor_parallel import random as tp_random

    return bool(getattr(tp_random, "HAVE_TE", False))


def _mlp_returns_bias_parameter(layer: torch.nn.Module) -> bool:
    fc2 = getattr(getattr(layer, "mlp", None), "linear_fc2", None)
    return bool(getattr(fc2, "skip_bias_add", False)) and isinstance(getattr(fc2, "bias", None), torch.nn.Parameter)


def _check_supported(config, sites: SwitchSites, level: str, modules: FrozenSet[str] = frozenset()) -> None:
    what = f"PipeMesh recompute level {level!r}"
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        raise NotImplementedError(f"{what} with FP8/FP4 (Transformer Engine quantized checkpointing) is not supported")
    if getattr(config, "enable_cuda_graph", False) or getattr(config, "cuda_graph_impl", "none") != "none":
        raise NotImplementedError(f"{what} with CUDA graphs is not supported")
    if getattr(config, "cpu_offloading", False):
        raise NotImplementedError(f"{what} with --cpu-offloading is not supported")
    if "layernorm" in modules and not _has_transformer_engine():
        raise NotImplementedError(
            f"{what}: the layernorm module needs Transformer Engine in megatron-core 0.19.2 "
            "(CheckpointWithoutOutput sets fp8 = True unconditionally, tensor_parallel/random.py:740, and its "
            "recompute then calls TE's fp8_autocast); install Transformer Engine or use a level without layernorm, "
            "e.g. 'selective:core_attn+mlp'")
    if "mlp" in modules and sites.mlp_returns_bias_parameter:
        raise NotImplementedError(
            f"{what}: the mlp module cannot be recomputed when the MLP returns its bias parameter "
            "(add_bias_linear; tensor_parallel/layers.py:1485): megatron-core 0.19.2's CheckpointFunction then "
            "re-enters its own backward without end (tensor_parallel/random.py:656). Run with --disable-bias-linear "
            "or use a level without mlp, e.g. 'selective' or 'full'")


@contextlib.contextmanager
def recompute_scope(model_chunk: torch.nn.Module, level: str) -> Iterator[None]:
    """Run ``model_chunk``'s forward (or backward) inside with the switches of lever ``level``; restores on exit.
    Costs O(switch sites): the sites come from :func:`switch_sites` (one walk of the modules per chunk)."""
    switches = Lever.parse_runtime(level).switches
    modules = switches.modules
    from megatron.core.transformer.transformer_block import TransformerBlock

    module = unwrap(model_chunk)
    config = module.config
    sites = switch_sites(module)
    _check_supported(config, sites, level, modules)
    decoder = sites.decoder
    num_layers = len(sites.decoder_layers)
    attentions, layers = sites.attentions, sites.layers
    if switches.whole_layers and num_layers and not isinstance(decoder, TransformerBlock):
        raise NotImplementedError(f"full recompute needs a megatron TransformerBlock decoder, got {type(decoder).__name__}")
    if "core_attn" in modules and num_layers and not attentions:
        raise NotImplementedError(
            f"recompute level {level!r}: no attention module with Megatron's checkpoint_core_attention switch in "
            f"{type(module).__name__} (unsupported layer implementation)")
    if modules - {"core_attn"} and num_layers and not layers:
        raise NotImplementedError(
            f"recompute level {level!r}: no layer with Megatron's recompute_mlp / recompute_input_layernorm switches "
            f"in {type(module).__name__} (unsupported layer implementation)")

    saved_config = (config.recompute_granularity, config.recompute_method, config.recompute_num_layers)
    changed = []
    try:
        for m, name, value in sites.assignments(modules):
            old = getattr(m, name)
            if old != value:  # most switches already hold the value: no write, nothing to restore
                _set_switch(m, name, value)
                changed.append((m, name, old))
        config.recompute_granularity, config.recompute_method = switches.granularity, switches.method
        config.recompute_num_layers = switches.num_layers
        yield
    finally:
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = saved_config
        for m, name, old in reversed(changed):
            _set_switch(m, name, old)
