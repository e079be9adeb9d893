"""Per (chunk, micro-batch) activation recomputation through Megatron's own machinery.

:func:`recompute_scope` sets, for the duration of one forward (or backward) of one model chunk, the
two switches megatron-core 0.19.2 reads at call time:

* ``Attention.checkpoint_core_attention`` (``transformer/attention.py:392``, set at construction
  from ``recompute_granularity == 'selective'`` and ``'core_attn' in recompute_modules``, read in
  ``Attention.forward`` as ``if self.checkpoint_core_attention and self.training``): the attention
  core (QK^T, softmax, dropout, attention over V) runs under ``tensor_parallel.checkpoint`` and is
  recomputed in the backward — Megatron's ``--recompute-granularity selective``;
* ``config.recompute_granularity == 'full'`` (read in ``TransformerBlock.forward``,
  ``transformer/transformer_block.py:624``) with ``recompute_method='uniform'`` and
  ``recompute_num_layers=1``: every layer keeps only its input and is recomputed in the backward —
  Megatron's ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``.

Levels: ``'none'`` (keep every activation: both switches off), ``'selective'``, ``'full'`` (the core
attention switch off inside the fully recomputed layers, as Megatron requires). Everything is
restored on exit; the config object is shared by every chunk of the rank, which is safe because one
op runs at a time. The runtime enters the same scope around the op's backward, so the recomputation
that runs inside ``backward_step`` takes the same path as the forward did (the full-recompute
replay re-enters the layers, which read the attention switch again).

Supported: Megatron's local spec and Transformer Engine specs in 16/32-bit (both go through the
same two switches and ``tensor_parallel.checkpoint``; the TE case is untested here). Refused with
``NotImplementedError``: FP8/FP4 (TE's quantized checkpointing keeps extra state), CUDA graphs, CPU
offloading, chunks whose decoder is not a ``TransformerBlock`` (full) or whose layers have no
Megatron attention switch (selective), and a global ``--recompute-modules`` other than ``core_attn``
(those are per-layer decisions made at construction that this scope does not manage).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Mapping, Optional, Tuple

import torch

from ..schedule.lower import HOST_LEVEL

LEVELS = ("none", "selective", "full")


def unwrap(model_chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside Megatron's DDP / FSDP / Float16Module wrappers (anything with ``.module``)."""
    module = model_chunk
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


PLAN_LEVELS = LEVELS + (HOST_LEVEL,)
"""Levels of a placement plan: the recompute levels and 'host' (kept whole, offloaded: :mod:`.offload`)."""


def check_plan(plan: Optional[Mapping[Tuple[int, int, int], str]]) -> None:
    """Fail early on unknown levels or malformed keys (pipeline rank, chunk, micro-batch)."""
    for key, level in (plan or {}).items():
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(k, int) for k in key)):
            raise ValueError(f"recompute plan key {key!r} is not (pipeline rank, chunk, micro-batch)")
        if level not in PLAN_LEVELS:
            raise ValueError(f"recompute plan {key}: unknown level {level!r}; use one of {', '.join(PLAN_LEVELS)}")


def _attention_modules(module: torch.nn.Module) -> List[torch.nn.Module]:
    from megatron.core.transformer.transformer_block import TransformerBlock

    return [m for m in module.modules()
            if hasattr(m, "checkpoint_core_attention") and not isinstance(m, TransformerBlock)]


def _check_supported(config, module: torch.nn.Module, level: str) -> None:
    what = f"PipeMesh recompute level {level!r}"
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        raise NotImplementedError(f"{what} with FP8/FP4 (Transformer Engine quantized checkpointing) is not supported")
    if getattr(config, "enable_cuda_graph", False) or getattr(config, "cuda_graph_impl", "none") != "none":
        raise NotImplementedError(f"{what} with CUDA graphs is not supported")
    if getattr(config, "cpu_offloading", False):
        raise NotImplementedError(f"{what} with --cpu-offloading is not supported")
    if getattr(config, "recompute_granularity", None) == "selective":
        others = set(getattr(config, "recompute_modules", None) or ["core_attn"]) - {"core_attn"}
        if others:
            raise NotImplementedError(
                f"{what}: --recompute-modules {sorted(others)} are per-layer decisions Megatron makes at "
                "construction; with a PipeMesh recompute plan use only core_attn (or no --recompute-* flags)")


@contextlib.contextmanager
def recompute_scope(model_chunk: torch.nn.Module, level: str) -> Iterator[None]:
    """Run ``model_chunk``'s forward (or backward) inside with recompute ``level``; restores on exit."""
    if level not in LEVELS:
        raise ValueError(f"unknown recompute level {level!r}; use one of {', '.join(LEVELS)}")
    from megatron.core.transformer.transformer_block import TransformerBlock

    module = unwrap(model_chunk)
    config = module.config
    _check_supported(config, module, level)
    decoder = getattr(module, "decoder", None)
    layers = len(getattr(decoder, "layers", ())) if decoder is not None else 0
    attentions = _attention_modules(module)
    if level == "full" and layers and not isinstance(decoder, TransformerBlock):
        raise NotImplementedError(f"full recompute needs a megatron TransformerBlock decoder, got {type(decoder).__name__}")
    if level == "selective" and layers and not attentions:
        raise NotImplementedError(
            f"selective recompute: no attention module with Megatron's checkpoint_core_attention switch in "
            f"{type(module).__name__} (unsupported layer implementation)")

    fields = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    saved_config = {name: getattr(config, name) for name in fields}
    saved_attention = [m.checkpoint_core_attention for m in attentions]
    try:
        for m in attentions:
            m.checkpoint_core_attention = level == "selective"
        if level == "full":
            config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
        else:
            config.recompute_granularity = "selective" if level == "selective" else None
            config.recompute_method = config.recompute_num_layers = None
        yield
    finally:
        for name, value in saved_config.items():
            setattr(config, name, value)
        for m, value in zip(attentions, saved_attention):
            m.checkpoint_core_attention = value
