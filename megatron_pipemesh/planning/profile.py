"""A measured profile (``pipemesh profile``, ``--pipemesh-profile``): its file format, whether it matches a command,
and the planner's costs with its measured times and bytes in place of the analytic ones.

One JSON object (:data:`SCHEMA_VERSION`): the device and versions it was measured with, the model shape, one
:class:`ComputePoint` per (TP, micro-batch size) measured (one transformer layer's forward and backward, the extra
backward of each recompute level, the embedding, the output layer with the loss, and the bytes each keeps for the
backward), the optimizer step per parameter, the host link where measured, the network where several ranks measured
it (:class:`NetworkProfile`: the NIC and intra-node rates the planner uses, with every timed point), and the per-op
times a training run measured (``--pipemesh-measure-iters``: :attr:`Profile.run_times`). Files written before the
format had a version (the flat per-op times of a run) still read: they are a profile with :attr:`Profile.run_times`
only; files of this version written before the network was measured read with :attr:`Profile.network` None.

:func:`apply_profile` is called by :func:`.clusters.costs_for` only: the costs are built in one place.

Pure: no torch.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .costs import ClusterSpec, ModelSpec, OpCosts
from .profile_network import LinkRate, NetworkProfile
from .profile_quality import LoadRecord, MachinePace, Spread

SCHEMA_VERSION = 3
"""Version of the file format (a flat file of per-op times, the format before these, has none)."""
READ_VERSIONS = (2, SCHEMA_VERSION)
"""Versions this pipemesh reads (2: before the pieces' spreads and the load record, which read as None)."""

RUN_TIME_FIELDS = ("forward_s", "backward_s", "first_stage_extra_s", "last_stage_extra_s", "p2p_s", "dp_reduce_s",
                   "dp_gather_s")
"""The per-op times a training run measures (``--pipemesh-measure-iters``)."""

class ProfileError(ValueError):
    """A profile file that cannot be read, or one that does not match the command it is used with."""


@dataclass(frozen=True)
class ModelShape:
    """What a profile's measurements depend on of the model (Megatron argument names in brackets)."""

    hidden_size: int
    """[--hidden-size]"""
    num_attention_heads: int
    """[--num-attention-heads]"""
    ffn_hidden_size: int
    """[--ffn-hidden-size] (4h by default)."""
    seq_length: int
    """[--seq-length]"""
    vocab_size: int
    """The padded vocabulary (embedding and output layer)."""
    num_layers: int
    """[--num-layers] of the command profiled (informative: the profile is per layer)."""
    dtype: str
    """'bf16', 'fp16' or 'fp32' [--bf16 / --fp16]."""
    layer_spec: str
    """'local' or 'te' [--transformer-impl]."""
    num_query_groups: Optional[int] = None
    """[--num-query-groups] with --group-query-attention; None: one per head."""
    swiglu: bool = False
    """[--swiglu]"""
    position_embedding: str = "learned_absolute"
    """[--position-embedding-type]"""
    moe: str = ""
    """The MoE layers [--num-experts, --moe-router-topk, --moe-ffn-hidden-size, --moe-shared-expert-intermediate-size,
    --moe-layer-freq] in words ('': dense)."""

    MATCHED = ("hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "vocab_size", "layer_spec",
               "num_query_groups", "swiglu", "position_embedding", "moe")
    """The fields a command must share with the profile (the layer count and micro-batch size may differ)."""


WORDS = {"hidden_size": "hidden", "num_attention_heads": "heads", "ffn_hidden_size": "ffn hidden",
         "seq_length": "sequence length", "vocab_size": "padded vocabulary", "layer_spec": "layer spec",
         "num_query_groups": "query groups", "swiglu": "swiglu", "position_embedding": "position embedding",
         "dtype": "dtype", "moe": "MoE layers"}


def dtype_name(args) -> str:
    """'bf16', 'fp16' or 'fp32': the compute dtype of Megatron's ``args``."""
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"


def shape_of(model: ModelSpec, dtype: str) -> ModelShape:
    """The shape of ``model`` computed in ``dtype`` ('bf16', 'fp16', 'fp32')."""
    return ModelShape(hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
                      ffn_hidden_size=model.ffn, seq_length=model.seq_length, vocab_size=model.vocab_size,
                      num_layers=model.num_layers, dtype=dtype, layer_spec=model.layer_spec,
                      num_query_groups=model.num_query_groups, swiglu=model.swiglu,
                      position_embedding=model.position_embedding, moe=moe_words(model))


def moe_words(model: ModelSpec) -> str:
    """A MoE model's layers in words ('' for a dense model)."""
    m = model.moe
    if m is None:
        return ""
    words = f"{m.num_experts} experts top-{m.topk} ffn {model.expert_ffn}"
    if m.shared_ffn:
        words += f" shared {m.shared_ffn}"
    if m.pattern:
        words += f" in {sum(m.pattern)} of {len(m.pattern)} layers"
    return words


@dataclass(frozen=True)
class ComputePoint:
    """What one transformer layer, the embedding and the output layer cost at one (TP, micro-batch size)."""

    tp: int
    """Tensor-parallel size measured at."""
    micro_batch_size: int
    """Micro-batch size measured at."""
    layer_forward_s: float
    """One transformer layer's forward, seconds."""
    layer_backward_s: float
    """Its backward (no recomputation), seconds."""
    recompute_extra_s: Dict[str, float]
    """Extra backward seconds of each recompute level (:class:`..schedule.levers.Lever` names) over none."""
    layer_activation_bytes: Dict[str, float]
    """Bytes one layer keeps for its backward, per recompute level."""
    embedding_forward_s: float
    """The embedding's forward (word and position tables), seconds."""
    embedding_backward_s: float
    """Its backward, seconds."""
    embedding_activation_bytes: float
    """Bytes it keeps for the backward."""
    output_forward_s: float
    """Final norm, output layer and loss, forward, seconds."""
    output_backward_s: float
    """Their backward, seconds."""
    output_activation_bytes: float
    """Bytes they keep for the backward."""
    batch_s: Optional[float] = None
    """What the first and the last pipeline stage spend per micro-batch taking the batch from the command's data
    loader onto the device (the training entry's ``get_batch``), seconds; None: not measured."""
    step_forward_s: Optional[Dict[str, float]] = None
    """Per :data:`.costs.STAGE_KINDS`: what Megatron's schedule step (its ``forward_step`` around the training
    entry's) spends per chunk-micro-batch beyond the layers, the embedding and the output layer with the loss,
    seconds; None: not measured."""
    step_backward_s: Optional[Dict[str, float]] = None
    """The same for its ``backward_step``."""
    spread: Optional[Dict[str, Spread]] = None
    """The samples behind each time above, by field name ('layer_forward_s', 'recompute_extra_s:full', ...);
    None: an older file."""


@dataclass(frozen=True)
class Profile:
    """A measured profile (the file :func:`load` reads and :meth:`to_json` writes)."""

    device_kind: str = ""
    """'cpu' or 'cuda' ('' in a file of run times only)."""
    device_name: str = ""
    """The device's name (CPU model, GPU name)."""
    torch_version: str = ""
    megatron_core_version: str = ""
    shape: Optional[ModelShape] = None
    """The model measured (None in an older file)."""
    compute: Tuple[ComputePoint, ...] = ()
    """One point per (TP, micro-batch size) measured."""
    optimizer_s_per_param: Optional[float] = None
    """Seconds per local parameter of Megatron's optimizer each iteration: zeroing the gradients and its step()."""
    host_link_gbps: Optional[float] = None
    """Pinned device-host copy rate, Gbit/s per direction (CUDA only; None: not measured)."""
    network: Optional[NetworkProfile] = None
    """The links between ranks, where several ranks measured them (None: one process, or an older file)."""
    method: Dict[str, object] = field(default_factory=dict)
    """How it was measured (timer, threads, warm-up, repeats)."""
    notes: Tuple[str, ...] = ()
    """What was not measured and why (TP > 1 needs CUDA; the NIC needs ranks on two or more nodes)."""
    run_times: Optional[Dict[str, float]] = None
    """Per-op times a training run measured (:data:`RUN_TIME_FIELDS`), or None."""
    load: Optional[LoadRecord] = None
    """What else computed on the machine while the compute was timed (CPU); None: not recorded."""
    pace: Optional[MachinePace] = None
    """The machine's own pace its compute and optimizer times are given at (CPU); None: CUDA or an older file."""
    schema_version: int = SCHEMA_VERSION

    def point(self, tp: int, micro_batch_size: int) -> Optional[ComputePoint]:
        """The measurements at ``tp`` and ``micro_batch_size``, or None."""
        for point in self.compute:
            if point.tp == tp and point.micro_batch_size == micro_batch_size:
                return point
        return None

    def nearest(self, tp: int, micro_batch_size: int) -> Optional[ComputePoint]:
        """The point measured at ``tp`` nearest ``micro_batch_size`` (the largest below it, else the smallest above),
        or None where nothing was measured at ``tp``."""
        sizes = sorted(point.micro_batch_size for point in self.compute if point.tp == tp)
        if not sizes:
            return None
        below = [b for b in sizes if b <= micro_batch_size]
        return self.point(tp, below[-1] if below else sizes[0])

    def point_for(self, tp: int, micro_batch_size: int) -> Optional[ComputePoint]:
        """The measurements at ``tp`` and ``micro_batch_size``; where that size was not measured, the analytic costs
        (linear in the micro-batch size) calibrated at the :meth:`nearest` size measured: its times and bytes times
        the ratio of the sizes. None where nothing was measured at ``tp``."""
        point = self.point(tp, micro_batch_size)
        if point is not None:
            return point
        near = self.nearest(tp, micro_batch_size)
        if near is None:
            return None
        ratio = micro_batch_size / near.micro_batch_size
        # batch_s and the schedule step stay as measured: taking a batch costs about the same at every size (2.6-2.9
        # ms at 1-8 here), and the step's own work is mostly per call
        return dataclasses.replace(
            near, micro_batch_size=micro_batch_size, layer_forward_s=near.layer_forward_s * ratio,
            layer_backward_s=near.layer_backward_s * ratio,
            recompute_extra_s={k: v * ratio for k, v in near.recompute_extra_s.items()},
            layer_activation_bytes={k: v * ratio for k, v in near.layer_activation_bytes.items()},
            embedding_forward_s=near.embedding_forward_s * ratio, embedding_backward_s=near.embedding_backward_s * ratio,
            embedding_activation_bytes=near.embedding_activation_bytes * ratio,
            output_forward_s=near.output_forward_s * ratio, output_backward_s=near.output_backward_s * ratio,
            output_activation_bytes=near.output_activation_bytes * ratio)

    def to_dict(self) -> dict:
        out = {"schema_version": self.schema_version, "kind": "pipemesh-profile",
               "device": {"kind": self.device_kind, "name": self.device_name},
               "versions": {"torch": self.torch_version, "megatron_core": self.megatron_core_version},
               "model": dataclasses.asdict(self.shape) if self.shape else None,
               "compute": [dataclasses.asdict(point) for point in self.compute],
               "optimizer_s_per_param": self.optimizer_s_per_param,
               "links": {"host_link_gbps": self.host_link_gbps,
                         **({"network": self.network.to_dict()} if self.network is not None else {})},
               "method": dict(self.method),
               "notes": list(self.notes)}
        if self.run_times is not None:
            out["run_times"] = dict(self.run_times)
        if self.load is not None:
            out["load"] = self.load.to_dict()
        if self.pace is not None:
            out["pace"] = self.pace.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def from_dict(data: Mapping, where: str = "the profile") -> Profile:
    """The profile ``data`` holds: this format, or an older file's flat per-op times (``where`` names it in errors)."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"{where} is not a JSON object; write it with pipemesh profile")
    if "schema_version" not in data:  # the flat per-op times a run wrote before the format had a version
        missing = [key for key in RUN_TIME_FIELDS if key not in data]
        if missing:
            raise ProfileError(f"{where} lacks {missing}; delete it to measure again")
        return Profile(run_times={key: float(data[key]) for key in RUN_TIME_FIELDS})
    version = data["schema_version"]
    if version not in READ_VERSIONS:
        raise ProfileError(f"{where} has schema version {version}; this pipemesh reads versions "
                           f"{', '.join(map(str, READ_VERSIONS))}: re-run pipemesh profile")
    try:
        model = data.get("model")
        device, versions, links = data.get("device") or {}, data.get("versions") or {}, data.get("links") or {}
        run_times = data.get("run_times")
        return Profile(
            device_kind=str(device.get("kind", "")), device_name=str(device.get("name", "")),
            torch_version=str(versions.get("torch", "")), megatron_core_version=str(versions.get("megatron_core", "")),
            shape=ModelShape(**model) if model else None,
            compute=tuple(_point(point) for point in data.get("compute") or ()),
            optimizer_s_per_param=data.get("optimizer_s_per_param"), host_link_gbps=links.get("host_link_gbps"),
            network=NetworkProfile.from_dict(links["network"]) if links.get("network") else None,
            method=dict(data.get("method") or {}), notes=tuple(data.get("notes") or ()),
            run_times=None if run_times is None else {key: float(run_times[key]) for key in RUN_TIME_FIELDS},
            load=LoadRecord.from_dict(data["load"]) if data.get("load") else None,
            pace=MachinePace.from_dict(data["pace"]) if data.get("pace") else None, schema_version=int(version))
    except (TypeError, KeyError, ValueError) as error:
        raise ProfileError(f"{where} is not a pipemesh profile ({error}); re-run pipemesh profile") from error


def at_pace(point: ComputePoint, factor: float) -> ComputePoint:
    """``point`` with every time (its fields in seconds, their spreads) times ``factor``: measured at one pace of the
    machine, given at another (:class:`.profile_quality.MachinePace`); its bytes as they are."""
    changes: Dict[str, object] = {}
    for item in dataclasses.fields(point):
        value = getattr(point, item.name)
        if not item.name.endswith("_s") or value is None:
            continue
        changes[item.name] = ({key: seconds * factor for key, seconds in value.items()} if isinstance(value, dict)
                              else value * factor)
    if point.spread is not None:
        changes["spread"] = {name: dataclasses.replace(
            spread, median_s=spread.median_s * factor, q1_s=spread.q1_s * factor, q3_s=spread.q3_s * factor,
            low_s=spread.low_s * factor, high_s=spread.high_s * factor) for name, spread in point.spread.items()}
    return dataclasses.replace(point, **changes)


def _point(data: Mapping) -> ComputePoint:
    """A :class:`ComputePoint` from its dictionary, its spreads as :class:`Spread`."""
    spread = data.get("spread")
    return ComputePoint(**{**data, "spread": None if spread is None else {
        str(name): Spread.from_dict(value) for name, value in spread.items()}})


def load(path: str) -> Profile:
    """The profile in the file at ``path`` (this format or an older one)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as error:
        raise ProfileError(f"cannot read the profile {path}: {error.strerror}") from error
    except ValueError as error:
        raise ProfileError(f"{path} is not JSON ({error}); write it with pipemesh profile") from error
    return from_dict(data, path)


def mismatch(profile: Profile, model: ModelSpec, dtype: str, device_kind: Optional[str],
             name: str = "the profile") -> Optional[str]:
    """One line naming the first way ``profile`` (the file ``name``) does not match ``model`` in ``dtype`` on
    ``device_kind`` ('cpu' or 'cuda'; None: either), or None when it matches."""
    fix = "re-run pipemesh profile with this command"
    if profile.shape is None or not profile.compute:
        return f"{name} holds no per-layer measurements (a training run's times only): {fix}"
    if device_kind is not None and profile.device_kind != device_kind:
        return f"{name} was measured on {profile.device_kind}, this plan is for {device_kind}: {fix} on that device"
    wanted = shape_of(model, dtype)
    for key in ("dtype",) + ModelShape.MATCHED:
        have, want = getattr(profile.shape, key), getattr(wanted, key)
        if have != want:
            return f"{name} was measured for {WORDS[key]} {have}, this command has {WORDS[key]} {want}: {fix}"
    return None


COST_NAMES = ("layer forward/backward", "recompute extras", "embedding", "output layer + loss", "activation bytes",
              "data loader", "schedule step", "optimizer step")
"""The costs a profile can give, in the order :func:`coverage` names them."""


def coverage(profile: Optional[Profile], tp: int, micro_batch_size: int,
             links: Sequence[LinkRate] = ()) -> Tuple[List[str], List[str]]:
    """(costs measured, costs assumed) when ``profile`` prices a layout at ``tp`` and ``micro_batch_size``, with the
    link rates the plan uses (:func:`chosen_rate`) described among them (without ``links``: the links assumed)."""
    link_measured = [rate.describe() for rate in links if rate.measured]
    link_assumed = [rate.describe() for rate in links if not rate.measured] if links else [
        "pipeline and data-parallel links (--nic-gbps)"]
    if profile is None:
        return link_measured, list(COST_NAMES) + link_assumed
    point = profile.point(tp, micro_batch_size)
    near = profile.nearest(tp, micro_batch_size) if point is None else None  # the analytic costs calibrated there
    source = point or near
    measured, assumed = [], []
    for name in COST_NAMES:
        per_layer = name in COST_NAMES[:5]
        if name == "optimizer step":
            have = profile.optimizer_s_per_param is not None
        elif source is None:
            have = False
        else:
            value = {"data loader": source.batch_s, "schedule step": source.step_forward_s}.get(name)
            have = per_layer or value is not None
        if not have:
            assumed.append(f"{name} (not measured at TP {tp}, micro-batch {micro_batch_size})"
                           if per_layer and source is None else name)
        elif near is not None and name != "optimizer step":
            measured.append(f"{name} ({'scaled from' if per_layer else 'as at'} micro-batch {near.micro_batch_size})")
        else:
            measured.append(name)
    return measured + link_measured, assumed + link_assumed


def _levels(measured: Mapping[str, float], analytic: Mapping[str, float], count: float,
            scale: float = 1.0) -> Dict[str, float]:
    """``analytic`` with the levels ``measured`` per layer (times ``count`` layers) in place; the others times
    ``scale``."""
    return {level: count * measured[level] if level in measured else value * scale
            for level, value in analytic.items()}


def apply_profile(costs: OpCosts, profile: Profile, model: ModelSpec, cluster: ClusterSpec,
                  stage_layers: Sequence[int]) -> OpCosts:
    """``costs`` (analytic, for a schedule whose stages hold ``stage_layers``) with ``profile``'s measured times
    and bytes in place wherever it has them at the cluster's TP and the model's micro-batch size (a size it did not
    measure: :meth:`Profile.point_for`, calibrated at the nearest size measured); the tensor-parallel
    collectives, the links and the transient bytes stay analytic."""
    # Measured with the whole sequence on one rank: a CP slice's costs stay analytic.
    point = profile.point_for(cluster.tp, model.micro_batch_size) if cluster.cp == 1 else None
    changes: Dict[str, object] = {}
    if point is not None:
        layers = max(stage_layers)
        # A level not measured (stock's uniform:k / block:k) keeps its analytic extra, scaled as the forward is.
        analytic_layer = (costs.forward_s - costs.tp_forward_s) / layers
        scale = point.layer_forward_s / analytic_layer if analytic_layer > 0 else 1.0
        stages = tuple(dataclasses.replace(
            stage, recompute_s=_levels(point.recompute_extra_s, stage.recompute_s, stage.layers, scale),
            activation_bytes=_levels(point.layer_activation_bytes, stage.activation_bytes, stage.layers))
            for stage in costs.stages)
        changes.update(
            forward_s=layers * point.layer_forward_s + costs.tp_forward_s,
            backward_s=layers * point.layer_backward_s + costs.tp_backward_s,
            recompute_s=_levels(point.recompute_extra_s, costs.recompute_s, layers, scale),
            activation_bytes=_levels(point.layer_activation_bytes, costs.activation_bytes, layers),
            # The embedding and the output layer are never recomputed: the same bytes at every level.
            first_stage_activation_bytes=dict.fromkeys(costs.activation_bytes, float(point.embedding_activation_bytes)),
            last_stage_activation_bytes=dict.fromkeys(costs.activation_bytes, float(point.output_activation_bytes)),
            first_stage_extra_s=point.embedding_forward_s, first_stage_backward_extra_s=point.embedding_backward_s,
            last_stage_extra_s=point.output_forward_s, last_stage_backward_extra_s=point.output_backward_s,
            stages=stages)
        if point.batch_s is not None:
            changes["batch_s"] = point.batch_s
        if point.step_forward_s is not None:
            changes.update(step_forward_s=dict(point.step_forward_s), step_backward_s=dict(point.step_backward_s))
    if profile.optimizer_s_per_param is not None and cluster.optimizer_step:
        # A rank's optimizer shard, from the parameters its static bytes count.
        changes["optimizer_s"] = tuple(params * profile.optimizer_s_per_param for params in costs.optimizer_params)
    return dataclasses.replace(costs, **changes) if changes else costs
