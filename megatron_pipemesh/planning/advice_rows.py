"""The advice's inputs and outputs (:mod:`.advice`): the cluster it is for, the user's command as a problem, one
row with its prediction, and the advice with its notes and what its search did.

Pure: no torch, no Megatron.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule.config import ScheduleConfig
from .clusters import PLANNING_CLUSTER, nic_cluster
from .costs import GB, ClusterSpec, ModelSpec
from .defaults import DEFAULT_HOST_LINK_GBPS, MFU
from .layout import LayerSplit
from .memory import MEMORY_MARGIN
from .planner import Plan
from .profile import Profile
from .stock import StockSetting


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
    latency_us: float = PLANNING_CLUSTER.latency_us
    """The fixed time of one message (a pipeline transfer, a collective's step), microseconds [--latency-us, or the
    profile's measurement]."""
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
    fp8_tflops: Optional[float] = None
    """Dense FP8 peak TFLOP/s of one GPU [--device-fp8-tflops, or --gpu's]; None: no FP8."""
    alltoall_intra_gbps: Optional[float] = None
    """The all-to-all rate among a node's GPUs a profile measured (:attr:`.costs.ClusterSpec.alltoall_intra_gbps`)."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def budget_bytes(self) -> float:
        """Device memory a plan may use: the memory less :data:`.memory.MEMORY_MARGIN`."""
        return self.device_memory_gb * GB * (1 - MEMORY_MARGIN)

    def spec(self, tp: int, dp: int, sequence_parallel: bool, distributed_optimizer: bool,
             overlap: Tuple[bool, bool] = (True, True), cp: int = 1, cp_comm: str = "p2p", ep: int = 1,
             etp: Optional[int] = None) -> ClusterSpec:
        """The planner's :class:`.costs.ClusterSpec` for one parallel layout; ``overlap``: the command's
        (--overlap-grad-reduce, --overlap-param-gather); ``cp``, ``cp_comm``: its context parallelism; ``ep``, ``etp``:
        its expert parallelism."""
        return nic_cluster(tp=tp, dp=dp, devices_per_node=self.gpus_per_node, nic_gbps=self.nic_gbps,
                           link_gbps=self.nic_gbps, intra_node_gbps=self.intra_node_gbps,
                           device_tflops=self.device_tflops, device_memory_gb=self.device_memory_gb,
                           host_link_gbps=self.host_link_gbps, nic_via_host=self.nic_via_host,
                           sequence_parallel=sequence_parallel and tp > 1, distributed_optimizer=distributed_optimizer,
                           mfu=self.mfu, latency_us=self.latency_us, host_copies_on_compute=self.host_copies_on_compute,
                           collectives=self.collectives, shared_cores=self.shared_cores,
                           pinned_cores=self.pinned_cores, overlap_grad_reduce=overlap[0],
                           overlap_param_gather=overlap[1], nic_burst_bytes=self.nic_burst_bytes, cp=cp,
                           cp_comm=cp_comm, fp8_tflops=self.fp8_tflops, ep=ep, etp=etp,
                           alltoall_intra_gbps=self.alltoall_intra_gbps)


@dataclass(frozen=True)
class ParallelLayout:
    """How the GPUs are split: tensor x context x pipeline x data parallel."""

    tp: int
    """Tensor-parallel size (inside a node)."""
    pp: int
    """Pipeline-parallel size."""
    dp: int
    """Data-parallel size (the replicas the global batch is split over)."""
    cp: int = 1
    """Context-parallel size (TP x CP inside a node in the search; the user's command may span nodes)."""
    ep: int = 1
    """Expert-parallel size (a MoE model's experts split over EP ranks of a stage)."""
    etp: Optional[int] = None
    """Expert tensor-parallel size; None: TP (Megatron's default)."""

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def describe(self) -> str:
        experts = ""
        if self.ep > 1 or (self.etp or self.tp) != self.tp:
            experts = f" EP{self.ep}" + (f" ETP{self.etp}" if (self.etp or self.tp) != self.tp else "")
        return f"TP{self.tp}" + (f" CP{self.cp}" if self.cp > 1 else "") + f" PP{self.pp} DP{self.dp}" + experts


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
    cp_comm: str = "p2p"
    """[--cp-comm-type] How a row's context-parallel exchange runs (the command's)."""
    context_parallel: bool = False
    """Rows may use context parallelism: the model's attention runs it (Transformer Engine's spec)."""

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
        return f"{layout_words(self.layout, self.vpp, self.split, self.stage_layers)}: {what}"


def layout_words(layout: ParallelLayout, vpp: int, split: LayerSplit, stage_layers: Sequence[int]) -> str:
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
    candidates unsearched: 'max_simulated' (one side), 'search_seconds' (both) or 'interrupted' (both: a signal)."""
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


def tokens_per_s(problem: AdviceProblem, row: AdviceRow) -> float:
    """Tokens trained per second at the row's predicted iteration time."""
    return problem.global_batch * problem.model.seq_length / row.iteration_s
