"""Namespace and tc command construction (nothing is run), plus a real namespace when root + ip netns work."""
import os
import re
import shutil
import subprocess

import pytest

from megatron_pipemesh.bench import netns
from megatron_pipemesh.bench.netns import (MIN_BURST_BYTES, NamespaceError, ShapedNamespace, Shaping, exec_prefix,
                                           parse_rate_mbit, setup_commands, teardown_commands)


@pytest.mark.parametrize("text,mbit", [("200mbit", 200), ("1gbit", 1000), ("500", 500), ("250kbit", 0.25),
                                       ("25mbps", 200), ("1.5Gbit", 1500)])
def test_parse_rate(text, mbit):
    """Rates in mbit, gbit, kbit, mbps or bare numbers convert to Mbit/s."""
    assert parse_rate_mbit(text) == pytest.approx(mbit)


@pytest.mark.parametrize("text", ["", "fast", "-5mbit", "0", "0mbit", "mbit"])
def test_parse_rate_rejects(text):
    """Empty, zero, negative or unit-only rates raise ValueError."""
    with pytest.raises(ValueError):
        parse_rate_mbit(text)


def test_setup_commands_tbf_only():
    """Shared: without delay the namespace gets lo up and one tbf qdisc with the rate, the minimum burst and 200 ms
    latency."""
    cmds = setup_commands("pmbench-x", Shaping(200.0, per_rank=False))
    assert cmds == [
        ["ip", "netns", "add", "pmbench-x"],
        ["ip", "netns", "exec", "pmbench-x", "ip", "link", "set", "lo", "up"],
        ["ip", "netns", "exec", "pmbench-x", "tc", "qdisc", "add", "dev", "lo", "root",
         "tbf", "rate", "200000kbit", "burst", str(4 * 65536), "latency", "200ms"],
    ]


def test_setup_commands_with_delay():
    """Shared, with a delay: netem is the root qdisc and tbf its child with the given burst and queue latency."""
    cmds = setup_commands("n1", Shaping(50.0, delay_ms=2.5, burst_bytes=10 ** 6, queue_ms=100, per_rank=False))
    assert cmds[2] == ["ip", "netns", "exec", "n1", "tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:",
                       "netem", "delay", "2.5ms"]
    assert cmds[3] == ["ip", "netns", "exec", "n1", "tc", "qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:",
                       "tbf", "rate", "50000kbit", "burst", "1000000", "latency", "100ms"]


def test_per_rank_commands_give_every_rank_its_own_shaped_nic():
    """Per rank: a bridge in the hub, a namespace per rank whose eth0 (its address SUBNET.r+1) is a veth to a bridge
    port; tbf at the rate on both ends (uplink behind the netem delay, downlink without it); teardown removes
    every rank namespace, then the hub."""
    shaping = Shaping(100.0, delay_ms=1.0, nic_queue="fifo")
    cmds = setup_commands("h", shaping, ranks=2)
    text = [" ".join(c) for c in cmds]
    assert "ip netns exec h ip link add pmbr0 type bridge" in text
    assert f"ip netns exec h ip addr add {netns.HUB_ADDRESS}/24 dev pmbr0" in text
    for rank in range(2):
        own = f"h-r{rank}"
        assert f"ip netns add {own}" in text
        assert f"ip netns exec h ip link add v{rank} type veth peer name eth0 netns {own}" in text
        assert f"ip netns exec h ip link set v{rank} master pmbr0" in text
        assert f"ip netns exec {own} ip addr add 10.213.0.{rank + 1}/24 dev eth0" in text
        assert f"ip netns exec {own} tc qdisc add dev eth0 root handle 1: netem delay 1ms" in text
        assert (f"ip netns exec {own} tc qdisc add dev eth0 parent 1:1 handle 10: tbf rate 100000kbit burst 262144 "
                "latency 200ms") in text
        assert f"ip netns exec h tc qdisc add dev v{rank} root tbf rate 100000kbit burst 262144 latency 200ms" in text
    # a rank's namespace exists before its veth end is moved into it
    assert text.index("ip netns add h-r1") < text.index("ip netns exec h ip link add v1 type veth peer name eth0 netns h-r1")
    assert not any("dev lo root" in t and "tbf" in t for t in text)  # the loopbacks stay unshaped
    assert teardown_commands("h", 2) == [["ip", "netns", "delete", "h-r0"], ["ip", "netns", "delete", "h-r1"],
                                         ["ip", "netns", "delete", "h"]]
    with pytest.raises(ValueError, match="1..250 ranks"):
        setup_commands("h", shaping, ranks=0)


