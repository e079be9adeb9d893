"""The model and the cluster the costs are priced for (:mod:`.costs`): :class:`ModelSpec` (a GPT's shape, read from
Megatron's flags) and :class:`ClusterSpec` (devices and links).

Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .defaults import DEFAULT_HOST_LINK_GBPS, MFU
from .layout import LayerSplit

GB = 1024 ** 3


REDUCE_SCATTER_STEPS = {"nccl": 1, "gloo": 2}
"""Ring passes of a reduce-scatter over n ranks, each moving (n-1)/n of the payload per rank. NCCL's ring
reduce-scatter is one pass. torch's gloo backend has no reduce-scatter of its own: ``reduce_scatter_tensor``
all-reduces the whole buffer and keeps this rank's shard (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``),
so it costs an all-reduce, two passes (measured: 8 MB over 2 ranks at 80 Mbit/s each, 0.84 s for both)."""


CP_COMM_TYPES = ("p2p", "a2a", "allgather")
"""The --cp-comm-type values the costs price (``a2a+p2p``, hierarchical, is not priced)."""


def reduce_scatter_steps(cluster: "ClusterSpec") -> int:
    """Ring passes of one reduce-scatter on ``cluster``'s collectives (:data:`REDUCE_SCATTER_STEPS`)."""
    return REDUCE_SCATTER_STEPS[cluster.collectives]



MOE_DISPATCHERS = ("alltoall", "allgather", "flex")
"""Megatron's token dispatchers (``flex``, DeepEP/HybridEP, is priced as ``alltoall``)."""


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts layers of a GPT (Megatron argument names in brackets)."""

    num_experts: int
    """Routed experts per MoE layer E [--num-experts]."""
    topk: int = 2
    """Experts each token is routed to k [--moe-router-topk]."""
    ffn_hidden_size: Optional[int] = None
    """An expert's MLP width [--moe-ffn-hidden-size]; None: the model's FFN."""
    shared_ffn: int = 0
    """The shared experts' total MLP width [--moe-shared-expert-intermediate-size]; 0: none."""
    shared_gate: bool = False
    """A gate on the shared experts [--moe-shared-expert-gate]."""
    pattern: Tuple[int, ...] = ()
    """1 for a MoE layer, 0 for a dense one, per layer [--moe-layer-freq]; (): every layer."""
    dispatcher: str = "alltoall"
    """How tokens reach their experts [--moe-token-dispatcher-type]: ``alltoall`` (the routed tokens' hidden states to
    their expert's rank and back), ``allgather`` (every rank's tokens to every rank, the outputs reduce-scattered),
    ``flex`` (priced as all-to-all)."""
    capacity_factor: Optional[float] = None
    """[--moe-expert-capacity-factor] Tokens above capacity x k x T / E per expert are dropped; None: none dropped."""
    pad_to_capacity: bool = False
    """[--moe-pad-expert-input-to-capacity] Every expert computes its full capacity."""
    router_fp32: bool = False
    """[--moe-router-dtype fp32] The router's logits and probabilities in fp32."""

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"--num-experts {self.num_experts} with --moe-router-topk {self.topk}: need 1 <= k <= E")
        if self.dispatcher not in MOE_DISPATCHERS:
            raise ValueError(f"--moe-token-dispatcher-type {self.dispatcher}: one of {', '.join(MOE_DISPATCHERS)}")

    def moe_fraction(self, num_layers: int) -> float:
        """The share of the model's layers that are MoE layers."""
        return sum(self.pattern) / len(self.pattern) if self.pattern else 1.0

    @property
    def routed_share(self) -> float:
        """Token-expert pairs an expert computes per routed pair: the capacity factor with padding to capacity (every
        expert computes cf x k x T / E rows), else 1 (balanced routing: the aux loss keeps the experts even; dropped
        tokens are not subtracted)."""
        return self.capacity_factor if self.pad_to_capacity and self.capacity_factor else 1.0


