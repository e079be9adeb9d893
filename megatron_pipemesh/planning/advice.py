"""What to run on a cluster: the user's command, the best stock flags and PipeMesh for its layout, and the best
parallel layout (TP x PP x DP, V, layer split) for the same GPUs with each, ranked by predicted iteration time.

The search prices every candidate with the planner's own costs and simulator, and prunes by lower bounds first:

* a parallel layout (:func:`parallel_layouts`): TP inside a node and dividing the heads, query groups and FFN; every
  PP, PP = 1 included (no pipeline: data parallel, Megatron's ``forward_backward_no_pipelining``, stock rows only:
  PipeMesh needs a pipeline); DP from the GPU count; the layouts the topology can describe (whole stages per node, or
  whole nodes per stage);
* per layout, every micro-batch size that divides the per-replica batch into at least p micro-batches
  (:func:`micro_batch_sizes`; the command's own first), priced from the profile where it measured that size;
* per layout and micro-batch size, every V the model allows (1 at PP = 1) and the layer splits of
  :func:`.layout.split_candidates` (the even split, and fewer layers on the stages that also hold the embedding and
  the output layer); at PP = 1 over DP > 1, stock also as Megatron recommends data parallelism where the command
  differs (:func:`_optimizers`): with the distributed optimizer (ZeRO-1, the sharding level Megatron's DDP offers)
  and with it and --overlap-grad-reduce --overlap-param-gather, the flags added;
* each (layout, V, split) gets the tight bound of any exact synchronous schedule (:func:`.bounds.bound_for`: memory
  ignored, so it bounds stock and PipeMesh alike) and is dropped if its weights, gradients and optimizer state alone
  exceed the memory; the rest are searched in order of that bound, on each side, until the bound reaches the best
  time found (PipeMesh: :func:`.planner.plan_schedule`, which prunes its group lists by their time without memory
  levers and fits at most :data:`FIT_LIMIT` of them to the memory; stock: :func:`.stock.best_stock` at that V, which
  prunes by compute). :func:`search_layouts` is that loop (the study runs its PipeMesh side). Stopped early (a
  time limit, or the study's cap on candidates), it keeps the rows found and records the least bound left
  (:class:`SearchLog`): no layout left unsearched runs faster than that. With ``jobs`` > 1 the loop runs on worker
  processes (:mod:`.parallel_search`), and so do the user layout's rows, with the same rows to the float.

The rows (:class:`Advice`): ``user`` (the command as given), ``best_stock`` (stock's best V, group size,
recomputation, offloading for the user's layout and split), ``pipemesh`` (PipeMesh for the user's layout, V and
split), ``best_layout`` (PipeMesh's best over the layouts) and ``best_layout_stock`` (stock's). Rows that do not fit
the memory are never best.

Pure: no torch, no Megatron.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..schedule.config import ScheduleConfig, ScheduleConfigError
from ..schedule.levers import DEVICE, RECOMPUTE_ONLY
from ..schedule.spans import OPTIM
from .bounds import bound_for, virtual_sizes
from .clusters import costs_for, nic_cluster
from .defaults import DEFAULT_HOST_LINK_GBPS, MFU
from .costs import GB, ClusterSpec, ModelSpec, ScheduleCosts
from .layout import LayerSplit, split_candidates
from .memory import MEMORY_MARGIN
from .planner import NoFeasiblePlan, Plan, PlannerOptions, fit_with_recompute, plan_schedule
from .planner_options import structured_options
from .pool import board
from .profile import Profile
from .simulator import SearchTimeUp, TimeUp, simulate
from .stock import StockResult, StockSetting, activation_budget, best_stock, evaluate, uniform_plan


@dataclass(frozen=True)
class AdviceCluster:
    """The cluster the advice is for (``pipemesh plan --megatron-args`` flags in brackets)."""

    nodes: int
    """Nodes [--nodes]."""
    gpus_per_node: int
    """GPUs of one node, behind its NIC [--gpus-per-node]."""
    nic_gbps: float
    """One node's network interface per direction, Gbit/s [--nic-gbps], shared by every transfer leaving the node."""
    intra_node_gbps: float
    """Per-GPU bandwidth between the GPUs of a node, Gbit/s [--intra-node-gbps] (PCIe ~100, NVLink ~2400)."""
    device_memory_gb: float
    """Memory of one GPU, GiB [--device-memory-gb, or --gpu's]."""
    device_tflops: float
    """Dense 16-bit peak TFLOP/s of one GPU [--device-tflops, or --gpu's]."""
    mfu: float = MFU
    """Fraction of the peak the layers reach [--mfu]."""
    host_memory_gb: Optional[float] = None
    """Host memory per GPU for offloaded activations, GiB [--host-memory-gb]; None: neither side offloads."""
    host_link_gbps: float = DEFAULT_HOST_LINK_GBPS
    """Device-host copy bandwidth per GPU and direction, Gbit/s [--host-link-gbps]."""
    nic_via_host: bool = True
    """Network traffic is staged through host memory (no GPUDirect RDMA: commodity clouds) [--gpudirect-rdma: no]."""
    latency_us: float = 30.0
    """Latency of one transfer, microseconds."""
    host_copies_on_compute: bool = False
    """The rows run on CPU ranks, whose host copies hold up their compute (costs measured on this CPU: no --gpu or
    --device-tflops); :attr:`.costs.ClusterSpec.host_copies_on_compute`."""
    collectives: str = "nccl"
    """Library of the ranks' communication: ``nccl`` (GPUs) or ``gloo`` (CPU ranks, or --distributed-backend gloo);
    :attr:`.costs.ClusterSpec.collectives`."""
    shared_cores: Optional[int] = None
    """Every rank runs on one host of this many CPU cores, shared by the ranks computing at the moment (``pipemesh
    bench --advice`` with more ranks than cores); :attr:`.costs.ClusterSpec.shared_cores`. None: a device each."""
    pinned_cores: bool = False
    """With ``shared_cores``: each pipeline rank's ranks pinned to one core (``pipemesh bench --pin-cores``);
    :attr:`.costs.ClusterSpec.pinned_cores`."""
    nic_burst_bytes: float = 0.0
    """The NICs' token-bucket burst (``pipemesh bench --advice``'s emulated NICs);
    :attr:`.costs.ClusterSpec.nic_burst_bytes`."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def budget_bytes(self) -> float:
        """Device memory a plan may use: the memory less :data:`.memory.MEMORY_MARGIN`."""
        return self.device_memory_gb * GB * (1 - MEMORY_MARGIN)

    def spec(self, tp: int, dp: int, sequence_parallel: bool, distributed_optimizer: bool,
             overlap: Tuple[bool, bool] = (True, True)) -> ClusterSpec:
        """The planner's :class:`.costs.ClusterSpec` for one parallel layout; ``overlap``: the command's
        (--overlap-grad-reduce, --overlap-param-gather)."""
        return nic_cluster(tp=tp, dp=dp, devices_per_node=self.gpus_per_node, nic_gbps=self.nic_gbps,
                           link_gbps=self.nic_gbps, intra_node_gbps=self.intra_node_gbps,
                           device_tflops=self.device_tflops, device_memory_gb=self.device_memory_gb,
                           host_link_gbps=self.host_link_gbps, nic_via_host=self.nic_via_host,
                           sequence_parallel=sequence_parallel and tp > 1, distributed_optimizer=distributed_optimizer,
                           mfu=self.mfu, latency_us=self.latency_us, host_copies_on_compute=self.host_copies_on_compute,
                           collectives=self.collectives, shared_cores=self.shared_cores,
                           pinned_cores=self.pinned_cores, overlap_grad_reduce=overlap[0],
                           overlap_param_gather=overlap[1], nic_burst_bytes=self.nic_burst_bytes)


@dataclass(frozen=True)
class ParallelLayout:
    """How the GPUs are split: tensor x pipeline x data parallel."""

    tp: int
    """Tensor-parallel size (inside a node)."""
    pp: int
    """Pipeline-parallel size."""
    dp: int
    """Data-parallel size."""

    def describe(self) -> str:
        return f"TP{self.tp} PP{self.pp} DP{self.dp}"


@dataclass(frozen=True)
class AdviceProblem:
    """The user's command as the search needs it."""

    model: ModelSpec
    """The GPT of the command, with its layer split and the vocabulary padded for its TP."""
    layout: ParallelLayout
    """The command's TP x PP x DP."""
    vpp: int
    """The command's V (1: no interleaving)."""
    global_batch: int
    """Sequences per iteration."""
    stock: Optional[StockSetting]
    """The stock schedule and recomputation the command runs; None when it runs PipeMesh."""
    pipemesh: Optional[ScheduleConfig] = None
    """The PipeMesh groups the command runs (None: it runs stock, or PipeMesh plans them itself)."""
    sequence_parallel: bool = False
    """[--sequence-parallel] Kept wherever TP > 1."""
    distributed_optimizer: bool = False
    """[--use-distributed-optimizer] Kept in every row."""
    overlap_grad_reduce: bool = True
    """[--overlap-grad-reduce] Kept in every row (:attr:`.costs.ClusterSpec.overlap_grad_reduce`)."""
    overlap_param_gather: bool = True
    """[--overlap-param-gather] Kept in every row (:attr:`.costs.ClusterSpec.overlap_param_gather`)."""
    grad_reduce_in_bf16: bool = False
    """[--grad-reduce-in-bf16] Asked for by the user (only then may a row reduce in bf16)."""
    interleaving_at_two: bool = True
    """V > 1 is allowed at PP = 2 (Megatron needs --overlap-p2p-communication, its default, for it)."""
    pipemesh_refused: Optional[str] = None
    """Why PipeMesh cannot run this command (a feature of it the runtime refuses); None: it can."""
    vocab_multiple: int = 128
    """[--make-vocab-size-divisible-by] The vocabulary is padded to a multiple of this times TP."""
    vocab_size: Optional[int] = None
    """The unpadded vocabulary (None: the model's, padded for every TP alike)."""
    max_tp: Optional[int] = None
    """The largest TP a row may use (None: the node's GPUs); 1 where the runtime cannot run tensor parallelism (on CPU,
    megatron-core's validate_args reads the CUDA device's architecture when TP > 1)."""
    profile: Optional[Profile] = None
    """A measured profile of the command's model (``pipemesh plan --profile``, already matched to it): every row's
    costs take its measurements wherever it has them (:func:`.clusters.costs_for`)."""
    search_micro_batch_size: bool = True
    """The rows may change --micro-batch-size (:func:`micro_batch_sizes`); False: every row keeps the command's."""

    def model_for(self, tp: int, split: LayerSplit) -> ModelSpec:
        """The model at tensor-parallel size ``tp`` (Megatron pads the vocabulary per TP) with ``split``."""
        vocab = self.model.vocab_size
        if self.vocab_size is not None:
            multiple = self.vocab_multiple * tp
            vocab = -(-self.vocab_size // multiple) * multiple
        return dataclasses.replace(self.model, vocab_size=vocab, layer_split=split)

    @property
    def overlap(self) -> Tuple[bool, bool]:
        """(--overlap-grad-reduce, --overlap-param-gather) of the command, for :meth:`AdviceCluster.spec`."""
        return self.overlap_grad_reduce, self.overlap_param_gather

    def microbatches(self, dp: int, micro_batch_size: Optional[int] = None) -> int:
        """Micro-batches per replica at ``dp`` with ``micro_batch_size`` (None: the command's)."""
        return self.global_batch // ((micro_batch_size or self.model.micro_batch_size) * dp)


@dataclass
class AdviceRow:
    """One recommendation (or the user's command) with its prediction."""

    name: str
    """``user``, ``best_stock``, ``pipemesh``, ``best_layout`` or ``best_layout_stock``."""
    layout: ParallelLayout
    """Its TP x PP x DP."""
    vpp: int
    """Virtual stages per rank V."""
    split: LayerSplit
    """Which stage holds which layers."""
    stage_layers: Tuple[int, ...]
    """Transformer layers per stage s = c*p + r."""
    microbatches: int
    """Micro-batches per iteration per data-parallel replica."""
    iteration_s: float
    """Predicted iteration time."""
    peak_memory_bytes: Tuple[float, ...]
    """Per pipeline rank: the predicted peak of device memory (weights, gradients, optimizer state, activations)."""
    fits: bool
    """The peak of every rank is within the memory budget."""
    compute_s: Tuple[float, ...]
    """Per pipeline rank: its forwards', backwards' and recomputation's time in one iteration."""
    stock: Optional[StockSetting] = None
    """The stock setting of a stock row."""
    plan: Optional[Plan] = None
    """The PipeMesh plan of a PipeMesh row."""
    micro_batch_size: Optional[int] = None
    """[--micro-batch-size] The row's, where it changes the command's; None: the command's."""
    added_flags: Tuple[str, ...] = ()
    """Store-true flags the row adds to the command (:data:`OVERLAP_FLAGS`); the distributed optimizer comes with the
    stock setting (sharding level ``optim``)."""

    @property
    def schedule(self) -> str:
        return "pipemesh" if self.plan is not None else "stock"

    def keeps(self, other: "AdviceRow") -> bool:
        """Same layout, V, layers per stage, micro-batch size and optimizer flags as ``other`` (so, for the same data
        and seed, the same losses)."""
        return ((self.layout, self.vpp, self.stage_layers, self.micro_batch_size, self._optimizer())
                == (other.layout, other.vpp, other.stage_layers, other.micro_batch_size, other._optimizer()))

    def _optimizer(self) -> Tuple[Optional[str], Tuple[str, ...]]:
        """The optimizer flags the row adds: its stock sharding level and its overlap flags."""
        return (self.stock.sharding if self.stock is not None else None), self.added_flags

    def describe(self) -> str:
        """The schedule in a few words (with "mbs b" where the row changes the micro-batch size)."""
        what = self.plan.config.group_flags() if self.plan is not None else self.stock.describe()
        if self.micro_batch_size is not None:
            what = f"mbs {self.micro_batch_size}, {what}"
        if self.added_flags:
            what += ", adds " + " ".join(self.added_flags)
        if self.plan is not None and self.plan.recompute_share:
            what += f", recompute {100 * self.plan.recompute_share:.1f}% of the time"
        if self.plan is not None and any(r.host_placed for r in self.plan.result.ranks):
            what += ", host placement"
        return f"{_layout_words(self.layout, self.vpp, self.split, self.stage_layers)}: {what}"


def _layout_words(layout: ParallelLayout, vpp: int, split: LayerSplit, stage_layers: Sequence[int]) -> str:
    """'TP1 PP8 DP2 V=2', with the layers per stage when the split is uneven."""
    return f"{layout.describe()} V={vpp}" + ("" if split.even else f", layers {'/'.join(map(str, stage_layers))}")


ROWS = ("user", "best_stock", "pipemesh", "best_layout", "best_layout_stock")
"""The rows of an :class:`Advice`, in report order."""


@dataclass
class SearchLog:
    """What :func:`search_layouts` did: the candidates it simulated and, if a limit stopped it early, what the
    candidates left could still gain."""

    simulated: Dict[str, int] = field(default_factory=lambda: {"pipemesh": 0, "stock": 0})
    """Per side ('pipemesh', 'stock'): candidates simulated (the others were pruned by their bound or not reached)."""
    stopped_by: Optional[str] = None
    """None: complete (every candidate that could beat a side's best was simulated). Otherwise the limit that left
    candidates unsearched: 'max_simulated' (one side) or 'search_seconds' (both)."""
    unsearched_bound_s: Optional[float] = None
    """When stopped: the least bound of the candidates left unsearched. None of them runs faster than that."""

    def stop(self, limit: str, bound_s: float) -> None:
        self.stopped_by = self.stopped_by or limit
        self.unsearched_bound_s = bound_s if self.unsearched_bound_s is None else min(self.unsearched_bound_s, bound_s)

    def gain(self, best_s: float) -> float:
        """How many times faster than ``best_s`` a candidate left unsearched could be, at most (1: none)."""
        if self.unsearched_bound_s is None or self.unsearched_bound_s >= best_s:
            return 1.0
        return best_s / self.unsearched_bound_s


@dataclass
class Advice:
    """The rows (None where a row cannot exist, with the reason in ``notes``) and what the search did."""

    rows: Dict[str, Optional[AdviceRow]]
    """Every name of :data:`ROWS`."""
    notes: List[str] = field(default_factory=list)
    """Why a row is missing, what was assumed, what a stopped search left."""
    candidates: int = 0
    """(layout, V, split) candidates with a bound."""
    search: SearchLog = field(default_factory=SearchLog)
    """What the layout search simulated, and whether ``search_seconds`` stopped it."""
    seconds: float = 0.0
    """Wall time of the search."""
    cpu_seconds: float = 0.0
    """CPU time of the search (this process and its worker processes): what it costs, however loaded the machine
    is."""

    def best(self) -> Optional[AdviceRow]:
        """The fastest row that fits (ties: the earlier in :data:`ROWS`, the user's command first)."""
        fitting = [row for name in ROWS if (row := self.rows.get(name)) is not None and row.fits]
        return min(fitting, key=lambda row: row.iteration_s) if fitting else None


@dataclass(frozen=True)
class _Candidate:
    """One (layout, V, split) with its lower bound."""

    layout: ParallelLayout
    """TP x PP x DP."""
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
        return (_layout_words(self.layout, self.vpp, self.split, self.model.stage_layers(self.layout.pp, self.vpp))
                + (f" mbs {self.micro_batch_size}" if self.micro_batch_size is not None else ""))


def parallel_layouts(problem: AdviceProblem, cluster: AdviceCluster) -> List[ParallelLayout]:
    """Every TP x PP x DP of the cluster's GPUs the search prices (module docstring)."""
    model = problem.model
    out = []
    for tp in range(1, min(cluster.gpus_per_node, problem.max_tp or cluster.gpus_per_node) + 1):
        if cluster.gpus_per_node % tp or cluster.gpus % tp:
            continue
        if model.num_attention_heads % tp or (model.num_query_groups or model.num_attention_heads) % tp or model.ffn % tp:
            continue
        for pp in range(1, cluster.gpus // tp + 1):
            if (cluster.gpus // tp) % pp or pp > model.num_layers:
                continue
            dp = cluster.gpus // (tp * pp)
            per_stage = tp * dp
            if cluster.gpus_per_node % per_stage and per_stage % cluster.gpus_per_node:
                continue  # neither whole stages per node nor whole nodes per stage (not modelled)
            if not micro_batch_sizes(problem, pp, dp):
                continue
            out.append(ParallelLayout(tp, pp, dp))
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


def _splits(problem: AdviceProblem, layout: ParallelLayout, vpp: int) -> List[LayerSplit]:
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


class _Optimizer(NamedTuple):
    """How a layout's candidates reduce and step: the command's, or what a row without a pipeline adds to it."""

    distributed: bool
    """--use-distributed-optimizer."""
    overlap: Tuple[bool, bool]
    """(--overlap-grad-reduce, --overlap-param-gather)."""
    sharding: Tuple[Optional[str], ...]
    """The stock sharding levels (``optim``: the distributed optimizer added)."""
    added: Tuple[str, ...]
    """The overlap flags added."""


def _optimizers(problem: AdviceProblem, layout: ParallelLayout) -> List[_Optimizer]:
    """A layout's optimizer settings: the command's; at PP = 1 over DP > 1 (data parallelism alone), also Megatron's
    own data-parallel setup where the command differs: the distributed optimizer (ZeRO-1 over Megatron's DDP buffers),
    and with it both overlap flags (gradients reduced in buckets under the last backward, parameters gathered under
    the first forward)."""
    own = _Optimizer(problem.distributed_optimizer, problem.overlap, (None,), ())
    if layout.pp > 1 or layout.dp == 1:
        return [own]
    sharding = (None,) if problem.distributed_optimizer else (OPTIM,)
    out = [own]
    if not problem.distributed_optimizer:
        out.append(_Optimizer(True, problem.overlap, sharding, ()))
    added = tuple(flag for flag, on in zip(OVERLAP_FLAGS, problem.overlap) if not on)
    if added:
        out.append(_Optimizer(True, (True, True), sharding, added))
    return out


def candidates(problem: AdviceProblem, cluster: AdviceCluster) -> List[_Candidate]:
    """Every (layout, micro-batch size, V, split) whose static memory fits, with its tight bound, least bound first
    (ties: the command's micro-batch size first)."""
    out = []
    own = problem.model.micro_batch_size
    for layout in parallel_layouts(problem, cluster):
        for optimizer in _optimizers(problem, layout):
            spec = cluster.spec(layout.tp, layout.dp, problem.sequence_parallel, optimizer.distributed, optimizer.overlap)
            for b in micro_batch_sizes(problem, layout.pp, layout.dp):
                m = problem.microbatches(layout.dp, b)
                for vpp in range(1, (problem.model.num_layers // layout.pp if layout.pp > 1 else 1) + 1):
                    if vpp > 1 and layout.pp == 2 and not problem.interleaving_at_two:
                        continue
                    for split in _splits(problem, layout, vpp):
                        model = dataclasses.replace(problem.model_for(layout.tp, split), micro_batch_size=b)
                        config = ScheduleConfig.depth_first(layout.pp, vpp, m)
                        costs = costs_for(model, spec, config, profile=problem.profile, levels=(DEVICE,))
                        if max(costs.static_bytes) > cluster.budget_bytes:
                            continue
                        bound = bound_for(config, ScheduleCosts(config, costs)).seconds
                        out.append(_Candidate(layout, vpp, split, model, spec, m, bound, problem.profile,
                                              None if b == own else b, optimizer.sharding, optimizer.added))
    return sorted(out, key=lambda c: c.bound_s)


FIT_LIMIT = 3
"""Group lists fitted to the memory per (layout, V, split) at most, the fastest without memory levers first
(:attr:`.planner.PlannerOptions.fit_limit`). Fitting re-simulates a candidate once per recomputation or placement
round; with every list that may win fitted, one GPT-13B candidate of 16 ranks and 64 micro-batches took minutes.
The lists are simulated without levers first, so the three fitted are the three that are fastest before memory."""


def search_options(pp: int, microbatches: int, host_budget_bytes: Optional[float]) -> PlannerOptions:
    """PipeMesh's search for the advice: the structured group family (:func:`.planner_options.structured_options`),
    with host placement when host memory is given (recomputation only otherwise), fitting at most
    :data:`FIT_LIMIT` lists per candidate."""
    placement = "auto" if host_budget_bytes is not None else RECOMPUTE_ONLY
    return structured_options(pp, microbatches, placement, host_budget_bytes, FIT_LIMIT)


def _host_bytes(cluster: AdviceCluster) -> Optional[float]:
    return None if cluster.host_memory_gb is None else cluster.host_memory_gb * GB


def _plan(candidate: _Candidate, cluster: AdviceCluster, incumbent_s: float = float("inf"),
          time_up: TimeUp = None) -> Optional[Plan]:
    """PipeMesh's best plan for one candidate (None: nothing fits or beats ``incumbent_s``; :class:`SearchTimeUp`
    when ``time_up`` says so)."""
    model, spec = candidate.model, candidate.cluster
    try:
        plan, _ = plan_schedule(candidate.layout.pp, candidate.vpp, candidate.microbatches,
                                lambda config: costs_for(model, spec, config, profile=candidate.profile),
                                cluster.budget_bytes,
                                search_options(candidate.layout.pp, candidate.microbatches, _host_bytes(cluster)),
                                incumbent_s=incumbent_s, time_up=time_up)
    except (NoFeasiblePlan, ScheduleConfigError):
        return None
    return plan if plan.result.iteration_s < incumbent_s else None


def _stock(candidate: _Candidate, problem: AdviceProblem, cluster: AdviceCluster,
           incumbent_s: float = float("inf"), vpps: Optional[Sequence[int]] = None,
           time_up: TimeUp = None) -> Optional[StockResult]:
    """Stock's best setting for one candidate's layout and split, at its V (or ``vpps``)."""
    budget = activation_budget(candidate.model, candidate.cluster, candidate.layout.pp, cluster.budget_bytes,
                               candidate.vpp)
    host = _host_bytes(cluster) if candidate.model.layer_spec == "te" else None
    return best_stock(candidate.model, candidate.cluster, candidate.layout.pp, candidate.microbatches, budget,
                      problem.grad_reduce_in_bf16, sharding=candidate.stock_sharding, host_limit=host,
                      vpps=vpps or (candidate.vpp,),
                      incumbent_s=incumbent_s, time_up=time_up, profile=candidate.profile)


def _stock_row(name: str, candidate: _Candidate, result: StockResult, cluster: AdviceCluster) -> AdviceRow:
    setting = result.setting
    config = setting.config()
    peaks = tuple(a + s for a, s in zip(result.peak_activation_bytes, result.static_bytes))
    costs = costs_for(candidate.model, candidate.cluster, config, profile=candidate.profile,
                      levels=(setting.recompute.level,))
    compute = tuple(r.busy_s for r in simulate(config, costs, uniform_plan(config, setting.recompute.level)).ranks)
    layers = candidate.model.stage_layers(setting.pp, setting.vpp)
    return AdviceRow(name, candidate.layout, setting.vpp, candidate.split, layers, setting.microbatches,
                     result.iteration_s, peaks, all(p <= cluster.budget_bytes for p in peaks), compute, stock=setting,
                     micro_batch_size=candidate.micro_batch_size, added_flags=candidate.added_flags)


def _plan_row(name: str, candidate: _Candidate, plan: Plan) -> AdviceRow:
    config = plan.config
    return AdviceRow(name, candidate.layout, config.vpp, candidate.split,
                     candidate.model.stage_layers(config.pp, config.vpp), config.microbatches, plan.result.iteration_s,
                     tuple(r.peak_memory_bytes for r in plan.result.ranks), plan.fits,
                     tuple(r.busy_s for r in plan.result.ranks), plan=plan, micro_batch_size=candidate.micro_batch_size)


def _user_candidate(problem: AdviceProblem, cluster: AdviceCluster, vpp: int) -> _Candidate:
    layout = problem.layout
    spec = cluster.spec(layout.tp, layout.dp, problem.sequence_parallel, problem.distributed_optimizer,
                        problem.overlap)
    return _Candidate(layout, vpp, problem.model.layer_split, problem.model, spec, problem.microbatches(layout.dp), 0.0,
                      problem.profile)


def _user_row(problem: AdviceProblem, cluster: AdviceCluster) -> AdviceRow:
    """The command as it is: its stock setting simulated, or its PipeMesh groups (fitted to the memory as the runtime's
    start-up planner fits them)."""
    user = _user_candidate(problem, cluster, problem.vpp)
    if problem.stock is not None:
        budget = activation_budget(user.model, user.cluster, user.layout.pp, cluster.budget_bytes, problem.vpp)
        return _stock_row("user", user, evaluate(problem.stock, user.model, user.cluster, budget, problem.profile),
                          cluster)
    if problem.pipemesh is None:  # --forward-groups auto: what its planner finds (the same search as ours)
        plan = _plan(user, cluster)
        if plan is None:
            raise NoFeasiblePlan(f"the command's --forward-groups auto finds no plan that fits "
                                 f"{cluster.device_memory_gb:g} GiB per GPU")
        return _plan_row("user", user, plan)
    costs = costs_for(user.model, user.cluster, problem.pipemesh, profile=problem.profile)
    plan = fit_with_recompute(problem.pipemesh, costs, cluster.budget_bytes,
                              search_options(user.layout.pp, user.microbatches, _host_bytes(cluster)))
    return _plan_row("user", user, plan)


class _UserLayout:
    """Stock's best setting over V and PipeMesh's plan for the user's layout (the ``best_stock`` and ``pipemesh``
    rows): with ``jobs`` > 1 on two worker processes while the caller prices the user's command and bounds the
    candidates, else when asked. The same functions either way, so the same rows."""

    def __init__(self, problem: AdviceProblem, cluster: AdviceCluster, user: _Candidate, pipemesh: bool, jobs: int):
        from .pool import WorkerPool, jobs_here

        self._args = (user, problem, cluster, virtual_sizes(problem.model, problem.layout.pp))
        self._pipemesh = pipemesh
        self._pool = WorkerPool(min(2 if pipemesh else 1, jobs_here(jobs))) if jobs_here(jobs) > 1 else None
        self._stock = self._plan = None
        if self._pool is not None:
            user, problem, cluster, vpps = self._args
            self._stock = self._pool.submit(_stock, user, problem, cluster, float("inf"), vpps)
            self._plan = self._pool.submit(_plan, user, cluster) if pipemesh else None

    def __enter__(self) -> "_UserLayout":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.close()

    def stock(self) -> Optional[StockResult]:
        if self._pool is not None:
            return self._stock.result()
        user, problem, cluster, vpps = self._args
        return _stock(user, problem, cluster, vpps=vpps)

    def plan(self) -> Optional[Plan]:
        if not self._pipemesh:
            return None
        return self._plan.result() if self._pool is not None else _plan(self._args[0], self._args[2])


Progress = Optional[Callable[[str], None]]
"""Where the search says what it is doing, one line at a time (the CLI's stderr); None: silent."""

HEARTBEAT_S = 10.0
"""Seconds between the layout search's progress lines when no row improves."""


def search_layouts(problem: AdviceProblem, cluster: AdviceCluster, found: Sequence[_Candidate],
                   best_pm: Optional[AdviceRow] = None, best_st: Optional[AdviceRow] = None, pipemesh: bool = True,
                   stock: bool = True, pm_incumbent_s: float = float("inf"), log: Optional[SearchLog] = None,
                   max_simulated: Optional[int] = None, time_up: TimeUp = None,
                   progress: Progress = None, jobs: int = 1,
                   deadline_s: Optional[float] = None) -> Tuple[Optional[AdviceRow], Optional[AdviceRow]]:
    """The fastest PipeMesh and stock rows over ``found`` (sorted by bound), each side starting from its given row
    (or, for PipeMesh, from ``pm_incumbent_s``, a time reached otherwise): a candidate is simulated for a side only
    while its bound is below that side's best time, and the search stops once the bound reaches both. A side that is
    not searched (``pipemesh`` / ``stock`` False) keeps its given row. ``log`` records what was simulated.

    Limits (None: none), each recorded in ``log`` with the least bound left: ``max_simulated`` stops a side after
    that many candidates; ``time_up`` (asked between candidates and between the simulations of one) stops both sides
    once it says the time has passed, abandoning the candidate in progress unless its side has no row yet. Either way
    the rows are real plans, and no candidate left runs faster than that bound. ``deadline_s`` (a
    :func:`time.monotonic` instant) is the same limit as ``time_up`` given as the time it passes.

    ``jobs`` > 1 (1 inside a worker, :func:`.pool.jobs_here`): the candidates are simulated on that many worker
    processes (:mod:`.parallel_search`) with the same rows and counts as here, to the float, when no time limit stops
    the search (``time_up`` cannot be sent to a worker: give ``deadline_s``)."""
    log = log if log is not None else SearchLog()
    if deadline_s is not None and time_up is None:
        time_up = lambda: time.monotonic() >= deadline_s  # noqa: E731
    from .pool import jobs_here

    jobs = jobs_here(jobs)
    if jobs > 1 and len(found) > 1:
        if deadline_s is None and time_up is not None:
            raise ValueError("search_layouts: a time_up function cannot be sent to worker processes; give deadline_s "
                             "(a time.monotonic() instant), or jobs=1")
        from .parallel_search import search_parallel

        return search_parallel(problem, cluster, found, best_pm, best_st, pipemesh, stock, pm_incumbent_s, log,
                               max_simulated, deadline_s, progress, jobs, run_side, _say, HEARTBEAT_S)
    next_beat = [time.perf_counter() + HEARTBEAT_S]

    def beat(index: int, candidate: _Candidate) -> None:
        now = time.perf_counter()
        if progress is not None and now >= next_beat[0]:
            progress(f"{index} of {len(found)} candidates done; now {candidate.describe()} (bound "
                     f"{candidate.bound_s:.3f} s)" + "".join(
                         f", best {name} {row.iteration_s:.3f} s"
                         for name, row in (("PipeMesh", best_pm), ("stock", best_st)) if row is not None))
            next_beat[0] = now + HEARTBEAT_S

    def asker(index: int, candidate: _Candidate, may_stop: bool) -> Callable[[], bool]:
        """Asked before each simulation inside a candidate: progress when due; time up only if ``may_stop``."""
        def ask() -> bool:
            beat(index, candidate)
            return may_stop and time_up is not None and time_up()
        return ask

    for index, candidate in enumerate(found):
        pm_limit = min(best_pm.iteration_s if best_pm else float("inf"), pm_incumbent_s) if pipemesh else -float("inf")
        st_limit = (best_st.iteration_s if best_st else float("inf")) if stock else -float("inf")
        if max_simulated is not None:  # a capped side stops at the first candidate it would have simulated
            if log.simulated["pipemesh"] >= max_simulated and candidate.vpp >= 2 and candidate.bound_s < pm_limit:
                log.stop("max_simulated", candidate.bound_s)
                pm_limit = -float("inf")
            if log.simulated["stock"] >= max_simulated and candidate.bound_s < st_limit:
                log.stop("max_simulated", candidate.bound_s)
                st_limit = -float("inf")
        if candidate.bound_s >= max(pm_limit, st_limit):
            break  # sorted by bound: no later candidate beats either side
        if time_up is not None and time_up():
            log.stop("search_seconds", candidate.bound_s)
            break
        beat(index, candidate)
        try:
            if candidate.vpp >= 2 and candidate.bound_s < pm_limit:
                log.simulated["pipemesh"] += 1
                plan = _plan(candidate, cluster, pm_limit, asker(index, candidate, best_pm is not None))
                if plan is not None:
                    best_pm = _plan_row("best_layout", candidate, plan)
                    _say(progress, best_pm)
            if candidate.bound_s < st_limit:
                log.simulated["stock"] += 1
                result = _stock(candidate, problem, cluster, st_limit, time_up=asker(index, candidate, best_st is not None))
                if result is not None and result.iteration_s < st_limit:
                    best_st = _stock_row("best_layout_stock", candidate, result, cluster)
                    _say(progress, best_st)
        except SearchTimeUp:
            log.stop("search_seconds", candidate.bound_s)
            break
    return best_pm, best_st


def run_side(problem: AdviceProblem, cluster: AdviceCluster, candidate: _Candidate, side: str, incumbent_s: float,
             deadline_s: Optional[float], may_stop: bool) -> Tuple[str, Optional[AdviceRow]]:
    """One task, in a worker: ``side`` of ``candidate`` searched below ``incumbent_s``. Returns ('done', its row or
    None when nothing fits or beats the incumbent), ('pruned', None) when the board's limit for the side fell to the
    candidate's bound or below, or ('time_up', None) when ``deadline_s`` (a :func:`time.monotonic` instant) passed
    and ``may_stop``."""
    slot = ("pipemesh", "stock").index(side)  # the board's slots (:data:`.parallel_search.SIDES`)
    why: List[str] = []

    def time_up() -> bool:
        shared = board()
        if shared is not None and candidate.bound_s >= shared[slot]:
            why.append("pruned")
            return True
        if may_stop and deadline_s is not None and time.monotonic() >= deadline_s:
            why.append("time_up")
            return True
        return False

    try:
        if side == "pipemesh":
            plan = _plan(candidate, cluster, incumbent_s, time_up)
            return "done", None if plan is None else _plan_row("best_layout", candidate, plan)
        result = _stock(candidate, problem, cluster, incumbent_s, time_up=time_up)
        if result is None or not result.iteration_s < incumbent_s:
            return "done", None
        return "done", _stock_row("best_layout_stock", candidate, result, cluster)
    except SearchTimeUp:
        return why[-1], None


def _say(progress: Progress, row: Optional[AdviceRow]) -> None:
    if progress is not None and row is not None:
        progress(f"{row.name}: {row.iteration_s:.3f} s{'' if row.fits else ' (does not fit)'}, {row.describe()}")


def advise(problem: AdviceProblem, cluster: AdviceCluster, search_seconds: Optional[float] = None,
           progress: Progress = None, jobs: int = 1) -> Advice:
    """The five rows of the module docstring for ``problem`` on ``cluster``.

    ``search_seconds`` (None: no limit): from the start, the time after which the layout search stops (the rows of the
    user's layout are always priced); a note then says how much faster a layout left unsearched could be, at most.
    ``progress`` hears each row found and, every :data:`HEARTBEAT_S` (between simulations), where the layout search
    is. ``jobs``: worker processes for the layout search (:func:`search_layouts`; the same rows for every number
    when the search is complete)."""
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    deadline_s = None if search_seconds is None else time.monotonic() + search_seconds
    rows: Dict[str, Optional[AdviceRow]] = dict.fromkeys(ROWS)
    notes: List[str] = []
    user = _user_candidate(problem, cluster, problem.vpp)
    pipemesh_ok = problem.pipemesh_refused is None
    with _UserLayout(problem, cluster, user, pipemesh_ok and problem.vpp >= 2, jobs) as own:
        rows["user"] = _user_row(problem, cluster)
        _say(progress, rows["user"])
        found = candidates(problem, cluster)
        stock, plan = own.stock(), own.plan()
    if stock is not None:
        rows["best_stock"] = _stock_row("best_stock", dataclasses.replace(user, vpp=stock.setting.vpp), stock, cluster)
        _say(progress, rows["best_stock"])
    else:
        notes.append(f"best_stock: no stock setting fits {cluster.device_memory_gb:g} GiB per GPU with "
                     f"{problem.layout.describe()}")
    if not pipemesh_ok:
        notes.append(f"pipemesh, best_layout: {problem.pipemesh_refused}")
    elif problem.layout.pp == 1:
        notes.append("pipemesh: the command runs no pipeline (PP = 1); PipeMesh schedules one (see best_layout)")
    elif problem.vpp < 2:
        notes.append("pipemesh: the command has no virtual stages (V = 1); PipeMesh needs V >= 2 (see best_layout)")
    else:
        if plan is not None:
            rows["pipemesh"] = _plan_row("pipemesh", user, plan)
            _say(progress, rows["pipemesh"])
        else:
            notes.append(f"pipemesh: no PipeMesh plan fits {cluster.device_memory_gb:g} GiB per GPU with "
                         f"{problem.layout.describe()} V={problem.vpp}")
    if progress is not None:
        progress(f"{len(found)} candidates (TP x PP x DP, V, layer split) whose weights fit, searched in the order of "
                 f"their bound" + (f" for up to {search_seconds:g} s" if search_seconds is not None else ""))
    log = SearchLog()
    best_pm, best_st = search_layouts(problem, cluster, found, rows["pipemesh"] if pipemesh_ok else None,
                                      rows["best_stock"], pipemesh=pipemesh_ok, log=log, progress=progress,
                                      deadline_s=deadline_s, jobs=jobs)
    if pipemesh_ok:
        rows["best_layout"] = dataclasses.replace(best_pm, name="best_layout") if best_pm else None
        if best_pm is None and not any(c.vpp >= 2 for c in found):
            notes.append("best_layout: no layout whose weights fit allows V >= 2 (the layers per stage, or "
                         "--no-overlap-p2p-communication at PP = 2), so PipeMesh has none")
        elif best_pm is None:
            notes.append(f"best_layout: no PipeMesh plan (PP >= 2, V >= 2) fits {cluster.device_memory_gb:g} GiB per GPU")
    rows["best_layout_stock"] = dataclasses.replace(best_st, name="best_layout_stock") if best_st else None
    if best_st is None:
        notes.append(f"best_layout_stock: no stock setting fits {cluster.device_memory_gb:g} GiB per GPU in any layout")
    if log.stopped_by is not None:
        searched = sum(1 for c in found if c.bound_s < log.unsearched_bound_s)
        gains = [f"{log.gain(row.iteration_s):.2f}x faster than {name} ({row.iteration_s:.3f} s)"
                 for name in ("best_layout", "best_layout_stock") if (row := rows[name]) is not None]
        notes.append(f"the layout search stopped at --search-seconds {search_seconds:g} after {searched} of {len(found)} "
                     f"candidates (the least bounds first); the rest run no faster than {log.unsearched_bound_s:.3f} s"
                     + (", so a layout left unsearched is at most " + " and ".join(gains) if gains else "")
                     + "; a longer --search-seconds searches further")
    return Advice(rows, notes, len(found), log, time.perf_counter() - started, _cpu_seconds() - cpu_started)


def _cpu_seconds() -> float:
    """CPU time of this process and of its workers that have ended (a search's pool ends with the search)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def tokens_per_s(problem: AdviceProblem, row: AdviceRow) -> float:
    """Tokens trained per second at the row's predicted iteration time."""
    return problem.global_batch * problem.model.seq_length / row.iteration_s

