"""Cost and memory inputs of the simulator: from a model + cluster description, or given directly.

Analytic formulas (all per chunk-micro-batch unless said otherwise):

* compute: forward FLOPs of a transformer layer 2bsh(h + 2kv) + 2bsh^2 + 4bs^2h + 2bsh(fc1 + f)
  (= 24bsh^2 + 4bs^2h for MHA and ffn = 4h, Narayanan et al., SC21; kv = h*g/a, fc1 = 2f with SwiGLU),
  plus 2*b*s*h*vocab for the output layer on the last stage; backward = 2x forward; divided by
  TP and by the achieved FLOP/s (device peak x ``mfu``);
* tensor parallel (t > 1, exposed on the compute stream as in Megatron without --tp-comm-overlap): per
  layer two all-reduces of s*b*h elements in the forward (after attention and after the MLP) and two in the
  backward (the column-parallel inputs' gradients), 2(t-1)/t x bytes each; with sequence parallelism an
  all-gather and a reduce-scatter of the same size in place of each, (t-1)/t x bytes each. The embedding's
  all-reduce (forward; SP: a reduce-scatter, and an all-gather in the backward) on stage 0, the output
  layer's input-gradient all-reduce (backward; SP: an all-gather forward, a reduce-scatter backward) on the
  last stage. Priced alone on the link the group uses (:attr:`.topology.Topology.tp_gbps`); a full
  recomputation repeats the forward's, a selective ``mlp`` one the MLP's;
* pipeline transfer: s*b*h activation elements (divided by TP under sequence parallelism) over the
  pipeline link (inside a node at the intra-node rate), plus latency;
* data parallel (ring): all-reduce 2(d-1)/d x bytes, reduce-scatter / all-gather (d-1)/d x bytes,
  over the data-parallel ring (its slowest hop); with a distributed optimizer gradients are
  reduce-scattered and parameters all-gathered, otherwise gradients are all-reduced and nothing is gathered;
* tied word embeddings (Megatron's default): after every rank's reductions the first and the last stage
  all-reduce the embedding's gradient (``finalize_model_grads``), vocab*h/t gradient elements each way; the
  learned position embedding lives on stage 0 alone (its group has one rank: no traffic);
* transfers share links max-min fairly in the simulator (:mod:`.network` on the resources and routes of
  :mod:`.topology`: a node's NIC is shared by every data-parallel ring, pipeline link and embedding
  all-reduce that leaves the node, a lone transfer gets all of it; host copies share the host link with the
  NIC's staging where ``nic_via_host``); every duration here is a transfer's time alone;
* memory: weights/grads/optimizer 18 B/param (6 + 12/d with a distributed optimizer); activations
  from :mod:`.memory` (Korthikanti et al., arXiv 2205.05198, term by term: s*b*h*(34 + 5*a*s/h)
  bytes per layer in 16-bit without recompute, 34*s*b*h with selective recompute, the layer input
  with full recompute, plus the embedding inputs on the first stage and the output layer and
  fp32 cross-entropy on the last), with CUDA's 1-byte dropout masks and fp32 norm statistics;
  per layer spec (local / Transformer Engine flash attention, GQA, SwiGLU, RoPE) and recompute level;
* the embedding (stage 0) and output layer (last stage) join their chunk's data-parallel volume;
* the optimizer step (Adam, memory-bound, ~36 bytes per local parameter) follows each rank's last
  reduction; the iteration ends with the slowest rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from ..schedule.config import ScheduleConfig
from ..schedule.levers import BASIC_LEVERS, DEVICE, FULL, KEPT, Lever
from ..schedule.ops import Op, OpKind
from ..schedule.timeline import FinalCollective
from .defaults import DEFAULT_HOST_LINK_GBPS
from .memory import ActivationShape, MoeShape, activation_bytes, recomputable_modules, selective_levels, transient_bytes
# ModelSpec and ClusterSpec live in .specs; the costs' importers take them from here too.
from .specs import GB, REDUCE_SCATTER_STEPS, ClusterSpec, ModelSpec, reduce_scatter_steps  # noqa: F401
from .topology import GBIT, Topology, topology

DDP_BUCKET_PARAMS = 40_000_000
"""Parameters of one of Megatron's gradient buckets with --overlap-grad-reduce (at least 1M x DP; megatron-core
0.19.2 ``resolve_ddp_bucket_size``); only the first pipeline stage is bucketed."""


STAGE_KINDS = ("only", "first", "middle", "last")
"""Kinds of pipeline chunk whose schedule step costs differ: the only stage (no pipeline: embedding, loss and the
whole batch), the first (embedding), a middle one, the last (output layer and loss)."""


def stage_kind(first: bool, last: bool) -> str:
    """The :data:`STAGE_KINDS` name of a chunk on the first and/or the last pipeline stage."""
    return "only" if first and last else "first" if first else "last" if last else "middle"



MEGATRON_SEND_WAIT = {"nccl": "none", "gloo": "posted"}
"""What Megatron's schedules wait for after each pipeline send, per collectives library
(:data:`~..schedule.lower.SEND_WAITS`). Megatron waits on every send right after issuing it
(``deallocate_pipeline_outputs``, always on in training). On gloo that wait lasts until the receiver has posted
its receive (a tcp pair sends only after the receiver's ready notice; then the socket buffer takes the bytes):
measured, it moves the PP = 2 predictions of ``bench --advice`` from 9-20% to within 6% of the runs. On NCCL it
makes the compute stream wait for the send kernel, which completes once the bytes are in the connection's
buffer, so a send under the buffer's size (4 MiB by default) holds nothing: "none" (not yet measured on GPUs)."""


PLANNED_MODULES = ("core_attn", "mlp")
"""``--recompute-modules`` PipeMesh's planner combines per chunk-micro-batch. ``layernorm`` is left out: it acts
only where the norms are separate modules (the local spec) and megatron-core 0.19.2 then needs Transformer Engine
installed for it (``runtime/recompute.py``: ``CheckpointWithoutOutput``), and it frees two norm outputs of a
layer's ~16 sbh."""


def planning_levels(model: ModelSpec) -> Tuple[Lever, ...]:
    """The levels PipeMesh's planner chooses from per chunk-micro-batch, each one its runtime applies to
    ``model``: none, the selective module sets of :data:`PLANNED_MODULES` that act on its layer spec
    (:func:`.memory.selective_levels`) and that megatron-core 0.19.2 can recompute for it
    (:func:`.memory.recomputable_modules`: ``mlp`` only without linear biases), and full."""
    allowed = set(PLANNED_MODULES) & recomputable_modules(model.layer_spec, model.linear_bias)
    chosen = tuple(lever for lever in selective_levels(model.layer_spec) if lever.modules <= allowed)
    return (DEVICE,) + chosen + (FULL,)


@dataclass(frozen=True, eq=False)
class StageCosts:
    """What differs between the stages of an uneven layer split (:mod:`.layout`), for one stage."""

    layers: Optional[int]
    """Transformer layers of the stage (None: those of the chunk :class:`OpCosts` describes)."""
    scale: float
    """Its layers over those of the chunk :class:`OpCosts` describes: the forward, the backward, their tensor-parallel
    collectives and the chunk's data-parallel volume scale with it (the embedding's and output layer's do not)."""
    activation_bytes: Dict[str, float]
    """Activation bytes one micro-batch of the stage keeps, per recompute level (first/last-stage extras apart)."""
    recompute_s: Dict[str, float]
    """Extra backward time per micro-batch of the stage, per recompute level."""
    transient_bytes: Dict[str, float]
    """Bytes a level's recomputation re-creates during the stage's backward."""


@dataclass
class OpCosts:
    """Per-op durations (seconds) and bytes used by the simulator; also works as a direct input."""

    forward_s: float
    """Forward of one chunk on one micro-batch (its tensor-parallel collectives included). With an uneven split
    (``stages``) the chunk of the stage with the most layers; every stage scales it by its :attr:`StageCosts.scale`."""
    backward_s: float
    """Backward of one chunk on one micro-batch (without recompute; its tensor-parallel collectives included)."""
    p2p_s: float
    """Time a pipeline link is busy with one activation/gradient transfer alone (with ``network``: on its
    slowest link; faster links take less, :meth:`.topology.Topology.p2p_speedup`)."""
    dp_reduce_s: float = 0.0
    """Gradient reduction of one chunk over data parallel."""
    dp_gather_s: float = 0.0
    """Parameter gather of one chunk over data parallel (0 without distributed optimizer)."""
    latency_s: float = 0.0
    """Added to every transfer."""
    first_stage_extra_s: float = 0.0
    """Extra forward time on stage 0 (embedding); backward gets twice this."""
    last_stage_extra_s: float = 0.0
    """Extra forward time on the last stage (output layer and loss); backward gets twice this."""
    first_stage_backward_extra_s: Optional[float] = None
    """Extra backward time on stage 0 when measured (a profile); None: twice ``first_stage_extra_s``."""
    last_stage_backward_extra_s: Optional[float] = None
    """Extra backward time on the last stage when measured (a profile); None: twice ``last_stage_extra_s``."""
    batch_s: float = 0.0
    """Forward time the first and the last stage spend per micro-batch taking the batch from the data loader (once
    where one stage is both; a profile measures it, 0 otherwise)."""
    step_forward_s: Dict[str, float] = field(default_factory=dict)
    """Forward time Megatron's schedule step spends per chunk-micro-batch beyond the layers, embedding and output
    layer, per kind of chunk (:data:`STAGE_KINDS`; a profile measures it, 0 otherwise)."""
    step_backward_s: Dict[str, float] = field(default_factory=dict)
    """The same for the backward."""
    activation_bytes: Dict[str, float] = field(default_factory=lambda: dict.fromkeys(BASIC_LEVERS, 0.0))
    """Activation bytes one chunk-micro-batch keeps alive until its backward, per recompute level."""
    first_stage_activation_bytes: Dict[str, float] = field(default_factory=dict)
    """Extra activation bytes of stage 0 (token/position ids, embedding dropout), per level."""
    last_stage_activation_bytes: Dict[str, float] = field(default_factory=dict)
    """Extra activation bytes of the last stage (final norm, output layer, fp32 cross-entropy), per level."""
    recompute_s: Dict[str, float] = field(default_factory=lambda: dict.fromkeys(BASIC_LEVERS, 0.0))
    """Extra backward time per chunk-micro-batch for each recompute level."""
    transient_bytes: Dict[str, float] = field(default_factory=dict)
    """Bytes a level's recomputation re-creates during the chunk's backward (on top of what it kept)."""
    static_bytes: Tuple[float, ...] = ()
    """Weights + grads + optimizer state per pipeline rank."""
    optimizer_params: Tuple[float, ...] = ()
    """Per pipeline rank: the parameters its optimizer steps (its shard with the distributed optimizer; empty where
    the costs were given directly)."""
    first_stage_dp_s: float = 0.0
    """Extra data-parallel time (reduction + gather) of stage 0's chunk: the embedding parameters."""
    last_stage_dp_s: float = 0.0
    """Extra data-parallel time of the last stage's chunk: the output layer parameters."""
    optimizer_s: Tuple[float, ...] = ()
    """Optimizer step per pipeline rank, after its last gradient reduction."""
    host_link_gbps: float = DEFAULT_HOST_LINK_GBPS
    """Device-host copy bandwidth of one rank per direction (Gbit/s): an OFFLOAD / RELOAD moves the
    chunk-micro-batch's 'none' activation bytes (first/last-stage extras included) in bytes*8/rate."""
    host_copies_on_compute: bool = False
    """An OFFLOAD / RELOAD holds up the rank's compute for its duration (:attr:`ClusterSpec.host_copies_on_compute`)."""
    grad_reduce_overlapped: bool = True
    """The reductions run during the backward (:attr:`ClusterSpec.overlap_grad_reduce`), else after it."""
    param_gather_overlapped: bool = True
    """The gathers run before the forwards (:attr:`ClusterSpec.overlap_param_gather`), else in the optimizer step."""
    megatron_send_wait: str = MEGATRON_SEND_WAIT["nccl"]
    """What Megatron's schedules wait for after a pipeline send on this cluster (:data:`MEGATRON_SEND_WAIT`)."""
    network: Optional[Topology] = None
    """The links the transfers share (:mod:`.topology`); None = each transfer takes its own time, nothing shared."""
    dp_buckets: int = 1
    """Without a pipeline (p = 1) and with --overlap-grad-reduce: Megatron's gradient buckets (:data:`DDP_BUCKET_PARAMS`
    parameters each, or 1M x DP): each bucket's reduction starts once the last micro-batch's backward has produced
    its gradients, each gather (--overlap-param-gather) is awaited by the first forward of the layers it holds, so a
    collective of n buckets overlaps the op next to it but for one bucket's share (:meth:`ScheduleCosts.data_parallel`).
    1: one collective after the backward (a pipeline stage past the first gets no buckets, and Megatron's pipelined
    schedules' own overlap is per chunk)."""
    embedding_allreduce_s: float = 0.0
    """The tied embedding's gradient all-reduce between stage 0 and the last stage after the backward: seconds
    of its transfer each way alone (0: untied, or one stage); its two ring steps add ``latency_s`` each."""
    tp_forward_s: float = 0.0
    """Of ``forward_s``: the tensor- and context-parallel collectives (what a measured layer does not include; also
    repeated by full recomputation)."""
    tp_backward_s: float = 0.0
    """Of ``backward_s``: the tensor- and context-parallel collectives."""
    first_stage_tp_s: Tuple[float, float] = (0.0, 0.0)
    """(forward, backward) tensor-parallel collectives of stage 0's embedding, on top of its chunk's."""
    last_stage_tp_s: Tuple[float, float] = (0.0, 0.0)
    """(forward, backward) tensor-parallel collectives of the last stage's output layer, on top of its chunk's."""
    stages: Tuple[StageCosts, ...] = ()
    """Per stage s = c*p + r of an uneven split: its layers' share of the chunk costs above and its own memory terms;
    empty: every stage is the chunk above (an even split, or costs given directly)."""

    @property
    def dp_total_s(self) -> float:
        return self.dp_reduce_s + self.dp_gather_s

    def stage(self, stage: int) -> StageCosts:
        """The costs of ``stage`` (the chunk's own when the split is even)."""
        if self.stages:
            return self.stages[stage]
        return StageCosts(None, 1.0, self.activation_bytes, self.recompute_s, self.transient_bytes)


def activation_shape(model: ModelSpec, cluster: ClusterSpec) -> ActivationShape:
    """What the activation model (:mod:`.memory`) needs of ``model`` on ``cluster`` (CUDA: fp32 norm statistics): a
    rank's slice of s/CP tokens under context parallelism (with ``allgather`` it saves every slice's keys and values)."""
    return ActivationShape(seq_length=model.seq_length // cluster.cp, micro_batch_size=model.micro_batch_size,
                           hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
                           vocab_size=model.vocab_size, ffn_hidden_size=model.ffn_hidden_size,
                           dtype_bytes=model.dtype_bytes, tp=cluster.tp, sequence_parallel=cluster.sequence_parallel,
                           norm_stat_bytes=4, hidden_dropout=model.hidden_dropout,
                           attention_dropout=model.attention_dropout, dropout_mask_bytes=model.dropout_mask_bytes,
                           attention_mask=model.layer_spec == "local",
                           position_embedding=model.position_embedding, layer_spec=model.layer_spec,
                           num_query_groups=model.num_query_groups, swiglu=model.swiglu,
                           bias_activation_fusion=model.bias_activation_fusion, fp8=model.fp8,
                           gathered_kv=cluster.cp if cluster.cp_comm == "allgather" else 1, moe=_moe_shape(model))


def _moe_shape(model: ModelSpec) -> Optional[MoeShape]:
    m = model.moe
    if m is None:
        return None
    gate = 2 if model.swiglu else 1
    return MoeShape(model.moe_fraction, m.num_experts, m.topk, gate * model.expert_ffn, model.expert_ffn,
                    gate * m.shared_ffn, m.shared_ffn, 4 if m.router_fp32 else model.dtype_bytes, m.routed_share)


def _tp_unit_s(model: ModelSpec, cluster: ClusterSpec, links: Topology) -> float:
    """One all-reduce's worth of a layer's s*b*h activations over the TP group (SP: an all-gather and a
    reduce-scatter of the full tensor cost the same; a rank's s/CP tokens under CP); latency only where the group
    crosses the NIC."""
    t = cluster.tp
    if t <= 1:
        return 0.0
    tokens = model.seq_length // cluster.cp * model.micro_batch_size
    unit = 2 * (t - 1) / t * tokens * model.hidden_size * model.dtype_bytes / (links.tp_gbps * GBIT)
    if t > cluster.devices_per_node:
        unit += 2 * (t - 1) * cluster.latency_us * 1e-6
    return unit


def gemm_flops_per_s(model: ModelSpec, cluster: ClusterSpec) -> float:
    """FLOP/s of the linear layers' GEMMs: the device's FP8 rate with :attr:`ModelSpec.fp8`, else its 16-bit rate
    (both at the cluster's MFU)."""
    peak = cluster.fp8_tflops if model.fp8 and cluster.fp8_tflops else cluster.device_tflops
    return peak * 1e12 * cluster.mfu


def layer_forward_s(model: ModelSpec, cluster: ClusterSpec) -> float:
    """Forward compute of one layer on one rank for one micro-batch (collectives apart): its GEMMs at
    :func:`gemm_flops_per_s`, the attention core (flash or unfused, 16-bit) at the 16-bit rate, over TP x CP (each CP
    rank runs a 1/CP slice of the tokens, and Megatron's load-balanced causal split gives it 1/CP of the attention)."""
    attention = 4 * model.micro_batch_size * model.seq_length ** 2 * model.hidden_size
    gemms = model.layer_forward_flops() - attention
    split = cluster.tp * cluster.cp
    return (gemms / gemm_flops_per_s(model, cluster)
            + attention / (cluster.device_tflops * 1e12 * cluster.mfu)) / split


def cp_exchange_s(model: ModelSpec, cluster: ClusterSpec, links: Topology, attention_fwd_s: float) -> Tuple[float, float]:
    """(forward, backward) seconds one layer's context-parallel exchange adds to a rank's compute stream for one
    micro-batch (``attention_fwd_s``: the rank's attention core forward), on the CP group's link
    (:attr:`.topology.Topology.cp_gbps`) alone:

    * ``p2p``: a ring of CP - 1 steps, each passing a slice's keys and values (2 x s/CP x b x kv / TP elements) to the
      next rank while the attention of the slice in hand runs; a step waits for whichever is longer. The backward
      passes the keys and values and their gradients (twice the bytes) beside twice the compute;
    * ``a2a``: all-to-alls of q, k, v before the attention and of its output after it, (CP - 1)/CP of each rank's
      (s/CP x b x (2h + 2kv) / TP) elements, exposed; the same in the backward;
    * ``allgather``: the keys and values gathered before the attention ((CP - 1)/CP of s x b x 2kv / TP elements),
      their gradients reduce-scattered in the backward, exposed."""
    c = cluster.cp
    if c <= 1:
        return 0.0, 0.0
    rate = links.cp_gbps * GBIT
    s, b, h, d, t = model.seq_length, model.micro_batch_size, model.hidden_size, model.dtype_bytes, cluster.tp
    latency = cluster.latency_us * 1e-6
    if cluster.cp_comm == "p2p":
        step = 2 * s / c * b * model.kv_width / t * d / rate + latency
        attention_step = attention_fwd_s / c
        return (c - 1) * max(step - attention_step, 0.0), (c - 1) * max(2 * step - 2 * attention_step, 0.0)
    if cluster.cp_comm == "a2a":
        moved = (c - 1) / c * s / c * b * (2 * h + 2 * model.kv_width) / t * d / rate + 2 * latency
        return moved, moved
    gathered = (c - 1) / c * s * b * 2 * model.kv_width / t * d / rate + latency
    return gathered, gathered


def _ring_s(model: ModelSpec, cluster: ClusterSpec, links: Topology, params: float, ranks: int) -> Tuple[float, float]:
    """(gradient reduction, parameter gather) seconds of ``params`` parameters over a ring of ``ranks``."""
    if ranks <= 1 or not params:
        return 0.0, 0.0
    dp_route = links.dp_route(0)
    dp_bytes_per_s = dp_route.lone_bytes_per_s if dp_route is not None else cluster.dp_gbps * GBIT
    grads = params * model.grad_bytes / dp_bytes_per_s
    if cluster.distributed_optimizer:
        return (reduce_scatter_steps(cluster) * (ranks - 1) / ranks * grads,
                (ranks - 1) / ranks * params * model.dtype_bytes / dp_bytes_per_s)
    return 2 * (ranks - 1) / ranks * grads, 0.0


def _dp_sync_s(model: ModelSpec, cluster: ClusterSpec, links: Topology, params: float,
               expert_params: float = 0.0) -> Tuple[float, float]:
    """(gradient reduction, parameter gather) seconds of a chunk's ``params`` parameters over DP x CP and its routed
    experts' ``expert_params`` over the expert data-parallel group (both on the rank's data-parallel link, one after
    the other, as Megatron's DDP reduces its dense and expert buffers)."""
    dense = _ring_s(model, cluster, links, params, cluster.dp_cp)
    experts = _ring_s(model, cluster, links, expert_params, cluster.edp)
    return dense[0] + experts[0], dense[1] + experts[1]


def ep_exchange_s(model: ModelSpec, cluster: ClusterSpec) -> Tuple[float, float]:
    """(forward, backward) seconds one layer's token dispatch and combine add to a rank's compute stream for one
    micro-batch (times the MoE layers' share; 0 at EP = 1), exposed (without --overlap-moe-expert-parallel-comm).

    A rank routes its T = s x b / CP tokens (/ TP under sequence parallelism) to k experts each, evenly over the EP ranks: ``alltoall`` sends (EP - 1)/EP of its T x k hidden states out and takes as many in,
    to dispatch and again to combine; ``allgather`` gathers every EP rank's T hidden states and reduce-scatters the
    outputs. The backward moves the same bytes. The EP group is EP blocks of ETP consecutive devices: the share to
    peers in the node crosses the intra-node link (at the all-to-all rate a profile measured there, where it did), the
    rest leaves through the node's NIC, which every device of the node loads at once; the longer of the two sets the
    time."""
    m, ep = model.moe, cluster.ep
    if m is None or ep <= 1:
        return 0.0, 0.0
    tokens = model.seq_length * model.micro_batch_size / (cluster.cp * (cluster.tp if cluster.sequence_parallel else 1))
    hidden = model.hidden_size * model.dtype_bytes
    per_peer = tokens * m.topk * hidden / ep if m.dispatcher != "allgather" else tokens * hidden
    node = cluster.devices_per_node
    inside = max(1, min(ep, node // cluster.expert_tp))  # EP ranks sharing this device's node
    intra = cluster.alltoall_intra_gbps or (cluster.intra_node_gbps if cluster.intra_node_gbps is not None
                                            else cluster.dp_gbps)
    nic = cluster.nic_gbps if cluster.nic_gbps is not None else cluster.dp_gbps
    across = (ep - inside) * per_peer * (node if cluster.nic_gbps is not None else 1) / (nic * GBIT)
    one = max((inside - 1) * per_peer / (intra * GBIT), across) + 2 * cluster.latency_us * 1e-6
    return 2 * one * model.moe_fraction, 2 * one * model.moe_fraction


def ep_crosses_nic(cluster: ClusterSpec) -> bool:
    """Whether an EP group spans more than one node (its dispatch then leaves through the NIC)."""
    return cluster.ep * cluster.expert_tp > cluster.devices_per_node


def _rank_state(model: ModelSpec, cluster: ClusterSpec, config: ScheduleConfig, stage_layers: Sequence[int],
                uneven: bool) -> Tuple[Tuple[float, ...], Tuple[float, ...], Tuple[float, ...]]:
    """(weights + grads + optimizer bytes, optimizer-step seconds, parameters the rank's optimizer steps) per pipeline
    rank. Dense parameters split over TP, with the distributed optimizer their state over DP x CP; routed experts split
    over EP x ETP, their state over the expert data-parallel group. With FP8, Transformer Engine caches each linear
    layer's weight in FP8 and its transpose for the backward across the micro-batches of an iteration: 2 bytes more
    per layer parameter."""
    t = cluster.tp
    experts = cluster.ep * cluster.expert_tp

    def bytes_per_param(ranks: int) -> float:
        return 6 + 12 / ranks if cluster.distributed_optimizer else 18

    static, optimizer, steps = [], [], []
    for rank in range(config.pp):
        rank_layers = (sum(stage_layers[c * config.pp + rank] for c in range(config.vpp)) if uneven
                       else config.vpp * max(stage_layers))
        dense = rank_layers * model.dense_layer_params() / t
        expert = rank_layers * model.expert_layer_params() / experts
        if rank == 0:
            dense += model.embedding_params() / t
        if rank == config.pp - 1 and not (config.pp == 1 and model.tied_embeddings):
            dense += model.vocab_size * model.hidden_size / t  # the output layer (tied: the embedding's copy)
        layer_weights = rank_layers * (model.dense_layer_params() / t + model.expert_layer_params() / experts)
        fp8_cache = 2 * layer_weights if model.fp8 else 0.0
        static.append(dense * bytes_per_param(cluster.dp_cp) + expert * bytes_per_param(cluster.edp) + fp8_cache)
        # Adam over this rank's optimizer shard: fp32 param, grad, m, v read and written (32 B) + bf16 copy (4 B).
        shard = dense / cluster.dp_cp + expert / cluster.edp if cluster.distributed_optimizer else dense + expert
        steps.append(shard)
        optimizer.append(shard * 36 / (cluster.memory_gbs * 1e9) if cluster.optimizer_step else 0.0)
    return tuple(static), tuple(optimizer), tuple(steps)


def analytic_costs(model: ModelSpec, cluster: ClusterSpec, config: ScheduleConfig,
                   levels: Sequence[str] = BASIC_LEVERS) -> OpCosts:
    """Derive :class:`OpCosts` for ``config`` from the model and cluster, with activation bytes and
    recompute times for every lever in ``levels`` (:class:`.levers.Lever` or its name)."""
    stage_layers = model.stage_layers(config.pp, config.vpp)
    layers = max(stage_layers)  # the chunk the scalar fields describe; the other stages scale it
    s, b, h, t, c = model.seq_length, model.micro_batch_size, model.hidden_size, cluster.tp, cluster.cp
    flops_per_s = cluster.device_tflops * 1e12 * cluster.mfu  # 16-bit: attention core, output layer
    forward = layers * layer_forward_s(model, cluster)
    attention_core_fwd = 4 * b * s * s * h / (t * c) / flops_per_s
    head_fwd = 2 * b * s * h * model.vocab_size / (t * c) / flops_per_s
    sp = t if cluster.sequence_parallel else 1
    act_elems = s * b * h / (sp * c)
    links = topology(cluster, config.pp)
    p2p = act_elems * model.dtype_bytes / links.slowest_p2p_bytes_per_s if config.pp > 1 else 0.0
    tp_unit = _tp_unit_s(model, cluster, links)
    cp_forward, cp_backward = cp_exchange_s(model, cluster, links, attention_core_fwd)
    ep_forward, ep_backward = ep_exchange_s(model, cluster)
    cp_forward, cp_backward = cp_forward + ep_forward, cp_backward + ep_backward  # both on the compute stream
    # per layer and direction: after attention and after the MLP (forward), their inputs' grads; CP's exchange
    tp_layer = 2 * tp_unit
    first_tp = (tp_unit / 2, tp_unit / 2) if cluster.sequence_parallel else (tp_unit, 0.0)
    last_tp = (tp_unit / 2, tp_unit / 2) if cluster.sequence_parallel else (0.0, tp_unit)
    reduce, gather = _dp_sync_s(model, cluster, links, layers * model.dense_layer_params() / t,
                                layers * model.expert_layer_params() / (cluster.ep * cluster.expert_tp))
    # The embedding (and position table) lives in stage 0's bucket, the output layer (or the tied embedding's
    # copy) in the last's.
    first_dp = sum(_dp_sync_s(model, cluster, links, model.embedding_params() / t))
    # Without a pipeline a tied output layer is the embedding itself: no copy to hold or reduce.
    last_dp = (0.0 if config.pp == 1 and model.tied_embeddings
               else sum(_dp_sync_s(model, cluster, links, model.vocab_size * h / t)))
    embedding = 0.0
    if model.tied_embeddings and config.pp > 1:
        # Two ranks: a ring all-reduce sends half the gradient each way twice.
        embedding = model.vocab_size * h / t * model.grad_bytes / links.embedding_route(0, config.pp - 1).lone_bytes_per_s
    shape = activation_shape(model, cluster)
    levels = tuple(dict.fromkeys((DEVICE,) + tuple(Lever.parse(level) for level in levels)))

    def recompute_s(count: int) -> Dict[str, float]:
        """Extra backward seconds of each level for a chunk of ``count`` layers (its forward: as ``forward_s``)."""
        chunk_forward = count * (layer_forward_s(model, cluster) + tp_layer + cp_forward)
        return {level: level.recompute_seconds(count, chunk_forward, module_s) if count else 0.0 for level in levels}

    middle = {level: activation_bytes(shape, layers, level) for level in levels}
    first = {level: activation_bytes(shape, layers, level, first_stage=True) - middle[level] for level in levels}
    last = {level: activation_bytes(shape, layers, level, last_stage=True) - middle[level] for level in levels}
    # Recomputing the MLP repeats its row-parallel all-reduce (SP: its all-gather and reduce-scatter) too.
    # Recomputing the attention core repeats its context-parallel exchange.
    module_s = {"core_attn": attention_core_fwd + cp_forward,
                "mlp": model.mlp_forward_flops() / (t * c) / gemm_flops_per_s(model, cluster) + tp_unit,
                # Norms are memory-bound: read the input, write the output, twice per layer.
                "layernorm": 0.0 if model.layer_spec == "te" else 2 * 2 * act_elems * model.dtype_bytes / (cluster.memory_gbs * 1e9)}

    stages: Tuple[StageCosts, ...] = ()
    if len(set(stage_layers)) > 1:
        kinds = {count: StageCosts(count, count / layers, {level: activation_bytes(shape, count, level) for level in levels},
                                   recompute_s(count), {level: transient_bytes(shape, count, level) for level in levels})
                 for count in set(stage_layers)}
        stages = tuple(kinds[count] for count in stage_layers)
    static, optimizer, shards = _rank_state(model, cluster, config, stage_layers, bool(stages))
    buckets = 1
    if config.pp == 1 and cluster.overlap_grad_reduce and cluster.dp_cp > 1:
        params = shards[0] * (cluster.dp_cp if cluster.distributed_optimizer else 1)
        buckets = max(1, math.ceil(params / max(DDP_BUCKET_PARAMS, 1_000_000 * cluster.dp_cp)))
    tp_forward, tp_backward = layers * (tp_layer + cp_forward), layers * (tp_layer + cp_backward)
    return OpCosts(
        forward_s=forward + tp_forward, backward_s=2 * forward + tp_backward, p2p_s=p2p, dp_reduce_s=reduce,
        dp_gather_s=gather, latency_s=cluster.latency_us * 1e-6, first_stage_extra_s=0.0, last_stage_extra_s=head_fwd,
        activation_bytes=middle, first_stage_activation_bytes=first, last_stage_activation_bytes=last,
        recompute_s=recompute_s(layers),
        first_stage_dp_s=first_dp, last_stage_dp_s=last_dp, optimizer_s=optimizer,
        transient_bytes={level: transient_bytes(shape, layers, level) for level in levels},
        static_bytes=static, optimizer_params=shards, host_link_gbps=cluster.host_link_gbps,
        host_copies_on_compute=cluster.host_copies_on_compute, network=links,
        megatron_send_wait=MEGATRON_SEND_WAIT[cluster.collectives],
        grad_reduce_overlapped=cluster.overlap_grad_reduce, param_gather_overlapped=cluster.overlap_param_gather,
        embedding_allreduce_s=embedding, dp_buckets=buckets, tp_forward_s=tp_forward, tp_backward_s=tp_backward,
        first_stage_tp_s=first_tp, last_stage_tp_s=last_tp, stages=stages,
    )


class ScheduleCosts:
    """Adapter from :class:`OpCosts` to the timeline engine's ``Costs`` protocol."""

    def __init__(self, config: ScheduleConfig, costs: OpCosts, recompute: Optional[Dict[Tuple[int, int, int], str]] = None):
        self.config, self.costs, self.recompute = config, costs, recompute or {}
        # Per (rank, chunk): its stage's costs (one shared object when the split is even).
        even = costs.stage(0) if not costs.stages else None
        self._stages = [[even or costs.stage(config.stage(rank, chunk)) for chunk in range(config.vpp)]
                        for rank in range(config.pp)]
        self._compute: Dict[Tuple[int, OpKind, int], float] = {}  # (rank, kind, chunk) -> time at no recomputation

    def stage_costs(self, rank: int, chunk: int) -> StageCosts:
        """The costs of the stage ``chunk`` of ``rank`` is."""
        return self._stages[rank][chunk]

    def transient(self, rank: int, chunk: int, level: str) -> float:
        """Bytes the recomputation at ``level`` re-creates during a backward of ``chunk`` on ``rank``."""
        return self._stages[rank][chunk].transient_bytes.get(level, 0.0)

    def kept_level(self, rank: int, op: Op) -> Lever:
        """The lever whose bytes and backward time apply (:attr:`.levers.Lever.kept`: 'host' keeps activations whole)."""
        return KEPT[self.recompute.get((rank, op.chunk, op.microbatch), DEVICE)]

    def recompute_time(self, rank: int, op: Op) -> float:
        """Extra backward time of the chunk-micro-batch of ``op`` for its recomputation."""
        return self._stages[rank][op.chunk].recompute_s[self.kept_level(rank, op)]

    def host_copy(self, rank: int, op: Op) -> float:
        """Seconds one direction of the rank's host link is busy with an OFFLOAD / RELOAD of ``op``'s
        chunk-micro-batch (its whole activations) alone. With a ``network`` the link is shared with the NIC's
        staging where ``ClusterSpec.nic_via_host``; not modelled: the GPUs behind one PCIe switch (the
        study's host rates are already a GPU's share) and host-memory bandwidth."""
        return self.bytes_at(rank, op.chunk, DEVICE) * 8 / (self.costs.host_link_gbps * 1e9)

    @property
    def host_copies_on_compute(self) -> bool:
        """Host copies run on the compute stream (:attr:`OpCosts.host_copies_on_compute`)."""
        return self.costs.host_copies_on_compute

    def activation(self, rank: int, op: Op) -> float:
        """Bytes the chunk-micro-batch of ``op`` keeps alive on ``rank`` until its backward."""
        return self.bytes_at(rank, op.chunk, self.kept_level(rank, op))

    def bytes_at(self, rank: int, chunk: int, level: str) -> float:
        """Activation bytes of one micro-batch of ``chunk`` on ``rank`` at recompute ``level`` (with the
        first/last-stage extras)."""
        c = self.costs
        stage = self.config.stage(rank, chunk)
        size = self._stages[rank][chunk].activation_bytes[level]
        if stage == 0:
            size += c.first_stage_activation_bytes.get(level, 0.0)
        if stage == self.config.num_stages - 1:
            size += c.last_stage_activation_bytes.get(level, 0.0)
        return size

    def compute(self, rank: int, op: Op) -> float:
        base = self._compute.get((rank, op.kind, op.chunk))
        if base is None:  # the simulator asks once per op: the same for every micro-batch of a chunk
            base = self._compute[rank, op.kind, op.chunk] = self._compute_without_recomputation(rank, op)
        return base if op.kind is OpKind.FORWARD else base + self.recompute_time(rank, op)

    def _compute_without_recomputation(self, rank: int, op: Op) -> float:
        c = self.costs
        stage = self.config.stage(rank, op.chunk)
        first, last = stage == 0, stage == self.config.num_stages - 1
        extra = (c.first_stage_extra_s if first else 0.0) + (c.last_stage_extra_s if last else 0.0)
        side = 0 if op.kind is OpKind.FORWARD else 1
        tp = (c.first_stage_tp_s[side] if first else 0.0) + (c.last_stage_tp_s[side] if last else 0.0)
        scale = self._stages[rank][op.chunk].scale
        kind = stage_kind(first, last)
        if op.kind is OpKind.FORWARD:
            return (c.forward_s * scale + extra + tp + (c.batch_s if first or last else 0.0)
                    + c.step_forward_s.get(kind, 0.0))
        first_back = 2 * c.first_stage_extra_s if c.first_stage_backward_extra_s is None else c.first_stage_backward_extra_s
        last_back = 2 * c.last_stage_extra_s if c.last_stage_backward_extra_s is None else c.last_stage_backward_extra_s
        return (c.backward_s * scale + (first_back if first else 0.0) + (last_back if last else 0.0) + tp
                + c.step_backward_s.get(kind, 0.0))

    def transfer(self, src: int, dst: int, op: Op) -> Tuple[float, float]:
        c = self.costs
        if c.network is None or not c.p2p_s:
            return c.p2p_s, c.latency_s
        return c.p2p_s / c.network.p2p_speedup(src, dst), c.latency_s

    def links(self) -> Optional[Topology]:
        """The shared links of the engine (:mod:`.topology`), or None."""
        return self.costs.network

    def final_collectives(self) -> Tuple[FinalCollective, ...]:
        """The tied embedding's all-reduce between stage 0 (rank 0, chunk 0) and the last stage."""
        c, last = self.costs, self.config.pp - 1
        if not c.embedding_allreduce_s or last == 0:
            return ()
        seconds = c.embedding_allreduce_s
        return (FinalCollective((0, last), ((0, last, seconds, 0), (last, 0, seconds, self.config.vpp - 1)), 2 * c.latency_s),)

    def data_parallel(self, rank: int, op: Op) -> float:
        c = self.costs
        base, total = (c.dp_gather_s, c.dp_total_s) if op.kind is OpKind.PARAM_SYNC else (c.dp_reduce_s, c.dp_total_s)
        stage = self.config.stage(rank, op.chunk)
        extra = (c.first_stage_dp_s if stage == 0 else 0.0) + (c.last_stage_dp_s if stage == self.config.num_stages - 1 else 0.0)
        # The embedding/output parameters split between gather and reduction like the chunk's own.
        share = base / total if total else (0.0 if op.kind is OpKind.PARAM_SYNC else 1.0)
        seconds = base * self._stages[rank][op.chunk].scale + extra * share
        n = c.dp_buckets
        if n > 1 and (op.kind is OpKind.GRAD_SYNC or c.param_gather_overlapped):
            # Bucketed (no pipeline): all but one bucket's share runs under the last backward / the first forward.
            neighbour = self._compute_without_recomputation(
                rank, Op(OpKind.BACKWARD if op.kind is OpKind.GRAD_SYNC else OpKind.FORWARD, op.chunk, 0))
            seconds = max(seconds / n, seconds - neighbour * (n - 1) / n)
        return seconds
