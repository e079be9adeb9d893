"""Cost and memory inputs of the simulator: from a model + cluster description, or given directly.

Analytic formulas (all per chunk-micro-batch unless said otherwise):

* compute: forward FLOPs of a transformer layer 8*b*s*h^2 + 4*b*s*h*ffn + 4*b*s^2*h (= 24bsh^2 + 4bs^2h
  for ffn = 4h, Narayanan et al., SC21),
  plus 2*b*s*h*vocab for the output layer on the last stage; backward = 2x forward; divided by
  TP and by the achieved FLOP/s (device peak x ``mfu``);
* pipeline transfer: s*b*h activation elements (divided by TP under sequence parallelism) over the
  pipeline link, plus latency;
* data parallel (ring): all-reduce 2(d-1)/d x bytes, reduce-scatter / all-gather (d-1)/d x bytes,
  over the data-parallel link; with a distributed optimizer gradients are reduce-scattered and
  parameters all-gathered, otherwise gradients are all-reduced and nothing is gathered;
* memory: weights/grads/optimizer 18 B/param (6 + 12/d with a distributed optimizer); activations
  from :mod:`.memory` (Korthikanti et al., arXiv 2205.05198, term by term: s*b*h*(34 + 5*a*s/h)
  bytes per layer in 16-bit without recompute, 34*s*b*h with selective recompute, the layer input
  with full recompute, plus the embedding inputs on the first stage and the output layer and
  fp32 cross-entropy on the last), with CUDA's 1-byte dropout masks and fp32 norm statistics.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from ..schedule.config import ScheduleConfig
from ..schedule.ops import Op, OpKind
from .memory import ActivationShape, activation_bytes

GB = 1024 ** 3


@dataclass(frozen=True)
class ModelSpec:
    """GPT model shape (Megatron argument names in brackets)."""

    num_layers: int = 24
    """Transformer layers [--num-layers]; must divide evenly over p*V stages."""
    hidden_size: int = 2048
    """Hidden size h [--hidden-size]."""
    num_attention_heads: int = 16
    """Attention heads a [--num-attention-heads]."""
    seq_length: int = 2048
    """Sequence length s [--seq-length]."""
    micro_batch_size: int = 1
    """Micro-batch size b [--micro-batch-size]."""
    vocab_size: int = 50304
    """Padded vocabulary size (embedding and output layer)."""
    ffn_hidden_size: Optional[int] = None
    """MLP hidden size; default 4h."""
    dtype_bytes: int = 2
    """Bytes per parameter/activation element in compute (2 for bf16/fp16, 4 for fp32)."""
    grad_bytes: int = 4
    """Bytes per gradient element in the data-parallel reduction (Megatron keeps fp32 main grads)."""
    hidden_dropout: float = 0.1
    """Megatron's --hidden-dropout (dropout masks are kept for the backward)."""
    attention_dropout: float = 0.1
    """Megatron's --attention-dropout."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def layer_params(self) -> int:
        h = self.hidden_size
        return 4 * h * h + 2 * h * self.ffn + 9 * h + self.ffn  # attention, MLP, biases and norms

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size + self.seq_length * self.hidden_size


@dataclass(frozen=True)
class ClusterSpec:
    """Devices and links."""

    tp: int = 1
    """Tensor-parallel size."""
    dp: int = 1
    """Data-parallel size d."""
    device_tflops: float = 312.0
    """Peak dense TFLOP/s of one device in the compute dtype."""
    mfu: float = 0.45
    """Fraction of peak actually reached by the layers."""
    device_memory_gb: float = 80.0
    """Memory per device (GiB)."""
    dp_gbps: float = 25.0
    """Bandwidth of the data-parallel collectives per device (Gbit/s)."""
    p2p_gbps: float = 25.0
    """Bandwidth of a pipeline link (Gbit/s)."""
    latency_us: float = 30.0
    """Latency of one transfer / collective step (microseconds)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (activations and transfers split over TP)."""
    distributed_optimizer: bool = True
    """Megatron distributed optimizer: grads reduce-scattered, params all-gathered, optimizer sharded."""


RECOMPUTE_LEVELS = ("none", "selective", "full")


@dataclass
class OpCosts:
    """Per-op durations (seconds) and bytes used by the simulator; also works as a direct input."""

    forward_s: float
    """Forward of one chunk on one micro-batch."""
    backward_s: float
    """Backward of one chunk on one micro-batch (without recompute)."""
    p2p_s: float
    """Time a pipeline link is busy with one activation/gradient transfer."""
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
    activation_bytes: Dict[str, float] = field(default_factory=lambda: {"none": 0.0, "selective": 0.0, "full": 0.0})
    """Activation bytes one chunk-micro-batch keeps alive until its backward, per recompute level."""
    first_stage_activation_bytes: Dict[str, float] = field(default_factory=dict)
    """Extra activation bytes of stage 0 (token/position ids, embedding dropout), per level."""
    last_stage_activation_bytes: Dict[str, float] = field(default_factory=dict)
    """Extra activation bytes of the last stage (final norm, output layer, fp32 cross-entropy), per level."""
    recompute_s: Dict[str, float] = field(default_factory=lambda: {"none": 0.0, "selective": 0.0, "full": 0.0})
    """Extra backward time per chunk-micro-batch for each recompute level."""
    static_bytes: Tuple[float, ...] = ()
    """Weights + grads + optimizer state per pipeline rank."""

def analytic_costs(model: ModelSpec, cluster: ClusterSpec, config: ScheduleConfig) -> OpCosts:
    """Derive :class:`OpCosts` for ``config`` from the model and cluster."""
    stages = config.pp * config.vpp
    if model.num_layers % stages:
        raise ValueError(f"--num-layers {model.num_layers} does not split evenly over p*V = {stages} stages; "
                         f"use a multiple of {stages}")
    layers = model.num_layers // stages
    s, b, h, a, t = model.seq_length, model.micro_batch_size, model.hidden_size, model.num_attention_heads, cluster.tp
    flops_per_s = cluster.device_tflops * 1e12 * cluster.mfu
    layer_fwd_flops = 8 * b * s * h * h + 4 * b * s * h * model.ffn + 4 * b * s * s * h
    forward = layers * layer_fwd_flops / t / flops_per_s
    attention_core_fwd = 4 * b * s * s * h / t / flops_per_s
    head_fwd = 2 * b * s * h * model.vocab_size / t / flops_per_s
    sp = t if cluster.sequence_parallel else 1
    act_elems = s * b * h / sp
    p2p = act_elems * model.dtype_bytes * 8 / (cluster.p2p_gbps * 1e9)
    chunk_params = layers * model.layer_params() / t
    d = cluster.dp
    grad_bytes = chunk_params * model.grad_bytes
    if d <= 1:
        reduce = gather = 0.0
    elif cluster.distributed_optimizer:
        reduce = (d - 1) / d * grad_bytes * 8 / (cluster.dp_gbps * 1e9)
        gather = (d - 1) / d * chunk_params * model.dtype_bytes * 8 / (cluster.dp_gbps * 1e9)
    else:
        reduce = 2 * (d - 1) / d * grad_bytes * 8 / (cluster.dp_gbps * 1e9)
        gather = 0.0
    shape = ActivationShape(seq_length=s, micro_batch_size=b, hidden_size=h, num_attention_heads=a,
                            vocab_size=model.vocab_size, ffn_hidden_size=model.ffn_hidden_size,
                            dtype_bytes=model.dtype_bytes, tp=t, sequence_parallel=cluster.sequence_parallel,
                            norm_stat_bytes=4, hidden_dropout=model.hidden_dropout,
                            attention_dropout=model.attention_dropout, dropout_mask_bytes=1)
    middle = {level: activation_bytes(shape, layers, level) for level in RECOMPUTE_LEVELS}
    first = {level: activation_bytes(shape, layers, level, first_stage=True) - middle[level] for level in RECOMPUTE_LEVELS}
    last = {level: activation_bytes(shape, layers, level, last_stage=True) - middle[level] for level in RECOMPUTE_LEVELS}
    static = []
    bytes_per_param = 6 + 12 / d if cluster.distributed_optimizer else 18
    for rank in range(config.pp):
        params = config.vpp * chunk_params
        if rank == 0:
            params += model.embedding_params() / t
        if rank == config.pp - 1:
            params += model.vocab_size * h / t  # untied output layer
        static.append(params * bytes_per_param)
    return OpCosts(
        forward_s=forward, backward_s=2 * forward, p2p_s=p2p, dp_reduce_s=reduce, dp_gather_s=gather,
        latency_s=cluster.latency_us * 1e-6, first_stage_extra_s=0.0, last_stage_extra_s=head_fwd,
        activation_bytes=middle, first_stage_activation_bytes=first, last_stage_activation_bytes=last,
        recompute_s={"none": 0.0, "selective": layers * attention_core_fwd, "full": forward},
        static_bytes=tuple(static),
    )


class ScheduleCosts:
    """Adapter from :class:`OpCosts` to the timeline engine's ``Costs`` protocol."""

    def __init__(self, config: ScheduleConfig, costs: OpCosts, recompute: Optional[Dict[Tuple[int, int, int], str]] = None):
        self.config, self.costs, self.recompute = config, costs, recompute or {}

    def level(self, rank: int, op: Op) -> str:
        return self.recompute.get((rank, op.chunk, op.microbatch), "none")

    def activation(self, rank: int, op: Op) -> float:
        """Bytes the chunk-micro-batch of ``op`` keeps alive on ``rank`` until its backward."""
        level, c = self.level(rank, op), self.costs
        stage = self.config.stage(rank, op.chunk)
        size = c.activation_bytes[level]
        if stage == 0:
            size += c.first_stage_activation_bytes.get(level, 0.0)
        if stage == self.config.num_stages - 1:
            size += c.last_stage_activation_bytes.get(level, 0.0)
        return size

    def compute(self, rank: int, op: Op) -> float:
        c = self.costs
        stage = self.config.stage(rank, op.chunk)
        extra = (c.first_stage_extra_s if stage == 0 else 0.0) + (c.last_stage_extra_s if stage == self.config.num_stages - 1 else 0.0)
        if op.kind is OpKind.FORWARD:
            return c.forward_s + extra
        return c.backward_s + 2 * extra + c.recompute_s[self.level(rank, op)]

    def transfer(self, src: int, dst: int, op: Op) -> Tuple[float, float]:
        return self.costs.p2p_s, self.costs.latency_s

    def data_parallel(self, rank: int, op: Op) -> float:
        if op.kind is OpKind.PARAM_SYNC:
            return self.costs.dp_gather_s
        return self.costs.dp_reduce_s