@dataclass(frozen=True)
class ModelSpec:
    """GPT model shape (Megatron argument names in brackets)."""

    num_layers: int = 24
    """Transformer layers [--num-layers], placed on the p*V stages by ``layer_split``."""
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
    """Bytes per gradient element in the data-parallel reduction (Megatron keeps fp32 main grads;
    2 with --grad-reduce-in-bf16)."""
    hidden_dropout: float = 0.1
    """Megatron's --hidden-dropout (dropout masks are kept for the backward)."""
    attention_dropout: float = 0.1
    """Megatron's --attention-dropout."""
    dropout_mask_bytes: Optional[int] = 1
    """Bytes per dropout-mask element: 1 with CUDA's ``native_dropout`` (bool mask); None = the compute dtype,
    as on CPU, where ``torch.dropout`` keeps its scaled noise tensor."""
    layer_spec: str = "local"
    """Layer implementation: 'local' (get_gpt_layer_local_spec, unfused attention with s*s scores) or
    'te' (Transformer Engine, --transformer-impl transformer_engine: flash/fused attention, fused norms)."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention [--group-query-attention --num-query-groups]; None = a."""
    swiglu: bool = False
    """Gated SwiGLU MLP [--swiglu]: fc1 is h x 2f."""
    bias_activation_fusion: bool = False
    """Fused bias+activation kernel [--bias-swiglu-fusion / --bias-gelu-fusion]; matters for the local
    spec's SwiGLU (the unfused product saves silu(gate) too)."""
    position_embedding: str = "learned_absolute"
    """[--position-embedding-type] 'learned_absolute' (an s x h table, int64 position ids) or 'rope'."""
    linear_bias: bool = True
    """Linear layers with biases (Megatron's default; False with --disable-bias-linear). Bias parameters are
    counted either way (they are small); with biases the MLP cannot be recomputed per module."""
    normalization: str = "LayerNorm"
    """[--normalization] 'LayerNorm' (a weight and a bias per norm) or 'RMSNorm' (a weight)."""
    max_position_embeddings: Optional[int] = None
    """Rows of the learned position table [--max-position-embeddings]; None: the sequence length."""
    fp8: bool = False
    """The linear layers' GEMMs run in FP8 through Transformer Engine [--fp8-format]: at the device's FP8 rate
    (:attr:`ClusterSpec.fp8_tflops`), their saved inputs kept in 1 byte."""
    tied_embeddings: bool = True
    """The output layer shares the word embedding (Megatron's default; False with
    --untie-embeddings-and-output-weights): with pipeline parallelism the last stage holds a copy whose
    gradient is all-reduced with stage 0's after the backward."""
    layer_split: LayerSplit = LayerSplit()
    """Which stage holds which layers [--pipeline-model-parallel-layout, --decoder-first/last-pipeline-num-layers,
    --account-for-embedding/loss-in-pipeline-split]; default: evenly."""
    moe: Optional[MoeSpec] = None
    """Mixture-of-experts layers [--num-experts ...]; None: a dense GPT. The per-layer terms below are averages over
    the model's layers (a chunk is priced with the model's share of MoE layers)."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def stage_layers(self, pp: int, vpp: int) -> Tuple[int, ...]:
        """Transformer layers of every stage s = c*p + r on p x V stages (:meth:`.layout.LayerSplit.stage_layers`:
        a LayoutError names the flag where Megatron would refuse the split)."""
        return self.layer_split.stage_layers(self.num_layers, pp, vpp)

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection: h * g / a."""
        return self.hidden_size * (self.num_query_groups or self.num_attention_heads) // self.num_attention_heads

    @property
    def fc1_width(self) -> int:
        return (2 if self.swiglu else 1) * self.ffn

    def _bias(self, width: int) -> int:
        return width if self.linear_bias else 0

    def attention_params(self) -> int:
        """QKV and output projections (and their biases)."""
        h, kv = self.hidden_size, self.kv_width
        return h * (h + 2 * kv) + h * h + self._bias(h + 2 * kv) + self._bias(h)

    def mlp_params(self, width: int) -> int:
        """An MLP of ``width`` (fc1 of 2 x width with SwiGLU, fc2; their biases)."""
        fc1 = (2 if self.swiglu else 1) * width
        return self.hidden_size * fc1 + width * self.hidden_size + self._bias(fc1) + self._bias(self.hidden_size)

    @property
    def moe_fraction(self) -> float:
        """The share of layers that are MoE layers (0 for a dense GPT)."""
        return self.moe.moe_fraction(self.num_layers) if self.moe is not None else 0.0

    @property
    def expert_ffn(self) -> int:
        return (self.moe.ffn_hidden_size or self.ffn) if self.moe is not None else 0

    def dense_layer_params(self) -> float:
        """Parameters of a layer held by every expert-parallel rank (split over TP): attention, norms, the dense MLP of
        a dense layer, the router, shared experts and their gate of a MoE layer; averaged over the layers."""
        base = self.attention_params() + 2 * self.norm_params()
        if self.moe is None:
            return base + self.mlp_params(self.ffn)
        f, m = self.moe_fraction, self.moe
        moe = self.hidden_size * m.num_experts + self._bias(m.num_experts) + (
            self.mlp_params(m.shared_ffn) if m.shared_ffn else 0) + (
            self.hidden_size if m.shared_ffn and m.shared_gate else 0)
        return base + (1 - f) * self.mlp_params(self.ffn) + f * moe

    def expert_layer_params(self) -> float:
        """Routed experts' parameters of a layer (split over EP x ETP), averaged over the layers."""
        if self.moe is None:
            return 0.0
        return self.moe_fraction * self.moe.num_experts * self.mlp_params(self.expert_ffn)

    def layer_params(self) -> float:
        """All parameters of a layer (averaged over the layers of a MoE GPT)."""
        return self.dense_layer_params() + self.expert_layer_params()

    def device_layer_params(self, cluster: "ClusterSpec") -> float:
        """A layer's parameters one device holds on ``cluster``: the dense ones over TP, the routed experts over
        EP x ETP."""
        return self.dense_layer_params() / cluster.tp + self.expert_layer_params() / (cluster.ep * cluster.expert_tp)

    def norm_params(self) -> int:
        """Parameters of one norm: a weight and a bias (LayerNorm), a weight (RMSNorm)."""
        return self.hidden_size * (1 if self.normalization == "RMSNorm" else 2)

    def layer_forward_flops(self) -> float:
        """Forward FLOPs of one layer for one micro-batch (2 per multiply-add; a MoE GPT's averaged over its layers)."""
        s, b, h = self.seq_length, self.micro_batch_size, self.hidden_size
        return (2 * b * s * h * (h + 2 * self.kv_width) + 2 * b * s * h * h + 4 * b * s * s * h
                + self.mlp_forward_flops() + self.moe_forward_flops())

    def _mlp_flops(self, width: int, tokens: float) -> float:
        return 2 * tokens * self.hidden_size * ((2 if self.swiglu else 1) * width + width)

    def mlp_forward_flops(self) -> float:
        """The dense MLPs' forward FLOPs per layer (the dense layers' share of a MoE GPT)."""
        return (1 - self.moe_fraction) * self._mlp_flops(self.ffn, self.seq_length * self.micro_batch_size)

    def moe_forward_flops(self) -> float:
        """A MoE layer's router, routed experts (each token through k experts) and shared experts, forward FLOPs per
        layer (times the MoE layers' share)."""
        if self.moe is None:
            return 0.0
        m, tokens = self.moe, self.seq_length * self.micro_batch_size
        flops = 2 * tokens * self.hidden_size * m.num_experts + m.routed_share * self._mlp_flops(
            self.expert_ffn, tokens * m.topk) + (self._mlp_flops(m.shared_ffn, tokens) if m.shared_ffn else 0.0)
        return self.moe_fraction * flops

    def embedding_params(self) -> int:
        rows = self.max_position_embeddings or self.seq_length
        position = rows * self.hidden_size if self.position_embedding == "learned_absolute" else 0
        return self.vocab_size * self.hidden_size + position



