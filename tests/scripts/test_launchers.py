"""scripts/pretrain_gpt_pipemesh.sh and scripts/slurm/*.sbatch: --help, --dry-run commands under a fake
Slurm job, the per-node srun chain, and error messages. (The real CPU run is in test_cpu_run.py.)"""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from .helpers import (BENCH, PYTHON, REPO, SBATCH, SINGLE, FAKE_PYTHON, clean_env, commands, exports,
                      fake_slurm, find, option, run, training_args, write_exe)

TINY = "configs/tiny-cpu.env"
GPT13 = "configs/gpt-1.3b.env"
PASS = ["--mock-data", "--lr", "2e-4", "--weird", "a b'c"]  # unknown flag and a value needing quotes


def _torchrun(cmds):
    found = [c for c in cmds if "torch.distributed.run" in c]
    assert len(found) == 1, cmds
    return found[0]


# ---------------------------------------------------------------------------------------------- help
@pytest.mark.parametrize("script", [SINGLE, SBATCH, BENCH], ids=lambda p: p.name)
def test_help_documents_every_option(script):
    """Each launcher's --help documents every option it accepts."""
    res = run(script, ["--help"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Usage:")
    for opt in ["--dry-run", "--config", "--set", "--nproc", "--python", "--megatron-lm-dir", "--run-dir",
                "--ifname", "--network", "-h, --help"]:
        assert opt in res.stdout, (script.name, opt)
    if script is not SINGLE:
        for opt in ["--nnodes", "--master-port", "--srun-args"]:
            assert opt in res.stdout, (script.name, opt)
    if script is BENCH:
        for opt in ["--schedules", "--train-iters", "--warmup", "--launcher"]:
            assert opt in res.stdout


# ---------------------------------------------------------------------------------- single node
def test_single_node_dry_run(tmp_path):
    """The dry run prints torchrun with config flags, then --set overrides, then the user's flags; creates nothing."""
    run_dir = tmp_path / "run"
    res = run(SINGLE, ["--dry-run", "--config", TINY, "--nproc", "2", "--python", PYTHON, "--run-dir", str(run_dir),
                       "--set", "GLOBAL_BATCH_SIZE=32", "--set", 'FORWARD_GROUPS=8 8', "--set", "BACKWARD_GROUPS=8 8",
                       "--unknown-flag", "7", "--", *PASS])
    assert res.returncode == 0, res.stderr
    assert not run_dir.exists(), "--dry-run must not create anything"
    cmds = commands(res.stdout)
    assert exports(cmds)["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "NCCL_SOCKET_IFNAME" not in exports(cmds)  # unset by default: NCCL chooses
    assert ["mkdir", "-p", f"{run_dir}/torchrun"] in cmds
    tr = _torchrun(cmds)
    assert tr[:3] == [PYTHON, "-m", "torch.distributed.run"]
    assert "--standalone" in tr and option(tr, "--nnodes") == "1" and option(tr, "--nproc-per-node") == "2"
    assert option(tr, "--log-dir") == f"{run_dir}/torchrun" and option(tr, "--tee") == "3"
    args = training_args(tr)
    # config flags first, then --set overrides, then the user's flags unchanged and in order
    assert option(args, "--num-layers") == "4" and option(args, "--pipeline-model-parallel-size") == "2"
    assert option(args, "--num-layers-per-virtual-pipeline-stage") == "1"
    assert option(args, "--global-batch-size") == "32"
    i = args.index("--forward-groups")
    assert args[i:i + 3] == ["--forward-groups", "8", "8"]
    assert option(args, "--pipeline-schedule") == "pipemesh"
    assert args[-(len(PASS) + 2):] == ["--unknown-flag", "7", *PASS]
    # CPU flags are the entry point's business, not the launcher's
    for cpu_flag in ("--distributed-backend", "--transformer-impl", "--use-cpu-initialization"):
        assert cpu_flag not in args


def test_every_pipemesh_config_key_becomes_its_flag(tmp_path):
    """PipeMesh's config keys (generated from PipeMeshConfig) map to their Megatron flags by kind."""
    res = run(SINGLE, ["--dry-run", "--config", TINY, "--nproc", "2", "--python", PYTHON, "--run-dir", str(tmp_path / "r"),
                       "--set", "MEASURE_MEMORY=1", "--set", "PRINT_SCHEDULE=0", "--set", "DP_GBPS=6.25",
                       "--set", "RECV_LOOKAHEAD=2", "--set", "PROFILE=/tmp/p.json"])
    assert res.returncode == 0, res.stderr
    args = training_args(_torchrun(commands(res.stdout)))
    assert "--pipemesh-measure-memory" in args and "--pipemesh-print-schedule" not in args
    assert option(args, "--pipemesh-dp-gbps") == "6.25" and option(args, "--pipemesh-recv-lookahead") == "2"
    assert option(args, "--pipemesh-profile") == "/tmp/p.json"
    bad = run(SINGLE, ["--dry-run", "--config", TINY, "--nproc", "2", "--python", PYTHON, "--set", "MEASURE_MEMORY=yes"])
    assert bad.returncode == 2 and "MEASURE_MEMORY=yes must be 0 or 1" in bad.stderr
    bad = run(SINGLE, ["--dry-run", "--config", TINY, "--nproc", "2", "--python", PYTHON, "--set", "MFU=high"])
    assert bad.returncode == 2 and "MFU=high is not a non-negative number" in bad.stderr


def test_single_node_env_vars_and_overrides(tmp_path):
    """Environment variables configure the launcher; a user-chosen stock schedule drops conflicting config flags."""
    env = clean_env({"PIPEMESH_CONFIG": TINY, "NPROC_PER_NODE": "3", "PIPEMESH_PYTHON": PYTHON,
                     "PIPEMESH_RUN_DIR": str(tmp_path / "r"), "PIPEMESH_IFNAME": "ens5",
                     "PIPEMESH_DRY_RUN": "1", "MASTER_PORT": "29511"})
    res = run(SINGLE, ["--network", "ethernet", "--", "--pipeline-schedule", "default",
                       "--num-virtual-stages-per-pipeline-rank", "2"], env=env)
    assert res.returncode == 0, res.stderr
    cmds = commands(res.stdout)
    ex = exports(cmds)
    assert ex["NCCL_SOCKET_IFNAME"] == "ens5" and ex["GLOO_SOCKET_IFNAME"] == "ens5"
    assert ex["NCCL_IB_DISABLE"] == "1"
    tr = _torchrun(cmds)
    assert option(tr, "--nproc-per-node") == "3"
    assert option(tr, "--master-port") == "29511" and "--standalone" not in tr
    args = training_args(tr)
    # the user chose the stock schedule and another virtual-pipeline flag: the config's conflicting
    # flags (groups, --num-layers-per-virtual-pipeline-stage) are left out
    assert "--forward-groups" not in args and "--backward-groups" not in args
    assert "--num-layers-per-virtual-pipeline-stage" not in args
    assert args.count("--pipeline-schedule") == 1 and option(args, "--pipeline-schedule") == "default"


def test_megatron_lm_checkout(tmp_path):
    """A Megatron-LM checkout given by option or environment goes first on PYTHONPATH and its pretrain_gpt.py is run."""
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("# stand-in\n")
    for how in ("option", "env"):
        extra = {"MEGATRON_LM_DIR": str(checkout)} if how == "env" else {}
        opts = ["--megatron-lm-dir", str(checkout)] if how == "option" else []
        res = run(SINGLE, ["--dry-run", "--nproc", "1", "--python", PYTHON, *opts, "--", "--mock-data"],
                  env=clean_env(extra))
        assert res.returncode == 0, res.stderr
        cmds = commands(res.stdout)
        assert exports(cmds)["PYTHONPATH"].split(":")[0] == str(checkout)
        args = training_args(_torchrun(cmds))
        assert args == ["--megatron-lm-script", str(checkout / "pretrain_gpt.py"), "--mock-data"]


@pytest.mark.parametrize("argv, env, needles", [
    (["--config", "configs/nope.env"], {}, ["configs/nope.env", "not found", "--config"]),
    (["--config"], {}, ["--config needs a value"]),
    (["--nproc", "two"], {}, ["--nproc", "two"]),
    (["--megatron-lm-dir", "/nonexistent/mlm"], {}, ["/nonexistent/mlm", "MEGATRON_LM_DIR"]),
    ([], {"MEGATRON_LM_DIR": "/"}, ["no pretrain_gpt.py", "Megatron-LM checkout"]),
    (["--python", "/no/such/python"], {}, ["/no/such/python", "--python", "PIPEMESH_PYTHON"]),
    (["--network", "infiniband"], {}, ["infiniband", "ethernet"]),
    (["--set", "FORWARD_GROUP=4 4"], {}, ["unknown key FORWARD_GROUP", "FORWARD_GROUPS"]),
    (["--set", "PP=two"], {}, ["PP=two"]),
])
def test_single_node_errors(argv, env, needles):
    """Bad launcher input exits 2 with an error naming the value and the fix."""
    base = ["--dry-run", "--python", PYTHON, "--nproc", "2"]
    res = run(SINGLE, base + argv, env=clean_env(env))
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr.startswith("error: ")
    for n in needles:
        assert n in res.stderr, (n, res.stderr)


def test_bad_config_file_names_the_line(tmp_path):
    """A bad config file is reported with its line number; the file is parsed, never evaluated."""
    cfg = tmp_path / "bad.env"
    cfg.write_text("# comment\nNUM_LAYERS=4\nPIPELINE=2\n")
    res = run(SINGLE, ["--dry-run", "--python", PYTHON, "--nproc", "2", "--config", str(cfg)])
    assert res.returncode == 2
    assert f"{cfg}:3: unknown key PIPELINE" in res.stderr
    cfg.write_text("NUM_LAYERS=$(rm -rf /)\n")
    res = run(SINGLE, ["--dry-run", "--python", PYTHON, "--nproc", "2", "--config", str(cfg)])
    assert res.returncode == 2 and f"{cfg}:1" in res.stderr  # parsed, never evaluated


def test_no_rank_count_is_an_error():
    """Without --nproc and without GPUs the launcher exits 2 asking for --nproc N."""
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: the GPU count is found")
    res = run(SINGLE, ["--dry-run", "--python", PYTHON, "--", "--mock-data"])
    assert res.returncode == 2 and "--nproc N" in res.stderr


# --------------------------------------------------------------------------------------- slurm
def test_sbatch_dry_run_fake_slurm(tmp_path):
    """In a (fake) Slurm job: one srun with node count, master, port, log dirs, and a note per node."""
    env = fake_slurm(tmp_path)
    run_dir = tmp_path / "job"
    res = run(SBATCH, ["--dry-run", "--config", GPT13, "--python", PYTHON, "--run-dir", str(run_dir),
                       "--ifname", "eth0", "--srun-args", "--cpu-bind=none --mpi=none", "--", *PASS], env=env)
    assert res.returncode == 0, res.stderr
    assert not run_dir.exists()
    cmds = commands(res.stdout)
    ex = exports(cmds)
    assert ex["NCCL_SOCKET_IFNAME"] == "eth0" and ex["GLOO_SOCKET_IFNAME"] == "eth0"
    assert ex["NCCL_IB_DISABLE"] == "1"  # gpt-1.3b.env: NETWORK=ethernet
    assert ex["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert ["mkdir", "-p", f"{run_dir}/logs", f"{run_dir}/torchrun"] in cmds
    (srun,) = find(cmds, "srun")
    assert option(srun, "--nodes") == "5" and option(srun, "--ntasks") == "5"
    assert option(srun, "--ntasks-per-node") == "1"
    assert option(srun, "--output") == f"{run_dir}/logs/%j-node%t.out"
    assert "--cpu-bind=none" in srun and "--mpi=none" in srun
    i = srun.index("bash")
    assert srun[i + 1] == str(REPO / "scripts" / "lib" / "srun_node.sh")
    tr = srun[i + 2:]
    assert tr[:3] == [PYTHON, "-m", "torch.distributed.run"]
    assert option(tr, "--nnodes") == "5" and option(tr, "--nproc-per-node") == "8"  # SLURM_GPUS_ON_NODE
    assert option(tr, "--master-addr") == "node01"
    assert option(tr, "--master-port") == str(20000 + 4242)
    assert option(tr, "--node-rank") == "{NODE_RANK}"
    assert option(tr, "--log-dir") == f"{run_dir}/torchrun/node{{NODE_RANK}}"
    args = training_args(tr)
    assert args[-len(PASS):] == PASS
    assert option(args, "--forward-groups") == "16" and option(args, "--pipeline-schedule") == "pipemesh"
    # scontrol was asked for the host names
    assert "scontrol show hostnames node[01-03,07],gpu5" in (tmp_path / "slurm.log").read_text()
    # one comment per node: its rank and log directory
    notes = [line for line in res.stdout.splitlines() if line.startswith("# node ")]
    assert notes[0].startswith("# node 0 = node01 (master node01:24242)")
    assert [n.split()[4].rstrip(":") for n in notes] == ["node01", "node02", "node03", "node07", "gpu5"]
    assert f"--node-rank 4 --log-dir {run_dir}/torchrun/node4" in notes[4]


def test_sbatch_uses_scontrol_names(tmp_path):
    """Host names come from scontrol when it is available."""
    env = fake_slurm(tmp_path, nodelist="gpu[1-2]", hostnames=["gpu-a.cluster", "gpu-b.cluster"], nnodes=2)
    res = run(SBATCH, ["--dry-run", "--python", PYTHON, "--", "--mock-data"], env=env)
    assert res.returncode == 0, res.stderr
    (srun,) = find(commands(res.stdout), "srun")
    assert option(srun, "--master-addr") == "gpu-a.cluster"


def test_sbatch_without_scontrol_parses_the_nodelist(tmp_path):
    """Without scontrol the script expands the nodelist itself and reads the GPU count from SLURM_GPUS_PER_NODE."""
    if shutil.which("scontrol"):
        pytest.skip("a real scontrol is on PATH")
    env = fake_slurm(tmp_path, nodelist="rack[2-3]-n[08-10],login1", scontrol=False, nnodes=None,
                     gpus=None)
    env["SLURM_JOB_NUM_NODES"] = "7"
    env["SLURM_GPUS_PER_NODE"] = "h100:4"
    res = run(SBATCH, ["--dry-run", "--python", PYTHON, "--", "--mock-data"], env=env)
    assert res.returncode == 0, res.stderr
    (srun,) = find(commands(res.stdout), "srun")
    assert option(srun, "--master-addr") == "rack2-n08"
    assert option(srun, "--nnodes") == "7" and option(srun, "--nproc-per-node") == "4"
    hosts = [line.split()[4].rstrip(":") for line in res.stdout.splitlines() if line.startswith("# node ")]
    assert hosts == ["rack2-n08", "rack2-n09", "rack2-n10", "rack3-n08", "rack3-n09", "rack3-n10", "login1"]


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07],gpu5", "node01 node02 node03 node07 gpu5"),
    ("a1", "a1"),
    ("n[9-11]", "n9 n10 n11"),
    ("x[001-002]y,z[3]", "x001y x002y z3"),
    ("a[1-2]-b[1,3]", "a1-b1 a1-b3 a2-b1 a2-b3"),
])
def test_nodelist_parser(nodelist, hosts):
    """pm_expand_nodelist expands Slurm node lists (ranges, zero padding, suffixes, several brackets)."""
    out = subprocess.run(["bash", "-c", f'source {REPO}/scripts/lib/common.sh && pm_expand_nodelist "$1"', "_",
                          nodelist], capture_output=True, text=True, check=True).stdout.split()
    assert out == hosts.split()


def test_sbatch_runs_one_torchrun_per_node(tmp_path):
    """Not a dry run: fake srun runs srun_node.sh on 3 'nodes', fake python records each torchrun."""
    env = fake_slurm(tmp_path, nodelist="cn[1-3]", hostnames=["cn1", "cn2", "cn3"], nnodes=3, gpus="4")
    fake_py = write_exe(tmp_path / "bin" / "fakepython", FAKE_PYTHON)
    env["FAKE_PYTHON_LOG"] = str(tmp_path / "python.log")
    run_dir = tmp_path / "job"
    res = run(SBATCH, ["--config", TINY, "--python", str(fake_py), "--run-dir", str(run_dir), "--", *PASS], env=env)
    assert res.returncode == 0, (res.stdout, res.stderr)
    calls = [json.loads(line) for line in (tmp_path / "python.log").read_text().splitlines()]
    # first the launcher's check that the interpreter can import megatron_pipemesh, then one torchrun per node
    assert calls[0][0] == "-c" and "megatron_pipemesh" in calls[0][1]
    calls = calls[1:]
    assert len(calls) == 3
    assert sorted(option(c, "--node-rank") for c in calls) == ["0", "1", "2"]
    for c in calls:
        rank = option(c, "--node-rank")
        assert option(c, "--master-addr") == "cn1" and option(c, "--nnodes") == "3"
        assert option(c, "--nproc-per-node") == "4"
        assert option(c, "--log-dir") == f"{run_dir}/torchrun/node{rank}"
        assert training_args(c)[-len(PASS):] == PASS
    # srun's per-node output files exist (%j = job id, %t = node)
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [f"4242-node{i}.out" for i in range(3)]


@pytest.mark.parametrize("drop, set_env, argv, needles", [
    ("SLURM_JOB_ID", {}, [], ["SLURM_JOB_ID is not set", "sbatch", "pretrain_gpt_pipemesh.sh"]),
    ("SLURM_JOB_NODELIST", {}, [], ["SLURM_JOB_NODELIST"]),
    ("SLURM_NNODES", {}, [], ["SLURM_NNODES", "--nnodes"]),
    ("SLURM_GPUS_ON_NODE", {}, [], ["--nproc N", "--gpus-per-node"]),
    (None, {}, ["--nnodes", "9"], ["9 nodes requested", "has 5"]),
    (None, {"SLURM_JOB_NODELIST": "node[01-03"}, [], ["node[01-03", "unbalanced"]),
    (None, {}, ["--config", "configs/missing.env"], ["configs/missing.env", "not found"]),
])
def test_sbatch_errors(tmp_path, drop, set_env, argv, needles):
    """Missing Slurm variables, too many nodes, a broken nodelist or a missing config exit 2 naming the problem."""
    env = fake_slurm(tmp_path, scontrol=False)
    if drop:
        env.pop(drop)
    env.update(set_env)
    res = run(SBATCH, ["--dry-run", "--python", PYTHON, *argv, "--", "--mock-data"], env=env)
    assert res.returncode == 2, (res.stdout, res.stderr)
    for n in needles:
        assert n in res.stderr, (n, res.stderr)


def test_sbatch_finds_repo_from_spool_copy(tmp_path):
    """sbatch runs a copy of the script from its spool directory: scripts/lib is found via SLURM_SUBMIT_DIR."""
    spool = tmp_path / "spool" / "job4242"
    spool.mkdir(parents=True)
    copy = spool / "slurm_script"
    shutil.copy(SBATCH, copy)
    env = fake_slurm(tmp_path)
    res = run(copy, ["--dry-run", "--python", PYTHON, "--", "--mock-data"], env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert str(REPO / "scripts" / "lib" / "srun_node.sh") in res.stdout
    env.pop("SLURM_SUBMIT_DIR")
    res = run(copy, ["--dry-run", "--python", PYTHON], env=env, cwd=tmp_path)
    assert res.returncode == 2 and "PIPEMESH_HOME" in res.stderr


def test_config_groups_checked_against_job_size(tmp_path):
    """Groups planned for another m give a warning naming FORWARD_GROUPS and the job's m."""
    env = fake_slurm(tmp_path, nodelist="n[1-4]", hostnames=["n1", "n2", "n3", "n4"], nnodes=4, gpus="1")
    res = run(SBATCH, ["--dry-run", "--config", GPT13, "--python", PYTHON], env=env)
    assert res.returncode == 0
    # 4 ranks, PP=4 -> DP=1 -> m=64, but the groups were planned for m=32
    assert "FORWARD_GROUPS" in res.stderr and "m = 64" in res.stderr and "warning:" in res.stderr


# ---------------------------------------------------------------------------------------- bench
def test_bench_dry_run_fake_slurm(tmp_path):
    """The bench script runs the 4 schedules with their own flags and ports, then summarize_runs.py."""
    env = fake_slurm(tmp_path, nodelist="node[1-8]", hostnames=[f"node{i}" for i in range(1, 9)], nnodes=8,
                     gpus="1")
    run_dir = tmp_path / "bench"
    res = run(BENCH, ["--dry-run", "--config", GPT13, "--python", PYTHON, "--run-dir", str(run_dir),
                      "--train-iters", "12", "--warmup", "3", "--ifname", "eth1", "--", *PASS], env=env)
    assert res.returncode == 0, res.stderr
    assert not run_dir.exists()
    cmds = commands(res.stdout)
    sruns = find(cmds, "srun")
    assert len(sruns) == 4
    runs = {}
    for srun in sruns:
        tr = srun[srun.index("bash") + 2:]
        name = option(srun, "--output").split("/")[-3]
        runs[name] = (tr, training_args(tr))
        assert option(tr, "--master-addr") == "node1" and option(tr, "--nnodes") == "8"
        args = runs[name][1]
        assert option(args, "--train-iters") == "12" and option(args, "--log-interval") == "1"
        assert option(args, "--eval-iters") == "0"
        assert args[-len(PASS):] == PASS
    assert list(runs) == ["1f1b", "depth-first", "breadth-first", "pipemesh"]
    ports = {option(tr, "--master-port") for tr, _ in runs.values()}
    assert len(ports) == 4
    a = runs["1f1b"][1]
    assert option(a, "--pipeline-schedule") == "default"
    assert "--num-virtual-stages-per-pipeline-rank" not in a and "--forward-groups" not in a
    a = runs["depth-first"][1]
    assert option(a, "--pipeline-schedule") == "default" and option(a, "--num-virtual-stages-per-pipeline-rank") == "2"
    assert "--microbatch-group-size-per-virtual-pipeline-stage" not in a and "--forward-groups" not in a
    a = runs["breadth-first"][1]
    # 8 ranks, TP=1, PP=4 -> DP=2; m = 64 / (1 x 2) = 32
    assert option(a, "--microbatch-group-size-per-virtual-pipeline-stage") == "32"
    assert option(a, "--pipeline-schedule") == "default"
    a = runs["pipemesh"][1]
    assert option(a, "--pipeline-schedule") == "pipemesh"
    i = a.index("--forward-groups")
    assert a[i:i + 6] == ["--forward-groups", "16", "4", "4", "4", "4"]
    assert exports(cmds)["NCCL_SOCKET_IFNAME"] == "eth1"
    (summary,) = [c for c in cmds if c[:1] == [PYTHON] and "summarize_runs.py" in c[1]]
    assert option(summary, "--warmup") == "3"
    assert option(summary, "--output") == f"{run_dir}/summary.md"
    assert summary[-4:] == [f"{n}={run_dir}/{n}" for n in ["1f1b", "depth-first", "breadth-first", "pipemesh"]]


def test_bench_local_launcher_dry_run(tmp_path):
    """--launcher local runs each chosen schedule with a standalone torchrun and its own log dir."""
    res = run(BENCH, ["--dry-run", "--launcher", "local", "--config", TINY, "--python", PYTHON, "--nproc", "2",
                      "--schedules", "depth-first,pipemesh", "--run-dir", str(tmp_path / "b"), "--",
                      "--mock-data"], env=clean_env())
    assert res.returncode == 0, res.stderr
    cmds = commands(res.stdout)
    trs = [c for c in cmds if "torch.distributed.run" in c]
    assert len(trs) == 2 and all("--standalone" in c for c in trs)
    assert [option(c, "--log-dir") for c in trs] == [f"{tmp_path}/b/depth-first/torchrun",
                                                     f"{tmp_path}/b/pipemesh/torchrun"]


@pytest.mark.parametrize("argv, needles", [
    ([], ["--config FILE is required"]),
    (["--config", TINY, "--schedules", "1f1b,zero-bubble"], ["zero-bubble", "depth-first"]),
    (["--config", TINY, "--train-iters", "3", "--warmup", "5"], ["--train-iters 3", "--warmup 5"]),
    (["--config", TINY, "--set", "LAYERS_PER_VP_STAGE=", "--schedules", "depth-first"], ["virtual pipeline", "VP"]),
    (["--config", TINY, "--launcher", "slurm"], ["SLURM_JOB_ID is not set"]),
])
def test_bench_errors(argv, needles):
    """Bad bench input (config, schedule, warm-up, VP, Slurm) exits 2 naming it."""
    res = run(BENCH, ["--dry-run", "--python", PYTHON, "--nproc", "2", *argv], env=clean_env())
    assert res.returncode == 2, (res.stdout, res.stderr)
    for n in needles:
        assert n in res.stderr, (n, res.stderr)
