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
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..schedule.config import ScheduleConfig
from ..schedule.ops import Op, OpKind
from ..schedule.order import rank_steps
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
        unit = self.model.layer_params() / self.cluster.tp
        rest = 1 - 1 / self.cluster.dp
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
    counts = live_states(config, kinds)
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


class LiveSet(set):
    """One rank's live states (:data:`LiveStates`), with their front kept once computed: the states no other state
    with the same kind in a backward covers (as many or more of every kind). With bytes >= 0 per chunk-micro-batch a
    covered state never holds more (float products and sums are monotone), so the peak over the front is the peak
    over every state, to the float; the front is a few states where the order passes through thousands."""

    _front: Optional[List[tuple]] = None

    def front(self) -> List[tuple]:
        if self._front is None:
            by_backward: Dict[int, List[tuple]] = {}
            for live, backward in self:
                by_backward.setdefault(backward, []).append(live)
            front: List[tuple] = []
            for backward, lives in by_backward.items():
                front += [(live, backward) for live in _uncovered(lives)]
            self._front = front
        return self._front


def _uncovered(lives: List[tuple]) -> List[tuple]:
    """The distinct count tuples no other one covers (as many or more of every kind). Sorted in decreasing order, a
    tuple can only be covered by an earlier one; with two kinds, exactly when an earlier one has as many of the
    second kind."""
    ordered = sorted(set(lives), reverse=True)
    if not ordered or len(ordered[0]) == 1:
        return ordered[:1]
    out: List[tuple] = []
    if len(ordered[0]) == 2:
        most = -1
        for live in ordered:
            if live[1] > most:
                out.append(live)
                most = live[1]
        return out
    for live in ordered:
        if not any(all(a >= b for a, b in zip(other, live)) for other in out):
            out.append(live)
    return out


def live_states(config: ScheduleConfig, kinds: Optional[ChunkKinds] = None) -> LiveStates:
    """The live counts of every rank's compute order (:func:`..schedule.order.rank_steps`; lowering adds no compute
    op and moves none): a forward adds its chunk, a backward holds it until it ends (one compute stream per rank, so
    the order fixes every peak). ``kinds``: default, chunks told apart by being stage 0 or the last stage only (an
    even split)."""
    kinds = kinds or ChunkKinds.of(config)
    counts = []
    for rank in range(config.pp):
        of_chunk = kinds.of_chunk[rank]
        live = [0] * len(kinds.chunks[rank])
        states = LiveSet()
        for forward, chunk, _ in rank_steps(config, rank):
            kind = of_chunk[chunk]
            if forward:
                live[kind] += 1
                states.add((tuple(live), -1))
            else:
                states.add((tuple(live), kind))
                live[kind] -= 1
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
        if isinstance(states, LiveSet) and all(size >= 0 for size in sizes):
            states = states.front()  # the same peak (LiveSet)
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


def sharding_model(setting: StockSetting, model: ModelSpec, cluster: ClusterSpec) -> Optional[MegatronFsdpSharding]:
    """The sharding model of a ZeRO-2/3 setting (None for the distributed optimizer or no level)."""
    if setting.sharding in (None, OPTIM):
        return None
    return MegatronFsdpSharding(model_for(model, setting), cluster, ShardingSpec((setting.sharding,) * setting.vpp))
