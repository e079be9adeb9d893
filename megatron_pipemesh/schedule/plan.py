"""``RunPlan``: everything a PipeMesh training run executes, in one typed, serializable object.

The flags (given groups), the planner (``--forward-groups auto``, ``pipemesh plan``), a plan file
(``--pipemesh-plan``) and the measured re-planner each make one; the runtime runs it as it is. Its
:meth:`RunPlan.to_dict` is the plan file ``pipemesh plan --output`` writes, and :meth:`RunPlan.lowering`
is the one rule that turns it into lowering options, for the runtime and for the start-up report
(whose digest the ranks compare).

Pure: no torch, no processes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from .config import BACKWARD_FLAG, FORWARD_FLAG, ScheduleConfig, ScheduleConfigError, uniform_groups
from .levers import BASIC_LEVERS, HOST, SELECTIVE_MODULES, Lever, runtime_lever
from .lower import (DEFAULT_RELOAD_LOOKAHEAD, LOOKAHEAD_LEAST, LoweredSchedule, LoweringOptions, check_lookahead,
                    host_placement_of, lower)
from .spans import SHARD_LEVELS

Key = Tuple[int, int, int]
"""(pipeline rank, chunk, micro-batch)."""

SHARD_SCOPES = ("data-parallel", "node")
"""Ranks a ZeRO-2/3 shard spans (``--pipemesh-shard-scope``)."""

PREDICTION_KEYS = ("predicted_iteration_time_s", "idle_fraction", "exposed_comm_s", "peak_memory_gb", "memory_budget_gb",
                   "fits", "recompute_share", "recompute_counts", "placement_counts", "peak_host_gb",
                   "host_memory_budget_gb", "exposed_host_s")
"""The planner's prediction in a plan file, in file order (the first eight precede the placement)."""


def megatron_groups(pp: int, microbatches: int, group_size: Optional[int] = None) -> Tuple[int, ...]:
    """The groups Megatron runs with ``--microbatch-group-size-per-virtual-pipeline-stage group_size`` (p where it is
    not given or outside [p, m]), in either direction."""
    size = group_size if group_size and pp <= group_size <= microbatches else pp
    return tuple(uniform_groups(microbatches, size))


OLD_PLACEMENT_KEY = "recompute"
"""The placement's key in plan files written before it was named for what it holds (recomputation and host
placement); still read."""


class RunPlanError(ValueError):
    """An inconsistent plan; the message says what is wrong and how to make a valid one."""


