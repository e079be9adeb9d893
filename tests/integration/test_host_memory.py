"""This rank's share of the node's host memory for pinned activation blocks (integration/host_memory.py), with faked
/proc/meminfo, cgroup files and torchrun / Slurm environments."""
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
