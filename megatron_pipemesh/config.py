"""``PipeMeshConfig``: the one declaration of PipeMesh's settings, grouped by concern.

:class:`PipeMeshConfig` nests one typed dataclass per concern (:class:`ScheduleSettings`,
:class:`CostSettings`, :class:`PlacementSettings`, :class:`MeasurementSettings`, :class:`ShardingSettings`);
each field carries its flag, help, default and launch key. Every surface is derived from them, so a setting is
declared once:

* the Megatron flags that :func:`megatron_pipemesh.install` adds (:func:`add_megatron_arguments`);
* the flags of the ``pipemesh`` command that share a setting (:func:`add_cli_arguments`, by the setting's key:
  its Megatron destination without ``pipemesh_``, e.g. ``dp_gbps``; the planner's cluster description drops the
  ``--pipemesh-`` prefix there, e.g. ``--dp-gbps``);
* the keys of the launch scripts' config files (``configs/*.env``), generated into
  ``scripts/lib/pipemesh_keys.sh`` by ``python -m megatron_pipemesh.config --bash`` (a test checks the
  committed file is current);
* the flags a benchmark or script passes back to Megatron (:meth:`PipeMeshConfig.megatron_flags`).

Pure: no torch, no processes.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from .flag_types import nonnegative_number, positive_int, positive_number
from .planning.clusters import PLANNING_CLUSTER
from .planning.defaults import DEFAULT_HOST_LINK_GBPS, MEMORY_MARGIN
from .planning.planner_options import PLACEMENT_MODES, RECOMPUTE_ONLY
from .schedule.plan import SHARD_SCOPES
from .schedule.spans import SHARD_LEVELS

_PLANNING = PLANNING_CLUSTER
"""The analytic cost model's defaults, which the cost flags share."""
_MARGIN = round(100 * MEMORY_MARGIN)

Groups = Union[None, str, Tuple[int, ...]]
"""A group list, 'auto', or None (not given)."""


def _group_value(text: str) -> Union[int, str]:
    """argparse type of a group flag: a positive number of micro-batches, or 'auto'."""
    return text if text == "auto" else positive_int(text)


def _positive_group(text: str) -> int:
    value = _group_value(text)
    if value == "auto":
        raise argparse.ArgumentTypeError("'auto' is for training runs; `pipemesh plan` chooses groups here")
    return value


_NUMBER_TYPES = (float, positive_number, nonnegative_number)

ACTIVATION_PLACEMENTS = PLACEMENT_MODES
"""Values of ``--pipemesh-activation-placement`` (see :attr:`PlacementSettings.activation_placement`)."""


def _setting(flag: str, help: str, default: Any = None, *, env: Optional[str] = None, cli: Optional[str] = None,
             cli_default: Any = MISSING, recommended: bool = False, **argparse_kwargs) -> Any:
    """A dataclass field carrying how the setting appears on each surface.

    ``flag``: the Megatron flag; ``env``: the launch-config key (None: not a config key); ``cli``: the
    ``pipemesh`` command's flag (None: not there); ``cli_default``: its default there, if different;
    ``recommended``: a recommendation of ``pipemesh plan --megatron-args`` decides it (the user's value is
    dropped from the recommended command and the row's own written).
    """
    meta = {"flag": flag, "help": help, "env": env, "cli": cli, "argparse": argparse_kwargs,
            "recommended": recommended}
    if cli_default is not MISSING:
        meta["cli_default"] = cli_default
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ScheduleSettings:
    """Which schedule runs and with which groups (or plan file)."""

    pipeline_schedule: str = _setting(
        "--pipeline-schedule", "'default' keeps Megatron's schedules untouched; 'pipemesh' runs the elastic schedule "
        "given by --forward-groups/--backward-groups (needs pipeline and virtual pipeline parallelism)",
        "default", env="SCHEDULE", recommended=True, choices=("default", "pipemesh"))
    """'default' (stock Megatron) or 'pipemesh'."""
    forward_groups: Groups = _setting(
        "--forward-groups", "forward (enqueue) group sizes, summing to the micro-batches per iteration, or 'auto'; "
        "default: groups of --microbatch-group-size-per-virtual-pipeline-stage (depth-first)",
        env="FORWARD_GROUPS", recommended=True, cli="--forward-groups", type=_group_value, nargs="+", metavar="G")
    """Forward group sizes f_1..f_k (sum m), 'auto' (the planner chooses), or None (Megatron's group size)."""
    backward_groups: Groups = _setting(
        "--backward-groups", "backward (dequeue) group sizes, summing to the micro-batches per iteration, or 'auto'; "
        "default: the forward groups", env="BACKWARD_GROUPS", recommended=True, cli="--backward-groups", type=_group_value,
        nargs="+", metavar="G")
    """Backward group sizes b_1..b_l (sum m), 'auto', or None (the forward groups)."""
    recv_lookahead: int = _setting(
        "--pipemesh-recv-lookahead", "post each pipeline receive N compute steps before it is needed (default 1)",
        1, env="RECV_LOOKAHEAD", type=int, metavar="N")
    """Compute ops between posting a pipeline receive and its consumer."""
    plan: Optional[str] = _setting(
        "--pipemesh-plan", "groups and recomputation from `pipemesh plan --output PLAN.json` (instead of the group "
        "flags)", env="PLAN", recommended=True, metavar="PLAN.json")
    """Path of a plan saved by ``pipemesh plan --output``."""


