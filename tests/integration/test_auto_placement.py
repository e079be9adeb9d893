"""--pipemesh-activation-placement in training (integration/auto_plan.py, measured.py): planner options,
host link and host memory defaults, and the agreement of rank-local inputs at the first call."""
import pytest

from megatron_pipemesh.integration import auto_plan as auto
from megatron_pipemesh.integration.measured import MeasuredReplanner
from megatron_pipemesh.planning.costs import DEFAULT_HOST_LINK_GBPS, GB
from megatron_pipemesh.runtime import host_link
from megatron_pipemesh.schedule.config import ScheduleConfig
from tests.integration.test_auto_budget import Resolved, StandInSchedule, _args

TIGHT_GB = 0.12  # the 4-rank test model needs recomputation or offloading below ~0.2 GiB per device


def _placement_args(mode, **overrides):
    values = dict(pipemesh_memory_budget_gb=TIGHT_GB, pipemesh_activation_placement=mode, pipemesh_host_link_gbps=None,
                  pipemesh_host_memory_gb=4.0)
    values.update(overrides)
    return _args(**values)


def _levels(resolved):
    return set(resolved.plan.placement.values())


def test_auto_placement_offloads_where_recompute_only_recomputes(monkeypatch):
    """Under the same tight budget, planning for GPUs (copies on streams of their own), 'auto' places
    chunk-micro-batches on the host, 'recompute-only' never does."""
    monkeypatch.setattr(auto, "machine_host_share_bytes", lambda: 64 * GB)
    monkeypatch.setattr(auto, "_on_cuda", lambda: True)
    link = dict(pipemesh_host_link_gbps=DEFAULT_HOST_LINK_GBPS)  # given: nothing to measure on a GPU
    only = Resolved(*auto.auto_plan(_placement_args("recompute-only", **link), 4, 2, 12))
    placed = Resolved(*auto.auto_plan(_placement_args("auto", **link), 4, 2, 12))
    assert "host" not in _levels(only) and "host" in _levels(placed)
    assert f"activation placement auto, host link {DEFAULT_HOST_LINK_GBPS:g} Gbit/s, host memory 4.0 GiB" in placed.summary
    assert placed.replan is None  # nothing rank-local: budget, host link and host memory all given or default


def test_auto_placement_on_cpu_prices_copies_on_the_compute_thread(monkeypatch):
    """On CPU ranks a host copy is a memcpy on the rank's own thread: the planner's costs say so, and 'auto' is then
    never predicted slower than 'recompute-only' under the same budget."""
    monkeypatch.setattr(auto, "machine_host_share_bytes", lambda: 64 * GB)
    assert not auto._on_cuda()
    args = _placement_args("auto")
    _, cluster = auto.model_and_cluster(args, auto.device_rate(args, "test"))
    assert cluster.host_copies_on_compute
    only = Resolved(*auto.auto_plan(_placement_args("recompute-only"), 4, 2, 12))
    placed = Resolved(*auto.auto_plan(args, 4, 2, 12))
    time = lambda resolved: resolved.plan.predicted["predicted_iteration_time_s"]  # noqa: E731
    assert time(placed) <= time(only)


def test_given_groups_are_placed_under_a_budget(monkeypatch):
    """With given groups, 'auto' fits host placement / recomputation to them (the groups stay)."""
    monkeypatch.setattr(auto, "machine_host_share_bytes", lambda: 64 * GB)
    config = ScheduleConfig(4, 2, 12, (6, 6), (6, 6))
    resolved = Resolved(*auto.place_given_groups(_placement_args("auto"), config))
    assert resolved.plan.schedule == config and "host" in _levels(resolved)
    with pytest.raises(ValueError, match="does not fit the memory budget of 0.01 GiB"):
        auto.place_given_groups(_placement_args("auto", pipemesh_memory_budget_gb=0.01), config)


def test_host_memory_flag_capped_by_the_machine_and_link_measured_on_gpu(monkeypatch):
    """--pipemesh-host-memory-gb above the machine's share is capped (rank-local then); on a GPU the host link is
    measured once when 'auto' may offload, never for the other modes or when the flag is given."""
    monkeypatch.setattr(auto, "machine_host_share_bytes", lambda: 0.5 * GB)
    assert auto.host_budget_bytes(_placement_args("auto", pipemesh_host_memory_gb=4.0)) == (0.5 * GB, True)
    assert auto.host_budget_bytes(_placement_args("auto", pipemesh_host_memory_gb=0.25)) == (0.25 * GB, False)
    calls = []

    def measured():
        calls.append(1)
        return host_link.HostLink(d2h_gbps=180.0, h2d_gbps=150.0, nbytes=256 << 20)

    monkeypatch.setattr(auto, "_on_cuda", lambda: True)
    monkeypatch.setattr(host_link, "startup_host_link", measured)
    link, source, local = auto.host_link_gbps(_placement_args("auto"))
    assert (link, local) == (150.0, True) and "measured d2h 180 / h2d 150 Gbit/s" in source
    assert auto.host_link_gbps(_placement_args("recompute-only"))[0] == DEFAULT_HOST_LINK_GBPS
    assert auto.host_link_gbps(_placement_args("auto", pipemesh_host_link_gbps=64.0))[:2] == (64.0, "given")
    assert calls == [1]


def test_ranks_agree_on_the_slowest_host_link(monkeypatch):
    """A rank that measured a fast host link re-plans, at the first call, with the slowest link over ranks."""
    import torch.distributed as dist

    monkeypatch.setattr(auto, "machine_host_share_bytes", lambda: 64 * GB)
    monkeypatch.setattr(auto, "_on_cuda", lambda: True)
    monkeypatch.setattr(auto, "_device_defaults", lambda args: (None, None))
    monkeypatch.setattr(host_link, "startup_host_link", lambda: host_link.HostLink(400.0, 400.0, 1))
    resolved = Resolved(*auto.auto_plan(_placement_args("auto"), 4, 2, 12))
    assert resolved.replan.agree_on_host and resolved.replan.cluster.host_link_gbps == 400.0
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), [mine, (0.5, mine[1])]))
    made = []

    def make_schedule(plan):
        made.append(dict(plan.placement))
        return StandInSchedule()

    replanner = MeasuredReplanner(StandInSchedule(), make_schedule, resolved.plan, resolved.replan)
    replanner()
    replanner()
    assert replanner.cluster.host_link_gbps == 0.5 and len(made) == 1
    # at 0.5 Gbit/s copies cannot hide behind compute: the agreed plan offloads less than the 400 Gbit/s one
    assert sum(v == "host" for v in made[0].values()) < sum(v == "host" for v in resolved.plan.placement.values())
