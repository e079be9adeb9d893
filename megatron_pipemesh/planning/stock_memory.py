"""Stock Megatron's memory model: per-rank activation peaks of a uniform setting from its program order, its
activation offloading (:class:`OffloadModel`) and its Megatron-FSDP ZeRO-2/3 (:class:`MegatronFsdpSharding`).

Because one compute stream per rank runs the ops in program order, the order fixes every peak: the live
chunk-micro-batches at each step, counted once per kind of chunk (:class:`ChunkKinds`), give the peak of every
recomputation level without a simulation.

Pure: no torch, no processes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from ..schedule.config import ScheduleConfig
from ..schedule.ops import Op, OpKind
from ..schedule.order import sequences
from ..schedule.spans import OPTIM, shards_parameters
from .costs import ClusterSpec, ModelSpec, OpCosts, ScheduleCosts, activation_shape
from .memory import offloadable_layer_bytes
from .sharding import ShardingModel, ShardingSpec
from .stock_options import StockOffload, StockSetting

Budget = Union[float, Sequence[float]]
"""Activation bytes allowed per pipeline rank: one number for every rank, or one per rank. With a
sharding level above ZeRO-1 it is still the device memory left after the *distributed optimizer's*
static bytes: the bytes the level saves are added to it, its gather and gradient buffers taken from it."""

def per_rank(budget: Budget, pp: int) -> List[float]:
    if isinstance(budget, (int, float)):
        return [float(budget)] * pp
    if len(budget) != pp:
        raise ValueError(f"an activation budget per rank needs {pp} values, got {len(budget)}")
    return [float(b) for b in budget]


def model_for(model: ModelSpec, setting: StockSetting) -> ModelSpec:
    return dataclasses.replace(model, grad_bytes=2) if setting.grad_reduce_in_bf16 else model


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
      (:func:`.stock.compute_bound`) and its data-parallel channel carrying 2m gathers (ZeRO-3) and m
      reduce-scatters per chunk (:meth:`microbatch_channel_s`), as if they overlapped perfectly."""

    def unit_buffers(self) -> float:
        """Bytes one FSDP unit (a transformer layer) holds beyond its shard: gathered weights (ZeRO-3) and
        its whole gradient bucket."""
        unit = self.model.device_layer_params(self.cluster)
        rest = 1 - 1 / self.cluster.dp_cp
        zero3 = shards_parameters(self.spec.levels[0])
        return unit * rest * (self.model.grad_bytes + (self.model.dtype_bytes if zero3 else 0))

    def microbatch_channel_s(self, config: ScheduleConfig, costs: OpCosts) -> List[float]:
        """Per rank: seconds its data-parallel channel is busy per iteration with Megatron-FSDP's
        collectives (ring time per collective as :class:`.sharding.ShardedCosts`)."""
        adapter = self.adapter(config, costs, {})
        zero3 = shards_parameters(self.spec.levels[0])
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

def order_peaks(config: ScheduleConfig, costs: OpCosts, levels: Sequence[str]) -> Dict[str, Tuple[float, ...]]:
    """Per-rank activation peak of ``config`` with each level of ``levels`` applied everywhere, from
    the program order (one compute stream per rank, so the order fixes the peak): a forward adds
    its chunk's bytes, a backward holds its recomputation's transient bytes until it frees them.

    The live set at each step is counted once per rank as live chunk-micro-batches per kind of chunk
    (:class:`ChunkKinds`: chunks that hold the same bytes); each level's peak is then a maximum over those counts."""
    adapter = ScheduleCosts(config, costs)
    kinds = ChunkKinds.of(config, adapter)
    return level_peaks(live_states(config, kinds), kinds, adapter, levels)


def level_peaks(counts: LiveStates, kinds: ChunkKinds, adapter: ScheduleCosts,
                levels: Sequence[str]) -> Dict[str, Tuple[float, ...]]:
    """:func:`order_peaks` from a schedule's live states already counted (``counts`` of ``kinds``)."""
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


