"""Namespace and tc command construction (nothing is run), plus a real namespace when root + ip netns work."""
import os
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
    """Without delay the namespace gets lo up and one tbf qdisc with the rate, the minimum burst and 200 ms latency."""
    cmds = setup_commands("pmbench-x", Shaping(200.0))
    assert cmds == [
        ["ip", "netns", "add", "pmbench-x"],
        ["ip", "netns", "exec", "pmbench-x", "ip", "link", "set", "lo", "up"],
        ["ip", "netns", "exec", "pmbench-x", "tc", "qdisc", "add", "dev", "lo", "root",
         "tbf", "rate", "200000kbit", "burst", str(4 * 65536), "latency", "200ms"],
    ]


def test_setup_commands_with_delay():
    """With a delay, netem is the root qdisc and tbf its child with the given burst and queue latency."""
    cmds = setup_commands("n1", Shaping(50.0, delay_ms=2.5, burst_bytes=10 ** 6, queue_ms=100))
    assert cmds[2] == ["ip", "netns", "exec", "n1", "tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:",
                       "netem", "delay", "2.5ms"]
    assert cmds[3] == ["ip", "netns", "exec", "n1", "tc", "qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:",
                       "tbf", "rate", "50000kbit", "burst", "1000000", "latency", "100ms"]


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
        with ShapedNamespace(Shaping(100.0), name="nsA", runner=runner):
            raise KeyboardInterrupt
    assert calls[-1] == ["ip", "netns", "delete", "nsA"]
    assert sum(c[:3] == ["ip", "netns", "delete"] for c in calls) == 1


def test_namespace_deleted_when_shaping_fails(monkeypatch):
    """A failing tc command still deletes the namespace and raises NamespaceError."""
    calls, runner = _fake(monkeypatch, fail_on="tc")
    with pytest.raises(NamespaceError):
        ShapedNamespace(Shaping(100.0), name="nsB", runner=runner).__enter__()
    assert calls[-1] == ["ip", "netns", "delete", "nsB"]


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
    with ShapedNamespace(Shaping(200.0)) as ns:
        shown = subprocess.run(ns.prefix() + ["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
        assert "tbf" in shown and "rate 200Mbit" in shown
        up = subprocess.run(ns.prefix() + ["ip", "link", "show", "lo"], capture_output=True, text=True).stdout
        assert "UP" in up
        name = ns.name
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed
