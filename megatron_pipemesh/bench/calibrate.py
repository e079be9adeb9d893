"""Feed measured costs into the simulator and compare its iteration time with the measured one.

Measured inputs (per schedule, from the unshaped run of that schedule):

* forward / backward of one chunk-micro-batch: each rank's ``forward-compute`` / ``backward-compute``
  timer (ms per iteration) divided by the chunk-micro-batches it runs (m x V; V = 1 for stock 1F1B).
  The fastest rank gives the per-op cost; what the first / last pipeline rank spends on top of it
  (embedding, output layer and loss) becomes ``first_stage_extra_s`` / ``last_stage_extra_s``
  (split 1 : 2 between forward and backward, as the simulator applies it);
* everything outside ``forward-backward`` (optimizer step, data loading between iterations) is the
  measured iteration time minus the forward-backward time of the unshaped run, added as is;
* pipeline transfer: activation bytes (s x b x h x 4, fp32 on CPU) / shaped bandwidth, plus the
  netem delay, plus a fixed per-transfer overhead fitted on the unshaped run of one stock schedule, or on its
  shaped run when there is no unshaped one (:func:`fit_transfer_overhead`: gloo on cores shared with the compute
  is not free);
  ``link_share`` (default 1: a link gets the whole rate) can divide the rate among concurrent flows;
* data parallel: ring all-reduce of the chunk's fp32 gradients (Megatron's default optimizer: no
  parameter gather; the first / last stage's also carry the embedding / output parameters), plus the
  tied-embedding all-reduce between the first and last pipeline rank after the backward (a final collective of
  the simulator), by :func:`allreduce_s` for the bench's topology (:mod:`.netns`):

  - **a NIC per rank** (``per_rank``, the default): each rank of a ring sends 2(d-1)/d x bytes through
    its own NIC, and rings of other stages use other NICs; the costs carry the product's topology
    (:func:`network_cluster`), so a rank's pipeline sends, ring and embedding all-reduce share its NIC max-min
    fairly in the simulation, as ``--nic-queue fair`` shares it;
  - **one token bucket for every rank** (``--network shared``: the loopback of one namespace): the d ranks
    of a ring send at the same time, so 2(d-1) x bytes pass the bucket per ring all-reduce
    (:func:`shared_bucket_allreduce_s`; ``link_share`` divides the rate among the rings of different
    pipeline stages reducing at once), and the dp embedding groups of 2 ranks reduce at the same time.
    The per-rank formula under-predicted the measured shared PP=2 x DP=2 ``--quick`` rows by 10-20%
    (see ``tests/bench/test_calibrate.py``).
* ``--sharding`` (Megatron's distributed optimizer): the all-reduce becomes a reduce-scatter of the
  gradients and an all-gather of the parameters. gloo's reduce-scatter is an all-reduce of the whole buffer
  (:data:`~megatron_pipemesh.planning.costs.REDUCE_SCATTER_STEPS`), so it costs what the all-reduce did; the
  gather moves half of that, and the
  simulation runs with the row's levels (:class:`megatron_pipemesh.planning.sharding.ShardingModel`:
  ZeRO-2/3 reductions per backward group, ZeRO-3 gathers per group span) on the same network.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from ..planning.clusters import bench_network_cluster
from ..planning.costs import REDUCE_SCATTER_STEPS, ClusterSpec, OpCosts
from ..planning.simulator import megatron_schedule, simulate
from ..planning.topology import topology
from ..schedule.config import ScheduleConfig
from ..schedule.levers import BASIC_LEVERS
from .runner import PADDED_VOCAB, ModelSetup, ParallelConfig

COLLECTIVES = "gloo"
"""The bench's ranks run on CPU, so their collectives are gloo's (:data:`REDUCE_SCATTER_STEPS`)."""
FP32 = 4


@dataclass
class MeasuredCompute:
    """Per-rank compute of one iteration (ms), from Megatron's timers."""

    forward_ms: List[float]
    backward_ms: List[float]
    overhead_ms: float
    """Measured iteration time minus forward-backward (optimizer etc.)."""


def measured_costs(model: ModelSetup, config: ParallelConfig, sched: ScheduleConfig, compute: MeasuredCompute,
                   bytes_per_s: Optional[float], latency_s: float = 0.0, link_share: float = 1.0,
                   distributed_optimizer: bool = False, per_rank: bool = True) -> OpCosts:
    """:class:`OpCosts` from measured compute and the shaped network (``bytes_per_s`` None: free network)."""
    pp, vpp, m = sched.pp, sched.vpp, sched.microbatches
    ops = m * vpp
    fwd = [f / ops / 1e3 for f in compute.forward_ms]
    bwd = [b / ops / 1e3 for b in compute.backward_ms]
    base_f, base_b = min(fwd), min(bwd)
    # extra per micro-batch on the first / last rank (one chunk there holds the first / last stage)
    def extra(rank: int) -> float:
        return ((fwd[rank] - base_f) + (bwd[rank] - base_b)) * vpp / 3.0
    first_extra = extra(0)
    last_extra = extra(pp - 1) if pp > 1 else 0.0
    spec = model.model_spec(pp)
    act_bytes = model.chunk.seq_length * model.chunk.micro_batch_size * model.chunk.hidden_size * FP32
    layers_per_chunk = spec.num_layers // (pp * vpp)
    chunk_grad_bytes = layers_per_chunk * spec.layer_params() * FP32
    d = config.dp
    gather = first_dp = last_dp = 0.0
    network = None
    rate = bytes_per_s * link_share if bytes_per_s else None
    if rate:
        p2p = act_bytes / rate
        reduce = allreduce_s(chunk_grad_bytes, d, rate, per_rank=per_rank)
        # stage 0's bucket also holds the embedding (and position table), the last stage's its output layer
        first_dp, last_dp = (allreduce_s(params * FP32, d, rate, per_rank=per_rank)
                             for params in (spec.embedding_params(), spec.vocab_size * spec.hidden_size))
        if distributed_optimizer:  # an all-gather is one ring pass (fp32 weights); gloo's reduce-scatter an all-reduce
            ring_pass = reduce / 2
            gather, reduce = ring_pass, REDUCE_SCATTER_STEPS[COLLECTIVES] * ring_pass
            # the extras split between reduction and gather as the chunk's own (the simulator's rule)
            first_dp, last_dp = (x * (REDUCE_SCATTER_STEPS[COLLECTIVES] + 1) / 2 for x in (first_dp, last_dp))
        if per_rank:  # every rank's NIC shared fairly by its pipeline sends, ring and embedding all-reduce
            network = topology(network_cluster(d, rate * 8 / 1e9, True), pp)
    else:
        p2p = reduce = 0.0
    return OpCosts(forward_s=base_f, backward_s=base_b, p2p_s=p2p, dp_reduce_s=reduce, dp_gather_s=gather,
                   latency_s=latency_s, first_stage_extra_s=first_extra, last_stage_extra_s=last_extra,
                   activation_bytes=dict.fromkeys(BASIC_LEVERS, 0.0), first_stage_dp_s=first_dp,
                   last_stage_dp_s=last_dp, static_bytes=tuple(0.0 for _ in range(pp)), network=network,
                   embedding_allreduce_s=embedding_allreduce_s(model, rate, d, per_rank))