class RankStates(NamedTuple):
    """One rank's live states along its compute order, one row per compute op: a forward's after it adds its
    chunk-micro-batch, a backward's while it runs (before it frees its own)."""

    counts: np.ndarray
    """(ops, kinds) integers: the live chunk-micro-batches of each kind of :class:`ChunkKinds`."""
    backward: np.ndarray
    """(ops,) integers: the kind of the backward running, -1 for a forward."""


LiveStates = List[RankStates]
"""Per rank: every live state its compute order passes through (:func:`live_states`)."""


def live_states(config: ScheduleConfig, kinds: Optional[ChunkKinds] = None) -> LiveStates:
    """The live counts of every rank's compute order (:func:`..schedule.order.sequences`; lowering adds no compute
    op and moves none): a forward adds its chunk, a backward holds it until it ends (one compute stream per rank, so
    the order fixes every peak). ``kinds``: default, chunks told apart by being stage 0 or the last stage only (an
    even split). Built as arrays (a running sum of +1 / -1 per op): the stock search reads thousands of orders."""
    kinds = kinds or ChunkKinds.of(config)
    forwards, backwards, warmups = sequences(config)
    forward_chunks = np.array([chunk for _, chunk, _ in forwards], dtype=np.int64)
    backward_chunks = np.array([chunk for _, chunk, _ in backwards], dtype=np.int64)
    n = len(forwards)
    out = []
    for rank in range(config.pp):
        w = warmups[rank]
        steady = n - w
        chunk = np.empty(2 * n, dtype=np.int64)
        forward = np.zeros(2 * n, dtype=bool)
        chunk[:w], forward[:w] = forward_chunks[:w], True  # warm-up forwards
        chunk[w:w + 2 * steady:2], forward[w:w + 2 * steady:2] = forward_chunks[w:], True  # 1F1B
        chunk[w + 1:w + 2 * steady:2] = backward_chunks[:steady]
        chunk[w + 2 * steady:] = backward_chunks[steady:]  # cool-down
        kind = np.asarray(kinds.of_chunk[rank], dtype=np.int64)[chunk]
        steps = np.zeros((2 * n, len(kinds.chunks[rank])), dtype=np.int64)
        steps[np.arange(2 * n), kind] = np.where(forward, 1, -1)
        live = np.cumsum(steps, axis=0)
        live[~forward, kind[~forward]] += 1  # a backward's state holds its own chunk-micro-batch
        out.append(RankStates(live, np.where(forward, -1, kind)))
    return out


def _peaks(counts: LiveStates, held: Sequence[Sequence[float]], transient: Sequence[Sequence[float]],
           in_flight: Optional[Sequence[float]] = None) -> Tuple[float, ...]:
    """Per rank: the peak over its live states of ``held[rank][kind]`` per live chunk-micro-batch of that kind,
    ``transient[rank][kind]`` during a backward of that kind and ``in_flight[rank]`` always. Each state's bytes are
    added kind by kind, then its transient, then what is in flight, as one would by hand: the same floats."""
    out = []
    for rank, states in enumerate(counts):
        sizes = held[rank]
        total = states.counts[:, 0] * float(sizes[0])
        for kind in range(1, len(sizes)):
            total = total + states.counts[:, kind] * float(sizes[kind])
        extra = np.array([float(x) for x in transient[rank]] + [0.0])  # index -1: a forward, nothing transient
        total = total + extra[states.backward]
        total = total + (float(in_flight[rank]) if in_flight is not None else 0.0)
        out.append(float(total.max()))
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


def sharding_model(setting: StockSetting, model: ModelSpec, cluster: ClusterSpec) -> Optional[MegatronFsdpSharding]:
    """The sharding model of a ZeRO-2/3 setting (None for the distributed optimizer or no level)."""
    if setting.sharding in (None, OPTIM):
        return None
    return MegatronFsdpSharding(model_for(model, setting), cluster, ShardingSpec((setting.sharding,) * setting.vpp))
