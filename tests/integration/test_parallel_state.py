"""Per-link pipeline groups: a creation/warm-up order that cannot deadlock, and Megatron's group options."""
from datetime import timedelta
from typing import Dict, List, Sequence

import pytest

from megatron_pipemesh.integration.parallel_state import megatron_group_options, pipeline_links


def _blocking_run(per_rank: Dict[int, List[tuple]]) -> bool:
    """Each rank works through its links in order, each step blocking until the link's other rank is on
    the same link; True if every rank finishes (no deadlock)."""
    position = {rank: 0 for rank in per_rank}
    while True:
        progressed = False
        for rank, links in per_rank.items():
            if position[rank] == len(links):
                continue
            link = links[position[rank]]
            _, src, dst = link
            peer = dst if rank == src else src
            peer_links = per_rank[peer]
            if position[peer] < len(peer_links) and peer_links[position[peer]] == link:
                position[rank] += 1
                position[peer] += 1
                progressed = True
        if all(position[r] == len(l) for r, l in per_rank.items()):
            return True
        if not progressed:
            return False


def _per_rank(order: Sequence[tuple]) -> Dict[int, List[tuple]]:
    out: Dict[int, List[tuple]] = {}
    for link in order:
        for rank in link[1:]:
            out.setdefault(rank, []).append(link)
    return out


@pytest.mark.parametrize("pipelines", [[[0, 1]], [[0, 1, 2]], [[0, 2, 4, 6], [1, 3, 5, 7]], [[4, 5, 6, 7, 0, 1, 2, 3]]])
def test_shared_link_order_cannot_deadlock(pipelines):
    """Every directed link of every pipeline appears once, and blocking on them in the shared order completes."""
    order = pipeline_links(pipelines)
    p = len(pipelines[0])
    assert len(order) == len(set(order)) == 2 * p * len(pipelines)
    assert order == pipeline_links(list(reversed(pipelines)))  # the same on every rank, whatever it gathered
    assert order == pipeline_links([ranks for ranks in pipelines for _ in ranks])  # one report per rank
    assert _blocking_run(_per_rank(order))


def test_the_deadlock_check_can_fail():
    """A per-rank order that differs between ranks (rank 1 takes its links backwards) is caught."""
    per_rank = _per_rank(pipeline_links([[0, 1, 2]]))
    per_rank[1] = list(reversed(per_rank[1]))
    assert not _blocking_run(per_rank)


def test_even_positions_before_odd_within_a_direction():
    """Even/odd phases: within one direction, links leaving even pipeline positions come first."""
    order = pipeline_links([[10, 11, 12, 13]])
    forward = [link for link in order if link[0] == "F"]
    assert forward == [("F", 10, 11), ("F", 12, 13), ("F", 11, 12), ("F", 13, 10)]


def test_group_options_follow_megatron_arguments():
    """The distributed timeout becomes the groups' timeout; ucc gets no NCCL options; other arguments pass."""
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import
    prepare_megatron_import()
    options = megatron_group_options(distributed_timeout_minutes=7, pipeline_model_parallel_comm_backend=None,
                                     tensor_model_parallel_size=2, some_future_argument=True)
    assert options == {"timeout": timedelta(minutes=7), "backend": None, "pg_options": None}
    assert megatron_group_options(pipeline_model_parallel_comm_backend="ucc")["pg_options"] is None


def test_every_link_group_gets_its_own_nccl_options(monkeypatch):
    """torch writes each group's ranks and name into the options object it is given, so each link group must get
    a fresh ``ProcessGroupNCCL.Options``. Checked without NCCL: Megatron's options builder and the group creation
    are stand-ins recording what each of the four link groups of a two-rank pipeline is created with."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import
    prepare_megatron_import()
    from megatron.core import parallel_state as ps

    from megatron_pipemesh.integration.parallel_state import create_pipemesh_groups

    built, created = [], []

    def get_nccl_options(name, configs):  # Megatron's builds a new object per call (parallel_state.py:168)
        built.append(SimpleNamespace(name=name, **configs[name]))
        return built[-1]

    def create_group(ranks, pg_options=None, group_desc=None, **_):
        created.append((tuple(ranks), pg_options))
        return group_desc

    def all_gather_object(out, obj):
        out[:] = [obj] * len(out)

    monkeypatch.setattr(ps, "get_nccl_options", get_nccl_options)
    monkeypatch.setattr(ps, "create_group", create_group)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_group", lambda: "pp")
    for name, value in (("get_world_size", lambda *a: 2), ("get_rank", lambda *a: 0),
                        ("get_process_group_ranks", lambda group: [0, 1]), ("all_gather_object", all_gather_object)):
        monkeypatch.setattr(dist, name, value)
    groups = create_pipemesh_groups(**megatron_group_options(high_priority_stream_groups=["pp"]), warm_up=False)
    assert sorted(groups) == [("B", 0, 1), ("B", 1, 0), ("F", 0, 1), ("F", 1, 0)]
    options = [opts for _, opts in created]
    assert len(options) == 4 and len({id(opts) for opts in options}) == 4, options
    assert all(opts.is_high_priority_stream for opts in options)
    with pytest.raises(TypeError, match="factory of options objects"):
        create_pipemesh_groups(pg_options=built[0], warm_up=False)
