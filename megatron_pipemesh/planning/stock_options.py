"""Stock Megatron's options for one (model, cluster, p, d, m), and the Megatron flags that select them.

What megatron-core 0.19.2 offers a dense GPT run, and what this module enumerates:

* schedule: no pipeline (p = 1: data parallel alone, ``forward_backward_no_pipelining``, every micro-batch's forward
  and backward in turn, the gradients reduced during or after the last backward as the command's
  --overlap-grad-reduce says), 1F1B (V = 1), or interleaved with V >= 2 virtual stages per rank for every V that
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
* Megatron's *default command* (:func:`.stock.default_stock`): what a user runs without a sweep, 1F1B and the
  interleaved schedule with the default group size g = p at every V, each with the first of none, selective,
  full block recomputation of the fewest layers that fits, no offloading; the best of those;
* sharding (on request, :data:`STOCK_SHARDING`): one level for every chunk, the uniform levels Megatron
  offers: ``optim`` = ``--use-distributed-optimizer`` (ZeRO-1, Megatron's DDP buffers), and through
  Megatron-FSDP ``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads`` (ZeRO-2) or
  ``optim_grads_params`` (ZeRO-3), GPU only (:class:`.stock_memory.MegatronFsdpSharding` says how they are modelled).

Megatron's ``num_microbatches_with_partial_activation_checkpoints`` is read by no layer in
megatron-core 0.19.2, so stock has no per-micro-batch recomputation and none is offered here.

Each setting is a frozen dataclass whose ``flags()`` are the exact Megatron flags (:func:`stock_flags`, the one
rendering: a setting alone, or a whole row of ``pipemesh plan --megatron-args`` with its TP and layer split).
:mod:`.stock_memory` models what each holds; :mod:`.stock` predicts and searches them.

Pure: no torch, no processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..schedule.config import ScheduleConfig
from ..schedule.levers import DEVICE, Lever
from ..schedule.spans import OPTIM, SHARD_LEVELS
from .layout import VPP_FLAGS, LayerSplit
from .memory import OFFLOAD_MODULES, selective_module_sets

TP_FLAG = "--tensor-model-parallel-size"
CP_FLAG = "--context-parallel-size"
EP_FLAG = "--expert-model-parallel-size"
ETP_FLAG = "--expert-tensor-parallel-size"
PP_FLAG = "--pipeline-model-parallel-size"
VPP_FLAG = VPP_FLAGS[0]
GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"
BF16_REDUCE_FLAG = "--grad-reduce-in-bf16"

STOCK_SHARDING = SHARD_LEVELS
"""The uniform sharding levels stock Megatron offers: the distributed optimizer (ZeRO-1) and
Megatron-FSDP's ZeRO-2 / ZeRO-3 (``--data-parallel-sharding-strategy``)."""


def sharding_flags(level: Optional[str]) -> List[str]:
    """Megatron's flags for a uniform sharding ``level`` (None: none given, whatever the run uses).

    Megatron-FSDP makes ``--use-distributed-optimizer`` implicit (``training/arguments.py:1106-1112``)
    and requires ``--ckpt-format fsdp_dtensor`` (``:1146``)."""
    if level is None:
        return []
    if level == OPTIM:
        return ["--use-distributed-optimizer"]
    if level not in STOCK_SHARDING:
        raise ValueError(f"stock sharding level {level!r}: use one of {', '.join(STOCK_SHARDING)}, "
                         f"e.g. --data-parallel-sharding-strategy optim_grads")
    return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", level, "--ckpt-format", "fsdp_dtensor"]


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
    link carrying every copy in one direction back to back (:meth:`.stock_memory.OffloadModel.busy_s`)."""

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
        """'no_pipeline' (p = 1: Megatron's ``forward_backward_no_pipelining``), '1f1b' or 'interleaved'."""
        return "no_pipeline" if self.pp == 1 else "1f1b" if self.vpp == 1 else "interleaved"

    @property
    def effective_group_size(self) -> Optional[int]:
        return None if self.vpp == 1 else (self.group_size or self.pp)

    def config(self) -> ScheduleConfig:
        """The same schedule in PipeMesh notation (uniform groups of g; groups are irrelevant at V = 1)."""
        if self.vpp == 1:
            return ScheduleConfig.depth_first(self.pp, 1, self.microbatches)
        return ScheduleConfig.uniform(self.pp, self.vpp, self.microbatches, self.effective_group_size)

    def flags(self) -> List[str]:
        """The setting's own Megatron flags (:func:`stock_flags`)."""
        return stock_flags(self)

    def describe(self) -> str:
        sched = ("no pipeline" if self.pp == 1 else "1F1B" if self.vpp == 1
                 else f"interleaved V={self.vpp} g={self.effective_group_size}")
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
    for vpp in split.virtual_sizes(num_layers, pp) if pp > 1 else [1]:  # no pipeline: no virtual stages
        out += [(1, None)] if vpp == 1 else [(vpp, g) for g in group_sizes(pp, microbatches)]
    return out

def default_recompute_ladder(layers_per_chunk: int) -> List[StockRecompute]:
    """The recomputation a Megatron user reaches for, cheapest first: none, ``--recompute-granularity selective``
    (Megatron's default modules, ``core_attn``), then full block recomputation of k = 1, 2, ... layers per chunk."""
    return ([StockRecompute(), StockRecompute("selective")]
            + [StockRecompute("full", method="block", num_layers=k) for k in range(1, layers_per_chunk + 1)])



def vpp_flags(vpp: int, split: Optional[LayerSplit] = None) -> List[str]:
    """V's flag: none at V = 1, none with a layout (its stages set V; Megatron refuses both), else the stage count."""
    if vpp == 1 or (split is not None and split.layout is not None):
        return []
    return [VPP_FLAG, str(vpp)]


def parallel_flags(tp: int, cp: int = 1, ep: int = 1, etp: Optional[int] = None) -> List[str]:
    """A row's TP (always written), CP and EP (written where they are not 1) and ETP (written where it is not TP)
    flags."""
    return ([TP_FLAG, str(tp)] + ([CP_FLAG, str(cp)] if cp > 1 else []) + ([EP_FLAG, str(ep)] if ep > 1 else [])
            + ([ETP_FLAG, str(etp)] if etp is not None and etp != tp else []))


def stock_flags(setting: StockSetting, tp: Optional[int] = None, split: Optional[LayerSplit] = None,
                cp: int = 1, ep: int = 1, etp: Optional[int] = None) -> List[str]:
    """Megatron's flags of a stock ``setting``: PP, V, the group size (interleaved only), recomputation, offloading,
    bf16 reduce (when the setting has it, i.e. the user asked) and the sharding level.

    With the run's ``tp`` (and ``cp``) and layer ``split`` (a row of ``pipemesh plan --megatron-args``): TP first, the
    group size
    only where it is not Megatron's default p (so that a row that changes nothing reads as the user's command), no V
    where a layout sets it, and the split's flags last."""
    command = tp is not None
    out = (parallel_flags(tp, cp, ep, etp) if command else []) + [PP_FLAG, str(setting.pp)] + vpp_flags(setting.vpp, split)
    if setting.vpp > 1 and not (command and setting.effective_group_size == setting.pp):
        out += [GROUP_FLAG, str(setting.effective_group_size)]
    out += setting.recompute.flags()
    if setting.offload is not None:
        out += setting.offload.flags()
    if setting.grad_reduce_in_bf16:
        out.append(BF16_REDUCE_FLAG)
    return out + sharding_flags(setting.sharding) + (split.flags() if split is not None else [])
