"""``pipemesh profile`` on several ranks times the links (integration/profile_links.py): the launcher's environment is
read and checked, nodes are told apart, the patterns follow the nodes found; on four gloo ranks placed on two nodes
every pattern is timed (flows sharing a NIC, one node's collectives); torchrun of the profile on two ranks writes the
links and ``pipemesh plan --profile`` takes the measured rates; on the bench's per-rank network (root) the NIC is
measured at the shaped rate."""
import json
import os
import subprocess
import sys

import pytest

from megatron_pipemesh.integration.profile_links import (CPU_BUCKET_BYTES, LaunchError, link_cases, launched,
                                                         megatron_bucket_bytes, message_sizes, node_notes,
                                                         node_numbers, round_trip_pairs)
from megatron_pipemesh.planning.profile import load
from megatron_pipemesh.planning.profile_network import (ALL_RANKS, BETWEEN_NODES, ONE_NODE, ROUND_TRIP, WITHIN_NODE,
                                                        NetworkProfile)
from tests import megatron_harness as h
from tests.cli.test_commands import run

SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 257 --pipeline-model-parallel-size 2")
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n0",
            "MASTER_PORT": "29500"}


def test_the_launch_is_read_from_torchruns_environment_and_bad_values_are_named():
    """One process (no WORLD_SIZE, or 1) is no launch; torchrun's variables give rank, world, local rank and local
    world; a rank outside the world, a non-number, a missing rendezvous address or several Slurm tasks without
    torchrun are refused naming what to do."""
    assert launched({}) is None and launched({"WORLD_SIZE": "1"}) is None
    launch = launched(TORCHRUN)
    assert (launch.rank, launch.world, launch.local_rank, launch.local_world) == (1, 4, 1, 2)
    with pytest.raises(LaunchError, match="RANK between 0 and 3"):
        launched({**TORCHRUN, "RANK": "4"})
    with pytest.raises(LaunchError, match="LOCAL_RANK='x' is not a whole number"):
        launched({**TORCHRUN, "LOCAL_RANK": "x"})
    with pytest.raises(LaunchError, match="MASTER_ADDR and MASTER_PORT"):
        launched({key: value for key, value in TORCHRUN.items() if key != "MASTER_ADDR"})
    # srun's own tasks (no torchrun) would not meet: refused; one task, or torchrun under srun, is fine
    with pytest.raises(LaunchError, match="one of 16 Slurm tasks without torchrun"):
        launched({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "16"})
    assert launched({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}) is None
    assert launched({**TORCHRUN, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}).world == 4


def test_nodes_are_numbered_by_first_rank_and_the_notes_say_what_cannot_be_measured():
    """Ranks sharing a hostname and network namespace share a node; one node leaves the NIC unmeasured, one rank per
    node the intra-node link and the shared flows; ranks per node unlike LOCAL_WORLD_SIZE are said."""
    assert node_numbers(["b ns", "a ns", "b ns", "a ns"]) == (0, 1, 0, 1)
    assert "the NIC is not measured: all 2 ranks ran on one node" in node_notes((0, 0), 2)[0]
    one_each = node_notes((0, 1), 2)
    assert one_each[0].startswith("the intra-node link and flows sharing a NIC are not measured: one rank per node")
    assert one_each[1].endswith("2 with 1 ranks each, while the launcher's LOCAL_WORLD_SIZE is 2")
    assert node_notes((0, 0, 1, 1), 2) == []


