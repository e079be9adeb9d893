"""Stock Megatron's whole option set for one (model, cluster, p, d, m), predicted and ranked.

What megatron-core 0.19.2 offers a dense GPT run, and what this module enumerates:

* schedule: 1F1B (V = 1), or interleaved with V >= 2 virtual stages per rank for every V that
  divides the layers per pipeline rank, with every group size
  ``--microbatch-group-size-per-virtual-pipeline-stage g`` the schedule accepts: p <= g <= m and
  the last group (m mod g) either empty or at least p (``schedules.py`` raises otherwise);
* recomputation: none; ``--recompute-granularity selective`` with ``--recompute-modules`` any
  non-empty subset of ``core_attn``, ``layernorm``, ``mlp`` (the modules a dense layer honours:
  ``moe_act``/``moe``/``shared_experts`` need MoE, ``mla_up_proj`` MLA; ``layernorm`` acts only where
  the norm is a separate module, i.e. not with Transformer Engine's fused LayerNormLinear);
  ``--recompute-granularity full --recompute-method uniform|block --recompute-num-layers k`` for
  every k from 1 to the layers of one model chunk (Megatron applies k per chunk; a larger k acts
  like k = layers);
* activation offloading (on request, with a host memory limit, and only on Transformer Engine's layer
  spec, which Megatron requires for it): ``--fine-grained-activation-offloading --offload-modules
  qkv_linear core_attn attn_proj`` with ``--activation-offload-fraction`` 1/4 ... 1, alone or with
  selective recomputation (:class:`StockOffload` says how it is modelled);
* ``--grad-reduce-in-bf16`` (on request; PipeMesh's side is then given the same gradient bytes);
* Megatron's *default command* (:func:`default_stock`): what a user runs without a sweep, 1F1B and the
  interleaved schedule with the default group size g = p at every V, each with the first of none, selective,
  full block recomputation of the fewest layers that fits, no offloading; the best of those;
* sharding (on request, :data:`STOCK_SHARDING`): one level for every chunk, the uniform levels Megatron
  offers: ``optim`` = ``--use-distributed-optimizer`` (ZeRO-1, Megatron's DDP buffers), and through
  Megatron-FSDP ``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads`` (ZeRO-2) or
  ``optim_grads_params`` (ZeRO-3), GPU only (:class:`MegatronFsdpSharding` says how they are modelled).

Megatron's ``num_microbatches_with_partial_activation_checkpoints`` is read by no layer in
megatron-core 0.19.2, so stock has no per-micro-batch recomputation and none is offered here.

Each setting is a frozen dataclass whose ``flags()`` are the exact Megatron flags. Its cost is
predicted with the simulator (:mod:`.simulator`, the same engine and costs as PipeMesh's planner)
and its per-rank peak activation bytes with :mod:`.memory`. Because a fixed-order schedule never
finishes earlier when its ops get longer, the fastest setting of one (schedule, V, g) that fits a
budget is the fitting one with the least recomputation time; :func:`best_stock` simulates only
those, in order of a compute lower bound, and stops once the bound exceeds the fastest time found.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

from ..schedule.config import ScheduleConfig
from ..schedule.levers import DEVICE, Lever
from ..schedule.lower import LoweredSchedule, lower
from ..schedule.ops import Op, OpKind
from ..schedule.spans import SHARD_LEVELS
from .costs import ClusterSpec, ModelSpec, OpCosts, ScheduleCosts, activation_shape, analytic_costs
from .bounds import virtual_sizes
from .layout import LayerSplit
from .memory import OFFLOAD_MODULES, offloadable_layer_bytes, selective_module_sets
from .sharding import ShardingModel, ShardingSpec
from .simulator import DeadlineExceeded, TimeUp, check_time, lowering_for, simulate

Budget = Union[float, Sequence[float]]
"""Activation bytes allowed per pipeline rank: one number for every rank, or one per rank. With a
sharding level above ZeRO-1 it is still the device memory left after the *distributed optimizer's*
static bytes: the bytes the level saves are added to it, its gather and gradient buffers taken from it."""

STOCK_SHARDING = SHARD_LEVELS
"""The uniform sharding levels stock Megatron offers: the distributed optimizer (ZeRO-1) and
Megatron-FSDP's ZeRO-2 / ZeRO-3 (``--data-parallel-sharding-strategy``)."""


def sharding_flags(level: Optional[str]) -> List[str]:
    """Megatron's flags for a uniform sharding ``level`` (None: none given, whatever the run uses).

    Megatron-FSDP makes ``--use-distributed-optimizer`` implicit (``training/arguments.py:1106-1112``)
    and requires ``--ckpt-format fsdp_dtensor`` (``:1146``)."""
    if level is None:
        return []
    if level == "optim":
        return ["--use-distributed-optimizer"]
    if level not in STOCK_SHARDING:
        raise ValueError(f"stock sharding level {level!r}: use one of {', '.join(STOCK_SHARDING)}, "
                         f"e.g. --data-parallel-sharding-strategy optim_grads")
    return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", level, "--ckpt-format", "fsdp_dtensor"]


FSDP_MODELS = ("span", "per-microbatch bound")
"""How a stock ZeRO-2/3 setting's time and memory are predicted (:class:`MegatronFsdpSharding`)."""


