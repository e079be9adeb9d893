"""The advice's candidates (:mod:`.advice`): every parallel layout, micro-batch size, V, layer split and optimizer
setting of the user's GPUs whose weights fit, each with the tight bound of any exact synchronous schedule of it.

Pure: no torch, no Megatron.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

from ..schedule.config import ScheduleConfig
from ..schedule.levers import DEVICE
from ..schedule.spans import OPTIM
from .advice_rows import AdviceCluster, AdviceProblem, ParallelLayout, layout_words
from .bounds import bound_for
from .clusters import costs_for
from .costs import ClusterSpec, ModelSpec, ScheduleCosts
from .layout import LayerSplit, split_candidates
from .profile import Profile


@dataclass(frozen=True)
class Candidate:
    """One (layout, V, split) with its lower bound."""

    layout: ParallelLayout
    """TP x CP x PP x DP."""
    vpp: int
    """Virtual stages per rank V."""
    split: LayerSplit
    """Which stage holds which layers."""
    model: ModelSpec
    """The model at this TP (its padded vocabulary) with ``split``."""
    cluster: ClusterSpec
    """The planner's cluster for this layout."""
    microbatches: int
    """Micro-batches per iteration per data-parallel replica."""
    bound_s: float
    """The tight bound of any exact synchronous schedule of it (:func:`.bounds.bound_for`, memory ignored)."""
    profile: Optional[Profile] = None
    """The problem's measured profile (:attr:`AdviceProblem.profile`)."""
    micro_batch_size: Optional[int] = None
    """The micro-batch size where it is not the command's (``model`` has it); None: the command's."""
    stock_sharding: Tuple[Optional[str], ...] = (None,)
    """The stock sharding levels tried (:data:`.stock_options.STOCK_SHARDING`; None: the command's optimizer as it
    is): ``optim`` adds --use-distributed-optimizer where the command has none (``cluster`` prices it so)."""
    added_flags: Tuple[str, ...] = ()
    """The overlap flags its rows add to the command (``cluster`` prices them)."""

    def describe(self) -> str:
        return (layout_words(self.layout, self.vpp, self.split, self.model.stage_layers(self.layout.pp, self.vpp))
                + (f" mbs {self.micro_batch_size}" if self.micro_batch_size is not None else ""))


def context_sizes(problem: AdviceProblem, cluster: AdviceCluster, tp: int) -> List[int]:
    """The CP sizes a layout at ``tp`` may use: 1, and where the model's attention runs context parallelism
    (:attr:`AdviceProblem.context_parallel`), every CP with TP x CP inside a node whose sequence splits into 2 x CP
    chunks (Megatron's load-balanced causal split)."""
    if not problem.context_parallel:
        return [1]
    room = cluster.gpus_per_node // tp
    return [cp for cp in range(1, room + 1) if room % cp == 0 and problem.model.seq_length % (2 * cp) == 0]


