"""This rank's share of the node's host memory for pinned activation blocks (integration/host_memory.py), with faked
/proc/meminfo, cgroup files and torchrun / Slurm environments."""
import dataclasses

import pytest

from megatron_pipemesh.integration import auto_plan as auto
from megatron_pipemesh.integration import host_memory as hm
from megatron_pipemesh.planning.costs import GB

KIB = 1024
# A node whose page cache is full: little is free, most is available.
FULL_CACHE = ("MemTotal:       1056000000 kB\nMemFree:           2000000 kB\nMemAvailable:    1000000000 kB\n"
              "Buffers:            10000 kB\nCached:          990000000 kB\nHugePages_Total:       0\n")


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A node with FULL_CACHE, no cgroup limit, and no launcher variables."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(FULL_CACHE)
    monkeypatch.setattr(hm, "MEMINFO", str(meminfo))
    monkeypatch.setattr(hm, "PROC_CGROUP", str(tmp_path / "no-cgroup"))
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NODEID", "CUDA_VISIBLE_DEVICES") + hm.SLURM_TASK_COUNTS + hm.MPI_LOCAL_SIZES:
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_meminfo_fields_are_bytes(node):
    fields = hm.read_meminfo()
    assert fields["MemAvailable"] == 1000000000 * KIB and fields["HugePages_Total"] == 0
    assert hm.available_bytes() == (1000000000 * KIB, "MemAvailable")


def test_a_plain_srun_shares_available_memory_among_its_tasks(node, monkeypatch):
    """srun with one task per GPU sets Slurm's task counts, not LOCAL_WORLD_SIZE: 8 ranks on this node (node 1 of
    "8(x2)") share MemAvailable (not MemFree, near zero under a full page cache), less the margin."""
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "8(x2)")
    monkeypatch.setenv("SLURM_NODEID", "1")
    share = auto.machine_host_share_bytes()
    assert share == pytest.approx(1000000000 * KIB / 8 * (1 - hm.MEMORY_MARGIN))


@pytest.mark.parametrize("environ, count, source", [
    ({"LOCAL_WORLD_SIZE": "4", "SLURM_NTASKS_PER_NODE": "1"}, 4, "LOCAL_WORLD_SIZE"),  # torchrun under sbatch
    ({"SLURM_NTASKS_PER_NODE": "8(x2)"}, 8, "SLURM_NTASKS_PER_NODE"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2,8", "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "0"}, 2,
     "SLURM_STEP_TASKS_PER_NODE"),
    ({"SLURM_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": "2"}, 4, "SLURM_TASKS_PER_NODE"),
    ({"SLURM_TASKS_PER_NODE": "8(x2),4"}, 8, "SLURM_TASKS_PER_NODE"),  # node unknown: the largest count
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0"}, 4, "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, 3, "visible GPUs"),
    ({}, 1, "default (no launcher count, no GPU)"),
])
def test_ranks_per_node_from_the_launcher_or_the_visible_gpus(environ, count, source):
    found = hm.ranks_per_node(environ, None if environ else (lambda: 0))
    assert (found.count, found.source) == (count, source)


def test_malformed_launcher_counts_are_named():
    with pytest.raises(ValueError, match="'8\\(y2\\)'"):
        hm.ranks_per_node({"SLURM_TASKS_PER_NODE": "8(y2)"})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='0'"):
        hm.ranks_per_node({"LOCAL_WORLD_SIZE": "0"})


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_cgroup_limit_caps_the_available_memory(node, monkeypatch, version):
    """Slurm's cgroup (or a container's) charges pinned pages to the job: its headroom caps MemAvailable."""
    job = "/slurm/uid_1/job_7/step_0"
    if version == "v2":
        (node / "cgroup").write_text(f"0::{job}\n")
        directory = node / "fs" / job.lstrip("/")
        limit, usage = "memory.max", "memory.current"
    else:
        (node / "cgroup").write_text(f"5:cpuset:/\n4:memory:{job}\n")
        directory = node / "fs" / "memory" / job.lstrip("/")
        limit, usage = "memory.limit_in_bytes", "memory.usage_in_bytes"
    directory.mkdir(parents=True)
    (directory / limit).write_text(f"{256 * GB}\n")
    (directory / usage).write_text(f"{56 * GB}\n")
    monkeypatch.setattr(hm, "PROC_CGROUP", str(node / "cgroup"))
    monkeypatch.setattr(hm, "CGROUP_ROOT", str(node / "fs"))
    available, what = hm.available_bytes()
    assert available == 200 * GB and what.startswith("cgroup ") and "below MemAvailable" in what
    (directory / limit).write_text("max\n" if version == "v2" else f"{1 << 62}\n")  # no limit
    assert hm.available_bytes()[1] == "MemAvailable"