class MegatronFsdpSharding(ShardingModel):
    """Megatron-FSDP's uniform ZeRO-2 / ZeRO-3 on a stock schedule, predicted at least as favourably as
    megatron-core 0.19.2 runs it.

    What Megatron-FSDP does (``core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py``): with
    ``optim_grads_params`` every ``TransformerLayer`` is an FSDP unit (``mcore_fsdp_adapter.py:158-164``);
    its parameters are all-gathered in a pre-forward hook (``_pre_forward_param_unshard``, ``:780-797``)
    and released after the unit's forward (``_post_forward``, ``:956-978``), gathered again before its
    backward (``_pre_backward_param_unshard``, ``:897-913``) and released after it: per unit, per
    micro-batch, forward and backward. With ``optim_grads`` or ``optim_grads_params`` the gradients are
    reduce-scattered after *every* backward (``grad_reduce_every_bprop``, ``:757-771`` and ``:865-880``);
    ``no_sync`` does not defer them (``:1150-1162``: "for grads shard mode there will actually always be
    gradient sync happening"), each bucket's whole gradient living in a temporary buffer until its
    reduce-scatter (``param_and_grad_buffer.py:3868``, ``:4230``). Pipeline parallelism: the
    schedules call each chunk's forward and backward as with DDP (``training/training.py:3532-3547``
    installs the chunks' ``no_sync`` / ``start_grad_sync`` / ``start_param_sync`` the same way), each
    virtual chunk is its own wrapper, and no check rejects ``--use-megatron-fsdp`` with pipeline or
    virtual pipeline parallelism (``training/arguments.py`` rejects pipeline parallelism only for
    ``--use-torch-fsdp2``, ``:997-1001``).

    Stock gets the faster of two predictions (each fitting the memory on its own terms):

    * ``span``: PipeMesh's own span model (this class as a :class:`.sharding.ShardingModel`): one
      all-gather per merged group span and one reduce-scatter per backward group -- fewer collectives
      than Megatron's per micro-batch ones -- with the whole chunk's weights held during a span;
    * ``per-microbatch bound``: Megatron-FSDP's own pattern, with buffers of one FSDP unit (one layer's
      gathered weights and gradient bucket), and as time a lower bound: the busier of a rank's compute
      (:func:`_compute_bound`) and its data-parallel channel carrying 2m gathers (ZeRO-3) and m
      reduce-scatters per chunk (:meth:`microbatch_channel_s`), as if they overlapped perfectly."""

    def unit_buffers(self) -> float:
        """Bytes one FSDP unit (a transformer layer) holds beyond its shard: gathered weights (ZeRO-3) and
        its whole gradient bucket."""
        unit = self.model.layer_params() / self.cluster.tp
        rest = 1 - 1 / self.cluster.dp
        zero3 = self.spec.levels[0] == "optim_grads_params"
        return unit * rest * (self.model.grad_bytes + (self.model.dtype_bytes if zero3 else 0))

    def microbatch_channel_s(self, config: ScheduleConfig, costs: OpCosts) -> List[float]:
        """Per rank: seconds its data-parallel channel is busy per iteration with Megatron-FSDP's
        collectives (ring time per collective as :class:`.sharding.ShardedCosts`)."""
        adapter = self.adapter(config, costs, {})
        zero3 = self.spec.levels[0] == "optim_grads_params"
        m = config.microbatches
        out = []
        for rank in range(config.pp):
            busy = 0.0
            for chunk in range(config.vpp):
                gather = adapter.data_parallel(rank, Op(OpKind.GATHER, chunk, 0))
                reduce = adapter.data_parallel(rank, Op(OpKind.REDUCE, chunk, 0))
                # ZeRO-2 gathers the updated parameters once (after the step), ZeRO-3 per forward and backward.
                busy += (2 * m if zero3 else 1) * gather + m * reduce
            out.append(busy)
        return out


@dataclass(frozen=True)
class StockRecompute:
    """One of Megatron's recomputation settings (applied to every layer of every chunk and micro-batch)."""

    granularity: str = "none"
    """'none', 'selective' or 'full' [--recompute-granularity]."""
    modules: Tuple[str, ...] = ()
    """Selective only: the checkpointed submodules [--recompute-modules]; () = Megatron's default core_attn."""
    method: Optional[str] = None
    """Full only: 'uniform' or 'block' [--recompute-method]."""
    num_layers: Optional[int] = None
    """Full only: k [--recompute-num-layers]: layers per checkpoint (uniform) or checkpointed layers per chunk (block)."""

    def __post_init__(self) -> None:
        if self.granularity not in ("none", "selective", "full"):
            raise ValueError(f"--recompute-granularity {self.granularity}: use none, selective or full")
        if self.granularity == "full" and (self.method not in ("uniform", "block") or not self.num_layers or self.num_layers < 1):
            raise ValueError("--recompute-granularity full needs --recompute-method uniform|block and "
                             "--recompute-num-layers k >= 1, e.g. --recompute-method block --recompute-num-layers 2")
        if self.granularity != "full" and (self.method or self.num_layers):
            raise ValueError("--recompute-method/--recompute-num-layers apply only to --recompute-granularity full")
        if self.modules and self.granularity != "selective":
            raise ValueError("--recompute-modules applies only to --recompute-granularity selective")
        if self.modules:
            Lever.selective(self.modules)  # validates the names

    @property
    def level(self) -> Lever:
        """The lever with the same memory and time."""
        if self.granularity == "none":
            return DEVICE
        if self.granularity == "selective":
            return Lever.selective(self.modules or ("core_attn",))
        return Lever.parse(f"{self.method}:{self.num_layers}")

    def flags(self) -> List[str]:
        if self.granularity == "none":
            return []
        out = ["--recompute-granularity", self.granularity]
        if self.granularity == "selective":
            if self.modules:
                out += ["--recompute-modules", *self.modules]
            return out
        return out + ["--recompute-method", str(self.method), "--recompute-num-layers", str(self.num_layers)]

    def describe(self) -> str:
        return " ".join(self.flags()) or "no recomputation"


OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
"""The ``--activation-offload-fraction`` values the search tries (least first: the least that fits)."""


