"""Process groups PipeMesh adds on top of Megatron's ``parallel_state`` (which stays untouched).

:func:`create_pipemesh_groups` creates **one process group per directed pipeline link and
direction** (activations r -> r+1 and gradients r+1 -> r, including the wrap-around links between
the last and the first rank that interleaved placement uses). Why: NCCL serializes point-to-point
operations per communicator in issue order, so with a single pipeline communicator a posted receive
can hold back a later send (and with p = 2 the two directions of one pair become
indistinguishable, the reason Megatron forbids PP=2 interleaving without overlap). With one
communicator per link, a link's transfers are ordered among themselves only, which is exactly the
order the schedule validator checks. Gloo (CPU) does not need them but gets them too, so CPU tests
exercise the same code.

The groups are made like Megatron's pipeline group: with the distributed timeout
(``--distributed-timeout-minutes``; NCCL's own default would ignore it), the pipeline backend
(``--pipeline-model-parallel-comm-backend``) and the NCCL options Megatron gives its ``pp`` group
(``--nccl-communicator-config-path``, ``--high-priority-stream-groups``), through Megatron's
``create_group`` so that ``update_pg_timeout`` reaches them too. ``megatron_pipemesh.install()``
creates them right after Megatron's ``initialize_model_parallel`` with that call's arguments, in
one order on every rank, and warms each link up with a one-element transfer, so every NCCL
communicator exists before iteration 1 (instead of a blocking two-rank rendezvous at the first send
of a training step).

Nothing else changes: stage placement, embedding groups and data-parallel groups stay Megatron's.
"""
from __future__ import annotations

import functools
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

LinkKey = Tuple[str, int, int]
"""(direction 'F' or 'B', source global rank, destination global rank)."""

_P2P_GROUPS: Optional[Dict[LinkKey, dist.ProcessGroup]] = None
_FOR_PP_GROUP = None
"""Megatron's pipeline group the cached link groups were made for (re-created when it changes)."""


def pipeline_links(pipelines: Sequence[Sequence[int]]) -> List[LinkKey]:
    """Every directed link of every pipeline, in the order all ranks create and warm them up.

    Per direction, links leaving an even pipeline position come before those leaving an odd one (so a
    warm-up phase pairs disjoint ranks, as Megatron's even/odd p2p ordering does); the order is one
    total order shared by all ranks, so blocking on the links one by one cannot deadlock: the earliest
    unfinished link always has both of its ranks waiting on it.
    """
    links = []
    for ranks in sorted({tuple(r) for r in pipelines}):  # each rank reports its own pipeline
        p = len(ranks)
        if p < 2:
            continue
        for d, (direction, step) in enumerate((("F", 1), ("B", -1))):
            for index in range(p):
                links.append(((d, index % 2, index, ranks), (direction, ranks[index], ranks[(index + step) % p])))
    return [link for _, link in sorted(links)]


def megatron_group_options(distributed_timeout_minutes: Optional[float] = None,
                           nccl_communicator_config_path: Optional[str] = None,
                           high_priority_stream_groups: Optional[Sequence[str]] = None,
                           pipeline_model_parallel_comm_backend: Optional[str] = None, **_ignored) -> dict:
    """Keyword arguments for the link groups, as Megatron's ``initialize_model_parallel`` builds its
    ``pp`` group from the same arguments (extra arguments of that call are ignored). ``pg_options`` is a
    factory (None without NCCL options): torch writes each group's ranks and name into the options object
    it is given, so every link group needs its own (a shared one would make NCCL's watchdog and flight
    recorder describe the last group created)."""
    from megatron.core import parallel_state

    configs: dict = {}
    if nccl_communicator_config_path is not None:
        import yaml

        with open(nccl_communicator_config_path, "r", encoding="utf-8") as stream:
            configs = yaml.safe_load(stream) or {}
    if "pp" in (high_priority_stream_groups or ()):
        configs.setdefault("pp", {})["is_high_priority_stream"] = True
    backend = pipeline_model_parallel_comm_backend
    return {
        "timeout": None if distributed_timeout_minutes is None else timedelta(minutes=distributed_timeout_minutes),
        "backend": backend,
        "pg_options": None if backend == "ucc" or "pp" not in configs else
        functools.partial(parallel_state.get_nccl_options, "pp", configs),
    }


