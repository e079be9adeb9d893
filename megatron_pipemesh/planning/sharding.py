"""Mixed sharding: a ZeRO level per model chunk, its memory and its data-parallel traffic.

Levels use Megatron's names (``--data-parallel-sharding-strategy``):

* ``optim`` (ZeRO-1): the optimizer state (fp32 main parameters when the model is 16-bit, Adam's
  two moments) is sharded over the data-parallel ranks; weights and gradients are whole. Gradients
  are reduce-scattered once per iteration (``GRAD_SYNC``) and the updated parameters all-gathered
  once (``PARAM_SYNC``): Megatron's distributed optimizer.
* ``optim_grads`` (ZeRO-2): also the gradients: the chunk keeps only its gradient shard; the whole
  gradient buffer exists from a backward group's first backward to that group's reduce-scatter
  (one reduction per backward group instead of one per iteration).
* ``optim_grads_params`` (ZeRO-3): also the parameters: the chunk keeps only its parameter shard and
  gathers the whole parameters before each forward or backward *group* (prefetched), releasing them
  after the group (:func:`megatron_pipemesh.schedule.spans.gather_spans`: one gather per merged
  span). Bigger groups mean fewer gathers.

Scope (``--pipemesh-shard-scope``): ``data-parallel`` shards over all ``d`` data-parallel ranks
(``s = d``); ``node`` is Megatron's hierarchical distributed optimizer
(``--num-distributed-optimizer-instances d/s``, one instance per node of ``s`` data-parallel ranks):
every data-parallel collective of every level -- the gathers, the per-group reductions, the
optimizer-state shards -- stays inside the node, and Megatron all-reduces each rank's node shard of
the gradients (``N/s`` of them) across the ``d/s`` nodes once per iteration, inside the chunk's
``GRAD_SYNC``. The optimizer state is therefore sharded over the node (``o/s``), replicated across
nodes, and every node steps its own copy (the issue asked for the optimizer sharded over all ``d``;
Megatron 0.19.2's instances replicate it, and sharding it over all would need a cross-node
reduce-scatter into a shard layout that Megatron's buffers do not have).

Bytes per parameter (w = weight bytes, g = gradient bytes, o = optimizer bytes: 8 for Adam's
moments plus 4 for fp32 main parameters when w < 4; s = d with the data-parallel scope):

==================  ===========  ===========  =========  ==========================================
level               weights      gradients    optimizer  transient (while a group span runs)
==================  ===========  ===========  =========  ==========================================
optim               w            g            o/s        --
optim_grads         w            g/s          o/s        g (the whole gradient buffer)
optim_grads_params  w/s          g/s          o/s        w(1-1/s) (rest of the weights) + g
==================  ===========  ===========  =========  ==========================================

The weight shard is a slice of the whole buffer (as in Megatron's buffers, where each rank's shard of a
bucket is a slice of the bucket), so a gathered chunk holds exactly its whole weights: at the peak of
a span a ZeRO-3 chunk's weights cost what a ZeRO-1 chunk's cost all the time; the saving is everywhere
else. The gradient shard is an accumulator of its own that stays allocated while a backward group fills
the whole buffer (the runtime adds each group's reduced shard to it), so a group costs g/s more than
ZeRO-1's gradients while it runs.

Megatron 0.19.2 findings (installed wheel, ``megatron/core``, ``megatron/training``), why the levels
above ZeRO-1 are not wired to Megatron-FSDP here:

* Megatron-FSDP is CUDA-only: ``distributed/fsdp/mcore_fsdp_adapter.py:156`` defaults the device to
  ``cuda:<current>``; ``distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:231-234`` calls
  ``torch.cuda.current_device()`` whatever device is given and ``:406-407`` creates ``torch.cuda.Stream``
  objects unconditionally. It cannot run on
  CPU/gloo, so nothing built on it can be tested here.
* Megatron-FSDP also demands ``--ckpt-format fsdp_dtensor`` (``training/arguments.py:1146``) and makes
  ``--use-distributed-optimizer`` implicit (``:1106-1112``).
* One sharding level per run: ``get_model`` builds one ``DistributedDataParallelConfig`` from the
  arguments (``training/training.py:1847``, ``get_megatron_ddp_config`` ``:1977``) and one wrapper class
  ``DP`` (``:1837-1843``), and ``wrap_model_chunks_with_ddp`` (``:1570``) passes that same config to
  every chunk (``:1684-1701``). Each virtual chunk *is* wrapped separately, so per-chunk wrapping is
  possible by calling the wrapper ourselves, but:
* the optimizer takes its mode from the first chunk only: ``optimizer/__init__.py:1082``
  (``ddp_config = model_chunks[0].ddp_config``; FSDP vs DDP path ``:1083``), so mixing FSDP and DDP
  chunks under one ``get_megatron_optimizer`` is not supported;
* with the DDP path (what ``optim`` is), every chunk holds whole parameter and gradient buffers
  (``distributed/param_and_grad_buffer.py``: ``param_data``/``grad_data`` per buffer); the distributed
  optimizer's fp32 shard of an fp32 model is a *view* into that parameter buffer
  (``optimizer/distrib_optimizer.py:467``), and its gradient shard a view into the gradient buffer.
  ZeRO-2/3 for a DDP chunk therefore means freeing and re-allocating the storage of those buffers
  around the schedule's groups (the shard views stay valid across ``untyped_storage().resize_``) --
  own code: the ``GATHER``/``RELEASE``/``REDUCE`` ops of :mod:`megatron_pipemesh.schedule` and their
  execution in :mod:`megatron_pipemesh.runtime.sharding`; this module is its memory and traffic model.

Pure: no torch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence, Tuple, Union

from ..schedule.config import ScheduleConfig
from ..schedule.lower import LoweringOptions
from ..schedule.ops import OpKind
from ..schedule.order import compute_program
from ..schedule.plan import SHARD_SCOPES
from ..schedule.spans import SHARD_LEVELS, ZERO_STAGE, gather_spans, group_index, group_spans
from .costs import ScheduleCosts, reduce_scatter_steps
from .topology import GBIT, topology

FLAG = "--pipemesh-sharding"
SCOPE_FLAG = "--pipemesh-shard-scope"


class ShardingError(ValueError):
    """An invalid sharding setting; the message names the flag, the rule and a valid example."""


def parse_levels(values: Union[None, str, Sequence[str]], vpp: int, *, distributed_optimizer: bool = True,
                 allow_auto: bool = True) -> Union[None, str, Tuple[str, ...]]:
    """``--pipemesh-sharding`` as None (not given), 'auto', or one level per virtual chunk.

    One level applies to every chunk; otherwise there must be exactly ``vpp`` of them."""
    if values is None:
        return None
    if isinstance(values, str):
        values = values.split()
    values = [str(v) for v in values]
    example = f"{FLAG} optim" + (f" or {FLAG} {' '.join(['optim'] + ['optim_grads_params'] * (vpp - 1))}" if vpp > 1 else "")
    if not values:
        raise ShardingError(f"{FLAG} needs at least one level. Example of a valid setting: {example}")
    if "auto" in values:
        if len(values) != 1:
            raise ShardingError(f"{FLAG} {' '.join(values)} is invalid: 'auto' stands alone. Example: {FLAG} auto")
        if not allow_auto:
            raise ShardingError(f"{FLAG} auto is for `pipemesh plan`; training takes the levels (or a plan). "
                                f"Example: {example}")
        levels: Union[str, Tuple[str, ...]] = "auto"
    else:
        unknown = [v for v in values if v not in SHARD_LEVELS]
        if unknown:
            raise ShardingError(f"{FLAG} {' '.join(values)} is invalid: unknown level(s) {', '.join(unknown)}; "
                                f"levels are {', '.join(SHARD_LEVELS)} (or auto). Example: {example}")
        if len(values) not in (1, vpp):
            raise ShardingError(f"{FLAG} {' '.join(values)} is invalid: give one level for all chunks or one per "
                                f"virtual chunk ({vpp}), got {len(values)}. Example: {example}")
        levels = tuple(values) * (vpp if len(values) == 1 else 1)
    if not distributed_optimizer:
        raise ShardingError(f"{FLAG} {' '.join(values)} needs --use-distributed-optimizer: every level shards the "
                            f"optimizer state over the data-parallel ranks (Megatron's distributed optimizer). "
                            f"Example: --use-distributed-optimizer {FLAG} {' '.join(values)}")
    return levels


def shard_size(scope: str, dp: int, tp: int = 1, devices_per_node: int = 8) -> int:
    """Ranks a ZeRO-2/3 chunk shards its weights and gradients over: all ``dp`` ranks, or those of one
    node (ranks are laid out TP fastest, then DP: a node holds ``devices_per_node // tp`` of them)."""
    if scope not in SHARD_SCOPES:
        raise ShardingError(f"{SCOPE_FLAG} {scope} is invalid: choose one of {', '.join(SHARD_SCOPES)}. "
                            f"Example: {SCOPE_FLAG} node")
    if scope == "data-parallel":
        return dp
    per_node = max(devices_per_node // max(tp, 1), 1)
    size = min(dp, per_node)
    if dp % size:
        raise ShardingError(f"{SCOPE_FLAG} node needs the data-parallel size ({dp}) to be a multiple of the "
                            f"data-parallel ranks per node ({size}). Example: {SCOPE_FLAG} data-parallel")
    return size


@dataclass(frozen=True)
class StateBytes:
    """Bytes of weights, gradients and optimizer state (per parameter, or totals)."""

    weights: float = 0.0
    """Weights held all the time (the whole weights, or the shard)."""
    grads: float = 0.0
    """Gradients held all the time (the whole buffer, or the reduced shard)."""
    optimizer: float = 0.0
    """Optimizer state (fp32 main parameters when 16-bit, Adam moments): a 1/s shard (s = d, or a node's)."""
    gathered: float = 0.0
    """The rest of the whole weights (beyond the shard), held only while a gather span runs (ZeRO-3)."""
    grad_buffer: float = 0.0
    """The whole gradient buffer, held only from a backward group's first backward to its reduction, next
    to the resident shard accumulator (ZeRO-2/3)."""

    @property
    def resident(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        return self.resident + self.gathered + self.grad_buffer

    def scaled(self, factor: float) -> "StateBytes":
        return StateBytes(*(factor * v for v in (self.weights, self.grads, self.optimizer, self.gathered, self.grad_buffer)))

    def __add__(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(self.weights + other.weights, self.grads + other.grads, self.optimizer + other.optimizer,
                          self.gathered + other.gathered, self.grad_buffer + other.grad_buffer)


def optimizer_bytes(dtype_bytes: int) -> int:
    """Adam's state per parameter: two fp32 moments, plus an fp32 main copy of 16-bit weights
    (Megatron keeps none for fp32 weights: the shard is a view of the weights)."""
    return 8 + (4 if dtype_bytes < 4 else 0)


def bytes_per_param(level: str, shard: int, dtype_bytes: int = 2, grad_bytes: int = 4) -> StateBytes:
    """Bytes per parameter of a chunk at ``level`` whose shards span ``shard`` ranks (table in the module
    docstring; the optimizer state is sharded over the same ranks: Megatron's distributed-optimizer instance)."""
    if level not in ZERO_STAGE:
        raise ShardingError(f"unknown sharding level {level!r}; levels are {', '.join(SHARD_LEVELS)}")
    zero = ZERO_STAGE[level]
    optimizer = optimizer_bytes(dtype_bytes) / shard
    weights = dtype_bytes / shard if zero == 3 else dtype_bytes
    grads = grad_bytes / shard if zero >= 2 else grad_bytes
    rest = 1 - 1 / shard
    # While a backward group runs, the runtime holds the whole gradient buffer next to its resident shard
    # accumulator (runtime/sharding.py: ChunkSharding.grad_accum), so the transient is the whole buffer.
    return StateBytes(weights, grads, optimizer, dtype_bytes * rest if zero == 3 else 0.0,
                      grad_bytes if zero >= 2 else 0.0)


@dataclass(frozen=True)
class ShardingSpec:
    """The sharding of one run: a level per virtual chunk and the scope of ZeRO-2/3 shards."""

    levels: Tuple[str, ...]
    """One level per virtual chunk."""
    scope: str = "data-parallel"
    """'data-parallel' or 'node'."""
    intra_node_gbps: Optional[float] = None
    """Bandwidth of the intra-node collectives of the 'node' scope (Gbit/s); None: the data-parallel bandwidth."""
    lookahead: int = 1
    """Prefetch a ZeRO-3 gather this many compute ops before its span."""

    @property
    def sharded_params(self) -> Tuple[int, ...]:
        """Chunks whose parameters are sharded (ZeRO-3)."""
        return tuple(c for c, level in enumerate(self.levels) if ZERO_STAGE[level] == 3)

    @property
    def sharded_grads(self) -> Tuple[int, ...]:
        """Chunks whose gradients are sharded (ZeRO-2 and ZeRO-3)."""
        return tuple(c for c, level in enumerate(self.levels) if ZERO_STAGE[level] >= 2)

    def describe(self) -> str:
        scope = f", scope {self.scope}" if self.sharded_grads else ""
        return "sharding " + " ".join(self.levels) + scope


def chunk_params(model, cluster, config: ScheduleConfig) -> List[List[float]]:
    """Parameters per device of every (rank, chunk): layers (dense over TP, routed experts over EP x ETP, each sharded
    here over DP x CP), plus the embedding on stage 0 and the untied output layer on the last stage (as
    :func:`.costs.analytic_costs` counts them)."""
    stages = config.pp * config.vpp
    layers = model.stage_layers(config.pp, config.vpp)
    t = cluster.tp
    out = []
    for rank in range(config.pp):
        row = []
        for chunk in range(config.vpp):
            stage = config.stage(rank, chunk)
            params = layers[stage] * model.device_layer_params(cluster)
            if stage == 0:
                params += model.embedding_params() / t
            if stage == stages - 1:
                params += model.vocab_size * model.hidden_size / t
            row.append(params)
        out.append(row)
    return out


def chunk_state(params: float, level: str, shard: int, dtype_bytes: int, grad_bytes: int) -> StateBytes:
    """Bytes of one chunk of ``params`` parameters at ``level``, sharded over ``shard`` ranks."""
    return bytes_per_param(level, shard, dtype_bytes, grad_bytes).scaled(params)


@dataclass(frozen=True)
class Traffic:
    """Data-parallel collectives of one chunk per iteration."""

    gathers: int
    """Parameter all-gathers (1 for ZeRO-1/2: the updated parameters after the step; one per span for ZeRO-3)."""
    gather_bytes: float
    """Payload of one all-gather: the chunk's whole weights."""
    reduces: int
    """Gradient reduce-scatters (1 for ZeRO-1; one per backward group for ZeRO-2/3)."""
    reduce_bytes: float
    """Payload of one reduce-scatter: the chunk's whole gradients."""
    group: int
    """Ranks of the gathers and reduce-scatters (d, or the s data-parallel ranks of a node with the node scope)."""
    cross_node_bytes: float = 0.0
    """Node scope: payload of the once-per-iteration all-reduce of this rank's node shard of the gradients
    across the nodes (g*N/s; Megatron's inter-instance all-reduce in ``GRAD_SYNC``); 0 otherwise."""
    nodes: int = 1
    """Ranks of that cross-node all-reduce (d/s)."""

    def sent_bytes(self) -> float:
        """Bytes each rank sends per iteration (ring: (n-1)/n of each gather / reduce-scatter payload,
        2(n-1)/n of the all-reduce's)."""
        ring = (self.group - 1) / self.group if self.group > 1 else 0.0
        across = 2 * (self.nodes - 1) / self.nodes * self.cross_node_bytes
        return ring * (self.gathers * self.gather_bytes + self.reduces * self.reduce_bytes) + across


def chunk_traffic(config: ScheduleConfig, rank: int, chunk: int, level: str, params: float, dp: int, shard: int,
                  dtype_bytes: int, grad_bytes: int, lookahead: int = 1) -> Traffic:
    """Collectives of ``chunk`` on ``rank`` in one iteration of ``config`` at ``level``, with shards over
    ``shard`` of the ``dp`` data-parallel ranks (``shard < dp``: the node scope)."""
    zero = ZERO_STAGE[level]
    compute = compute_program(config, rank)
    gathers = len(gather_spans(config, compute, chunk, lookahead)) if zero == 3 else 1
    reduces = len(group_spans(config, compute, chunk, OpKind.BACKWARD)) if zero >= 2 else 1
    nodes = dp // shard
    cross = params * grad_bytes / shard if nodes > 1 else 0.0
    return Traffic(gathers, params * dtype_bytes, reduces, params * grad_bytes, shard, cross, nodes)


@dataclass
class RankSplit:
    """Memory split of one pipeline rank."""

    rank: int
    levels: Tuple[str, ...]
    state: StateBytes
    """Weights, gradients, optimizer state and their transient buffers (summed over chunks)."""
    activations: float = 0.0
    """Peak activation bytes (from the simulator, when known)."""
    chunks: List[StateBytes] = field(default_factory=list)

    @property
    def peak_gather(self) -> float:
        """Largest transient of one chunk (gathered weights + gradient buffer)."""
        return max((c.gathered + c.grad_buffer for c in self.chunks), default=0.0)


def rank_splits(model, cluster, config: ScheduleConfig, spec: ShardingSpec) -> List[RankSplit]:
    """Weights/gradients/optimizer bytes of every pipeline rank under ``spec``."""
    if len(spec.levels) != config.vpp:
        raise ShardingError(f"{FLAG} gives {len(spec.levels)} levels for {config.vpp} virtual chunks")
    shard = shard_size(spec.scope, cluster.dp_cp, cluster.tp, cluster.devices_per_node)
    params = chunk_params(model, cluster, config)
    out = []
    for rank in range(config.pp):
        chunks = [chunk_state(params[rank][c], spec.levels[c], shard, model.dtype_bytes, model.grad_bytes)
                  for c in range(config.vpp)]
        total = StateBytes()
        for state in chunks:
            total = total + state
        out.append(RankSplit(rank, spec.levels, total, chunks=chunks))
    return out


def format_split(split: RankSplit, unit: float = 1024 ** 3, unit_name: str = "GiB") -> str:
    """One line: the level per chunk and weights/grads/optimizer/gather buffers/activations."""
    s = split.state
    return (f"rank {split.rank}: [{' '.join(split.levels)}] weights {s.weights / unit:.3f} + grads {s.grads / unit:.3f} "
            f"+ optimizer {s.optimizer / unit:.3f} = {s.resident / unit:.3f} {unit_name}, gather buffers "
            f"{split.peak_gather / unit:.3f}, activations {split.activations / unit:.3f} {unit_name}")


class ShardedCosts(ScheduleCosts):
    """Costs adapter that charges the collectives of mixed sharding on the data-parallel channel:
    with the data-parallel scope ZeRO-1 chunks keep the given costs; a ZeRO-3 GATHER all-gathers the
    chunk's weights and a REDUCE / the GRAD_SYNC of a ZeRO-2/3 chunk reduce-scatters its gradients over
    the shard group (ring: (n-1)/n of the payload; twice that on gloo, :func:`~.costs.reduce_scatter_steps`).
    With the node scope every level's gathers (PARAM_SYNC too) and reductions run over the node's ranks at
    the intra-node bandwidth, and every GRAD_SYNC adds the all-reduce of the node shard across the nodes
    (2(n-1)/n) at the data-parallel one."""

    def __init__(self, config: ScheduleConfig, costs, recompute, model, cluster, spec: ShardingSpec):
        super().__init__(config, costs, recompute)
        self.spec, self.model = spec, model
        self.params = chunk_params(model, cluster, config)
        self.dp = cluster.dp_cp
        self.shard = shard_size(spec.scope, cluster.dp_cp, cluster.tp, cluster.devices_per_node)
        route = topology(cluster, config.pp).dp_route(0)
        self.dp_gbps = route.lone_bytes_per_s / GBIT if route is not None else cluster.dp_gbps  # a ring's rate alone
        self.shard_gbps = (spec.intra_node_gbps or self.dp_gbps) if spec.scope == "node" else self.dp_gbps
        self.reduce_steps = reduce_scatter_steps(cluster)

    def _ring(self, payload: float, group: int, gbps: float, steps: int = 1) -> float:
        return steps * (group - 1) / group * payload * 8 / (gbps * 1e9) + self.costs.latency_s if group > 1 else 0.0

    def data_parallel(self, rank: int, op) -> float:
        zero = ZERO_STAGE[self.spec.levels[op.chunk]]
        node = self.shard < self.dp
        if not node and (zero == 1 or op.kind is OpKind.PARAM_SYNC):
            return super().data_parallel(rank, op)
        params = self.params[rank][op.chunk]
        if op.kind in (OpKind.GATHER, OpKind.PARAM_SYNC):
            return self._ring(params * self.model.dtype_bytes, self.shard, self.shard_gbps)
        seconds = self._ring(params * self.model.grad_bytes, self.shard, self.shard_gbps, self.reduce_steps)
        if op.kind is OpKind.GRAD_SYNC and node:
            seconds += self._ring(params * self.model.grad_bytes / self.shard, self.dp // self.shard, self.dp_gbps, 2)
        return seconds


@dataclass
class ShardingModel:
    """Mixed sharding of one model on one cluster: what the simulator needs (lowering options, the
    costs adapter, resident bytes per rank, and the transient buffers on the memory timeline)."""

    model: object
    cluster: object
    spec: ShardingSpec

    def lowering(self, options: LoweringOptions) -> LoweringOptions:
        return replace(options, sharding=self.spec.levels, gather_lookahead=self.spec.lookahead)

    def adapter(self, config: ScheduleConfig, costs, recompute) -> ShardedCosts:
        return ShardedCosts(config, costs, recompute, self.model, self.cluster, self.spec)

    def splits(self, config: ScheduleConfig) -> List[RankSplit]:
        return rank_splits(self.model, self.cluster, config, self.spec)

    def optimizer_seconds(self, seconds: Sequence[float]) -> List[float]:
        """The optimizer step per rank: with the node scope each rank steps a 1/s shard, not a 1/d one."""
        shard = shard_size(self.spec.scope, self.cluster.dp_cp, self.cluster.tp, self.cluster.devices_per_node)
        return [t * self.cluster.dp_cp / shard for t in seconds]

    def memory_deltas(self, rank: int, timeline, splits: List[RankSplit]) -> List[Tuple[float, float]]:
        """(time, bytes) changes of ``rank``'s transient buffers: gathered weights from each GATHER's start
        to its RELEASE; a ZeRO-2/3 chunk's whole gradient buffer from the first backward of each
        backward group to the end of that group's reduction (REDUCE, or GRAD_SYNC for the last)."""
        chunks = splits[rank].chunks
        config = timeline.schedule.config
        deltas: List[Tuple[float, float]] = []
        reductions = {c: [] for c in range(config.vpp)}
        for event in timeline.comms:
            if event.src != rank or event.lane not in ("dp", "release"):
                continue
            kind, chunk = event.op.kind, event.op.chunk
            if kind is OpKind.GATHER:
                deltas.append((event.start, chunks[chunk].gathered))
            elif kind is OpKind.RELEASE:
                deltas.append((event.start, -chunks[chunk].gathered))
            elif kind in (OpKind.REDUCE, OpKind.GRAD_SYNC) and chunks[chunk].grad_buffer:
                reductions[chunk].append(event.end)
        for chunk, ends in reductions.items():
            starts = {}
            for event in timeline.compute[rank]:
                if event.op.kind is OpKind.BACKWARD and event.op.chunk == chunk:
                    starts.setdefault(group_index(config.backward_groups, event.op.microbatch), event.start)
            held: List[List[float]] = []  # one buffer per chunk: overlapping holds merge
            for start, end in zip([starts[g] for g in sorted(starts)], sorted(ends)):
                if held and start <= held[-1][1]:
                    held[-1][1] = max(held[-1][1], end)
                else:
                    held.append([start, end])
            for start, end in held:
                deltas += [(start, chunks[chunk].grad_buffer), (end, -chunks[chunk].grad_buffer)]
        return deltas


def candidate_levels(vpp: int) -> List[Tuple[str, ...]]:
    """Level tuples ``auto`` tries: every mix for V <= 2; otherwise the uniform levels and chunk 0 at
    ZeRO-1 (its first gather can hide behind nothing) with ZeRO-2 or ZeRO-3 for the other chunks."""
    if vpp <= 2:
        return [tuple(mix) for mix in itertools.product(SHARD_LEVELS, repeat=vpp)]
    out = [(level,) * vpp for level in SHARD_LEVELS]
    out += [("optim",) + (level,) * (vpp - 1) for level in SHARD_LEVELS[1:]]
    return out


def plan_with_sharding(pp: int, vpp: int, microbatches: int, costs_for, budget_bytes: float, model, cluster,
                       scope: str = "data-parallel", levels: Union[str, Tuple[str, ...]] = "auto", options=None,
                       intra_node_gbps: Optional[float] = None):
    """``pipemesh plan`` with mixed sharding: for each level tuple (``auto``: :func:`candidate_levels`; or
    the given levels) choose groups and recomputation jointly (:func:`.planner.plan_schedule` simulates
    every candidate with the tuple's gathers, reductions and memory); the fastest plan that fits wins
    (ties: less peak memory, then fewer sharded chunks). Returns (best plan, {levels: best plan or None})."""
    from .planner import NoFeasiblePlan, PlannerOptions, plan_schedule

    options = options or PlannerOptions()
    tuples = candidate_levels(vpp) if levels == "auto" else [tuple(levels)]
    results = {}
    for mix in tuples:
        sharding = ShardingModel(model, cluster, ShardingSpec(mix, scope, intra_node_gbps))
        try:
            results[mix], _ = plan_schedule(pp, vpp, microbatches, costs_for, budget_bytes, options, sharding=sharding)
        except NoFeasiblePlan:
            results[mix] = None
    feasible = [(mix, plan) for mix, plan in results.items() if plan is not None]
    if not feasible:
        raise NoFeasiblePlan(f"no schedule fits the memory budget of {budget_bytes / 1024 ** 3:.2f} GiB per device with "
                             f"any of the sharding levels tried ({', '.join(' '.join(m) for m in tuples)})")
    best = min(feasible, key=lambda item: (round(item[1].result.iteration_s, 12),
                                           max(r.peak_memory_bytes for r in item[1].result.ranks),
                                           sum(ZERO_STAGE[level] for level in item[0])))
    return best[1], results