@dataclass(frozen=True)
class StockOffload:
    """Megatron's fine-grained activation offloading of :data:`.memory.OFFLOAD_MODULES` (megatron-core
    0.19.2, ``pipeline_parallel/fine_grained_activation_offload.py``; CUDA and Transformer Engine only).

    What it does: around each offloaded module's forward, saved-tensor hooks collect what the module saves;
    after the module, a side stream copies the group to pinned host memory and the device copy is freed
    (``bulk_offload_group``); in the backward, the group of the next layer is reloaded while the current one
    computes (``bulk_reload``), and a chunk's last layer before the chunk's backward starts
    (``pre_reload_last_layer``). It works in every stock schedule (``schedules.py`` resets it after each
    forward-backward). ``--activation-offload-fraction`` offloads that share of the eligible groups.

    How it is modelled, at least as favourably as Megatron runs it: a stored chunk-micro-batch holds
    :func:`.memory.offloadable_layer_bytes` x layers x fraction fewer bytes; the chunk in its forward
    or backward holds two layers' offloadable bytes more (the group in flight and the one being used);
    the host holds the offloaded bytes of every stored chunk-micro-batch (within the host memory limit);
    and the time is the schedule's own (copies overlap compute perfectly) or, if longer, the rank's host
    link carrying every copy in one direction back to back (:meth:`OffloadModel.busy_s`)."""

    fraction: float = 1.0
    """Share of the offload groups moved [--activation-offload-fraction]."""

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"--activation-offload-fraction {self.fraction}: use a value in (0, 1], e.g. 0.5")

    def flags(self) -> List[str]:
        out = ["--fine-grained-activation-offloading", "--offload-modules", *OFFLOAD_MODULES]
        return out + ([] if self.fraction == 1 else ["--activation-offload-fraction", f"{self.fraction:g}"])

    def describe(self) -> str:
        return f"offload {', '.join(OFFLOAD_MODULES)}" + ("" if self.fraction == 1 else f" x{self.fraction:g}")


@dataclass(frozen=True)
class StockSetting:
    """One stock Megatron configuration of the pipeline schedule and recomputation."""

    pp: int
    """Pipeline size p [--pipeline-model-parallel-size]."""
    vpp: int
    """Virtual stages per rank V [--num-virtual-stages-per-pipeline-rank]; 1 = 1F1B."""
    microbatches: int
    """Micro-batches per iteration per data-parallel replica m."""
    group_size: Optional[int] = None
    """Interleaved only: g [--microbatch-group-size-per-virtual-pipeline-stage]; None = Megatron's default p."""
    recompute: StockRecompute = StockRecompute()
    """Recomputation applied everywhere."""
    grad_reduce_in_bf16: bool = False
    """[--grad-reduce-in-bf16] Reduce gradients in bf16 (2 bytes) instead of fp32."""
    sharding: Optional[str] = None
    """Uniform sharding level of every chunk (:data:`STOCK_SHARDING`, flags :func:`sharding_flags`); None:
    not part of the setting (the distributed optimizer is assumed, no flag is emitted)."""
    offload: Optional[StockOffload] = None
    """Fine-grained activation offloading (None: off)."""

    def __post_init__(self) -> None:
        sharding_flags(self.sharding)  # validates the level
        if self.offload is not None and self.recompute.granularity == "full":
            raise ValueError("--fine-grained-activation-offloading with --recompute-granularity full: a recomputed "
                             "layer saves only its input; use selective recomputation or none with offloading")

    @property
    def schedule(self) -> str:
        return "1f1b" if self.vpp == 1 else "interleaved"

    @property
    def effective_group_size(self) -> Optional[int]:
        return None if self.vpp == 1 else (self.group_size or self.pp)

    def config(self) -> ScheduleConfig:
        """The same schedule in PipeMesh notation (uniform groups of g; groups are irrelevant at V = 1)."""
        if self.vpp == 1:
            return ScheduleConfig.depth_first(self.pp, 1, self.microbatches)
        return ScheduleConfig.uniform(self.pp, self.vpp, self.microbatches, self.effective_group_size)

    def flags(self) -> List[str]:
        out = ["--pipeline-model-parallel-size", str(self.pp)]
        if self.vpp > 1:
            out += ["--num-virtual-stages-per-pipeline-rank", str(self.vpp),
                    "--microbatch-group-size-per-virtual-pipeline-stage", str(self.effective_group_size)]
        out += self.recompute.flags()
        if self.offload is not None:
            out += self.offload.flags()
        if self.grad_reduce_in_bf16:
            out.append("--grad-reduce-in-bf16")
        return out + sharding_flags(self.sharding)

    def describe(self) -> str:
        sched = "1F1B" if self.vpp == 1 else f"interleaved V={self.vpp} g={self.effective_group_size}"
        return (f"{sched}, {self.recompute.describe()}" + (f", {self.offload.describe()}" if self.offload else "")
                + (", bf16 grad reduce" if self.grad_reduce_in_bf16 else "")
                + (f", sharding {self.sharding}" if self.sharding else ""))

    def to_dict(self) -> dict:
        return {"schedule": self.schedule, "vpp": self.vpp, "group_size": self.effective_group_size,
                "recompute": self.recompute.describe(), "grad_reduce_in_bf16": self.grad_reduce_in_bf16,
                "offload_fraction": self.offload.fraction if self.offload else None,
                "sharding": self.sharding, "flags": self.flags()}


def recompute_options(layers_per_chunk: int, layer_spec: str = "local") -> List[StockRecompute]:
    """Every stock recomputation setting for chunks of ``layers_per_chunk`` layers."""
    out = [StockRecompute()]
    for chosen in selective_module_sets(layer_spec):
        out.append(StockRecompute("selective", () if chosen == ("core_attn",) else chosen))
    for method in ("block", "uniform"):
        for k in range(1, layers_per_chunk + 1):
            out.append(StockRecompute("full", method=method, num_layers=k))
    return out


def group_sizes(pp: int, microbatches: int) -> List[int]:
    """Every g Megatron's interleaved schedule accepts: p <= g <= m, m mod g = 0 or >= p."""
    return [g for g in range(pp, microbatches + 1) if microbatches % g == 0 or microbatches % g >= pp]