def test_per_rank_nic_is_fair_by_default():
    """Per rank, fair (the default): on each NIC an htb root class at the rate, one class per peer rank, one for pure
    TCP acknowledgements and one default class (the hub, ARP), each guaranteed rate / classes with the whole rate as
    ceiling and equal quanta, each with a byte FIFO as deep as the tbf's queue; u32 filters send acknowledgements to
    their class first, then a peer's packets to its class, by destination on the rank's uplink (eth0) and by source
    on its downlink (the bridge port)."""
    cmds = [" ".join(c) for c in setup_commands("h", Shaping(120.0), ranks=3)]
    assert Shaping(120.0).nic_queue == "fair"
    sizes = "burst 262144 cburst 262144 quantum 131072"
    limit = 120e6 / 8 * 0.2 + 262144
    for rank, ns, dev, match in [(0, "h-r0", "eth0", "dst"), (1, "h", "v1", "src")]:
        tc = f"ip netns exec {ns} tc"
        own = [c for c in cmds if c.startswith(f"{tc} ") and f" dev {dev} " in c]
        peers = [q for q in range(3) if q != rank]
        assert own[:2] == [f"{tc} qdisc add dev {dev} root handle 10: htb default 2",
                           f"{tc} class add dev {dev} parent 10: classid 10:1 htb rate 120000kbit ceil 120000kbit {sizes}"]
        for minor in [2, 3] + [0x10 + q for q in peers]:
            assert (f"{tc} class add dev {dev} parent 10:1 classid 10:{minor:x} htb rate 30000kbit ceil 120000kbit "
                    f"{sizes}") in own
            assert f"{tc} qdisc add dev {dev} parent 10:{minor:x} bfifo limit {int(limit)}" in own
        assert (f"{tc} filter add dev {dev} parent 10: protocol ip prio 1 u32 match ip protocol 6 0xff match u8 0x05 "
                "0x0f at 0 match u16 0x0000 0xff80 at 2 match u8 0x10 0xff at 33 flowid 10:3") in own
        for q in peers:
            assert (f"{tc} filter add dev {dev} parent 10: protocol ip prio 2 u32 match ip {match} "
                    f"10.213.0.{q + 1}/32 flowid 10:{0x10 + q:x}") in own
        assert len(own) == 2 + 2 * 4 + 1 + 2  # root qdisc + class, 4 classes + their FIFOs, ACK + 2 peer filters
    assert not any("tbf" in c for c in cmds)


def test_fair_nic_sits_behind_the_delay():
    """With a one-way delay the uplink's netem is the root and htb its child; the downlink has no delay."""
    cmds = [" ".join(c) for c in setup_commands("h", Shaping(100.0, delay_ms=2.0), ranks=2)]
    assert "ip netns exec h-r0 tc qdisc add dev eth0 root handle 1: netem delay 2ms" in cmds
    assert "ip netns exec h-r0 tc qdisc add dev eth0 parent 1:1 handle 10: htb default 2" in cmds
    assert "ip netns exec h tc qdisc add dev v0 root handle 10: htb default 2" in cmds


def test_nic_queue_rules():
    """fair needs the per-rank network (the shared loopback has one address for every rank); the shared loopback
    defaults to fifo; unknown disciplines and a bad match direction are refused."""
    from megatron_pipemesh.bench.nic_queue import fair_commands

    assert Shaping(100.0, per_rank=False).nic_queue == "fifo"
    with pytest.raises(ValueError, match="per-rank network"):
        Shaping(100.0, per_rank=False, nic_queue="fair")
    with pytest.raises(ValueError, match="fair, fifo"):
        Shaping(100.0, nic_queue="sfq")
    with pytest.raises(ValueError, match="'dst' .* 'src'"):
        fair_commands("n", "eth0", 100.0, MIN_BURST_BYTES, 200.0, {1: "10.213.0.2"}, "to")
    assert "fair share per peer" in Shaping(100.0).describe()
    assert "one FIFO" in Shaping(100.0, nic_queue="fifo").describe()


def test_rank_worker_enters_its_namespace():
    """The worker wrapper runs the rest of its arguments with python inside NAME-r<LOCAL_RANK>."""
    from megatron_pipemesh.bench.rank_netns import worker_command

    assert worker_command("h", 3, ["-m", "mod", "--x"], python="py") == ["ip", "netns", "exec", "h-r3", "py", "-m",
                                                                         "mod", "--x"]


def test_rank_worker_refuses_to_run_outside_torchrun(monkeypatch):
    """Without torchrun's LOCAL_RANK the wrapper stops with a usage message instead of guessing a rank."""
    from megatron_pipemesh.bench import rank_netns

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit, match="LOCAL_RANK"):
        rank_netns.main(["h", "-m", "mod"])


def test_unshaped_namespace_and_teardown():
    """An unshaped namespace gets no qdisc; teardown deletes it; the exec prefix runs commands in it."""
    assert setup_commands("n2", None) == [["ip", "netns", "add", "n2"],
                                          ["ip", "netns", "exec", "n2", "ip", "link", "set", "lo", "up"]]
    assert teardown_commands("n2") == [["ip", "netns", "delete", "n2"]]
    assert exec_prefix("n2") == ["ip", "netns", "exec", "n2"]


