"""Megatron features that the stock interleaved schedule supports but the PipeMesh schedule does not.

Each would otherwise be silently ignored (or break in ways far from the cause), so they are refused:
at argument validation (``integration.flags`` reports :func:`unsupported_message` of Megatron's args when
``--pipeline-schedule pipemesh``), and again on the model config at the schedule's first call by
:func:`check_model_config` (for programs that build their ``TransformerConfig`` without Megatron's
argument parser). Both read the one table :data:`UNSUPPORTED`, taken from megatron-core 0.19.2's
``forward_backward_pipelining_with_interleaving`` and the training loop around it.

A second table, :data:`UNSUPPORTED_COMBINATIONS`, refuses Megatron features that work with PipeMesh but not
together with one of its levers (ZeRO-2/3 chunks, host placement); they are checked on the args before planning
(the levers the flags ask for) and again on the plan once it is made or loaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

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


ZERO_2_3 = ("optim_grads", "optim_grads_params")
"""Sharding levels whose runtime frees and re-allocates the storage of Megatron's DDP buffers (runtime/sharding.py)."""


def _sharding_levels(source, plan) -> Tuple[str, ...]:
    """The ZeRO levels of the run: the plan's once there is one, else ``--pipemesh-sharding`` as given ('auto':
    not known before the planner chose them)."""
    if plan is not None:
        return tuple(getattr(plan, "sharding", None) or ())
    return tuple(getattr(source, "pipemesh_sharding", None) or ())


def _zero_2_3(source, plan) -> bool:
    """Whether some chunk of the run is ZeRO-2/3."""
    return any(level in ZERO_2_3 for level in _sharding_levels(source, plan))


def _host_placement(source, plan) -> bool:
    """Whether chunk-micro-batches may be placed on the host: the plan places some, or 'auto' placement may (the
    planner, and the re-planner at the first calls, choose per chunk-micro-batch)."""
    return bool(getattr(plan, "host_placement", None)) or getattr(source, "pipemesh_activation_placement", None) == "auto"


@dataclass(frozen=True)
class UnsupportedCombination:
    """A Megatron feature that PipeMesh supports, but not together with one of PipeMesh's own levers."""

    attribute: str
    """Name of the Megatron feature's field in Megatron's args (and in its config object, where it has one)."""
    flag: str
    """How a user turns the Megatron feature on."""
    lever: str
    """The PipeMesh lever it conflicts with, as the user chooses it."""
    used: Callable[[object, object], bool]
    """Whether the run uses the lever, from (Megatron's args or a model config, the run's plan or None)."""
    why: str
    """What goes wrong when both are on."""
    instead: str
    """What to do instead."""


UNSUPPORTED_COMBINATIONS = (
    UnsupportedCombination(
        "nccl_ub", "--use-nccl-ub", "ZeRO-2/3 chunks (--pipemesh-sharding optim_grads / optim_grads_params, or a plan "
        "file or --pipemesh-sharding auto that chose them)", _zero_2_3,
        "with --use-nccl-ub Megatron allocates each chunk's parameter and gradient buffers in an NCCL memory pool "
        "(ncclMemAlloc, registered with the data-parallel communicators: param_and_grad_buffer.py:1129-1152). A "
        "ZeRO-2/3 chunk frees those buffers' storage between groups and re-allocates it with resize_ outside that "
        "pool: the freed blocks stay cached in the NCCL pool while the new ones come from the default pool, so the "
        "chunk holds both (ZeRO-2/3 then saves no memory, against the plan's prediction) and its collectives run on "
        "unregistered memory",
        "drop --use-nccl-ub, or keep every chunk at --pipemesh-sharding optim (ZeRO-1 keeps its buffers whole)"),
    UnsupportedCombination(
        "defer_embedding_wgrad_compute", "--defer-embedding-wgrad-compute", "host placement (--pipemesh-activation-"
        "placement auto, or a plan with host-placed chunk-micro-batches)", _host_placement,
        "Megatron's output layer then keeps each micro-batch's input in a list outside autograd for the weight "
        "gradients it computes after the last backward (tensor_parallel/layers.py:1150-1154); OFFLOAD of a last-stage "
        "chunk-micro-batch would copy that tensor to the host while the list keeps it on the device, so the copy "
        "frees nothing and the plan's device memory is wrong",
        "drop --defer-embedding-wgrad-compute, or use --pipemesh-activation-placement recompute-only (or device) "
        "and a plan without host placement"),
)


def _problems(source, plan=None) -> List[str]:
    found = []
    for item in UNSUPPORTED:
        value = getattr(source, item.attribute, None)
        if value is not None and item.enabled(value):
            found.append(f"{item.flag} = {value!r} is not supported by --pipeline-schedule pipemesh: {item.why}. "
                         f"Instead: {item.instead}.")
    for pair in UNSUPPORTED_COMBINATIONS:
        if getattr(source, pair.attribute, False) and pair.used(source, plan):
            found.append(f"{pair.flag} with {pair.lever} is not supported by --pipeline-schedule pipemesh: {pair.why}. "
                         f"Instead: {pair.instead}.")
    return found


def unsupported_message(source, plan=None) -> Optional[str]:
    """One paragraph naming every unsupported feature enabled in Megatron's args or a model config, and every
    unsupported combination of one with the levers of the run's ``plan`` (a :class:`~..schedule.plan.RunPlan`;
    None: the levers the args ask for), or None."""
    found = _problems(source, plan)
    return " ".join(found) if found else None


def check_model_config(config, plan=None) -> None:
    """Raise ``PipeMeshRuntimeError`` if the model's ``TransformerConfig`` enables such a feature (or one that
    conflicts with ``plan``'s levers)."""
    message = unsupported_message(config, plan)
    if message:
        raise PipeMeshRuntimeError(message)