def schedule_options(pp: int, num_layers: int, microbatches: int,
                     split: LayerSplit = LayerSplit()) -> List[Tuple[int, Optional[int]]]:
    """(V, g) of every stock schedule: 1F1B and interleaved for every V at which ``split`` places the layers (evenly:
    every V dividing the layers per rank; a layout: its own V)."""
    if split.even and num_layers % pp:
        raise ValueError(f"--num-layers {num_layers} must be a multiple of --pipeline-model-parallel-size {pp}, or give "
                         "an uneven split (e.g. --pipeline-model-parallel-layout)")
    out: List[Tuple[int, Optional[int]]] = []
    for vpp in split.virtual_sizes(num_layers, pp):
        out += [(1, None)] if vpp == 1 else [(vpp, g) for g in group_sizes(pp, microbatches)]
    return out


@dataclass
class StockResult:
    """A stock setting with its predicted iteration time and per-rank peaks."""

    setting: StockSetting
    iteration_s: Optional[float]
    """Simulated iteration time; None when not simulated (it does not fit, see :func:`best_stock`)."""
    peak_activation_bytes: Tuple[float, ...]
    """Per pipeline rank: the peak of what the activation budget (:data:`Budget`) must hold: activation bytes
    (transient recomputation included); with ZeRO-2/3 the peak of activations plus gather and gradient
    buffers, less the static bytes the level saves against the distributed optimizer."""
    static_bytes: Tuple[float, ...]
    """Per pipeline rank: weights, gradients and optimizer state (at the setting's sharding level)."""
    fsdp_model: Optional[str] = None
    """ZeRO-2/3 (Megatron-FSDP): which prediction (:data:`FSDP_MODELS`) gave the time and peaks."""
    host_peak_bytes: Tuple[float, ...] = ()
    """Per pipeline rank with offloading: the peak of offloaded activations in host memory (else empty)."""

    def fits(self, budget: Budget) -> bool:
        return all(peak <= limit for peak, limit in zip(self.peak_activation_bytes, _per_rank(budget, len(self.peak_activation_bytes))))

    def to_dict(self) -> dict:
        return {**self.setting.to_dict(), "iteration_s": self.iteration_s,
                "peak_activation_bytes": list(self.peak_activation_bytes), "fsdp_model": self.fsdp_model,
                "host_peak_bytes": list(self.host_peak_bytes)}


def _per_rank(budget: Budget, pp: int) -> List[float]:
    if isinstance(budget, (int, float)):
        return [float(budget)] * pp
    if len(budget) != pp:
        raise ValueError(f"an activation budget per rank needs {pp} values, got {len(budget)}")
    return [float(b) for b in budget]


def _model_for(model: ModelSpec, setting: StockSetting) -> ModelSpec:
    return dataclasses.replace(model, grad_bytes=2) if setting.grad_reduce_in_bf16 else model


def order_peaks(config: ScheduleConfig, costs: OpCosts, levels: Sequence[str],
                schedule: Optional[LoweredSchedule] = None) -> Dict[str, Tuple[float, ...]]:
    """Per-rank activation peak of ``config`` with each level of ``levels`` applied everywhere, from
    the program order (one compute stream per rank, so the order fixes the peak): a forward adds
    its chunk's bytes, a backward holds its recomputation's transient bytes until it frees them.

    The live set at each step is counted once per rank as live chunk-micro-batches per kind of chunk
    (:class:`ChunkKinds`: chunks that hold the same bytes); each level's peak is then a maximum over those counts."""
    schedule = schedule or lower(config, lowering_for(costs))
    adapter = ScheduleCosts(config, costs)
    kinds = ChunkKinds.of(config, adapter)
    counts = live_states(config, schedule, kinds)
    return {level: _peaks(counts, kinds.bytes_at(adapter, level), kinds.transient(adapter, level)) for level in levels}


@dataclass(frozen=True)
class ChunkKinds:
    """The chunks of each rank grouped by what one micro-batch of them holds at any level: the same stage costs
    (layers) and the same first/last-stage extras. An even split has at most three kinds per rank."""

    of_chunk: Tuple[Tuple[int, ...], ...]
    """Per rank: the kind of each chunk."""
    chunks: Tuple[Tuple[int, ...], ...]
    """Per rank: one chunk of each kind, in kind order."""

    @classmethod
    def of(cls, config: ScheduleConfig, adapter: Optional[ScheduleCosts] = None) -> "ChunkKinds":
        """The kinds of ``config``'s chunks under ``adapter``'s stage costs (None: every stage alike)."""
        last = config.num_stages - 1
        of_chunk, chunks = [], []
        for rank in range(config.pp):
            keys: Dict[tuple, int] = {}
            row = []
            for chunk in range(config.vpp):
                stage = config.stage(rank, chunk)
                costs = id(adapter.stage_costs(rank, chunk)) if adapter is not None else None
                row.append(keys.setdefault((costs, stage == 0, stage == last), len(keys)))
            of_chunk.append(tuple(row))
            chunks.append(tuple(row.index(kind) for kind in range(len(keys))))
        return cls(tuple(of_chunk), tuple(chunks))

    def bytes_at(self, adapter: ScheduleCosts, level: str) -> List[List[float]]:
        """Per rank and kind: one micro-batch's activation bytes at ``level``."""
        return [[adapter.bytes_at(rank, chunk, level) for chunk in chunks] for rank, chunks in enumerate(self.chunks)]

    def transient(self, adapter: ScheduleCosts, level: str) -> List[List[float]]:
        """Per rank and kind: the bytes recomputation at ``level`` re-creates during a backward."""
        return [[adapter.transient(rank, chunk, level) for chunk in chunks] for rank, chunks in enumerate(self.chunks)]


