"""configs/*.env: every file parses, states its cluster, and its groups are valid for the layout it states."""
from __future__ import annotations

import re

import pytest

from megatron_pipemesh.schedule.config import ScheduleConfig

from .helpers import PYTHON, REPO, SBATCH, SINGLE, commands, fake_slurm, option, run, training_args

CONFIGS = sorted((REPO / "configs").glob("*.env"))


def read(path):
    values = {}
    for raw in path.read_text().splitlines():
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        k, _, v = s.partition("=")
        values[k] = v.strip('"')
    return values


def test_shipped_configs():
    """The tiny CPU config and the 1.3B, 7B and 13B GPU configs are shipped."""
    assert {p.name for p in CONFIGS} >= {"tiny-cpu.env", "gpt-1.3b.env", "gpt-7b.env", "gpt-13b.env"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_groups_valid_for_stated_cluster(path):
    """Each config's groups are valid for the p, V and m that its stated cluster gives."""
    c = read(path)
    world = int(c["NNODES"]) * int(c["GPUS_PER_NODE"])
    tp, pp = int(c.get("TP", 1)), int(c["PP"])
    dp = world // (tp * pp)
    assert dp * tp * pp == world
    m = int(c["GLOBAL_BATCH_SIZE"]) // (int(c["MICRO_BATCH_SIZE"]) * dp)
    vpp = int(c["VP"]) if c.get("VP") else int(c["NUM_LAYERS"]) // (pp * int(c["LAYERS_PER_VP_STAGE"]))
    assert int(c["NUM_LAYERS"]) % (pp * vpp) == 0
    ScheduleConfig(pp, vpp, m, tuple(map(int, c["FORWARD_GROUPS"].split())),
                   tuple(map(int, c["BACKWARD_GROUPS"].split())))  # raises on invalid groups


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.name.startswith("gpt-")], ids=lambda p: p.name)
def test_gpu_configs_document_cluster_and_planner_command(path):
    """GPU configs state the cluster, the network and the planner command whose choice they hold."""
    text = path.read_text()
    assert re.search(r"Cluster assumed: \d+ nodes x \d+ GPUs?, NVIDIA .* \d+ GB", text)
    assert re.search(r"\d+ Gbit/s Ethernet", text)
    assert "#   pipemesh plan --pp" in text  # the exact planner command
    c = read(path)
    assert f"{c['FORWARD_GROUPS']} / {c['BACKWARD_GROUPS']}" in text  # the plan's choice is the config's


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_launches_without_warnings(tmp_path, path):
    """Each config dry-runs through its launcher without warnings, passing its layers and the PipeMesh schedule."""
    c = read(path)
    nodes, gpus = int(c["NNODES"]), c["GPUS_PER_NODE"]
    if nodes == 1:
        res = run(SINGLE, ["--dry-run", "--config", str(path), "--python", PYTHON, "--", "--mock-data"])
    else:
        env = fake_slurm(tmp_path, nodelist=f"n[1-{nodes}]", hostnames=[f"n{i}" for i in range(1, nodes + 1)],
                         nnodes=nodes, gpus=gpus)
        res = run(SBATCH, ["--dry-run", "--config", str(path), "--python", PYTHON, "--", "--mock-data"], env=env)
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr, res.stderr
    (tr,) = [x for x in commands(res.stdout) if "torch.distributed.run" in x]
    args = training_args(tr)
    assert option(args, "--num-layers") == c["NUM_LAYERS"]
    assert option(args, "--pipeline-schedule") == "pipemesh"