@dataclass(frozen=True)
class CostSettings:
    """What the planner's analytic costs assume: the memory budget, the device and the links."""

    memory_budget_gb: Optional[float] = _setting(
        "--pipemesh-memory-budget-gb", f"memory per device a plan may use (GiB); default in training on GPU: free "
        f"memory minus {_MARGIN}%%, required without CUDA; default in `pipemesh plan`: --device-memory-gb minus "
        f"{_MARGIN}%%", env="MEMORY_BUDGET_GB", recommended=True, cli="--memory-budget-gb", type=float, metavar="GB")
    """Per-device memory the plan may use (GiB); None: free device memory minus the margin
    (:data:`~megatron_pipemesh.planning.memory.MEMORY_MARGIN`)."""
    device_tflops: Optional[float] = _setting(
        "--pipemesh-device-tflops", "peak 16-bit TFLOP/s of one device for the analytic costs (default in training: "
        "known GPU models, and without CUDA the CPU's measured matmul rate; in the `pipemesh` command: "
        f"{_PLANNING.device_tflops:g})", env="DEVICE_TFLOPS", recommended=True, cli="--device-tflops",
        cli_default=_PLANNING.device_tflops, type=float, metavar="TFLOPS")
    """Peak dense TFLOP/s of one device; None: looked up from the GPU's name, or measured on a CPU."""
    mfu: float = _setting(
        "--pipemesh-mfu", f"fraction of peak the layers reach, for the analytic costs (default {_PLANNING.mfu:g})",
        _PLANNING.mfu,
        env="MFU", cli="--mfu", type=float, metavar="F")
    """Fraction of peak FLOP/s the layers reach."""
    dp_gbps: float = _setting(
        "--pipemesh-dp-gbps", "data-parallel bandwidth per device in Gbit/s, for the analytic costs (default "
        f"{_PLANNING.dp_gbps:g})", _PLANNING.dp_gbps, env="DP_GBPS", cli="--dp-gbps", type=float, metavar="GBPS")
    """Data-parallel collective bandwidth per device (Gbit/s)."""
    p2p_gbps: float = _setting(
        "--pipemesh-p2p-gbps", f"pipeline link bandwidth in Gbit/s, for the analytic costs (default {_PLANNING.p2p_gbps:g})",
        _PLANNING.p2p_gbps,
        env="P2P_GBPS", cli="--p2p-gbps", type=float, metavar="GBPS")
    """Pipeline link bandwidth (Gbit/s)."""