def test_shaping_validation():
    """Shaping rejects bursts below 4 x MTU, a zero rate and a negative delay; bytes_per_s converts Mbit/s."""
    with pytest.raises(ValueError, match="MTU"):
        Shaping(100.0, burst_bytes=65536)
    with pytest.raises(ValueError):
        Shaping(0.0)
    with pytest.raises(ValueError):
        Shaping(100.0, delay_ms=-1)
    assert Shaping(8.0).bytes_per_s == 1e6
    # a NIC's frames carry 1448 data bytes per 1514 on the wire; the shared loopback's 64 KiB frames ~ nothing
    assert Shaping(8.0).payload_bytes_per_s == pytest.approx(1e6 * 1448 / 1514)
    assert Shaping(8.0, per_rank=False).payload_bytes_per_s == 1e6
    assert Shaping(8.0).payload_burst_bytes == pytest.approx(MIN_BURST_BYTES * 1448 / 1514)
    assert Shaping(8.0, per_rank=False).payload_burst_bytes == MIN_BURST_BYTES
    assert MIN_BURST_BYTES == 4 * 65536


def test_unique_names():
    """Two new namespace names differ."""
    assert netns.new_namespace_name() != netns.new_namespace_name()


def _fake(monkeypatch, fail_on=None):
    calls = []

    def runner(cmd):
        calls.append(list(cmd))
        if fail_on and fail_on in cmd:
            raise NamespaceError("boom")

    monkeypatch.setattr(netns, "permission_problem", lambda: None)
    return calls, runner