LiveStates = List[set]
"""Per rank: every (live chunk-micro-batches per kind of :class:`ChunkKinds`, the kind in a backward or -1) its
program order passes through (:func:`live_states`)."""


def live_states(config: ScheduleConfig, schedule: LoweredSchedule, kinds: Optional[ChunkKinds] = None) -> LiveStates:
    """The live counts of every rank's program order: a forward adds its chunk, a backward holds it until
    it ends (one compute stream per rank, so the order fixes every peak). ``kinds``: default, chunks told apart
    by being stage 0 or the last stage only (an even split)."""
    kinds = kinds or ChunkKinds.of(config)
    counts = []
    for rank in range(config.pp):
        of_chunk = kinds.of_chunk[rank]
        live = [0] * len(kinds.chunks[rank])
        states = set()
        for op in schedule.programs[rank]:
            kind = op.kind
            if kind is OpKind.FORWARD:
                live[of_chunk[op.chunk]] += 1
                states.add((tuple(live), -1))
            elif kind is OpKind.BACKWARD:
                states.add((tuple(live), of_chunk[op.chunk]))
                live[of_chunk[op.chunk]] -= 1
        counts.append(states)
    return counts


def _peaks(counts: LiveStates, held: Sequence[Sequence[float]], transient: Sequence[Sequence[float]],
           in_flight: Optional[Sequence[float]] = None) -> Tuple[float, ...]:
    """Per rank: the peak over its live states of ``held[rank][kind]`` per live chunk-micro-batch of that kind,
    ``transient[rank][kind]`` during a backward of that kind and ``in_flight[rank]`` always."""
    out = []
    for rank, states in enumerate(counts):
        sizes, extra = held[rank], transient[rank]
        base = in_flight[rank] if in_flight is not None else 0.0
        out.append(max(sum(n * size for n, size in zip(live, sizes)) + (extra[backward] if backward >= 0 else 0.0) + base
                       for live, backward in states))
    return tuple(out)


@dataclass(frozen=True)
class OffloadModel:
    """Bytes and copy time of :class:`StockOffload` on one (model, cluster, p x V)."""

    layer_bytes: float
    """:func:`.memory.offloadable_layer_bytes` of one layer and micro-batch."""
    layers: Tuple[int, ...]
    """Layers of each stage (stage order s = c*p + r)."""
    host_link_gbps: float
    """Device-host copy bandwidth per direction (Gbit/s)."""
    pp: int
    """Pipeline size p (rank r's chunk c is stage c*p + r)."""

    @classmethod
    def of(cls, model: ModelSpec, cluster: ClusterSpec, config: ScheduleConfig) -> "OffloadModel":
        return cls(offloadable_layer_bytes(activation_shape(model, cluster)), model.stage_layers(config.pp, config.vpp),
                   cluster.host_link_gbps, config.pp)

    def chunk_bytes(self, offload: StockOffload, rank: int, chunk: int) -> float:
        """Bytes one stored micro-batch of ``chunk`` on ``rank`` keeps in host memory instead of on the device."""
        return offload.fraction * self.layers[chunk * self.pp + rank] * self.layer_bytes

    def _moved(self, kinds: ChunkKinds, offload: StockOffload) -> List[List[float]]:
        return [[self.chunk_bytes(offload, rank, chunk) for chunk in chunks] for rank, chunks in enumerate(kinds.chunks)]

    def device_peaks(self, counts: LiveStates, kinds: ChunkKinds, adapter: ScheduleCosts, level: str,
                     offload: StockOffload) -> Tuple[float, ...]:
        """Per-rank activation peak with ``level`` everywhere and ``offload``: two layers' groups in flight."""
        held = [[size - moved for size, moved in zip(sizes, moves)]
                for sizes, moves in zip(kinds.bytes_at(adapter, level), self._moved(kinds, offload))]
        flight = [min(2, max(self.layers[c * self.pp + r] for c in range(len(kinds.of_chunk[r])))) * self.layer_bytes
                  for r in range(self.pp)]
        return _peaks(counts, held, kinds.transient(adapter, level), flight)

    def host_peaks(self, counts: LiveStates, kinds: ChunkKinds, offload: StockOffload) -> Tuple[float, ...]:
        """Per-rank peak of the offloaded bytes in host memory."""
        moved = self._moved(kinds, offload)
        return _peaks(counts, moved, [[0.0] * len(row) for row in moved])

    def busy_s(self, config: ScheduleConfig, offload: StockOffload) -> float:
        """Seconds the busiest rank's host link needs per iteration and direction: every chunk-micro-batch's copy."""
        total = max(sum(self.chunk_bytes(offload, rank, chunk) for chunk in range(config.vpp)) for rank in range(config.pp))
        return config.microbatches * total * 8 / (self.host_link_gbps * 1e9)


def uniform_plan(config: ScheduleConfig, level: str) -> Dict[Tuple[int, int, int], str]:
    """A recompute plan with ``level`` for every (rank, chunk, micro-batch): stock's only kind."""
    return {(r, c, j): level for r in range(config.pp) for c in range(config.vpp) for j in range(config.microbatches)}


def _costs(model: ModelSpec, cluster: ClusterSpec, setting: StockSetting, levels: Iterable[str]) -> OpCosts:
    return analytic_costs(_model_for(model, setting), cluster, setting.config(), levels=tuple(levels))


def sharding_model(setting: StockSetting, model: ModelSpec, cluster: ClusterSpec) -> Optional[MegatronFsdpSharding]:
    """The sharding model of a ZeRO-2/3 setting (None for the distributed optimizer or no level)."""
    if setting.sharding in (None, "optim"):
        return None
    return MegatronFsdpSharding(_model_for(model, setting), cluster, ShardingSpec((setting.sharding,) * setting.vpp))


