"""How much host memory this rank may pin for offloaded activations, and how many ranks share the node.

``--pipemesh-activation-placement auto`` budgets the pinned blocks of host placement per rank. The host side:

* **Available memory** is ``MemAvailable`` of ``/proc/meminfo``: free pages plus the page cache and reclaimable
  slabs the kernel gives back on demand. ``MemFree`` (glibc's ``_SC_AVPHYS_PAGES``) leaves the page cache out, so
  on a node whose cache is full (a data set read once) it is near zero and host placement would be dropped for no
  reason. A cgroup memory limit (Slurm's ``task/cgroup`` with ``ConstrainRAMSpace``, containers) caps it: pinned
  pages are charged to the job's cgroup, whose OOM killer ends the job long before the node runs out. The limit
  may sit on any ancestor of the process's cgroup (Slurm sets it on the job, the task below reads ``max``): the
  smallest headroom over them counts.
* **Ranks per node** come from the launcher: torchrun's ``LOCAL_WORLD_SIZE``; Slurm's ``SLURM_NTASKS_PER_NODE``
  (set with ``--ntasks-per-node``), else ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` (``"8(x2),4"``:
  this node's entry by ``SLURM_NODEID``; a plain ``srun`` with one task per GPU sets these, not
  ``LOCAL_WORLD_SIZE``); mpirun's ``OMPI_COMM_WORLD_LOCAL_SIZE`` / ``MPI_LOCALNRANKS``; else the GPUs this
  process sees (one rank per GPU), else one.

Each rank's share is the available memory over the ranks of the node, less the planning margin.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple

from ..planning.costs import GB
from ..planning.memory import MEMORY_MARGIN

MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
"""Where the kernel says these (read at each call; None arguments mean these paths)."""


def read_meminfo(path: Optional[str] = None) -> Dict[str, int]:
    """The fields of ``/proc/meminfo`` in bytes (its ``kB`` are KiB); {} when it cannot be read."""
    try:
        with open(path or MEMINFO, encoding="ascii") as handle:
            text = handle.read()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        match = re.match(r"(\w+):\s+(\d+)(?:\s+kB)?\s*$", line)
        if match:
            fields[match.group(1)] = int(match.group(2)) * (1024 if line.rstrip().endswith("kB") else 1)
    return fields


def _read_number(path: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def cgroup_headroom(root: Optional[str] = None, proc_cgroup: Optional[str] = None) -> Optional[Tuple[int, str]]:
    """(bytes the job's memory cgroups can still charge, where that limit was read), or None without a limit.

    A limit binds every cgroup below it, and the launcher may set it above the process's own cgroup: Slurm's
    task/cgroup puts a task in ``.../job_N/step_S/user/task_T`` with ``memory.max`` on the job (and step) while the
    task's own file reads ``max``. So every level from this process's cgroup up to the hierarchy's root is read and
    the smallest headroom wins. cgroup v2: ``memory.max - memory.current``; v1: ``memory.limit_in_bytes -
    memory.usage_in_bytes`` of the memory controller (a limit above 2**60 bytes is v1's 'none')."""
    root = root or CGROUP_ROOT
    try:
        with open(proc_cgroup or PROC_CGROUP, encoding="ascii") as handle:
            entries = [line.split(":", 2) for line in handle.read().splitlines()]
    except OSError:
        entries = []
    entries = [entry for entry in entries if len(entry) == 3]  # hierarchy id : controllers : path
    v2 = next((path for number, controllers, path in entries if number == "0" and not controllers), None)
    v1 = next((path for _, controllers, path in entries if "memory" in controllers.split(",")), None)
    hierarchies = []
    if v2 is not None:
        hierarchies.append((root, v2, "memory.max", "memory.current"))
    if v1 is not None:
        hierarchies.append((os.path.join(root, "memory"), v1, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    found = []
    for base, path, limit_name, usage_name in hierarchies:
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):  # this process's cgroup first, then each ancestor
            directory = os.path.join(base, *parts[:depth])
            limit = _read_number(os.path.join(directory, limit_name))
            usage = _read_number(os.path.join(directory, usage_name))
            if limit is not None and usage is not None and limit < 1 << 60:
                found.append((max(0, limit - usage), f"cgroup {os.path.join(directory, limit_name)}"))
    return min(found, key=lambda item: item[0]) if found else None


def available_bytes(meminfo: Optional[str] = None, cgroup_root: Optional[str] = None,
                    proc_cgroup: Optional[str] = None) -> Optional[Tuple[int, str]]:
    """(bytes this node can give this job now, what they are): ``MemAvailable`` (older kernels without it:
    ``MemFree + Cached``; without ``/proc/meminfo``, POSIX's free pages), capped by the job's cgroup headroom; None
    when none of them can be read."""
    fields = read_meminfo(meminfo)
    if "MemAvailable" in fields:
        available, what = fields["MemAvailable"], "MemAvailable"
    elif "MemFree" in fields:
        available, what = fields["MemFree"] + fields.get("Cached", 0), "MemFree + Cached"
    else:  # no /proc: the free pages POSIX reports (a lower bound: the page cache is not counted)
        try:
            available, what = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages (sysconf)"
        except (ValueError, OSError, AttributeError):
            return None
    headroom = cgroup_headroom(cgroup_root, proc_cgroup)
    if headroom is not None and headroom[0] < available:
        return headroom[0], f"{headroom[1]} headroom (below {what} {available / GB:.1f} GiB)"
    return available, what


def expand_tasks_per_node(text: str) -> Tuple[int, ...]:
    """Slurm's compressed task counts, one per node: ``"8(x2),4"`` -> (8, 8, 4). ValueError when malformed."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ValueError(f"cannot read Slurm's task count {text!r} (expected e.g. '8' or '8(x2),4')")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return tuple(counts)


@dataclass(frozen=True)
class RanksPerNode:
    """The ranks on this node and where the number came from."""

    count: int
    """Ranks on this process's node."""
    source: str
    """The environment variable (or 'visible GPUs', 'default') it was read from."""
    nodes: Tuple[int, ...] = ()
    """Every node's count where the launcher lists them (Slurm), else (count,)."""


SLURM_TASK_COUNTS = ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
"""Slurm's variables with tasks per node, in the order they are trusted (the first is the user's --ntasks-per-node,
the others what srun placed: the step's, then the job's)."""
MPI_LOCAL_SIZES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
"""Ranks on this node as Open MPI's and MPICH's (Hydra's) mpirun say."""


def launcher_ranks_per_node(environ: Mapping[str, str]) -> Optional[RanksPerNode]:
    """Ranks on this node as the launcher says: torchrun's ``LOCAL_WORLD_SIZE``, then Slurm's task counts
    (:data:`SLURM_TASK_COUNTS`; a list gives this node's entry by ``SLURM_NODEID``, the largest when that is not
    known), then mpirun's (:data:`MPI_LOCAL_SIZES`); None when none of them launched this process. ValueError
    naming a malformed value."""
    local = environ.get("LOCAL_WORLD_SIZE")
    if local:
        return _local_size("LOCAL_WORLD_SIZE", local)
    for name in SLURM_TASK_COUNTS:
        value = environ.get(name)
        if not value:
            continue
        nodes = expand_tasks_per_node(value)
        node = environ.get("SLURM_NODEID", "")
        mine = nodes[int(node)] if node.isdigit() and int(node) < len(nodes) else max(nodes)
        return RanksPerNode(mine, name, nodes)
    for name in MPI_LOCAL_SIZES:
        if environ.get(name):
            return _local_size(name, environ[name])
    return None


def _local_size(name: str, value: str) -> RanksPerNode:
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r} is not a positive number of ranks")
    return RanksPerNode(int(value), name, (int(value),))


def _visible_gpus(environ: Mapping[str, str]) -> int:
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return len([device for device in listed.split(",") if device.strip() and device.strip() != "-1"])
    try:
        import torch
    except ImportError:  # pragma: no cover
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def ranks_per_node(environ: Mapping[str, str], visible_gpus: Optional[Callable[[], int]] = None) -> RanksPerNode:
    """:func:`launcher_ranks_per_node`, else one rank per GPU this process sees, else one."""
    found = launcher_ranks_per_node(environ)
    if found is not None:
        return found
    gpus = visible_gpus() if visible_gpus is not None else _visible_gpus(environ)
    if gpus > 0:
        return RanksPerNode(gpus, "visible GPUs", (gpus,))
    return RanksPerNode(1, "default (no launcher count, no GPU)", (1,))


@dataclass(frozen=True)
class HostShare:
    """This rank's share of the node's available memory for pinned activation blocks."""

    available_bytes: int
    """What the node (or the job's cgroup) can give now."""
    available_source: str
    """Where that was read ('MemAvailable', a cgroup's headroom)."""
    ranks: RanksPerNode
    """The ranks sharing it."""
    margin: float = MEMORY_MARGIN
    """Fraction kept back (the planning margin)."""

    @property
    def bytes(self) -> float:
        return self.available_bytes / self.ranks.count * (1 - self.margin)

    def describe(self) -> str:
        """The numbers, for plan lines and refusals."""
        return (f"{self.available_source} {self.available_bytes / GB:.1f} GiB / {self.ranks.count} ranks per node "
                f"({self.ranks.source}) - {100 * self.margin:.0f}% margin = {self.bytes / GB:.2f} GiB per rank")


def host_share(environ: Optional[Mapping[str, str]] = None, meminfo: Optional[str] = None,
               cgroup_root: Optional[str] = None, proc_cgroup: Optional[str] = None,
               visible_gpus: Optional[Callable[[], int]] = None) -> Optional[HostShare]:
    """This rank's :class:`HostShare`, or None where the available memory cannot be read."""
    available = available_bytes(meminfo, cgroup_root, proc_cgroup)
    if available is None:
        return None
    environ = os.environ if environ is None else environ
    return HostShare(available[0], available[1], ranks_per_node(environ, visible_gpus))


def plan_host_bytes(plan) -> Optional[Tuple[float, int]]:
    """(pinned bytes the busiest rank's pool holds, that pipeline rank) for a plan that places activations on the
    host: from its block sizes (:mod:`..schedule.host_blocks`, the pool the runtime allocates), else its predicted
    peak of host activations (a lower bound: blocks round up); None when it places nothing or says nothing."""
    if not plan.host_placement or plan.schedule is None:
        return None
    if plan.host_blocks:
        from ..schedule.host_blocks import pool_blocks, pool_bytes
        schedule = plan.lower(param_sync=False, grad_sync=True)
        need = [(pool_bytes(pool_blocks(program, {c: b for (r, c), b in plan.host_blocks.items() if r == rank})), rank)
                for rank, program in enumerate(schedule.programs)]
        return max(need)
    peaks = (plan.predicted or {}).get("peak_host_gb")
    if peaks:
        peak = max(peaks)
        return peak * GB, list(peaks).index(peak)
    return None


def check_plan_fits_host(plan, what: str, share: Optional[HostShare], where: str = "this node") -> None:
    """Raise ValueError naming the numbers when ``plan``'s host placement needs more pinned memory on some rank
    than ``share`` (the share of each rank on ``where``; the plan was made for another machine or more memory)."""
    need = plan_host_bytes(plan)
    if need is None or share is None or need[0] <= share.bytes:
        return
    raise ValueError(f"{what} places activations on the host, which needs {need[0] / GB:.2f} GiB of pinned memory on "
                     f"pipeline rank {need[1]}, but {where} gives each rank {share.describe()}. Re-plan for this "
                     f"machine (`pipemesh plan ... --host-memory-gb {share.bytes / GB:.1f}`), run fewer ranks per node, "
                     "or free host memory")
