"""Process groups PipeMesh adds on top of Megatron's ``parallel_state`` (which stays untouched).

:func:`initialize_model_parallel` keeps Megatron's signature, calls it, then creates:

* **one process group per directed pipeline link and direction** (activations r -> r+1 and
  gradients r+1 -> r, including the wrap-around links between the last and the first rank that
  interleaved placement uses). Why: NCCL serializes point-to-point operations per communicator
  in issue order, so with a single pipeline communicator a posted receive can hold back a later
  send (and with p = 2 the two directions of one pair become indistinguishable, the reason
  Megatron forbids PP=2 interleaving without overlap). With one communicator per link, a link's
  transfers are ordered among themselves only, which is exactly the order the schedule validator
  checks. Gloo (CPU) does not need them but gets them too, so CPU tests exercise the same code.

Nothing else changes: stage placement, embedding groups and data-parallel groups stay Megatron's.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch.distributed as dist

LinkKey = Tuple[str, int, int]
"""(direction 'F' or 'B', source global rank, destination global rank)."""

_P2P_GROUPS: Optional[Dict[LinkKey, dist.ProcessGroup]] = None


def _megatron_initialize():
    from megatron.core import parallel_state
    return getattr(parallel_state.initialize_model_parallel, "__wrapped__", parallel_state.initialize_model_parallel)


def initialize_model_parallel(*args, **kwargs) -> None:
    """Megatron's ``initialize_model_parallel`` (same arguments) + :func:`create_pipemesh_groups`."""
    _megatron_initialize()(*args, **kwargs)
    create_pipemesh_groups()


def create_pipemesh_groups() -> Dict[LinkKey, dist.ProcessGroup]:
    """Create the per-link groups (collective: every rank of the world must call it once)."""
    global _P2P_GROUPS
    from megatron.core import parallel_state

    pp_group = parallel_state.get_pipeline_model_parallel_group()
    mine = dist.get_process_group_ranks(pp_group)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    pipelines = sorted({tuple(ranks) for ranks in every})
    backend = dist.get_backend(pp_group)
    me = dist.get_rank()
    groups: Dict[LinkKey, dist.ProcessGroup] = {}
    for ranks in pipelines:
        p = len(ranks)
        if p < 2:
            continue
        for direction, step in (("F", 1), ("B", -1)):
            for index in range(p):
                src, dst = ranks[index], ranks[(index + step) % p]
                group = dist.new_group([src, dst], backend=backend)  # every rank calls, same order
                if me in (src, dst):
                    groups[(direction, src, dst)] = group
    _P2P_GROUPS = groups
    return groups


def get_pipemesh_p2p_groups(create: bool = True) -> Optional[Dict[LinkKey, dist.ProcessGroup]]:
    """The per-link groups; created on first use when ``create`` (a collective call)."""
    if _P2P_GROUPS is None and create:
        create_pipemesh_groups()
    return _P2P_GROUPS


def destroy_pipemesh_groups() -> None:
    global _P2P_GROUPS
    _P2P_GROUPS = None