def _result(setting: StockSetting, config: ScheduleConfig, costs: OpCosts, sharding: Optional[MegatronFsdpSharding],
            schedule: Optional[LoweredSchedule] = None, offload: Optional[OffloadModel] = None,
            deadline_s: Optional[float] = None) -> StockResult:
    """Simulate ``setting`` (its uniform recomputation, its sharding when given, and its offloading with the
    ``offload`` model); :class:`.timeline.DeadlineExceeded` once it is known to end after ``deadline_s``."""
    if setting.offload is not None:
        if sharding is not None or offload is None:
            raise ValueError("stock offloading is modelled with the distributed optimizer only and needs its OffloadModel")
        schedule = schedule or lower(config, lowering_for(costs))
        result = simulate(config, costs, uniform_plan(config, setting.recompute.level), schedule, deadline_s=deadline_s)
        adapter = ScheduleCosts(config, costs)
        kinds = ChunkKinds.of(config, adapter)
        counts = live_states(config, schedule, kinds)
        return StockResult(setting, max(result.iteration_s, offload.busy_s(config, setting.offload)),
                           offload.device_peaks(counts, kinds, adapter, setting.recompute.level, setting.offload),
                           tuple(costs.static_bytes), host_peak_bytes=offload.host_peaks(counts, kinds, setting.offload))
    result = simulate(config, costs, uniform_plan(config, setting.recompute.level), schedule, sharding, deadline_s)
    if sharding is None:
        return StockResult(setting, result.iteration_s, tuple(r.peak_activation_bytes for r in result.ranks),
                           tuple(costs.static_bytes))
    resident = tuple(split.state.resident for split in sharding.splits(config))
    # In the budget's terms: the whole peak less the distributed optimizer's static bytes.
    return StockResult(setting, result.iteration_s,
                       tuple(r.peak_memory_bytes - static for r, static in zip(result.ranks, costs.static_bytes)), resident,
                       FSDP_MODELS[0])


def _microbatch_bound(setting: StockSetting, config: ScheduleConfig, costs: OpCosts, sharding: MegatronFsdpSharding,
                      peaks: Sequence[float]) -> StockResult:
    """Megatron-FSDP's per-micro-batch pattern (:class:`MegatronFsdpSharding`): a lower bound of the time and
    the peak with one unit's buffers, from the program-order activation ``peaks``."""
    resident = tuple(split.state.resident for split in sharding.splits(config))
    busy = max(sharding.microbatch_channel_s(config, costs))
    time = max(_compute_bound(config, costs, setting.recompute.level), busy)
    buffers = sharding.unit_buffers()
    return StockResult(setting, time, tuple(p + r + buffers - static for p, r, static in zip(peaks, resident, costs.static_bytes)),
                       resident, FSDP_MODELS[1])


def evaluate(setting: StockSetting, model: ModelSpec, cluster: ClusterSpec, budget: Budget = float("inf")) -> StockResult:
    """Simulate one stock setting: iteration time and per-rank peaks. ZeRO-2/3: the faster of the two
    predictions of :class:`MegatronFsdpSharding` that fits ``budget`` (the span model if neither does)."""
    config = setting.config()
    level = setting.recompute.level
    costs = _costs(model, cluster, setting, (level,))
    sharding = sharding_model(setting, model, cluster)
    offload = OffloadModel.of(_model_for(model, setting), cluster, config) if setting.offload else None
    span = _result(setting, config, costs, sharding, offload=offload)
    if sharding is None:
        return span
    bound = _microbatch_bound(setting, config, costs, sharding, order_peaks(config, costs, (level,))[level])
    fitting = [r for r in (span, bound) if r.fits(budget)]
    return min(fitting, key=lambda r: r.iteration_s) if fitting else span


@dataclass
class _Choice:
    """One stock (schedule, V, g, sharding level) with the recomputation options that may fit, before
    simulating it."""

    setting: StockSetting
    """The setting with the least recomputation time among ``options``."""
    config: ScheduleConfig
    costs: OpCosts
    schedule: LoweredSchedule
    lower_bound_s: float
    """No schedule finishes before its busiest rank's compute plus optimizer step (one stream per rank)."""
    sharding: Optional[MegatronFsdpSharding] = None
    """ZeRO-2/3: the sharding model (``schedule`` is lowered with its ops)."""
    options: Tuple[Tuple[float, StockRecompute, Tuple[float, ...]], ...] = ()
    """ZeRO-2/3: (compute bound, recomputation, activation peaks) of every option whose activation peak
    alone fits, least recomputation first (:func:`_simulated` takes the first that fits, per prediction)."""
    offload: Optional[OffloadModel] = None
    """With offloading options: their model."""
    without_offload: Optional[StockSetting] = None
    """When ``setting`` offloads: the fitting setting with the least recomputation that does not (its host
    link may make the offloading setting the slower one), or None if none fits."""


class _Candidate(NamedTuple):
    """One recomputation (and offloading) option of a stock schedule in :func:`_choices`, ordered by its first
    three fields: least recomputation time, then least offloading, then enumeration order."""

    recompute_s: float
    fraction: float
    """Offloaded share (0: no offloading)."""
    index: int
    recompute: StockRecompute
    offload: Optional[StockOffload]
    peaks: Tuple[float, ...]
    """Per-rank activation peak."""