def parallel_layouts(problem: AdviceProblem, cluster: AdviceCluster) -> List[ParallelLayout]:
    """Every TP x CP x PP x DP of the cluster's GPUs the search prices (module docstring)."""
    model = problem.model
    out = []
    for tp in range(1, min(cluster.gpus_per_node, problem.max_tp or cluster.gpus_per_node) + 1):
        if cluster.gpus_per_node % tp or cluster.gpus % tp:
            continue
        if model.num_attention_heads % tp or (model.num_query_groups or model.num_attention_heads) % tp or model.ffn % tp:
            continue
        for cp in context_sizes(problem, cluster, tp):
            for pp in range(1, cluster.gpus // (tp * cp) + 1):
                if (cluster.gpus // (tp * cp)) % pp or pp > model.num_layers:
                    continue
                dp = cluster.gpus // (tp * cp * pp)
                per_stage = tp * cp * dp
                if cluster.gpus_per_node % per_stage and per_stage % cluster.gpus_per_node:
                    continue  # neither whole stages per node nor whole nodes per stage (not modelled)
                if not micro_batch_sizes(problem, pp, dp):
                    continue
                for ep, etp in expert_sizes(problem, tp, cp, dp):
                    out.append(ParallelLayout(tp, pp, dp, cp, ep, etp))
    return out


def expert_sizes(problem: AdviceProblem, tp: int, cp: int, dp: int) -> List[Tuple[int, Optional[int]]]:
    """(EP, ETP) a stage of TP x CP x DP ranks may split a MoE model's experts over: every EP dividing the experts
    and, with ETP, the stage's ranks (Megatron's expert grid); ETP = TP (None) and, where TP > 1, ETP = 1. A dense
    model: (1, None) only."""
    moe = problem.model.moe
    if moe is None:
        return [(1, None)]
    ranks = tp * cp * dp
    out = []
    # Megatron's MoE layer keeps linear biases only at ETP = 1 (TransformerConfig asserts it).
    widths = [1] if tp > 1 and problem.model.linear_bias else [None, 1] if tp > 1 else [None]
    for etp in widths:
        width = etp or tp
        out += [(ep, etp) for ep in range(1, moe.num_experts + 1)
                if moe.num_experts % ep == 0 and ranks % (ep * width) == 0
                and problem.model.expert_ffn % width == 0]
    return out


def micro_batch_sizes(problem: AdviceProblem, pp: int, dp: int) -> List[int]:
    """The micro-batch sizes the rows may use with ``pp`` x ``dp``: every size that divides the per-replica batch
    (global batch / DP) into at least p micro-batches, the command's own first (it wins ties); only the command's
    when :attr:`AdviceProblem.search_micro_batch_size` is off. Which of them fit the memory, the simulation says."""
    own = problem.model.micro_batch_size
    if problem.global_batch % dp:
        return []
    replica = problem.global_batch // dp
    sizes = range(1, replica + 1) if problem.search_micro_batch_size else (own,)
    fitting = [b for b in sizes if replica % b == 0 and replica // b >= pp]
    return sorted(fitting, key=lambda b: b != own)


def splits(problem: AdviceProblem, layout: ParallelLayout, vpp: int) -> List[LayerSplit]:
    """The split candidates of one (layout, V): the user's own split where it works there, then those of
    :func:`.layout.split_candidates` (an even split is written as no flag)."""
    out = []
    if problem.model.layer_split.valid(problem.model.num_layers, layout.pp, vpp):
        out.append(problem.model.layer_split)
    L = problem.model.num_layers
    for split in split_candidates(L, layout.pp, vpp):
        if not split.valid(L, layout.pp, vpp):
            continue
        layers = split.stage_layers(L, layout.pp, vpp)
        if all(layers != known.stage_layers(L, layout.pp, vpp) for known in out):
            out.append(split)
    return out


OVERLAP_FLAGS = ("--overlap-grad-reduce", "--overlap-param-gather")
"""Megatron's data-parallel overlap flags (the second needs the distributed optimizer)."""


class Optimizer(NamedTuple):
    """How a layout's candidates reduce and step: the command's, or what a row without a pipeline adds to it."""

    distributed: bool
    """--use-distributed-optimizer."""
    overlap: Tuple[bool, bool]
    """(--overlap-grad-reduce, --overlap-param-gather)."""
    sharding: Tuple[Optional[str], ...]
    """The stock sharding levels (``optim``: the distributed optimizer added)."""
    added: Tuple[str, ...]
    """The overlap flags added."""


def optimizers(problem: AdviceProblem, layout: ParallelLayout) -> List[Optimizer]:
    """A layout's optimizer settings: the command's; at PP = 1 over DP > 1 (data parallelism alone), also Megatron's
    own data-parallel setup where the command differs: the distributed optimizer (ZeRO-1 over Megatron's DDP buffers),
    and with it both overlap flags (gradients reduced in buckets under the last backward, parameters gathered under
    the first forward)."""
    own = Optimizer(problem.distributed_optimizer, problem.overlap, (None,), ())
    if layout.pp > 1 or layout.dp == 1:
        return [own]
    sharding = (None,) if problem.distributed_optimizer else (OPTIM,)
    out = [own]
    if not problem.distributed_optimizer:
        out.append(Optimizer(True, problem.overlap, sharding, ()))
    added = tuple(flag for flag, on in zip(OVERLAP_FLAGS, problem.overlap) if not on)
    if added:
        out.append(Optimizer(True, (True, True), sharding, added))
    return out


def candidates(problem: AdviceProblem, cluster: AdviceCluster) -> List[Candidate]:
    """Every (layout, micro-batch size, V, split) whose static memory fits, with its tight bound, least bound first
    (ties: the command's micro-batch size first)."""
    out = []
    own = problem.model.micro_batch_size
    for layout in parallel_layouts(problem, cluster):
        for optimizer in optimizers(problem, layout):
            spec = cluster.spec(layout.tp, layout.dp, problem.sequence_parallel, optimizer.distributed, optimizer.overlap,
                                layout.cp, problem.cp_comm, layout.ep, layout.etp)
            for b in micro_batch_sizes(problem, layout.pp, layout.dp):
                m = problem.microbatches(layout.dp, b)
                for vpp in range(1, (problem.model.num_layers // layout.pp if layout.pp > 1 else 1) + 1):
                    if vpp > 1 and layout.pp == 2 and not problem.interleaving_at_two:
                        continue
                    for split in splits(problem, layout, vpp):
                        model = dataclasses.replace(problem.model_for(layout.tp, split), micro_batch_size=b)
                        config = ScheduleConfig.depth_first(layout.pp, vpp, m)
                        costs = costs_for(model, spec, config, profile=problem.profile, levels=(DEVICE,))
                        if max(costs.static_bytes) > cluster.budget_bytes:
                            continue
                        bound = bound_for(config, ScheduleCosts(config, costs)).seconds
                        out.append(Candidate(layout, vpp, split, model, spec, m, bound, problem.profile,
                                              None if b == own else b, optimizer.sharding, optimizer.added))
    return sorted(out, key=lambda c: c.bound_s)
