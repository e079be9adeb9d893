"""Megatron features that the stock interleaved schedule supports but the PipeMesh schedule does not.

Each would otherwise be silently ignored (or break in ways far from the cause), so they are refused:
at argument validation (``integration.flags`` reports :func:`unsupported_message` of Megatron's args when
``--pipeline-schedule pipemesh``), and again on the model config at the schedule's first call by
:func:`check_model_config` (for programs that build their ``TransformerConfig`` without Megatron's
argument parser). Both read the one table :data:`UNSUPPORTED`, taken from megatron-core 0.19.2's
``forward_backward_pipelining_with_interleaving`` and the training loop around it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

from .errors import PipeMeshRuntimeError


@dataclass(frozen=True)
class Unsupported:
    """One refused feature."""

    attribute: str
    """Name of the field in Megatron's args namespace and in ``TransformerConfig``."""
    flag: str
    """How a user turns it on (the command-line flag, or where it is set when there is none)."""
    enabled: Callable[[object], bool]
    """Whether the value read from args or config means the feature is on."""
    why: str
    """What the stock interleaved schedule does for it that PipeMesh does not."""
    instead: str
    """What to do instead."""


def _truthy(value) -> bool:
    return bool(value)


UNSUPPORTED = (
    Unsupported("cuda_graph_impl", "--cuda-graph-impl (or the deprecated --enable-cuda-graph / --external-cuda-graph)",
                lambda v: v not in (None, "none"),
                "CUDA graphs are captured in the stock schedule's order of micro-batches (Transformer Engine graphs via "
                "get_schedule_table, 'local' graphs via create_cudagraphs after the first iteration, 'full_iteration' "
                "captures the whole forward-backward); PipeMesh runs another order and posts its own transfers",
                "drop --cuda-graph-impl (use --cuda-graph-impl none) or use --pipeline-schedule default"),
    Unsupported("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm", _truthy,
                "the combined-1F1B MoE path fuses one forward with one backward of the stock schedule's steady "
                "state (combined_1f1b_schedule_for_interleaved_pipelining); PipeMesh runs forwards and backwards "
                "as separate ops",
                "drop --overlap-moe-expert-parallel-comm or use --pipeline-schedule default"),
    Unsupported("fine_grained_activation_offloading", "--fine-grained-activation-offloading", _truthy,
                "the stock schedule resets the offloading manager after each iteration and its offload/reload "
                "points follow the stock order of micro-batches",
                "drop --fine-grained-activation-offloading (PipeMesh's planner trades memory by recomputation and "
                "host placement instead: --forward-groups auto --pipemesh-activation-placement auto) or use "
                "--pipeline-schedule default"),
    Unsupported("moe_paged_stash", "--moe-paged-stash", _truthy,
                "the stock schedule resets the paged stash at the start of every call (paged_stash_reset)",
                "drop --moe-paged-stash or use --pipeline-schedule default"),
    Unsupported("num_microbatches_with_partial_activation_checkpoints",
                "num_microbatches_with_partial_activation_checkpoints (TransformerConfig field; no flag in "
                "megatron-core 0.19.2, set by --yaml-cfg or by code)",
                lambda v: v is not None,
                "the stock schedule passes checkpoint_activations_microbatch to forward_step from its warm-up "
                "window; PipeMesh chooses recomputation per (rank, chunk, micro-batch) itself",
                "leave it unset and let PipeMesh plan recomputation (--forward-groups auto or --pipemesh-plan), or use "
                "--pipeline-schedule default"),
    Unsupported("variable_seq_lengths", "variable_seq_lengths (TransformerConfig field, set by code)", _truthy,
                "the stock p2p communicator exchanges tensor shapes before each transfer; PipeMesh posts receives "
                "of the fixed shape (seq-length, micro-batch-size, hidden-size) ahead of time",
                "use a fixed --seq-length or --pipeline-schedule default"),
)


def _problems(source) -> List[str]:
    found = []
    for item in UNSUPPORTED:
        value = getattr(source, item.attribute, None)
        if value is not None and item.enabled(value):
            found.append(f"{item.flag} = {value!r} is not supported by --pipeline-schedule pipemesh: {item.why}. "
                         f"Instead: {item.instead}.")
    return found


def unsupported_message(source) -> Optional[str]:
    """One paragraph naming every unsupported feature enabled in Megatron's args or a model config, or None."""
    found = _problems(source)
    return " ".join(found) if found else None


def check_model_config(config) -> None:
    """Raise ``PipeMeshRuntimeError`` if the model's ``TransformerConfig`` enables such a feature."""
    message = unsupported_message(config)
    if message:
        raise PipeMeshRuntimeError(message)