def test_the_patterns_follow_the_nodes():
    """One node of two ranks: p2p inside it and the collectives over all; two nodes of one rank: p2p between them;
    two nodes of two: both, the first node's ranks each sending to the other node at once, and the collectives
    over one node as well; every pattern at every message size."""
    def names(cases):
        return [(case.pattern, case.scope, case.ranks, case.flows) for case in cases]

    one_node = names(link_cases((0, 0), [100]))
    assert one_node == [("p2p", WITHIN_NODE, (0, 1), ((0, 1),)),
                        ("p2p both ways", WITHIN_NODE, (0, 1), ((0, 1), (1, 0))),
                        ("all-reduce", ALL_RANKS, (0, 1), ()), ("reduce-scatter", ALL_RANKS, (0, 1), ()),
                        ("all-gather", ALL_RANKS, (0, 1), ()), ("all-to-all", ALL_RANKS, (0, 1), ())]
    assert [case[:2] for case in names(link_cases((0, 1), [100]))][:2] == [("p2p", BETWEEN_NODES),
                                                                           ("p2p both ways", BETWEEN_NODES)]
    two_by_two = link_cases((0, 1, 0, 1), [100, 200])
    assert len(two_by_two) == 2 * 13 and {case.nbytes for case in two_by_two} == {100, 200}
    shared = [case for case in two_by_two if case.pattern == "shared NIC"][0]
    assert shared.flows == ((0, 1), (2, 3)) and shared.ranks == (0, 1, 2, 3)
    assert [case.ranks for case in two_by_two if case.scope == ONE_NODE] == [(0, 2)] * 8
    # a message's fixed time: between the first ranks of two nodes, and inside the first node holding two ranks
    assert round_trip_pairs((0, 0)) == [(WITHIN_NODE, 0, 1)]
    assert round_trip_pairs((0, 1)) == [(BETWEEN_NODES, 0, 1)]
    assert round_trip_pairs((0, 1, 0, 1)) == [(BETWEEN_NODES, 0, 1), (WITHIN_NODE, 0, 2)]
    assert round_trip_pairs((0, 1, 1)) == [(BETWEEN_NODES, 0, 1), (WITHIN_NODE, 1, 2)]
    assert message_sizes(2, 32, 64, 4, CPU_BUCKET_BYTES) == {"activation": 16384, "bucket": 4 * 2 ** 20}
    assert message_sizes(2, 32, 64, 4, CPU_BUCKET_BYTES, topk=2)["dispatch"] == 2 * 16384


def test_the_bucket_is_megatrons_in_parameters_of_the_gradient_buffers_dtype(megatron):
    """Megatron's DDP bucket is 40,000,000 parameters (1,000,000 x the data-parallel size above 40 ranks) or
    --ddp-bucket-size, each of the gradient buffer's dtype: fp32 for bf16 (validation sets
    --accumulate-allreduce-grads-in-fp32) unless --grad-reduce-in-bf16 -- not 40 MiB."""
    from megatron_pipemesh.integration.profile import grad_bytes
    from tests.integration.conftest import TINY, profile_args_of

    assert megatron_bucket_bytes(None, 8, 4) == 160_000_000 and megatron_bucket_bytes(None, 64, 4) == 256_000_000
    assert megatron_bucket_bytes(20_000_000, 64, 2) == 40_000_000
    assert grad_bytes(megatron) == 4  # fp32 parameters
    assert grad_bytes(profile_args_of(TINY.split() + ["--bf16"])) == 4
    assert grad_bytes(profile_args_of(TINY.split() + ["--bf16", "--grad-reduce-in-bf16"])) == 2


def four_ranks_on_two_nodes():
    """Worker: gloo ranks 0, 2 on node 'a' and 1, 3 on node 'b' (the node key replaced: one machine has one), every
    link timed once at small messages."""
    import torch.distributed as dist

    from megatron_pipemesh.integration import profile_links

    dist.init_process_group("gloo")
    profile_links.node_key = lambda: "ab"[dist.get_rank() % 2]
    network, notes = profile_links.measure_network(profile_links.launched(), {"activation": 4096, "bucket": 65536},
                                                   warmup=1, repeats=2, cuda=False)
    return {"network": network.to_dict(), "notes": notes}