@dataclass(frozen=True)
class PlacementSettings:
    """Where the planner may keep activations: recomputation, host memory, the host link."""

    activation_placement: str = _setting(
        "--pipemesh-activation-placement", "where the planner keeps the activations a backward needs: "
        "'recompute-only' (default: on the device, recomputed where memory binds), 'auto' (per chunk-micro-batch "
        "the cheapest of device, host memory (offloaded after the forward, reloaded before the backward), "
        "selective or full recomputation), 'device' (all on the device, no offload, no recomputation: a plan "
        "that does not fit the memory budget is an error)", RECOMPUTE_ONLY, env="ACTIVATION_PLACEMENT", recommended=True,
        cli="--activation-placement", choices=ACTIVATION_PLACEMENTS)
    """Memory levers the planner may use: 'recompute-only' (recomputation, today's behaviour), 'auto'
    (host offload and recomputation, chosen per chunk-micro-batch by bytes freed per ms of added time) or
    'device' (none: every activation stays on the device; planning fails if that exceeds the budget)."""
    host_link_gbps: Optional[float] = _setting(
        "--pipemesh-host-link-gbps", "device-host link bandwidth per rank and direction in Gbit/s, for offloaded "
        "activations; default in training on GPU: measured at start-up; without CUDA and in the `pipemesh` "
        f"command: {DEFAULT_HOST_LINK_GBPS:g} (PCIe 4.0 x16, pinned memory)", env="HOST_LINK_GBPS",
        cli="--host-link-gbps", type=positive_number, metavar="GBPS")
    """Device-to-host (and host-to-device) copy bandwidth of one rank (Gbit/s); None: measured on GPU,
    :data:`~megatron_pipemesh.planning.costs.DEFAULT_HOST_LINK_GBPS` otherwise."""
    host_memory_gb: Optional[float] = _setting(
        "--pipemesh-host-memory-gb", "host memory per rank the plan may fill with offloaded activations (GiB, "
        "counted in the pinned blocks they take: each chunk-micro-batch's bytes rounded up to a power of two); "
        "default in planning: unlimited; in training the runtime caps it by the machine's memory",
        env="HOST_MEMORY_GB", recommended=True, cli="--host-memory-gb", type=nonnegative_number, metavar="GB")
    """Host memory budget per rank for offloaded activations (GiB); None: unlimited in planning."""


@dataclass(frozen=True)
class MeasurementSettings:
    """What a run measures and reports: measured re-planning, memory, the schedule picture."""

    measure_iters: int = _setting(
        "--pipemesh-measure-iters", "with 'auto': time the first N training iterations, then re-plan from the "
        "measured costs (0: analytic costs only)", 0, env="MEASURE_ITERS", type=int, metavar="N")
    """Iterations timed before re-planning with measured costs (auto only)."""
    profile: Optional[str] = _setting(
        "--pipemesh-profile", "with 'auto': plan from the measured costs in FILE if it exists; measurements of "
        "--pipemesh-measure-iters are saved there", env="PROFILE", metavar="FILE.json")
    """Measured-cost file read at start-up and written by --pipemesh-measure-iters."""
    measure_memory: bool = _setting(
        "--pipemesh-measure-memory", "measure the activation memory each rank holds (saved-tensor accounting on CPU, "
        "allocator statistics on CUDA) and report its peak every --log-interval", False, env="MEASURE_MEMORY",
        action="store_true")
    """Meter activation memory and report the measured peak per rank in the training log."""
    print_schedule: bool = _setting(
        "--pipemesh-print-schedule", "print the text timeline of the first pipeline ranks at start-up "
        "(`pipemesh show --picture`)", False, env="PRINT_SCHEDULE", action="store_true")
    """Print the schedule picture with the start-up plan line."""



