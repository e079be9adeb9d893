"""Activation memory model: bytes one chunk-micro-batch keeps alive until its backward.

Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", arXiv
2205.05198, Table 2) count, per layer in 16-bit with dropout, s*b*h*(34 + 5*a*s/h) bytes without
recompute, 34*s*b*h with selective recompute and the layer input 2*s*b*h with full recompute. This
module states the same count term by term, for Megatron's *local* (non-fused) layer spec, with the
terms Korthikanti leaves out (norm statistics, fp32 softmax copies, masks, token ids, logits), so
that it can be checked against what the runtime measures (``runtime/memory.py``). The terms and
their sources (measured with ``SavedTensorMeter`` on CPU, fp32 and bf16, megatron-core 0.19.2,
``get_gpt_layer_local_spec``; s = sequence, b = micro-batch, h = hidden, a = heads, f = FFN hidden,
d = bytes per element of the compute dtype, t = TP, SP = sequence parallel):

Per transformer layer, in elements of the compute dtype:

====================================  ========  ==================================================
saved tensor                          elements  saved by
====================================  ========  ==================================================
input_layernorm input                 sbh       LayerNorm backward (the layer input)
linear_qkv input (norm output)        sbh       ColumnParallelLinear (weight grad)
q, k, v (one qkv storage)             3sbh/t    baddbmm (QK^T) and bmm (probs x V)
linear_proj input (context)           sbh/t     RowParallelLinear (weight grad)
pre_mlp_layernorm input               sbh       LayerNorm backward
linear_fc1 input (norm output)        sbh       ColumnParallelLinear
linear_fc1 output (GeLU input)        fsb/t     GeLU backward
GeLU output (linear_fc2 input)        fsb/t     RowParallelLinear
====================================  ========  ==================================================

= (4 + 3/t + 1/t) sbh + 2 fsb/t = 16 sbh at t = 1, f = 4h; the four replicated sbh terms are divided
by t too under SP (the column-parallel linears then save the sequence-sharded input). Korthikanti's
16-bit count is the same 32 sbh bytes plus 2 sbh bytes of hidden-dropout masks = 34 sbh.

Also per layer: LayerNorm mean and rstd, 2 x 2 x sb values (in the input dtype on CPU, fp32 on CUDA:
``norm_stat_bytes``); with ``hidden_dropout > 0`` two dropout masks of sbh elements (in the compute dtype
on CPU, measured; 1-byte bool masks with CUDA's ``native_dropout``: ``dropout_mask_bytes``); with RoPE
the rotated q and k (2sbh/t) and four cos/sin tables s*(h/a) (compute dtype); attention
scores a*s*s*b/t elements: the softmax output (fp32 when ``attention_softmax_in_fp32`` and 16-bit
compute: 4 bytes), plus the probabilities cast back to 16-bit for the bmm (d bytes; measured in bf16,
absent in fp32 where it is the same storage), plus with attention dropout the mask (``dropout_mask_bytes``) and the
dropped probabilities (d bytes) instead of the cast copy. Selective recompute removes exactly the
attention-score terms; the core-attention checkpoint keeps q, k, v, the mask and a 4-byte mask-type
tensor (ignored). Full recompute (``uniform``, one layer per checkpoint) keeps the layer input sbh
(/t under SP) per layer (and, with RoPE, the fp32 rotary table s*(h/a) once per chunk).

Per chunk: the attention mask s*s bytes (bool, local spec's explicit causal mask; 0 with
``attention_mask=False``, e.g. TE/flash causal kernels). First stage: token ids and position ids
(int64, b*s each; no position ids with RoPE) and, with dropout, the embedding-dropout mask (sbh elements).
Last stage: final layernorm input sbh + statistics 2sb + output-layer input sbh (elements of d; /t
under SP), the cross-entropy softmax s*b*vocab/t in fp32 (Megatron's vocab-parallel cross entropy
upcasts the logits) and its target mask (sb bytes, bool) and masked targets (sb int64), and the
fp32 loss mask (sb) that ``loss_func``'s masked sum saves (pipeline runs; the single-chunk check
calls the model directly and sums with the mask itself, which saves the same sb fp32 values).

Recomputation options (Megatron's, checked against its real switches in
``tests/planning/test_stock_memory.py`` within 0.1%): ``--recompute-modules`` ``core_attn`` frees the
score terms (and, with GQA on the local spec, the repeated k/v), ``mlp`` frees the fc1 and activation
outputs, ``layernorm`` the two norm outputs and their statistics (output-discarding checkpoints; not
measurable on CPU: megatron-core 0.19.2 needs Transformer Engine for them); ``--recompute-method
uniform --recompute-num-layers k`` keeps ceil(L/k) layer inputs per chunk, ``block`` k keeps min(k, L)
inputs and the other layers whole. :func:`transient_bytes` is what the recomputation re-creates inside
the backward (k layers for uniform, one for block/full, the modules of one layer for selective).

Layer specs: ``te`` (Transformer Engine: flash/fused attention keeps q, k, v, its output and an fp32
log-sum-exp a*s*b/t, no s*s terms, no mask), GQA (k and v of width h*g/a; the local spec copies q
and repeats k, v to a heads, measured), SwiGLU (fc1 output 2f + activation output f; 2f more unfused
on the local spec, measured), RoPE (the rotated q and k and the cos/sin tables, measured).

``output_bytes`` is the chunk output s*b*h*d (/t under SP) that the pipeline keeps after the forward
(not on the last stage); Megatron frees it after the send with ``--deallocate-pipeline-outputs``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from typing import Dict, FrozenSet, Iterable, Optional, Tuple

from ..schedule.levers import DEVICE, SELECTIVE_MODULES, Lever
from .defaults import MEMORY_MARGIN  # noqa: F401  (re-exported: the margin is declared in .defaults)


def selective_module_sets(layer_spec: str = "local") -> Tuple[Tuple[str, ...], ...]:
    """Every ``--recompute-modules`` set that acts on a dense layer of ``layer_spec``: the non-empty subsets of
    :data:`SELECTIVE_MODULES`, without ``layernorm`` on Transformer Engine's spec (its norms are fused into
    the following linear: nothing to recompute), in :data:`SELECTIVE_MODULES` order."""
    modules = spec_modules(layer_spec)
    return tuple(chosen for size in range(1, len(modules) + 1) for chosen in combinations(modules, size))


def spec_modules(layer_spec: str) -> Tuple[str, ...]:
    """The :data:`SELECTIVE_MODULES` a dense layer of ``layer_spec`` has as separate modules: Transformer Engine's
    spec fuses the norms into the following linear, so there is no ``layernorm`` to recompute."""
    return tuple(m for m in SELECTIVE_MODULES if not (layer_spec == "te" and m == "layernorm"))


def recomputable_modules(layer_spec: str, linear_bias: bool, transformer_engine: bool = False) -> FrozenSet[str]:
    """The :data:`SELECTIVE_MODULES` megatron-core 0.19.2 can recompute in a dense layer of this model and install.
    ``mlp`` only without linear biases: an MLP that returns its bias Parameter makes Megatron's CheckpointFunction
    re-enter its own backward without end (``runtime/recompute.py`` names the lines). ``layernorm`` only where the
    spec has it (:func:`spec_modules`) and only with Transformer Engine installed (``CheckpointWithoutOutput`` needs its FP8GlobalStateManager). PipeMesh's planner
    (:func:`.costs.planning_levels`) and the bench's stock rows (``bench/memory_fair.runnable_options``) both
    choose from these."""
    out = set(spec_modules(layer_spec))
    if linear_bias:
        out.discard("mlp")
    if not transformer_engine:
        out.discard("layernorm")
    return frozenset(out)


def selective_levels(layer_spec: str = "local") -> Tuple[Lever, ...]:
    """The levers (:meth:`Lever.selective`) of :func:`selective_module_sets`; 'selective' (core_attn) first."""
    return tuple(Lever.selective(chosen) for chosen in selective_module_sets(layer_spec))


def parse_level(level: str) -> Tuple[str, FrozenSet[str], int]:
    """(kind name, recomputed modules, layers) of a lever (:meth:`Lever.parse`), for callers of the tuple form."""
    lever = Lever.parse(level)
    return lever.kind.value, lever.modules, lever.layers


@dataclass(frozen=True)
class MoeShape:
    """A MoE layer's saved tensors, as the activation model needs them (:class:`.specs.MoeSpec`)."""

    fraction: float
    """The share of the layers that are MoE layers."""
    experts: int
    """Routed experts E."""
    topk: int
    """Experts per token k."""
    fc1: int
    """An expert's fc1 output width (2f with SwiGLU)."""
    ffn: int
    """An expert's activation (fc2 input) width f."""
    shared_fc1: int = 0
    """The shared experts' fc1 output width (0: none)."""
    shared_ffn: int = 0
    """The shared experts' activation width."""
    router_bytes: int = 4
    """Bytes of a router logit / probability."""
    routed_share: float = 1.0
    """Token-expert pairs computed per routed pair (the capacity factor when padded to capacity)."""