def test_four_ranks_on_two_nodes_time_every_pattern():
    """Every pattern is timed with positive seconds and rates; the NIC is the shared flows' sum (two flows), the
    intra-node rate one flow inside a node; every rank gets the same points; the one note is that torchrun's
    LOCAL_WORLD_SIZE (4: one machine) disagrees with the nodes found."""
    results = h.run_worker(f"{__file__}:four_ranks_on_two_nodes", nproc=4, timeout=240)
    network = NetworkProfile.from_dict(results[0]["network"])
    assert results[0]["notes"] == ["nodes told apart by hostname and network namespace: 2 with 2 ranks each, while "
                                   "the launcher's LOCAL_WORLD_SIZE is 4"]
    assert network.node_of_rank == (0, 1, 0, 1) and network.backend == "gloo" and network.nodes == 2
    assert len(network.points) == 28 and all(p.gbps > 0 and len(p.seconds) == 2 and min(p.seconds) > 0
                                             for p in network.points)
    shared = [p for p in network.points if p.pattern == "shared NIC" and p.nbytes == 65536][0]
    assert network.nic_gbps == pytest.approx(2 * shared.gbps) and network.nic_from.startswith("2 flows sharing a NIC")
    inside = [p for p in network.points if p.pattern == "p2p" and p.scope == WITHIN_NODE and p.nbytes == 65536][0]
    assert network.intra_node_gbps == inside.gbps
    trips = [p for p in network.points if p.pattern == ROUND_TRIP]
    assert [(p.scope, p.ranks, p.nbytes) for p in trips] == [(BETWEEN_NODES, (0, 1), 4), (WITHIN_NODE, (0, 2), 4)]
    assert network.round_trip is trips[0] and network.latency_us == pytest.approx(trips[0].median_s / 2 * 1e6)
    assert all(NetworkProfile.from_dict(r["network"]).points == network.points for r in results[1:])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """torchrun of pipemesh profile on two ranks of this machine (one node)."""
    path = tmp_path_factory.mktemp("links") / "profile.json"
    done = h.run_torchrun(["-m", "megatron_pipemesh", "profile", "--megatron-args", SMALL, "--output", str(path),
                           "--repeats", "2", "--warmup", "1", "--max-seconds", "0", "--bucket-mib", "1"], nproc=2, timeout=300,
                          env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, h.failure_excerpt(done.stdout)
    return path, done.stdout


def test_torchrun_profile_writes_the_links_and_plan_takes_the_measured_rate(two_ranks):
    """The file has the compute (rank 0) and the links: one node of two ranks, a positive intra-node rate, no NIC
    (noted); --show prints them; plan --profile prices with the measured intra-node rate and says so, still needs
    --nic-gbps (one line naming why) and, given --intra-node-gbps, says the flag won over the measurement."""
    path, output = two_ranks
    profile = load(str(path))
    assert [p.micro_batch_size for p in profile.compute] == [1, 2]
    network = profile.network
    assert network.node_of_rank == (0, 0) and network.nic_gbps is None and network.intra_node_gbps > 0
    assert network.round_trip.scope == WITHIN_NODE and 0 < network.latency_us < 1e5
    assert network.sizes == {"activation": 16384, "bucket": 2 ** 20}
    assert any("the NIC is not measured: all 2 ranks ran on one node" in note for note in profile.notes)
    # rank 0 timed the data loader in a child of its own (the builder's barriers would span the job)
    assert all(point.batch_s > 0 for point in profile.compute) and "micro-batch 2: data loader" in output
    assert not any("data loader" in note for note in profile.notes)
    assert output.count("wrote ") == 1  # rank 0 alone writes and prints
    code, out, err = run(["profile", "--show", str(path)])
    assert code == 0 and "intra-node link: " in out and "NIC: not measured (one node)" in out
    assert f"message latency: {network.latency_us:.4g} us (half a round trip within a node)" in out
    cluster = ["--nodes", "1", "--gpus-per-node", "2", "--device-memory-gib", "1", "--quiet"]
    code, out, err = run(["plan"] + cluster + ["--megatron-args", SMALL, "--profile", str(path)])
    assert code == 2 and "--nic-gbps (one node's network interface, Gbit/s per direction) is required: the " \
                         f"profile {path} did not measure the NIC (it ran on one node" in err
    code, out, err = run(["plan"] + cluster + ["--nic-gbps", "0.1", "--megatron-args", SMALL, "--profile", str(path),
                                               "--json"])
    assert code == 0, err
    report = json.loads(out)["profile"]
    assert f"intra-node link {network.intra_node_gbps:.4g} Gbit/s measured (profile)" in report["measured"]["1"]
    assert "NIC 0.1 Gbit/s (--nic-gbps, given)" in report["assumed"]["1"]
    latency = {item["what"]: item for item in json.loads(out)["assumed"]}["message latency"]
    assert latency["value"] == f"{network.latency_us:.4g} us per pipeline transfer and collective step"
    assert latency["source"].startswith("measured by the profile: half a 4-byte round trip within a node (ranks 0 "
                                        "and 1, gloo)")
    assert report["links"]["intra_node"] == {"gbps": network.intra_node_gbps, "source": "measured",
                                             "measured_gbps": network.intra_node_gbps}
    code, out, err = run(["plan"] + cluster + ["--nic-gbps", "0.1", "--intra-node-gbps", "50", "--megatron-args", SMALL,
                                               "--profile", str(path)])
    assert code == 0, err
    assert f"intra-node link 50 Gbit/s (--intra-node-gbps, given; the profile measured " \
           f"{network.intra_node_gbps:.4g})" in out


def test_on_the_bench_network_the_nic_is_measured_at_the_shaped_rate(tmp_path):
    """Two ranks in namespaces of their own (each its own node) with NICs shaped at 200 Mbit/s: the measured NIC is
    within 10% of the shaped payload rate, and plan --profile without --nic-gbps uses it."""
    from megatron_pipemesh.bench.netns import permission_problem

    problem = permission_problem()
    if problem:
        pytest.skip(problem)
    # the script's own timeout comes first: it kills its ranks and deletes its namespaces (a kill from here would not)
    done = subprocess.run([sys.executable, "scripts/profile_links_check.py", "--rate", "200mbit", "--out-dir",
                           str(tmp_path), "--repeats", "2", "--bucket-mib", "2", "--timeout", "300"],
                          capture_output=True, text=True, timeout=360, cwd=str(h.REPO_ROOT), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    network = load(str(tmp_path / "profile.json")).network
    shaped = 200e6 * 1448 / 1514 / 1e9
    assert network.nodes == 2 and network.nic_gbps == pytest.approx(shaped, rel=0.1)
    assert f"NIC {network.nic_gbps:.4g} Gbit/s measured (profile)" in done.stdout


def host_link_of_two_ranks():
    """Worker: the pinned-link measurement on 2 gloo ranks, the copies themselves faked (no GPU): rank 0's copies run
    at 200 Gbit/s, rank 1's at 100; returns what each rank keeps and when each rank's copies started."""
    import time

    import torch
    import torch.distributed as dist

    from megatron_pipemesh.integration import profile, profile_links
    from megatron_pipemesh.runtime import host_link

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    starts = []

    def fake_measure(device, nbytes=host_link.MEASURE_BYTES, repeats=3, before_copy=None):
        for _ in range(2 * (repeats + 1)):
            if rank == 1:
                time.sleep(0.05)  # a rank that comes late to every copy: the others must wait for it
            before_copy()
            starts.append(time.time())
        gbps = 200.0 if rank == 0 else 100.0
        return host_link.HostLink(gbps, gbps * 1.5, nbytes)

    host_link.measure_host_link = fake_measure
    torch.cuda.current_device = lambda: 0
    kept, rates = profile.host_link_together(profile_links.launched(), profile.ProfileSettings(repeats=3))
    return {"kept": kept, "rates": rates, "starts": starts}


def test_every_rank_of_a_node_times_the_pinned_link_at_once_and_the_slowest_counts():
    """Launched on several ranks, each rank times its pinned copies with the others copying at once (a barrier before
    every copy: rank 1, late to each, holds rank 0's copies back), and every rank keeps the slowest rate -- not rank
    0's alone while the node's other ranks idle."""
    results = h.run_worker(f"{__file__}:host_link_of_two_ranks", nproc=2, timeout=120)
    assert [r["kept"] for r in results] == [100.0, 100.0] and results[0]["rates"] == [200.0, 100.0]
    first, second = (r["starts"] for r in results)
    assert len(first) == len(second) == 8
    assert max(abs(a - b) for a, b in zip(first, second)) < 0.04  # each copy starts together, not 50 ms apart