@dataclass(frozen=True)
class ClusterSpec:
    """Devices and links."""

    tp: int = 1
    """Tensor-parallel size."""
    dp: int = 1
    """Data-parallel size d (the replicas the global batch is split over)."""
    cp: int = 1
    """Context-parallel size [--context-parallel-size]: each rank of a CP group runs a 1/CP slice of every sequence
    (Megatron's rank order tp-cp-dp-pp: a CP group is CP consecutive blocks of TP ranks); gradients are reduced and
    the distributed optimizer sharded over DP x CP (:attr:`dp_cp`)."""
    cp_comm: str = "p2p"
    """How the attention's keys and values cross the CP group [--cp-comm-type]: ``p2p`` (a ring, each step's transfer
    under the previous step's attention), ``a2a`` (all-to-all of q, k, v and the output, exposed) or ``allgather``
    (the keys and values gathered before the attention, their gradients reduce-scattered, exposed)."""
    fp8_tflops: Optional[float] = None
    """Dense FP8 peak TFLOP/s of one device (the linear layers' rate with :attr:`ModelSpec.fp8`); None: no FP8."""
    ep: int = 1
    """Expert-parallel size [--expert-model-parallel-size]: a MoE layer's experts split over EP ranks (Megatron's expert
    rank order etp-ep-edp-pp: an EP group is EP consecutive blocks of ETP ranks), tokens exchanged by the dispatcher."""
    etp: Optional[int] = None
    """Expert tensor-parallel size [--expert-tensor-parallel-size]; None: TP."""
    alltoall_intra_gbps: Optional[float] = None
    """An all-to-all's rate among a node's devices, bytes leaving a device (Gbit/s), as a profile measured it; None:
    the intra-node link's rate."""
    device_tflops: float = 312.0
    """Peak dense TFLOP/s of one device in the compute dtype."""
    mfu: float = MFU
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
    overlap_grad_reduce: bool = True
    """[--overlap-grad-reduce] each chunk's gradients reduce during the backward, once its last backward ran; False:
    Megatron's ``finalize_model_grads`` reduces them all after the last backward, exposed."""
    overlap_param_gather: bool = True
    """[--overlap-param-gather] with the distributed optimizer, each chunk's parameters gather before its first
    forward; False: the optimizer step gathers them, exposed."""
    memory_gbs: float = 1500.0
    """Device memory bandwidth (GB/s): memory-bound work (norm recomputation, the optimizer step)."""
    devices_per_node: int = 8
    """Devices sharing one node's NIC (Megatron's rank order: TP fastest, then DP, then PP)."""
    nic_gbps: Optional[float] = None
    """Bandwidth of one node's network interface per direction (Gbit/s), shared max-min fairly by every
    data-parallel ring, pipeline link and embedding all-reduce that leaves (enters) the node, a lone transfer
    getting all of it; ``dp_gbps`` / ``p2p_gbps`` then play no part in them. None = no shared NIC: each
    pipeline link runs at ``p2p_gbps`` and each rank's data-parallel ring at ``dp_gbps``, on links of their own."""
    optimizer_step: bool = True
    """Count the optimizer step (Adam, memory-bound: ~36 bytes moved per local parameter)."""
    host_link_gbps: float = DEFAULT_HOST_LINK_GBPS
    """Device-host copy bandwidth of one device per direction (Gbit/s): offloaded activations."""
    intra_node_gbps: Optional[float] = None
    """Per-device bandwidth of a data-parallel ring, pipeline link or tensor-parallel group that stays inside
    one node (PCIe or NVLink, Gbit/s), shared by the transfers of a device; None = the same as ``dp_gbps`` /
    ``p2p_gbps`` (one rate everywhere; tensor parallelism at ``dp_gbps``)."""
    nic_via_host: bool = False
    """Network traffic is staged through host memory (no GPUDirect RDMA, as on commodity clouds): every
    transfer over the NIC also crosses the sending device's host link device-to-host and the receiving
    device's host-to-device, shared with its activation copies."""
    host_copies_on_compute: bool = False
    """Activation copies to and from the host run on the rank's compute stream (CPU ranks: the runtime's copy is a
    memcpy on the rank's own thread), so an OFFLOAD / RELOAD holds up the rank's compute for its whole duration;
    False: they run on copy streams of their own (CUDA), overlapping compute."""
    collectives: str = "nccl"
    """Library of the data-parallel collectives, which decides what a reduce-scatter costs
    (:func:`reduce_scatter_steps`): ``nccl`` (GPUs) or ``gloo`` (CPU ranks)."""
    shared_cores: Optional[int] = None
    """Every rank runs on one host with this many CPU cores, one thread each, and the cores go fairly to the ranks
    computing at the moment (the OS's processor sharing: a rank waiting in a pipeline bubble lends its core), so a
    compute op (and a host copy on the compute stream) runs at min(1, cores / ranks computing) of its one-core speed
    (:mod:`.topology`'s ``cpu`` resources). The bench's emulated cluster when its ranks outnumber the cores; None:
    every rank computes on a device of its own, at its full speed."""
    pinned_cores: bool = False
    """With ``shared_cores``: the ranks of pipeline rank r are pinned to core r % ``shared_cores`` (``pipemesh bench
    --pin-cores``), so they share that core only, with the other pipeline ranks pinned there."""
    nic_burst_bytes: float = 0.0
    """Bytes each NIC direction passes at once after it idles: a token bucket's burst (the bench's emulated NICs, tc
    tbf: 256 KiB), refilled at the NIC's rate while it carries nothing (:class:`.network.FairShareNetwork`). 0: a NIC
    at line rate, as real ones are."""

    @property
    def dp_cp(self) -> int:
        """Ranks a gradient is reduced over, and the distributed optimizer shards over: DP x CP."""
        return self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: the ranks an expert's gradient is reduced (and its optimizer state sharded) over,
        TP x CP x DP / (EP x ETP)."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    def __post_init__(self):
        if self.cp_comm not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm {self.cp_comm!r} is not one of {', '.join(CP_COMM_TYPES)}")
        if (self.tp * self.cp * self.dp) % (self.ep * self.expert_tp):
            raise ValueError(f"ep={self.ep} x etp={self.expert_tp} must divide a stage's TP x CP x DP = "
                             f"{self.tp * self.cp * self.dp} ranks (Megatron's expert grid)")
        if int(self.cp) != self.cp or self.cp < 1:
            raise ValueError(f"cp={self.cp!r} is invalid: the context-parallel size, a whole number >= 1")
        if self.collectives not in REDUCE_SCATTER_STEPS:
            raise ValueError(f"collectives {self.collectives!r} is not one of {', '.join(REDUCE_SCATTER_STEPS)}")
        if self.shared_cores is not None and (int(self.shared_cores) != self.shared_cores or self.shared_cores < 1):
            raise ValueError(f"shared_cores={self.shared_cores!r} is invalid: the CPU cores the ranks share, a whole "
                             "number >= 1 (None: every rank computes on a device of its own)")
        if self.pinned_cores and self.shared_cores is None:
            raise ValueError("pinned_cores=True needs shared_cores: the cores the pipeline ranks are pinned to")
        if not self.nic_burst_bytes >= 0:
            raise ValueError(f"nic_burst_bytes={self.nic_burst_bytes!r} is invalid: bytes >= 0 (0: no burst)")