def test_a_plan_file_whose_host_placement_exceeds_the_share_is_refused_naming_the_numbers(node, monkeypatch, tmp_path):
    """--pipemesh-plan with host placement made for a bigger host: refused at parse time with the pinned bytes the
    plan needs, the share and where its numbers came from (never a failing pinned allocation mid-iteration)."""
    from megatron_pipemesh.integration.flags import PipeMeshArgumentError, check_pipemesh_args
    from megatron_pipemesh.schedule.config import ScheduleConfig
    from megatron_pipemesh.schedule.plan import RunPlan
    from tests.integration.test_flags import _args

    config = ScheduleConfig(4, 2, 12, (12,), (12,))
    placement = {(1, 0, j): "host" for j in range(4)}
    path = tmp_path / "plan.json"
    path.write_text(RunPlan(config, placement, host_blocks={(1, 0): 32 << 30}).to_json())
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "8")
    need = RunPlan.from_json(path.read_text())
    assert hm.plan_host_bytes(need)[1] == 1 and hm.plan_host_bytes(need)[0] % (32 << 30) == 0
    with pytest.raises(PipeMeshArgumentError) as info:
        check_pipemesh_args(_args(pipemesh_plan=str(path)))
    text = str(info.value)
    assert f"needs {hm.plan_host_bytes(need)[0] / GB:.2f} GiB of pinned memory on pipeline rank 1" in text
    assert "MemAvailable 953.7 GiB / 8 ranks per node (SLURM_TASKS_PER_NODE)" in text and "--host-memory-gb 107.3" in text
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2")  # the same plan fits two ranks' shares
    assert check_pipemesh_args(_args(pipemesh_plan=str(path))).plan.host_blocks == {(1, 0): 32 << 30}


def _slurm_tree(node, version: str, limits: dict, usages: dict, leaf: str):
    """A Slurm-shaped cgroup tree under ``node``: this process in ``leaf``; ``limits`` / ``usages``: per directory
    (relative to the hierarchy's root), the memory limit and usage files written there (others hold none, as
    Slurm's task and user levels do)."""
    if version == "v2":
        (node / "cgroup").write_text(f"0::/{leaf}\n")
        root, limit_name, usage_name, unlimited = node / "fs", "memory.max", "memory.current", "max"
    else:
        (node / "cgroup").write_text(f"5:cpuset:/\n4:memory:/{leaf}\n")
        root, limit_name, usage_name, unlimited = node / "fs" / "memory", "memory.limit_in_bytes", \
            "memory.usage_in_bytes", str(1 << 63 - 1)
    parts = leaf.split("/")
    for depth in range(len(parts) + 1):
        directory = root.joinpath(*parts[:depth])
        directory.mkdir(parents=True, exist_ok=True)
        relative = "/".join(parts[:depth])
        if depth:  # the root of a hierarchy has no limit file (v2) or an unlimited one
            (directory / limit_name).write_text(f"{limits.get(relative, unlimited)}\n")
            (directory / usage_name).write_text(f"{usages.get(relative, 0)}\n")
    return root


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_slurms_job_limit_two_levels_above_the_task_caps_the_share(node, monkeypatch, version):
    """Slurm (cgroup v2, task/cgroup): the task sits in .../job_7/step_0/user/task_3 and memory.max is set on the
    job only; the task's own file reads 'max'. The job's headroom (64 GiB limit, 24 GiB charged) caps MemAvailable
    (953 GiB), and 8 ranks share that: every rank's share is under the job's limit, never an eighth of the node."""
    job = "system.slice/slurmstepd.scope/job_7"
    leaf = f"{job}/step_0/user/task_3"
    _slurm_tree(node, version, limits={job: 64 * GB}, usages={job: 24 * GB, f"{job}/step_0": 20 * GB,
                                                              leaf: 2 * GB}, leaf=leaf)
    monkeypatch.setattr(hm, "PROC_CGROUP", str(node / "cgroup"))
    monkeypatch.setattr(hm, "CGROUP_ROOT", str(node / "fs"))
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "8")
    available, what = hm.available_bytes()
    assert available == 40 * GB and job in what and "below MemAvailable" in what
    share = hm.host_share()
    assert share.bytes == pytest.approx(40 * GB / 8 * (1 - hm.MEMORY_MARGIN)) and 8 * share.bytes < 64 * GB


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_smallest_headroom_over_the_ancestors_wins(node, monkeypatch, version):
    """Limits on the job and on the step: what counts is the smallest limit less usage over every level from the
    task up to the root (here the job's 10 GiB left, though the step's limit is the smaller one)."""
    job = "slurm/uid_1/job_9"
    step = f"{job}/step_0"
    leaf = f"{step}/task_0"
    # job: 100 GiB limit, 90 charged (10 left); step: 60 GiB limit, 30 charged (30 left)
    _slurm_tree(node, version, limits={job: 100 * GB, step: 60 * GB}, usages={job: 90 * GB, step: 30 * GB},
                leaf=leaf)
    monkeypatch.setattr(hm, "PROC_CGROUP", str(node / "cgroup"))
    monkeypatch.setattr(hm, "CGROUP_ROOT", str(node / "fs"))
    headroom, where = hm.cgroup_headroom()
    assert headroom == 10 * GB and where.endswith(("job_9/memory.max", "job_9/memory.limit_in_bytes"))