def _choices(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int, budget: Budget,
             grad_reduce_in_bf16: bool, sharding: Sequence[Optional[str]] = (None,),
             host_limit: Optional[float] = None, vpps: Optional[Sequence[int]] = None) -> List[_Choice]:
    """For every stock (schedule kind, V, g) in :func:`schedule_options` order and every level of
    ``sharding``: the recomputation option with the least recomputation time whose peak fits ``budget``
    (left out where nothing fits), with what simulating it needs and a lower bound of its time.

    With ``host_limit`` (bytes of host memory per device) and Transformer Engine's layer spec, the options
    also include :class:`StockOffload` at every fraction of :data:`OFFLOAD_FRACTIONS`, with no or selective
    recomputation, where the offloaded bytes fit ``host_limit`` (distributed optimizer only): ties in
    recomputation time go to the least offloading, and an offloading choice keeps the best one without.

    Without buffers (no level, or ``optim``) the peak is exact from the program order. With ZeRO-2/3 the
    activation peak plus the resident bytes is a lower bound of the peak (buffers are >= 0): every
    option it admits is kept, and :func:`_simulate_choice` takes the first whose simulation fits. ``vpps``: only
    these V (default: every V of :func:`schedule_options`)."""
    out = []
    limits = _per_rank(budget, pp)
    for vpp, g in schedule_options(pp, model.num_layers, microbatches, model.layer_split):
        if vpps is not None and vpp not in vpps:
            continue
        options = recompute_options(max(model.stage_layers(pp, vpp)), model.layer_spec)
        probe = StockSetting(pp, vpp, microbatches, g, StockRecompute(), grad_reduce_in_bf16)
        costs = _costs(model, cluster, probe, [o.level for o in options])
        config = probe.config()
        schedule = lower(config, lowering_for(costs))
        peaks_of = order_peaks(config, costs, [o.level for o in options], schedule)
        offload, offloads = None, []
        if host_limit is not None and model.layer_spec == "te":
            adapter = ScheduleCosts(config, costs)
            kinds = ChunkKinds.of(config, adapter)
            counts = live_states(config, schedule, kinds)
            offload = OffloadModel.of(_model_for(model, probe), cluster, config)
            for option in options:
                if option.granularity == "full":
                    continue
                for fraction in OFFLOAD_FRACTIONS:
                    moved = StockOffload(fraction)
                    if all(host <= host_limit for host in offload.host_peaks(counts, kinds, moved)):
                        offloads.append((option, moved, offload.device_peaks(counts, kinds, adapter, option.level, moved)))
        for level in sharding:
            setting = dataclasses.replace(probe, sharding=level)
            shard = sharding_model(setting, model, cluster)
            room = list(limits)
            if shard is not None:  # the static bytes this level saves against the distributed optimizer
                room = [limit + static - split.state.resident
                        for limit, static, split in zip(limits, costs.static_bytes, shard.splits(config))]
            candidates = [_Candidate(costs.recompute_s[o.level], 0.0, index, o, None, peaks_of[o.level])
                          for index, o in enumerate(options)]
            if shard is None:
                candidates += [_Candidate(costs.recompute_s[o.level], moved.fraction, len(options) + index, o, moved, peaks)
                               for index, (o, moved, peaks) in enumerate(offloads)]
            fitting = sorted((c for c in candidates if all(p <= b for p, b in zip(c.peaks, room))), key=lambda c: c[:3])
            if not fitting:
                continue
            first = fitting[0]
            plain = next((c.recompute for c in fitting if c.offload is None), None)
            without = (dataclasses.replace(setting, recompute=plain)
                       if (first.offload is not None and plain is not None) else None)
            # ZeRO-2/3 settings keep every fitting option for _simulated (no offloading with them).
            bounds = (tuple((_compute_bound(config, costs, c.recompute.level), c.recompute, c.peaks) for c in fitting)
                      if shard is not None else ())
            out.append(_Choice(dataclasses.replace(setting, recompute=first.recompute, offload=first.offload), config,
                               costs, schedule if shard is None else lower(config, shard.lowering(lowering_for(costs))),
                               bounds[0][0] if bounds else _compute_bound(config, costs, first.recompute.level), shard,
                               bounds, offload if first.offload is not None else None, without))
    return out


def _compute_bound(config: ScheduleConfig, costs: OpCosts, level: str) -> float:
    """max over ranks of (its forwards' and backwards' durations + its optimizer step), the
    simulator's own per-op durations (:class:`.costs.ScheduleCosts`)."""
    adapter = ScheduleCosts(config, costs, {(r, c, 0): level for r in range(config.pp) for c in range(config.vpp)})
    bound = 0.0
    for rank in range(config.pp):
        busy = sum(adapter.compute(rank, Op(kind, chunk, 0)) * config.microbatches
                   for chunk in range(config.vpp) for kind in (OpKind.FORWARD, OpKind.BACKWARD))
        optimizer = costs.optimizer_s[rank] if rank < len(costs.optimizer_s) else 0.0
        bound = max(bound, busy + optimizer)
    return bound


def _simulated(choice: _Choice, budget: Budget, best_s: float = float("inf")) -> Optional[StockResult]:
    """Simulate ``choice``: its setting; with ZeRO-2/3, per prediction of :class:`MegatronFsdpSharding`, the
    first option (least recomputation first) that fits ``budget`` -- options whose compute bound exceeds
    ``best_s`` are not tried -- and the faster of the two (None: nothing fits or can beat ``best_s``)."""
    if choice.sharding is None:  # a simulation stops once it is known to end after best_s
        found = []
        for setting, offload in ((choice.setting, choice.offload), (choice.without_offload, None)):
            if setting is not None:
                try:
                    found.append(_result(setting, choice.config, choice.costs, None, choice.schedule, offload, best_s))
                except DeadlineExceeded:
                    pass
        # the offloading setting unless the one without is faster
        return min(found, key=lambda r: r.iteration_s) if found else None
    found: List[StockResult] = []
    for predict in (lambda setting, peaks: _result(setting, choice.config, choice.costs, choice.sharding, choice.schedule),
                    lambda setting, peaks: _microbatch_bound(setting, choice.config, choice.costs, choice.sharding, peaks)):
        for bound, option, peaks in choice.options:
            if bound * (1 - BOUND_SLACK) > best_s:
                break
            result = predict(dataclasses.replace(choice.setting, recompute=option), peaks)
            if result.fits(budget):
                found.append(result)
                break
    return min(found, key=lambda r: r.iteration_s) if found else None