@dataclass(frozen=True)
class RunPlan:
    """What one PipeMesh run executes."""

    schedule: Optional[ScheduleConfig] = None
    """p, V, m and the two group lists of a training iteration; None: groups of Megatron's
    ``--microbatch-group-size-per-virtual-pipeline-stage`` at each call (depth-first by default)."""
    placement: Mapping[Key, Lever] = field(default_factory=dict)
    """Memory lever per (pipeline rank, chunk, micro-batch): host placement or a recompute level; missing
    keys keep their activations on the device."""
    sharding: Tuple[str, ...] = ()
    """ZeRO level per virtual chunk (``optim``, ``optim_grads``, ``optim_grads_params``); empty: Megatron's own
    data parallelism."""
    shard_scope: str = "data-parallel"
    """Ranks a shard spans: ``data-parallel`` or ``node``."""
    recv_lookahead: int = 1
    """Compute ops between posting a pipeline receive and its consumer."""
    reload_lookahead: int = DEFAULT_RELOAD_LOOKAHEAD
    """Compute ops between a RELOAD and its backward (the planner sizes it from the copy time)."""
    gather_lookahead: int = LoweringOptions.gather_lookahead
    """Compute ops between a ZeRO-3 GATHER and its span."""
    predicted: Optional[Mapping[str, Any]] = None
    """What the planner predicted for the plan (:data:`PREDICTION_KEYS`: iteration time, memory per rank, ...),
    kept in the plan file for the user; the runtime never reads it."""
    host_blocks: Mapping[Tuple[int, int], int] = field(default_factory=dict)
    """(pipeline rank, chunk) -> bytes of the pinned block each host-placed chunk-micro-batch of that chunk takes,
    as the planner priced it (its activation bytes rounded up to a power of two): the runtime allocates its pinned
    pool from it before the first call (:mod:`.host_blocks`). Empty: not known (the pool grows in the first call)."""

    def __post_init__(self) -> None:
        placement = {}
        for key, lever in self.placement.items():
            if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(k, int) for k in key)):
                raise RunPlanError(f"placement key {key!r} is not (pipeline rank, chunk, micro-batch)")
            parsed = runtime_lever(lever)
            if parsed is None:
                raise RunPlanError(f"unknown placement level(s): {key} has unknown level {str(lever)!r}; use "
                                   f"{', '.join(BASIC_LEVERS + (HOST,))} or 'selective:<modules joined by +>' with "
                                   f"modules from {', '.join(SELECTIVE_MODULES)} (e.g. selective:core_attn+mlp)")
            if not parsed.is_device:
                placement[key] = parsed
        object.__setattr__(self, "placement", dict(sorted(placement.items())))
        object.__setattr__(self, "sharding", tuple(self.sharding))
        blocks = {}
        for key, size in dict(self.host_blocks).items():
            if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, int) for k in key)
                    and isinstance(size, int) and size > 0 and size & (size - 1) == 0):
                raise RunPlanError(f"host block entry {key!r}: {size!r} is not (pipeline rank, chunk) -> a positive "
                                   "power of two of bytes; re-run `pipemesh plan --output`")
            blocks[key] = size
        object.__setattr__(self, "host_blocks", dict(sorted(blocks.items())))
        config = self.schedule
        if config is not None:
            outside = [key for key in placement if not (0 <= key[0] < config.pp and 0 <= key[1] < config.vpp
                                                        and 0 <= key[2] < config.microbatches)]
            if outside:
                raise RunPlanError(f"entries {outside[:3]} (rank, chunk, micro-batch) are outside p, V, m = "
                                   f"{(config.pp, config.vpp, config.microbatches)}")
        unknown = [level for level in self.sharding if level not in SHARD_LEVELS]
        if unknown:
            raise RunPlanError(f"unknown sharding level(s) {unknown}; levels are {', '.join(SHARD_LEVELS)}")
        if self.sharding and config is not None and len(self.sharding) != config.vpp:
            raise RunPlanError(f"sharding gives {len(self.sharding)} levels for {config.vpp} virtual chunks (one per chunk)")
        if self.shard_scope not in SHARD_SCOPES:
            raise RunPlanError(f"shard scope {self.shard_scope!r}: use one of {', '.join(SHARD_SCOPES)}")
        for name in LOOKAHEAD_LEAST:
            check_lookahead(name, getattr(self, name), RunPlanError)

    # What the plan holds ------------------------------------------------------------------------
    @property
    def host_placement(self) -> Tuple[Key, ...]:
        """Every rank's host-placed chunk-micro-batches (all ranks lower, and compare, the whole plan)."""
        return host_placement_of(self.placement)

    @property
    def recomputed(self) -> Dict[Key, Lever]:
        """The chunk-micro-batches whose activations are recomputed, with their level."""
        return {key: lever for key, lever in self.placement.items() if lever.recomputes}

    def describe(self) -> str:
        """The groups and how many chunk-micro-batches are recomputed or host-placed."""
        groups = self.schedule.describe() if self.schedule is not None else "Megatron's group size"
        text = (f"{groups}, {len(self.recomputed)} recomputed and {len(self.host_placement)} host-placed "
                "chunk-micro-batches")
        return text + (f", sharding {' '.join(self.sharding)}" if self.sharding else "")

    # What the runtime runs ----------------------------------------------------------------------
    def config_for(self, pp: int, vpp: int, microbatches: int, group_size: Optional[int] = None,
                   forward_only: bool = False) -> ScheduleConfig:
        """The schedule of one call with ``microbatches``: the plan's groups; Megatron's group size where the plan
        has none, or for an evaluation call with another batch (the order does not change its results)."""
        config = self.schedule
        if config is not None and config.microbatches != microbatches:
            if not forward_only:
                raise ScheduleConfigError(FORWARD_FLAG, list(config.forward_groups),
                                          f"this iteration has {microbatches} micro-batches but the groups sum to "
                                          f"{config.microbatches} (batch-size ramp-up or a changed global batch size?)",
                                          f"{FORWARD_FLAG} {microbatches} {BACKWARD_FLAG} {microbatches}")
            config = None
        if config is None:
            groups = megatron_groups(pp, microbatches, group_size)
            return ScheduleConfig(pp, vpp, microbatches, groups, groups)
        return config

    def lowering(self, *, param_sync: bool, grad_sync: bool, forward_only: bool = False) -> LoweringOptions:
        """The lowering options of a call: the plan's lookaheads, sharding and host placement (training only), with
        the data-parallel sync points Megatron drives (``param_sync_func`` / ``grad_sync_func`` set)."""
        return LoweringOptions(recv_lookahead=self.recv_lookahead, param_sync=param_sync and not forward_only,
                               grad_sync=grad_sync and not forward_only, forward_only=forward_only,
                               host_placement=() if forward_only else self.host_placement,
                               reload_lookahead=self.reload_lookahead,
                               sharding=() if forward_only else self.sharding, gather_lookahead=self.gather_lookahead)

    def lower(self, *, param_sync: bool, grad_sync: bool) -> LoweredSchedule:
        """The lowered training iteration (its ``digest()`` is what the ranks compare at the first call)."""
        if self.schedule is None:
            raise RunPlanError("the plan follows Megatron's group size at each call: lower config_for(...) instead")
        return lower(self.schedule, self.lowering(param_sync=param_sync, grad_sync=grad_sync))

    # Plan files ---------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """The plan file's content (``pipemesh plan --output``): p, V, m, the groups, the prediction, the placement
        (``placement``: every lever but the device), the sharding levels, the lookaheads (the receive and gather
        lookaheads only where they differ from the default)."""
        config = self.schedule
        if config is None:
            raise RunPlanError("a plan that follows Megatron's group size at each call has no groups to save")
        predicted = self.predicted or {}
        data: Dict[str, Any] = {"pp": config.pp, "vpp": config.vpp, "microbatches": config.microbatches,
                                "forward_groups": list(config.forward_groups),
                                "backward_groups": list(config.backward_groups)}
        data.update((key, predicted[key]) for key in PREDICTION_KEYS[:8] if key in predicted)
        data["placement"] = [{"rank": r, "chunk": c, "microbatch": j, "level": str(lever)}
                             for (r, c, j), lever in self.placement.items()]
        if self.sharding:
            data.update(sharding=list(self.sharding), shard_scope=self.shard_scope)
        data.update((key, predicted[key]) for key in PREDICTION_KEYS[8:] if key in predicted)
        data["reload_lookahead"] = self.reload_lookahead
        if self.host_blocks:
            data["host_blocks"] = [{"rank": r, "chunk": c, "bytes": size} for (r, c), size in self.host_blocks.items()]
        for name in ("recv_lookahead", "gather_lookahead"):
            if getattr(self, name) != getattr(RunPlan, name):
                data[name] = getattr(self, name)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunPlan":
        """A plan from :meth:`to_dict`'s content (also the files of earlier versions: without lookaheads, and with the
        placement under its earlier key ``recompute``); raises :class:`RunPlanError` naming what is wrong."""
        if not isinstance(data, Mapping):
            raise RunPlanError(f"a plan is a JSON object, got {type(data).__name__}")
        known = {"pp", "vpp", "microbatches", "forward_groups", "backward_groups", "placement", OLD_PLACEMENT_KEY,
                 "recv_lookahead", "reload_lookahead", "gather_lookahead", "sharding", "shard_scope", "host_blocks",
                 *PREDICTION_KEYS}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RunPlanError(f"unknown key(s) {unknown}; a plan has {', '.join(sorted(known))}")
        missing = [key for key in ("pp", "vpp", "microbatches", "forward_groups", "backward_groups") if key not in data]
        if "placement" in data and OLD_PLACEMENT_KEY in data:
            raise RunPlanError(f"both 'placement' and its earlier name {OLD_PLACEMENT_KEY!r}; keep 'placement' only")
        if missing:
            raise RunPlanError(f"missing key(s) {missing}; re-run `pipemesh plan --output`")
        try:
            schedule = ScheduleConfig(data["pp"], data["vpp"], data["microbatches"], tuple(data["forward_groups"]),
                                      tuple(data["backward_groups"]))
            placement = {(int(e["rank"]), int(e["chunk"]), int(e["microbatch"])): e["level"]
                         for e in data.get("placement", data.get(OLD_PLACEMENT_KEY, []))}
            host_blocks = {(int(e["rank"]), int(e["chunk"])): e["bytes"] for e in data.get("host_blocks", [])}
        except (KeyError, TypeError, ValueError) as error:
            raise RunPlanError(f"malformed plan ({type(error).__name__}: {error}); re-run `pipemesh plan --output`") from error
        sharding = data.get("sharding")
        return cls(schedule, placement, tuple(sharding) if sharding is not None else (),
                   data.get("shard_scope", "data-parallel"), data.get("recv_lookahead", 1),
                   data.get("reload_lookahead", DEFAULT_RELOAD_LOOKAHEAD),
                   data.get("gather_lookahead", LoweringOptions.gather_lookahead),
                   {key: data[key] for key in PREDICTION_KEYS if key in data} or None, host_blocks)

    def to_json(self) -> str:
        """The plan file's text."""
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "RunPlan":
        try:
            data = json.loads(text)
        except ValueError as error:
            raise RunPlanError(f"not JSON ({error})") from error
        return cls.from_dict(data)