def shared_bucket_allreduce_s(nbytes: float, ranks: int, bytes_per_s: float, groups: int = 1) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` ranks when all of them (and ``groups``
    such rings at once) send through one token bucket of ``bytes_per_s``: 2(ranks-1) x nbytes per ring."""
    if ranks < 2:
        return 0.0
    return 2 * (ranks - 1) * nbytes * groups / bytes_per_s


def allreduce_s(nbytes: float, ranks: int, bytes_per_s: float, groups: int = 1, per_rank: bool = True) -> float:
    """Seconds of ``groups`` concurrent ring all-reduces of ``nbytes`` over ``ranks`` ranks each: with a NIC per
    rank, 2(ranks-1)/ranks x nbytes per NIC (groups on other NICs); else through one shared bucket."""
    if not per_rank:
        return shared_bucket_allreduce_s(nbytes, ranks, bytes_per_s, groups)
    return 2 * (ranks - 1) / ranks * nbytes / bytes_per_s if ranks > 1 else 0.0


def embedding_allreduce_s(model: ModelSetup, bytes_per_s: Optional[float], dp: int = 1, per_rank: bool = True) -> float:
    """Tied word-embedding gradient all-reduce between the first and last pipeline rank (2 ranks), the
    ``dp`` replicas' groups at once."""
    if not bytes_per_s:
        return 0.0
    return allreduce_s(PADDED_VOCAB * model.chunk.hidden_size * FP32, 2, bytes_per_s, groups=dp, per_rank=per_rank)


def network_cluster(dp: int, gbps: float, per_rank: bool, **fields) -> ClusterSpec:
    """The bench's network as a :class:`ClusterSpec` (``fields``: the rest of it), with gloo's collectives. A NIC per
    rank: every rank its own node whose NIC (``gbps`` each way) its pipeline sends, data-parallel ring and embedding
    all-reduce share max-min fairly (:mod:`megatron_pipemesh.planning.topology`, as ``--nic-queue fair`` shares
    it). One shared bucket: pipeline links at ``gbps``, a ring at ``gbps`` / d (each ring collective moves (d-1) x
    its payload through the one bucket, :func:`allreduce_s`), each on a link of its own. The bench's ranks are CPU
    processes, whose host copies run on their compute thread."""
    fields.setdefault("host_copies_on_compute", True)
    return bench_network_cluster(dp, gbps, per_rank, COLLECTIVES, **fields)


def sharding_model(model: ModelSetup, config: ParallelConfig, levels: Sequence[str], bytes_per_s: Optional[float],
                   link_share: float = 1.0, per_rank: bool = True):
    """The levels' :class:`~megatron_pipemesh.planning.sharding.ShardingModel` on the bench's network
    (:func:`network_cluster`; the unshaped loopback is free either way)."""
    from ..planning.sharding import ShardingModel, ShardingSpec

    gbps = bytes_per_s * link_share * 8 / 1e9 if bytes_per_s else UNSHAPED_GBPS
    cluster = network_cluster(config.dp, gbps, per_rank or not bytes_per_s, distributed_optimizer=True)
    return ShardingModel(model.model_spec(config.pp), cluster, ShardingSpec(tuple(levels)))


UNSHAPED_GBPS = 1e6
"""The unshaped loopback in the calibration: free (its cost is in the fitted per-transfer overhead)."""


def predict_iteration_ms(model: ModelSetup, config: ParallelConfig, sched: ScheduleConfig, compute: MeasuredCompute,
                         bytes_per_s: Optional[float], latency_s: float = 0.0, link_share: float = 1.0,
                         sharding: Optional[Sequence[str]] = None, per_rank: bool = True,
                         megatron_p2p: bool = False) -> Dict[str, float]:
    """Simulated forward-backward and iteration time (ms) with measured costs; ``sharding``: the row's levels
    (``--sharding``: the distributed optimizer's collectives and the levels' gathers and reductions);
    ``per_rank``: the network's topology (a NIC per rank, else one shared bucket); ``megatron_p2p``: a stock row
    (Megatron's receives and send waits, :func:`~..planning.simulator.megatron_lowering`)."""
    costs = measured_costs(model, config, sched, compute, bytes_per_s, latency_s, link_share, sharding is not None,
                           per_rank)
    shards = sharding_model(model, config, sharding, bytes_per_s, link_share, per_rank) if sharding else None
    result = simulate(sched, costs, schedule=megatron_schedule(sched, costs, shards) if megatron_p2p else None,
                      sharding=shards)
    fb = result.iteration_s
    return {"forward_backward_ms": fb * 1e3, "iteration_ms": fb * 1e3 + compute.overhead_ms,
            "simulated_idle_fraction": result.idle_fraction,
            "simulated_exposed_comm_ms": result.exposed_comm_s * 1e3,
            "p2p_ms": costs.p2p_s * 1e3, "dp_reduce_ms": costs.dp_reduce_s * 1e3,
            "forward_ms": costs.forward_s * 1e3, "backward_ms": costs.backward_s * 1e3}


def fit_transfer_overhead(model: ModelSetup, config: ParallelConfig, sched: ScheduleConfig, compute: MeasuredCompute,
                          measured_forward_backward_ms: float, upper_s: float = 0.05, bytes_per_s: Optional[float] = None,
                          latency_s: float = 0.0, link_share: float = 1.0, sharding: Optional[Sequence[str]] = None,
                          per_rank: bool = True, megatron_p2p: bool = True) -> float:
    """The fixed cost per pipeline transfer (s) that makes the simulated forward-backward time of ``sched`` equal
    the measured one: gloo over TCP with ranks sharing the CPU cores is not free even unshaped (thread hand-offs,
    copies). Fitted once per configuration on one stock schedule, then used for every prediction of that
    configuration: on its unshaped run (``bytes_per_s`` None), or, when the bench ran none (``--no-limit``,
    ``--quick``), on its shaped run with the network modelled, so the overhead also takes up what the network model
    misses for that row. 0 when the simulation is already as slow as the measurement. ``megatron_p2p``: the row ran
    Megatron's own schedule (:func:`~..planning.simulator.megatron_lowering`)."""
    def fb(overhead: float) -> float:
        return predict_iteration_ms(model, config, sched, compute, bytes_per_s, latency_s + overhead, link_share,
                                    sharding, per_rank, megatron_p2p)["forward_backward_ms"]
    if fb(0.0) >= measured_forward_backward_ms:
        return 0.0
    lo, hi = 0.0, upper_s
    if fb(hi) < measured_forward_backward_ms:
        return hi
    for _ in range(30):
        mid = (lo + hi) / 2
        if fb(mid) < measured_forward_backward_ms:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