@dataclass(frozen=True)
class ActivationShape:
    """What the activation model needs to know about the model and its parallelism."""

    seq_length: int
    micro_batch_size: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    ffn_hidden_size: Optional[int] = None
    """Default 4 * hidden_size."""
    dtype_bytes: int = 2
    """Bytes per activation element in compute (2 for bf16/fp16, 4 for fp32)."""
    tp: int = 1
    sequence_parallel: bool = False
    attention_softmax_in_fp32: bool = True
    """Megatron's default; keeps the softmax output in fp32 under 16-bit compute."""
    norm_stat_bytes: Optional[int] = None
    """Bytes of LayerNorm mean/rstd values; None = the compute dtype (CPU); 4 on CUDA."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    dropout_mask_bytes: Optional[int] = None
    """Bytes per dropout-mask element; None = the compute dtype (torch's CPU dropout multiplies by a
    mask of the input dtype, measured); 1 for CUDA's ``native_dropout`` (bool mask)."""
    attention_mask: bool = True
    """An explicit s x s bool mask per micro-batch (local spec); False for causal kernels without one."""
    position_embedding: str = "learned_absolute"
    """``learned_absolute`` (int64 position ids saved on the first stage) or ``rope``."""
    layer_spec: str = "local"
    """``local`` (Megatron's ``get_gpt_layer_local_spec``: unfused attention keeps the a*s*s scores,
    softmax and dropout mask) or ``te`` (Transformer Engine: flash/fused attention keeps only its fp32
    log-sum-exp a*s*b, no s*s terms and no mask; norms fused into the following linear, so
    ``--recompute-modules layernorm`` has nothing to act on; fused SwiGLU)."""
    num_query_groups: Optional[int] = None
    """Key/value heads g for grouped-query attention [--num-query-groups]; None = a (multi-head)."""
    swiglu: bool = False
    """Gated SwiGLU MLP [--swiglu]: linear_fc1 outputs 2f (gate and up) and the activation f."""
    bias_activation_fusion: bool = False
    """[--bias-swiglu-fusion / --bias-gelu-fusion] With SwiGLU on the local spec, the fused kernel saves
    only its input (2f) and the product (f, the fc2 input); unfused, the chunk/silu/product chain saves
    2f more per layer (measured with megatron-core 0.19.2 on CPU). TE always fuses."""
    fp8: bool = False
    """Transformer Engine's FP8 linears [--fp8-format] save their inputs quantized: 1 byte per element of the two
    norm outputs, the context and the fc2 input."""
    gathered_kv: int = 1
    """Copies of the rank's keys and values the attention saves: CP with ``--cp-comm-type allgather`` saves every
    slice's (CP); 1 otherwise."""
    moe: Optional[MoeShape] = None
    """Mixture-of-experts layers (None: dense): a MoE layer keeps, per routed token-expert pair, the permuted input,
    the expert's fc1 and activation outputs and its output (which the combine's probability gradient needs), and per
    token the router's logits, probabilities and routing map; the shared experts as a dense MLP. Kept at every
    selective level (PipeMesh plans ``mlp`` recomputation for dense layers only)."""

    def __post_init__(self) -> None:
        if self.layer_spec not in ("local", "te"):
            raise ValueError(f"layer_spec {self.layer_spec!r}: use 'local' or 'te' (Transformer Engine)")
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ValueError(f"--num-query-groups {groups} must divide --num-attention-heads {self.num_attention_heads}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection: h * g / a."""
        groups = self.num_query_groups or self.num_attention_heads
        return self.hidden_size * groups // self.num_attention_heads


def _layer_terms(shape: ActivationShape) -> Dict[str, float]:
    """Bytes of one layer's saved tensors for one micro-batch, by the module that recomputation of
    it frees ('core_attn', 'layernorm', 'mlp') or 'kept' (held at every selective level)."""
    s, b, h, a, f = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.num_attention_heads, shape.ffn
    d, t = shape.dtype_bytes, shape.tp
    sp = t if shape.sequence_parallel else 1
    sbh, kv = s * b * h, s * b * shape.kv_width
    local = shape.layer_spec == "local"
    stat = d if shape.norm_stat_bytes is None else shape.norm_stat_bytes
    mask = shape.dropout_mask_bytes or d
    # The layer input and the attention-block output (norm inputs, checkpoint inputs of 'layernorm').
    kept = 2 * sbh / sp * d
    linear_in = 1 if shape.fp8 else d  # bytes of a linear layer's saved input
    if local and kv < sbh:
        # Local spec, GQA: a reshape copies q, k and v are repeated to a heads (all saved); recomputing
        # core_attn keeps the q copy and the q/k/v storage (h + 2kv) instead of the 3h it saved.
        kept += (2 * sbh + 2 * kv) / t * d + sbh / t * d
        gqa_repeat = (sbh - 2 * kv) / t * d
    else:
        # q, k, v storage (the gathered keys and values under CP's allgather); linear_proj input (context)
        kept += (sbh + 2 * kv * shape.gathered_kv) / t * d + sbh / t * linear_in
        gqa_repeat = 0.0
    if shape.hidden_dropout > 0:
        kept += 2 * sbh / sp * mask  # dropout masks after attention and after the MLP
    if shape.position_embedding == "rope":
        kept += (sbh + kv) / t * d + 4 * s * (h // a) * d  # rotated q and k; cos/sin of q and k
    norm = 2 * sbh / sp * linear_in + 2 * 2 * s * b / sp * stat  # the two norm outputs (linear inputs), mean/rstd
    if not local:
        kept, norm = kept + norm, 0.0  # TE fuses the norms into LayerNormLinear: nothing to recompute
    mlp = ((2 if shape.swiglu else 1) * f * d + f * linear_in) * s * b / t  # fc1 output, activation (fc2 input)
    if shape.swiglu and local and not shape.bias_activation_fusion:
        # The unfused glu (chunk, silu, product) saves 2f more than the fused kernel (measured: 5f in all).
        mlp += 2 * f * s * b / t * d
    moe = 0.0
    if shape.moe is not None:
        m, tokens = shape.moe, s * b / sp
        routed = tokens * m.topk * m.routed_share
        moe = (routed * (2 * h + m.fc1 + m.ffn) * d + tokens * m.experts * (2 * m.router_bytes + 1)
               + tokens * (m.shared_fc1 + m.shared_ffn) * d)
        mlp, moe = mlp * (1 - m.fraction), moe * m.fraction
    if local:
        scores = a * s * s * b / t
        softmax = 4 if (shape.attention_softmax_in_fp32 or d == 4) else d
        if shape.attention_dropout > 0:
            attn = scores * (softmax + mask + d)
        else:
            attn = scores * (softmax + (d if softmax != d else 0))
        attn += gqa_repeat
    else:
        attn = a * s * b / t * 4  # flash attention's fp32 log-sum-exp
    return {"kept": kept, "layernorm": norm, "mlp": mlp, "core_attn": attn, "moe": moe}


OFFLOAD_MODULES = ("qkv_linear", "core_attn", "attn_proj")
"""``--offload-modules`` that move a dense Transformer Engine layer's saved tensors to the host with
Megatron's ``--fine-grained-activation-offloading`` (megatron-core 0.19.2, which requires Transformer Engine,
``training/arguments.py:1854-1856``): ``attn_norm`` and ``mlp_norm`` act only where the norm is its own
module, and Transformer Engine fuses both norms into the following linear (IdentityOp,
``transformer_layer.py:1442-1449``); ``expert_fc1``/``moe_act``/``fused_group_mlp`` need MoE."""


def offloadable_layer_bytes(shape: ActivationShape) -> float:
    """Bytes of one layer's saved tensors, for one micro-batch, that fine-grained offloading of
    :data:`OFFLOAD_MODULES` moves to the host: what the offload groups save (saved-tensor hooks around
    each module, ``fine_grained_activation_offload.py``), tensors of at least 2**20 elements
    (``min_offloaded_tensor_size``): ``linear_qkv`` (Transformer Engine's LayerNormLinear keeps the layer
    input and the norm output), core attention (q, k, v) and ``linear_proj`` (the context). The MLP's
    tensors (its input, fc1 and activation outputs) and the dropout masks stay on the device."""
    if shape.layer_spec != "te":
        raise ValueError("fine-grained activation offloading needs Transformer Engine's layer spec "
                         "(megatron-core 0.19.2 asserts --transformer-impl transformer_engine)")
    s, b, h, d, t = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.dtype_bytes, shape.tp
    sp = t if shape.sequence_parallel else 1
    sbh, kv = s * b * h, s * b * shape.kv_width
    return 2 * sbh / sp * d + (sbh + 2 * kv) / t * d + sbh / t * d


def _hidden_bytes(shape: ActivationShape) -> float:
    """One hidden state sbh (/t under SP): a layer's input, all that a layer recomputed from it keeps, and a
    chunk's output."""
    sp = shape.tp if shape.sequence_parallel else 1
    return shape.seq_length * shape.micro_batch_size * shape.hidden_size / sp * shape.dtype_bytes


def layer_activation_bytes(shape: ActivationShape, level: str) -> float:
    """Bytes one transformer layer keeps for its backward, for one micro-batch, at ``level``
    ('none', a selective level, or 'full' = only the checkpointed layer input)."""
    lever = Lever.parse(level)
    if lever.per_chunk:
        raise ValueError(f"{level!r} is a per-chunk recompute level; use activation_bytes for a chunk")
    return lever.layer_bytes(_layer_terms(shape), _hidden_bytes(shape))


def transient_bytes(shape: ActivationShape, layers: int, level: str) -> float:
    """Bytes recomputation re-creates inside a chunk's backward on top of what the chunk kept
    (:meth:`Lever.transient_bytes`)."""
    return Lever.parse(level).transient_bytes(layers, _layer_terms(shape), _hidden_bytes(shape))


def activation_bytes(shape: ActivationShape, layers: int, level: str = DEVICE, first_stage: bool = False,
                     last_stage: bool = False) -> float:
    """Bytes one chunk of ``layers`` layers keeps alive for one micro-batch until its backward.

    Per-chunk levels: 'uniform:k' checkpoints the input of each group of k layers (ceil(L/k) inputs);
    'block:k' checkpoints the first min(k, L) layers one by one and keeps the others whole."""
    s, b, h, d = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.dtype_bytes
    sp = shape.tp if shape.sequence_parallel else 1
    lever = Lever.parse(level)
    total = lever.chunk_bytes(layers, _layer_terms(shape), _hidden_bytes(shape))
    if layers and shape.attention_mask and shape.layer_spec == "local":
        total += s * s
    if layers and lever.checkpoints_layers and shape.position_embedding == "rope":
        total += s * (h // shape.num_attention_heads) * 4  # the fp32 rotary embedding, a checkpoint input
    if first_stage:
        total += (2 if shape.position_embedding == "learned_absolute" else 1) * s * b * 8
        if shape.hidden_dropout > 0:
            total += s * b * h / sp * (shape.dropout_mask_bytes or d)  # embedding dropout mask
    if last_stage:
        stat = d if shape.norm_stat_bytes is None else shape.norm_stat_bytes
        total += 2 * s * b * h / sp * d + 2 * s * b / sp * stat
        total += s * b * shape.vocab_size / shape.tp * 4 + s * b * 1 + s * b * 8
        total += s * b * 4  # the fp32 loss mask saved by the masked sum of Megatron's GPT loss_func
    return total


def output_bytes(shape: ActivationShape, last_stage: bool = False) -> float:
    """The chunk output the pipeline holds after a forward (0 on the last stage: the loss)."""
    return 0.0 if last_stage else _hidden_bytes(shape)


def chunk_bytes(shape: ActivationShape, num_layers: int, pp: int, vpp: int, rank: int, chunk: int, level: str,
                keep_outputs: bool = False) -> float:
    """Bytes of chunk ``chunk`` on pipeline ``rank`` (stage chunk*pp + rank, Megatron's placement) for one
    micro-batch: activations at ``level``, plus the held output when ``keep_outputs``
    (no ``--deallocate-pipeline-outputs``)."""
    stages = pp * vpp
    if num_layers % stages:
        raise ValueError(f"{num_layers} layers do not split evenly over p*V = {stages} stages")
    stage = chunk * pp + rank
    first, last = stage == 0, stage == stages - 1
    total = activation_bytes(shape, num_layers // stages, level, first_stage=first, last_stage=last)
    if keep_outputs:
        total += output_bytes(shape, last_stage=last)
    return total


def host_block_bytes(nbytes: float) -> int:
    """Host memory one chunk-micro-batch placed on the host takes for ``nbytes`` of activations: one pinned
    block, rounded up to a power of two. Torch's caching host allocator rounds every pinned block that way
    (to index its free lists), so the runtime's pool (``runtime/offload.py``) asks for exactly this size, and
    the planner holds its host budget to these bytes, not the activations' (up to twice as many)."""
    size = math.ceil(nbytes)
    return 0 if size <= 0 else 1 << (size - 1).bit_length()