@dataclass(frozen=True)
class ShardingSettings:
    """Mixed sharding: the ZeRO level per chunk and the ranks a shard spans."""

    levels: Union[None, str, Tuple[str, ...]] = _setting(
        "--pipemesh-sharding", "ZeRO level per virtual chunk (one for all, or one per chunk), Megatron's names: optim "
        "(optimizer state sharded), optim_grads (and gradients), optim_grads_params (and parameters, gathered before "
        "each group); or auto (the planner chooses); needs --use-distributed-optimizer", env="SHARDING",
        cli="--sharding", nargs="+", metavar="LEVEL", choices=SHARD_LEVELS + ("auto",))
    """Sharding level per virtual chunk, 'auto', or None (no mixed sharding: Megatron's own flags decide)."""
    scope: str = _setting(
        "--pipemesh-shard-scope", "ranks that the shards span: data-parallel (all) or node (the data-parallel ranks of "
        "one node, as Megatron's hierarchical distributed optimizer: parameters, gradients and optimizer state sharded "
        "within the node, gradients all-reduced across nodes once per iteration)", "data-parallel",
        env="SHARD_SCOPE", cli="--shard-scope", choices=SHARD_SCOPES)
    """'data-parallel' or 'node'."""
    ranks_per_node: Optional[int] = _setting(
        "--pipemesh-ranks-per-node", "ranks per node for --pipemesh-shard-scope node (default: the launcher's "
        "LOCAL_WORLD_SIZE, torchrun, or SLURM_NTASKS_PER_NODE, Slurm)", type=int, metavar="N")
    """Ranks per node of the node scope; None: from the launcher's environment."""



GROUPS = (("schedule", ScheduleSettings), ("costs", CostSettings), ("placement", PlacementSettings),
          ("measurement", MeasurementSettings), ("sharding", ShardingSettings))
"""(attribute of :class:`PipeMeshConfig`, settings class) per concern, in flag order."""


@dataclass(frozen=True)
class PipeMeshConfig:
    """PipeMesh's settings of one training run, as given on the command line (before validation)."""

    schedule: ScheduleSettings = ScheduleSettings()
    """Which schedule runs, its groups or plan file, the receive lookahead."""
    costs: CostSettings = CostSettings()
    """Memory budget and the analytic cost model's device and links."""
    placement: PlacementSettings = PlacementSettings()
    """Activation placement levers and the host link and memory."""
    measurement: MeasurementSettings = MeasurementSettings()
    """Measured re-planning, memory metering, the start-up picture."""
    sharding: ShardingSettings = ShardingSettings()
    """ZeRO level per chunk and shard scope."""

    @classmethod
    def from_args(cls, args: Any) -> "PipeMeshConfig":
        """The settings of a parsed Megatron namespace (missing attributes keep their defaults)."""
        groups = {}
        for name, settings in GROUPS:
            values = {}
            for f in fields(settings):
                value = getattr(args, _dest(f), f.default)
                if f.metadata["argparse"].get("type") is _group_value:
                    value = normalize_groups(f.metadata["flag"], value)
                elif f.metadata["argparse"].get("nargs") == "+" and value is not None and not isinstance(value, str):
                    value = tuple(value)
                values[f.name] = value
            groups[name] = settings(**values)
        return cls(**groups)

    @property
    def enabled(self) -> bool:
        return self.schedule.pipeline_schedule == "pipemesh"

    def megatron_flags(self) -> List[str]:
        """Megatron flags that reproduce these settings (defaults left out)."""
        out: List[str] = []
        for name, f in setting_fields():
            value = getattr(getattr(self, name), f.name)
            if value == f.default or value is None:
                continue
            flag = f.metadata["flag"]
            if isinstance(value, bool):
                out.append(flag)
            elif isinstance(value, tuple):
                out += [flag, *map(str, value)]
            else:
                out += [flag, str(value)]
        return out


def setting_fields() -> Iterator[Tuple[str, Field]]:
    """(group attribute, field) of every setting, in flag order."""
    for name, settings in GROUPS:
        for f in fields(settings):
            yield name, f


def _dest(f: Field) -> str:
    """argparse destination of a setting (Megatron's namespace attribute)."""
    return f.metadata["flag"].lstrip("-").replace("-", "_")


SETTINGS: Dict[str, Field] = {_dest(f).removeprefix("pipemesh_"): f for _, f in setting_fields()}
"""Every setting by its key: its Megatron destination without ``pipemesh_`` (``forward_groups``, ``dp_gbps``,
``sharding``, ``shard_scope``, ...)."""