def _plan_file(tmp_path):
    from megatron_pipemesh.schedule.config import ScheduleConfig
    from megatron_pipemesh.schedule.plan import RunPlan

    path = tmp_path / "plan.json"
    placement = {(1, 0, j): "host" for j in range(4)}
    path.write_text(RunPlan(ScheduleConfig(4, 2, 12, (12,), (12,)), placement, host_blocks={(1, 0): 32 << 30}).to_json())
    return path


class _Schedule:
    """The PipeMesh schedule the re-planner wraps: counts its calls."""

    calls = 0

    def __call__(self, **kwargs):
        self.calls += 1
        return "ran"


def _ranks_reading(monkeypatch, shares, rank):
    """torch.distributed as rank ``rank`` of ``len(shares)`` sees it: every rank's host share gathered."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda *a: len(shares))
    monkeypatch.setattr(dist, "get_rank", lambda *a: rank)

    def gather(out, mine, *a, **k):
        assert mine == shares[rank]
        out[:] = shares

    monkeypatch.setattr(dist, "all_gather_object", gather)


def test_ranks_whose_readings_disagree_refuse_a_plan_file_together(node, monkeypatch, tmp_path):
    """8 ranks: rank 0's node gives each of its 2 ranks 429 GiB, rank 5's gives each of its 8 ranks 11 GiB; the plan
    needs 128 GiB pinned on pipeline rank 1 (four 32 GiB blocks at once). Rank 0 alone would go on while rank 5 exits and rank 0 waits in NCCL:
    with several ranks nothing is refused at parse time, and at the first call every rank (rank 0 too) refuses
    with the smallest share, naming its rank, before any pinned block is allocated."""
    from megatron_pipemesh.integration.flags import check_pipemesh_args
    from megatron_pipemesh.integration.measured import MeasuredReplanner
    from tests.integration.test_flags import _args

    path = _plan_file(tmp_path)
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2")
    settings = check_pipemesh_args(_args(pipemesh_plan=str(path), world_size=8))
    assert settings.replan is not None and settings.replan.host_fit == hm.host_share()
    assert hm.plan_host_bytes(settings.plan) == (128 * GB, 1) and settings.replan.host_fit.bytes > 128 * GB
    small = hm.HostShare(100 * GB, "MemAvailable", hm.RanksPerNode(8, "SLURM_TASKS_PER_NODE", (8,)))
    shares = [settings.replan.host_fit] * 5 + [small] + [settings.replan.host_fit] * 2
    for rank in (0, 5):
        _ranks_reading(monkeypatch, shares, rank)
        schedule = _Schedule()
        inputs = dataclasses.replace(settings.replan, host_fit=shares[rank])  # what that rank read at parse time
        replanner = MeasuredReplanner(schedule, None, settings.plan, inputs)
        with pytest.raises(ValueError) as info:
            replanner(model=[])
        text = str(info.value)
        assert schedule.calls == 0 and "needs 128.00 GiB of pinned memory on pipeline rank 1" in text
        assert "rank 5's node (the smallest share over the 8 ranks) gives each rank MemAvailable 100.0 GiB / 8 " \
               "ranks per node" in text


def test_ranks_that_all_fit_run_the_plan_file_after_agreeing(node, monkeypatch, tmp_path):
    """Every rank's share fits: the first call checks once and runs; a single process is still refused (or not) at
    parse time, where nothing can disagree."""
    from megatron_pipemesh.integration.flags import check_pipemesh_args
    from megatron_pipemesh.integration.measured import MeasuredReplanner
    from tests.integration.test_flags import _args

    path = _plan_file(tmp_path)
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2")
    settings = check_pipemesh_args(_args(pipemesh_plan=str(path), world_size=4))
    _ranks_reading(monkeypatch, [settings.replan.host_fit] * 4, 2)
    schedule = _Schedule()
    replanner = MeasuredReplanner(schedule, None, settings.plan, settings.replan)
    assert replanner(model=[]) == "ran" and replanner(model=[]) == "ran" and schedule.calls == 2
    assert check_pipemesh_args(_args(pipemesh_plan=str(path), world_size=1)).replan is None