def test_namespace_deleted_after_error_in_body(monkeypatch):
    """The namespace is deleted exactly once when the body raises (even KeyboardInterrupt)."""
    calls, runner = _fake(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        with ShapedNamespace(Shaping(100.0, per_rank=False), name="nsA", runner=runner):
            raise KeyboardInterrupt
    assert calls[-1] == ["ip", "netns", "delete", "nsA"]
    assert sum(c[:3] == ["ip", "netns", "delete"] for c in calls) == 1


def test_namespace_deleted_when_shaping_fails(monkeypatch):
    """A failing tc command still deletes the namespace and raises NamespaceError."""
    calls, runner = _fake(monkeypatch, fail_on="tc")
    with pytest.raises(NamespaceError):
        ShapedNamespace(Shaping(100.0, per_rank=False), name="nsB", runner=runner).__enter__()
    assert calls[-1] == ["ip", "netns", "delete", "nsB"]


def test_per_rank_namespaces_all_deleted_when_setup_fails_midway(monkeypatch):
    """A failure while shaping the per-rank network deletes every rank namespace and the hub (each tried)."""
    calls, runner = _fake(monkeypatch, fail_on="tc")
    with pytest.raises(NamespaceError):
        ShapedNamespace(Shaping(100.0), name="nsP", runner=runner, ranks=3).__enter__()
    assert calls[-4:] == [["ip", "netns", "delete", f"nsP-r{r}"] for r in range(3)] + [["ip", "netns", "delete", "nsP"]]


def test_no_permission_message(monkeypatch):
    """Without permission to create a namespace the error points to --unshaped."""
    monkeypatch.setattr(netns, "permission_problem", lambda: "creating a network namespace needs root")
    with pytest.raises(NamespaceError, match="--unshaped"):
        ShapedNamespace(Shaping(100.0), name="nsC", runner=lambda cmd: None).__enter__()


def _netns_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    name = netns.new_namespace_name("pmprobe")
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return ok


@pytest.mark.skipif(not _netns_works(), reason="needs root and a working `ip netns`")
def test_real_shaped_namespace_is_created_and_removed():
    """With root, a real namespace has lo up and a 200 Mbit tbf qdisc, and is gone afterwards."""
    with ShapedNamespace(Shaping(200.0, per_rank=False)) as ns:
        shown = subprocess.run(ns.prefix() + ["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
        assert "tbf" in shown and "rate 200Mbit" in shown
        up = subprocess.run(ns.prefix() + ["ip", "link", "show", "lo"], capture_output=True, text=True).stdout
        assert "UP" in up
        name = ns.name
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed


PAIR_SCRIPT = """
import os, subprocess, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
where = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True, text=True).stdout.strip()
payload = torch.ones(NBYTES // 4)
dist.barrier()
start = time.monotonic()
if rank % 2 == 0:
    dist.send(payload, rank + 1)
else:
    dist.recv(payload, rank - 1)
    print(f"pair {rank - 1}->{rank}: {time.monotonic() - start:.3f} s", flush=True)
print(f"rank {rank} in {where} via {os.environ['GLOO_SOCKET_IFNAME']}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.skipif(not _netns_works(), reason="needs root and a working `ip netns`")
def test_real_per_rank_network_gives_every_rank_its_own_nic(tmp_path):
    """Four gloo ranks launched as the bench launches them: each one runs in its own namespace through its eth0,
    and two pairs sending at once each get the whole rate (one token bucket for all ranks would halve it)."""
    from megatron_pipemesh.bench.runner import launch_command, run_once

    rate_mbit, nbytes = 80.0, 4_000_000  # 0.4 s per pair at the full rate, 0.8 s through one shared bucket
    script = tmp_path / "pairs.py"
    script.write_text(PAIR_SCRIPT.replace("NBYTES", str(nbytes)))
    with ShapedNamespace(Shaping(rate_mbit), ranks=4) as ns:
        cmd = launch_command(4, [], ns.prefix(), rank_namespaces=ns.rank_namespaces, target=(str(script),))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}  # the wrapper must override it
        code, _, _, text = run_once(cmd, env, str(tmp_path / "log.txt"), 120, sample_memory=False)
        name = ns.name
    assert code == 0, text[-3000:]
    for rank in range(4):
        assert f"rank {rank} in {name}-r{rank} via eth0" in text
    seconds = [float(x) for x in re.findall(r"pair \d->\d: ([0-9.]+) s", text)]
    ideal = nbytes * 8 / (rate_mbit * 1e6)
    assert len(seconds) == 2 and all(0.6 * ideal <= t <= 1.45 * ideal for t in seconds), (seconds, ideal)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed and f"{name}-r0" not in listed


COLLECTIVES_SCRIPT = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
grads = torch.ones(NBYTES // 4)
shard = torch.empty(grads.numel() // world)
# The least of two runs each: one run can take longer on a loaded machine (a rank scheduled late) or while the
# TCP connection's window still grows.
for name, call in (("all_reduce", lambda: dist.all_reduce(grads)),
                   ("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard, grads))):
    least = float("inf")
    for _ in range(2):
        dist.barrier()
        start = time.monotonic()
        call()
        least = min(least, time.monotonic() - start)
    if rank == 0:
        print(f"{name}: {least:.3f} s", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not _netns_works(), reason="needs root and a working `ip netns`")
def test_real_gloo_reduce_scatter_costs_an_all_reduce(tmp_path):
    """The price the planner and the calibration give gloo's reduce-scatter (``REDUCE_SCATTER_STEPS['gloo']``):
    on the bench's network it takes as long as an all-reduce of the same buffer, twice a ring reduce-scatter."""
    from megatron_pipemesh.bench.runner import launch_command, run_once
    from megatron_pipemesh.planning.costs import REDUCE_SCATTER_STEPS

    rate_mbit, nbytes = 80.0, 4_000_000
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES_SCRIPT.replace("NBYTES", str(nbytes)))
    with ShapedNamespace(Shaping(rate_mbit), ranks=2) as ns:
        cmd = launch_command(2, [], ns.prefix(), rank_namespaces=ns.rank_namespaces, target=(str(script),))
        code, _, _, text = run_once(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, str(tmp_path / "log.txt"), 120,
                                    sample_memory=False)
    assert code == 0, text[-3000:]
    seconds = {name: float(t) for name, t in re.findall(r"(all_reduce|reduce_scatter): ([0-9.]+) s", text)}
    ring_pass = nbytes / 2 * 8 / (rate_mbit * 1e6 * netns.VETH_PAYLOAD_FRACTION)  # (n-1)/n of the buffer, n = 2
    assert seconds["reduce_scatter"] >= 0.8 * seconds["all_reduce"], seconds
    assert seconds["reduce_scatter"] == pytest.approx(REDUCE_SCATTER_STEPS["gloo"] * ring_pass, rel=0.3), seconds


@pytest.mark.skipif(not _netns_works(), reason="needs root and a working `ip netns`")
def test_real_fair_nic_classes_are_accepted_by_the_kernel():
    """With root, the fair NIC's htb classes and u32 filters exist on both ends of every rank's NIC (the network
    check measures how they share; this only checks that the kernel took them)."""
    with ShapedNamespace(Shaping(200.0), ranks=2) as ns:
        for where, dev in ((f"{ns.name}-r0", "eth0"), (ns.name, "v1")):
            show = lambda *what: subprocess.run(exec_prefix(where) + ["tc", *what, "show", "dev", dev],  # noqa: E731
                                                capture_output=True, text=True).stdout
            classes = show("class")
            assert "class htb 10:1 root rate 200Mbit ceil 200Mbit" in classes
            peer = "10:11" if dev == "eth0" else "10:10"
            assert f"class htb {peer} parent 10:1" in classes and "class htb 10:3 parent 10:1" in classes
            assert show("filter").count("flowid") == 2  # the acknowledgements and the one peer