def normalize_groups(flag: str, values: Optional[Sequence[Union[int, str]]]) -> Groups:
    """A parsed group flag as None, 'auto' or a tuple of ints; ValueError for 'auto' mixed with sizes."""
    if values is None or isinstance(values, str) and values == "auto":
        return values
    if isinstance(values, str):
        values = values.split()
    values = list(values)
    if "auto" in values:
        if len(values) != 1:
            raise ValueError(f"{flag} {' '.join(map(str, values))} is invalid: 'auto' stands alone. "
                             f"Example of a valid setting: {flag} auto")
        return "auto"
    return tuple(int(v) for v in values)


def megatron_flag_names() -> Tuple[str, ...]:
    """Every Megatron flag PipeMesh adds, in declaration order."""
    return tuple(f.metadata["flag"] for _, f in setting_fields())


def recommended_flag_names() -> Tuple[str, ...]:
    """PipeMesh's Megatron flags a recommendation decides (``recommended`` settings), in declaration order."""
    return tuple(f.metadata["flag"] for _, f in setting_fields() if f.metadata["recommended"])


def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add PipeMesh's flags to a Megatron parser (idempotent)."""
    if any(megatron_flag_names()[0] in action.option_strings for action in parser._actions):
        return parser
    group = parser.add_argument_group("PipeMesh", "elastic pipeline schedule (megatron_pipemesh)")
    for _, f in setting_fields():
        meta = f.metadata
        group.add_argument(meta["flag"], default=f.default, help=meta["help"], **meta["argparse"])
    return parser


def add_cli_arguments(group, names: Sequence[str]) -> None:
    """Add the ``pipemesh`` command's flags for the settings ``names`` (keys of :data:`SETTINGS`) to an argparse
    group."""
    for name in names:
        f = SETTINGS[name]
        meta = f.metadata
        if meta["cli"] is None:
            raise KeyError(f"{name} is not a `pipemesh` command flag")
        kwargs = dict(meta["argparse"])
        if name in ("forward_groups", "backward_groups"):
            kwargs["type"] = _positive_group
        group.add_argument(meta["cli"], default=meta.get("cli_default", f.default), help=meta["help"], **kwargs)


def env_keys() -> Dict[str, str]:
    """Launch-config key -> Megatron flag, for every setting that has a key."""
    return {f.metadata["env"]: f.metadata["flag"] for _, f in setting_fields() if f.metadata["env"]}


def bash_keys() -> str:
    """``scripts/lib/pipemesh_keys.sh``: the launch scripts' PipeMesh config keys and their flags."""
    kinds = {}
    for _, f in setting_fields():
        if not f.metadata["env"]:
            continue
        action = f.metadata["argparse"].get("action")
        choices = f.metadata["argparse"].get("choices")
        if action == "store_true":
            kind = "bool"
        elif f.metadata["argparse"].get("nargs") == "+" and choices:
            kind = "words:" + "|".join(choices)
        elif f.metadata["argparse"].get("nargs") == "+":
            kind = "groups"
        elif choices:
            kind = "choice:" + "|".join(choices)
        elif f.metadata["argparse"].get("type") is int:
            kind = "uint"
        elif f.metadata["argparse"].get("type") in _NUMBER_TYPES:
            kind = "number"
        else:
            kind = "path"
        kinds[f.metadata["env"]] = kind
    lines = ["# Generated by `python -m megatron_pipemesh.config --bash` from PipeMeshConfig; do not edit.",
             "# shellcheck shell=bash disable=SC2034",
             "PM_PIPEMESH_KEYS=(" + " ".join(env_keys()) + ")",
             "declare -A PM_PIPEMESH_FLAG=(" + " ".join(f"[{k}]={v}" for k, v in env_keys().items()) + ")",
             "declare -A PM_PIPEMESH_KIND=(" + " ".join(f"[{k}]='{v}'" for k, v in kinds.items()) + ")"]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_pipemesh.config",
                                     description="Print PipeMesh's settings for other tools.")
    parser.add_argument("--bash", action="store_true", help="the launch scripts' key file (scripts/lib/pipemesh_keys.sh)")
    parser.add_argument("--flags", action="store_true", help="the Megatron flags, one per line")
    args = parser.parse_args(argv)
    if args.bash:
        sys.stdout.write(bash_keys())
    else:
        print("\n".join(megatron_flag_names()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
