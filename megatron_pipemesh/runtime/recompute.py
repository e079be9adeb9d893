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
from typing import FrozenSet, Iterator, List, Tuple

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


def _attention_modules(module: torch.nn.Module) -> List[torch.nn.Module]:
    from megatron.core.transformer.transformer_block import TransformerBlock

    return [m for m in module.modules()
            if hasattr(m, "checkpoint_core_attention") and not isinstance(m, TransformerBlock)]


def _layers(module: torch.nn.Module) -> List[torch.nn.Module]:
    """Modules with TransformerLayer's module-recompute switches (read at call time)."""
    return [m for m in module.modules() if hasattr(m, "recompute_mlp") and hasattr(m, "recompute_input_layernorm")]


def _has_transformer_engine() -> bool:
    from megatron.core.tensor_parallel import random as tp_random

    return bool(getattr(tp_random, "HAVE_TE", False))


def _mlp_returns_bias_parameter(layer: torch.nn.Module) -> bool:
    fc2 = getattr(getattr(layer, "mlp", None), "linear_fc2", None)
    return bool(getattr(fc2, "skip_bias_add", False)) and isinstance(getattr(fc2, "bias", None), torch.nn.Parameter)


def _check_supported(config, module: torch.nn.Module, level: str, modules: FrozenSet[str] = frozenset()) -> None:
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
    if "mlp" in modules and any(_mlp_returns_bias_parameter(layer) for layer in _layers(module)):
        raise NotImplementedError(
            f"{what}: the mlp module cannot be recomputed when the MLP returns its bias parameter "
            "(add_bias_linear; tensor_parallel/layers.py:1485): megatron-core 0.19.2's CheckpointFunction then "
            "re-enters its own backward without end (tensor_parallel/random.py:656). Run with --disable-bias-linear "
            "or use a level without mlp, e.g. 'selective' or 'full'")


@contextlib.contextmanager
def recompute_scope(model_chunk: torch.nn.Module, level: str) -> Iterator[None]:
    """Run ``model_chunk``'s forward (or backward) inside with the switches of lever ``level``; restores on exit."""
    switches = Lever.parse_runtime(level).switches
    modules = switches.modules
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlock

    module = unwrap(model_chunk)
    config = module.config
    _check_supported(config, module, level, modules)
    decoder = getattr(module, "decoder", None)
    num_layers = len(getattr(decoder, "layers", ())) if decoder is not None else 0
    attentions = _attention_modules(module)
    layers = _layers(module)
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

    fields = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    layer_fields = ("recompute_input_layernorm", "recompute_pre_mlp_layernorm", "recompute_mlp")
    saved_config = {name: getattr(config, name) for name in fields}
    saved_attention = [m.checkpoint_core_attention for m in attentions]
    saved_layers = [{name: getattr(layer, name) for name in layer_fields} for layer in layers]
    try:
        for m in attentions:
            m.checkpoint_core_attention = "core_attn" in modules
        for layer in layers:
            # Where Megatron's construction would set them ('layernorm' only for a separate norm module,
            # 'mlp' only for dense layers).
            layer.recompute_input_layernorm = ("layernorm" in modules
                                               and not isinstance(getattr(layer, "input_layernorm", None), IdentityOp))
            layer.recompute_pre_mlp_layernorm = ("layernorm" in modules
                                                 and not isinstance(getattr(layer, "pre_mlp_layernorm", None), IdentityOp))
            layer.recompute_mlp = "mlp" in modules and not getattr(layer, "is_moe_layer", False)
        config.recompute_granularity, config.recompute_method = switches.granularity, switches.method
        config.recompute_num_layers = switches.num_layers
        yield
    finally:
        for name, value in saved_config.items():
            setattr(config, name, value)
        for m, value in zip(attentions, saved_attention):
            m.checkpoint_core_attention = value
        for layer, values in zip(layers, saved_layers):
            for name, value in values.items():
                setattr(layer, name, value)