def _warm_up(groups: Dict[LinkKey, dist.ProcessGroup], order: Sequence[LinkKey]) -> None:
    """One tiny blocking transfer per link this rank is on, in the shared order (builds NCCL communicators)."""
    me = dist.get_rank()
    for key in order:
        group = groups.get(key)
        if group is None:
            continue
        _, src, dst = key
        nccl = "nccl" in dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        buffer = torch.full((1,), float(src), device=device)
        if me == src:
            dist.send(buffer, dst, group=group)
        else:
            dist.recv(buffer, src, group=group)
            if int(buffer.item()) != src:  # .item() also waits for the NCCL transfer
                raise RuntimeError(f"rank {me}: PipeMesh link warm-up on {key} received {buffer.item()} instead of {src}")


def create_pipemesh_groups(timeout: Optional[timedelta] = None, backend: Optional[str] = None,
                           pg_options: Optional[Callable[[], object]] = None,
                           warm_up: bool = True) -> Dict[LinkKey, dist.ProcessGroup]:
    """Create (and warm up) the per-link groups: a collective call, every rank of the world calls it once
    after Megatron's ``initialize_model_parallel``. ``timeout``/``backend``/``pg_options`` as from
    :func:`megatron_group_options` (``pg_options`` makes a fresh options object for each group); None
    leaves torch's defaults (and the backend of the world)."""
    if pg_options is not None and not callable(pg_options):
        raise TypeError("create_pipemesh_groups(pg_options=...) takes a factory of options objects (one per link "
                        f"group: torch writes each group's ranks into its own), not {type(pg_options).__name__}; "
                        "pass megatron_group_options(...)['pg_options'] or lambda: make_options()")
    global _P2P_GROUPS, _FOR_PP_GROUP
    from megatron.core import parallel_state

    pp_group = parallel_state.get_pipeline_model_parallel_group()
    every: List[Optional[List[int]]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, dist.get_process_group_ranks(pp_group))
    order = pipeline_links(every)
    me = dist.get_rank()
    groups: Dict[LinkKey, dist.ProcessGroup] = {}
    for key in order:  # every rank creates every group, in the same order
        _, src, dst = key
        group = parallel_state.create_group([src, dst], timeout=timeout, backend=backend,
                                            pg_options=pg_options() if pg_options is not None else None,
                                            group_desc=f"PIPEMESH_LINK_{key[0]}_{src}_{dst}")
        if me in (src, dst):
            groups[key] = group
    if warm_up:
        _warm_up(groups, order)
    _P2P_GROUPS, _FOR_PP_GROUP = groups, pp_group
    return groups


def _default_timeout() -> Optional[timedelta]:
    """``--distributed-timeout-minutes`` when Megatron's global args exist (lazy creation), else None."""
    try:
        from megatron.training import global_vars
    except ImportError:  # core-only install
        return None
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    minutes = getattr(args, "distributed_timeout_minutes", None)
    return None if minutes is None else timedelta(minutes=minutes)


def get_pipemesh_p2p_groups(create: bool = True) -> Optional[Dict[LinkKey, dist.ProcessGroup]]:
    """The per-link groups of Megatron's current pipeline group; when missing (``install()`` was not
    active at ``initialize_model_parallel``) and ``create``, they are created here: a collective call that
    the schedule makes on every rank at its first call."""
    from megatron.core import parallel_state

    current = parallel_state.get_pipeline_model_parallel_group()
    if (_P2P_GROUPS is None or _FOR_PP_GROUP is not current) and create:
        create_pipemesh_groups(timeout=_default_timeout())
    return _P2P_GROUPS if _FOR_PP_GROUP is current else None
