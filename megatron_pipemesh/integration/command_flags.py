"""A recommendation's ``pretrain_gpt.py`` flags: the user's own flags with only the ones the recommendation
changes replaced (``pipemesh plan --megatron-args``).

What a row may change: the tensor-, context-, expert- and pipeline-parallel sizes, V, Megatron's group size, its recomputation and
activation-offloading flags, the layer split, the PipeMesh schedule flags, the micro-batch size (:data:`MICRO_BATCH_FLAG`,
replaced only where the row changes it) and, without a pipeline, the distributed optimizer (added where missing). Everything else the user wrote (data,
optimizer, precision, ``--grad-reduce-in-bf16``, logging) stays as written and in place, so the command trains the
same model on the same data.

Megatron's flags all start with ``--`` and none is positional, so a flag's values are the words up to the next word
that starts with ``--`` (``--recompute-modules core_attn mlp``, a store-true flag takes none); ``--flag=value`` is one
word. Megatron's parser is built with ``allow_abbrev=False``, so a flag is matched by its whole name (and its
aliases, which the caller passes from the parser).

Pure: no torch, no Megatron.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

from ..config import recommended_flag_names
from ..planning.layout import SPLIT_FLAGS, VPP_FLAGS, LayerSplit
from ..planning.stock_options import (BF16_REDUCE_FLAG, CP_FLAG, EP_FLAG, ETP_FLAG, GROUP_FLAG, PP_FLAG, TP_FLAG,
                                      parallel_flags, stock_flags, vpp_flags)
from ..schedule.config import ScheduleConfig

__all__ = ["REPLACED", "MICRO_BATCH_FLAG", "flag_name", "without", "replace_flags", "set_value", "expand_aliases", "split_flags", "stock_flags",
           "pipemesh_flags"]
RECOMPUTE_FLAGS = ("--recompute-granularity", "--recompute-modules", "--recompute-method", "--recompute-num-layers",
                   "--recompute-activations")
OFFLOAD_FLAGS = ("--fine-grained-activation-offloading", "--offload-modules", "--activation-offload-fraction")
PIPEMESH_FLAGS = recommended_flag_names()
REPLACED = (TP_FLAG, CP_FLAG, EP_FLAG, ETP_FLAG, PP_FLAG, *VPP_FLAGS, GROUP_FLAG, *RECOMPUTE_FLAGS, *OFFLOAD_FLAGS, *SPLIT_FLAGS,
            BF16_REDUCE_FLAG, *PIPEMESH_FLAGS)
"""Every flag a recommendation may set: the user's are dropped and the row's own written instead."""
MICRO_BATCH_FLAG = "--micro-batch-size"
"""Replaced (with its aliases) only by a row that changes the micro-batch size."""


def flag_name(word: str) -> str:
    """The flag of a word: ``--a=1`` -> ``--a``; a word that is not a flag is returned as it is."""
    return word.split("=", 1)[0] if word.startswith("--") else word


def without(flags: Sequence[str], names: Iterable[str]) -> List[str]:
    """``flags`` without every occurrence of the flags ``names`` and their values (module docstring)."""
    names = set(names)
    out: List[str] = []
    dropping = False
    for word in flags:
        if word.startswith("--"):
            dropping = flag_name(word) in names
        if not dropping:
            out.append(word)
    return out


def replace_flags(flags: Sequence[str], names: Iterable[str], new: Sequence[str]) -> List[str]:
    """``flags`` without ``names`` (:func:`without`), then ``new`` appended."""
    return without(flags, names) + list(new)


def set_value(flags: Sequence[str], names: Iterable[str], value: str) -> List[str]:
    """``flags`` with the value of the flag ``names`` (any of its spellings) set to ``value`` where it stands (every
    occurrence), or the flag appended with ``value`` where it is absent."""
    names = list(names)
    out: List[str] = []
    found = skipping = False
    for word in flags:
        if word.startswith("--"):
            skipping = False
            if flag_name(word) in names:
                out += [flag_name(word), value]
                found = skipping = True
                continue
        if not skipping:
            out.append(word)
    return out if found else out + [names[0], value]


def expand_aliases(names: Iterable[str], aliases: Optional[Dict[str, Sequence[str]]]) -> List[str]:
    """``names`` and every other spelling the parser accepts for each (``aliases``: flag -> its option strings)."""
    out = []
    for name in names:
        out += [name, *((aliases or {}).get(name, ()))]
    return out


def split_flags(split: LayerSplit) -> List[str]:
    """Megatron's flags for the layer split (none for an even split)."""
    return split.flags()


def pipemesh_flags(config: ScheduleConfig, tp: int, split: LayerSplit, grad_reduce_in_bf16: bool,
                   budget_gb: Optional[float] = None, host_memory_gb: Optional[float] = None,
                   device_tflops: Optional[float] = None, cp: int = 1, ep: int = 1,
                   etp: Optional[int] = None) -> List[str]:
    """The flags of a PipeMesh row: TP (and CP), PP, V, the split, ``--pipeline-schedule pipemesh`` and the groups. With
    ``budget_gb`` (the plan keeps some activations off the device: recomputed or on the host) also the runtime's
    placement flags, so that its start-up planner fits the same groups into the same budget:
    ``--pipemesh-activation-placement auto --pipemesh-memory-budget-gb B --pipemesh-host-memory-gb H`` (H = 0
    without host memory, so it recomputes only, as the advice did), and the device's TFLOP/s when the advice was given
    one (the runtime measures it otherwise)."""
    out = parallel_flags(tp, cp, ep, etp) + [PP_FLAG, str(config.pp)] + vpp_flags(config.vpp, split) + split_flags(split)
    if grad_reduce_in_bf16:
        out.append(BF16_REDUCE_FLAG)
    out += ["--pipeline-schedule", "pipemesh", "--forward-groups", *map(str, config.forward_groups),
            "--backward-groups", *map(str, config.backward_groups)]
    if budget_gb is not None:
        out += ["--pipemesh-activation-placement", "auto", "--pipemesh-memory-budget-gb", f"{budget_gb:.3f}",
                "--pipemesh-host-memory-gb", f"{host_memory_gb or 0:g}"]
        if device_tflops is not None:
            out += ["--pipemesh-device-tflops", f"{device_tflops:g}"]
    return out