def best_per_schedule(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int, budget: Budget,
                      grad_reduce_in_bf16: bool = False, sharding: Sequence[Optional[str]] = (None,),
                      host_limit: Optional[float] = None) -> Dict[Tuple[str, int, Optional[int], Optional[str]], StockResult]:
    """For every stock (schedule kind, V, g, sharding level): its fastest recomputation setting (and
    offloading, with ``host_limit``: see :func:`_choices`) that fits ``budget`` (see :data:`Budget`),
    simulated. Schedules where nothing fits are left out."""
    out: Dict[Tuple[str, int, Optional[int], Optional[str]], StockResult] = {}
    for choice in _choices(model, cluster, pp, microbatches, budget, grad_reduce_in_bf16, sharding, host_limit):
        result = _simulated(choice, budget)
        if result is not None:
            setting = result.setting
            out[(setting.schedule, setting.vpp, setting.effective_group_size, setting.sharding)] = result
    return out


BOUND_SLACK = 1e-9
"""Relative slack on the compute bound (its float sum may round differently from the simulator's)."""


def best_stock(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int, budget: Budget,
               grad_reduce_in_bf16: bool = False, sharding: Sequence[Optional[str]] = (None,),
               host_limit: Optional[float] = None, vpps: Optional[Sequence[int]] = None,
               incumbent_s: float = float("inf"), time_up: TimeUp = None) -> Optional[StockResult]:
    """The fastest stock setting whose per-rank peak fits ``budget``; None if none fits. ``sharding``: the
    uniform levels to try (:data:`STOCK_SHARDING`; default: none named, the distributed optimizer assumed).
    ``host_limit``: host memory per device for Megatron's activation offloading (None: not tried; it is
    tried only on Transformer Engine's layer spec, see :func:`_choices`).

    The same answer as the fastest of :func:`best_per_schedule` (ties: the first in
    :func:`schedule_options` order, then ``sharding`` order), without simulating the choices whose
    compute bound already exceeds the fastest time found: they are simulated in order of that bound
    (sharding changes static memory and communication, never compute, so the bound holds at every level), and a
    simulation stops once it is known to end after the fastest time found.
    ``vpps``: only these V. ``incumbent_s``: a time reached otherwise; choices whose bound exceeds it are not
    simulated, nor run past it (None if none can beat it). ``time_up``: asked before each simulation; True stops
    the search with :class:`.simulator.SearchTimeUp`."""
    choices = _choices(model, cluster, pp, microbatches, budget, grad_reduce_in_bf16, sharding, host_limit, vpps)
    best: Optional[Tuple[float, int, StockResult]] = None
    for index, choice in sorted(enumerate(choices), key=lambda item: item[1].lower_bound_s):
        if choice.lower_bound_s * (1 - BOUND_SLACK) > (best[0] if best is not None else incumbent_s):
            break
        check_time(time_up)
        result = _simulated(choice, budget, best[0] if best else incumbent_s)
        if result is not None and (best is None or (result.iteration_s, index) < best[:2]):
            best = (result.iteration_s, index, result)
    return best[2] if best else None


def default_recompute_ladder(layers_per_chunk: int) -> List[StockRecompute]:
    """The recomputation a Megatron user reaches for, cheapest first: none, ``--recompute-granularity selective``
    (Megatron's default modules, ``core_attn``), then full block recomputation of k = 1, 2, ... layers per chunk."""
    return ([StockRecompute(), StockRecompute("selective")]
            + [StockRecompute("full", method="block", num_layers=k) for k in range(1, layers_per_chunk + 1)])


def default_settings(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int, budget: Budget,
                     grad_reduce_in_bf16: bool = False) -> List[StockResult]:
    """Megatron's default command at every V: 1F1B, and the interleaved schedule with Megatron's default group
    size (``--microbatch-group-size-per-virtual-pipeline-stage`` unset: g = p) at every V that divides the layers
    per rank, each with the first recomputation of :func:`default_recompute_ladder` that fits ``budget``; no
    offloading. Simulated; the schedules where nothing fits (or g = p is not allowed) are left out."""
    out = []
    for vpp, g in schedule_options(pp, model.num_layers, microbatches, model.layer_split):
        if g not in (None, pp):
            continue
        ladder = default_recompute_ladder(max(model.stage_layers(pp, vpp)))
        probe = StockSetting(pp, vpp, microbatches, g, StockRecompute(), grad_reduce_in_bf16)
        costs = _costs(model, cluster, probe, [o.level for o in ladder])
        config = probe.config()
        schedule = lower(config, lowering_for(costs))
        peaks = order_peaks(config, costs, [o.level for o in ladder], schedule)
        limits = _per_rank(budget, pp)
        fitting = next((o for o in ladder if all(peak <= limit for peak, limit in zip(peaks[o.level], limits))), None)
        if fitting is not None:
            out.append(_result(dataclasses.replace(probe, recompute=fitting), config, costs, None, schedule))
    return out


def default_stock(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int, budget: Budget,
                  grad_reduce_in_bf16: bool = False) -> Optional[StockResult]:
    """The fastest of :func:`default_settings` (ties: 1F1B, then the smaller V); None if none fits."""
    results = default_settings(model, cluster, pp, microbatches, budget, grad_reduce_in_bf16)
    return min(results, key=lambda r: r.iteration_s) if results else None


def activation_budget(model: ModelSpec, cluster: ClusterSpec, pp: int, memory_bytes: float,
                      vpp: Optional[int] = None) -> Tuple[float, ...]:
    """Activation bytes per rank left by ``memory_bytes`` of device memory after the static bytes
    (weights, gradients, optimizer state; the same for every V and schedule of one layer split; ``vpp``: the V to
    place the split at, default the first V it has)."""
    vpp = vpp or virtual_sizes(model, pp)[0]
    costs = analytic_costs(model, cluster, ScheduleConfig.depth_first(pp, vpp, pp))
    return tuple(memory_bytes - static for static in costs.static_bytes)
