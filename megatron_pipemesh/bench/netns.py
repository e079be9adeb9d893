"""A network namespace whose loopback is shaped with ``tc``: an emulated commodity network on one machine.

All ranks of a run are started with ``ip netns exec NAME ...``; they talk over the namespace's own
``lo``, which carries a token-bucket filter (``tbf``) of the given rate and, when a delay is asked for,
a ``netem`` delay in front of it. The filter shapes the *aggregate* traffic of all ranks (one
loopback device), not each link separately.

The commands are built as argument lists by pure functions (tested without running them);
:class:`ShapedNamespace` runs them and always deletes the namespace (``finally``; also on Ctrl-C).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from typing import List, Optional, Sequence

LOOPBACK_MTU = 65536
"""Linux loopback MTU: a tbf burst below it drops every full-size packet."""

MIN_BURST_BYTES = 4 * LOOPBACK_MTU


class NamespaceError(RuntimeError):
    """The namespace could not be created or shaped (message says why and what to do)."""


_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)


def parse_rate_mbit(text: str) -> float:
    """'200mbit', '1gbit', '500' (Mbit/s) -> Mbit/s. Raises ValueError."""
    match = _RATE_RE.match(str(text))
    if not match:
        raise ValueError(f"cannot read a bandwidth from {text!r}; write e.g. 200mbit, 1gbit or 500 (Mbit/s)")
    value, prefix, unit = float(match.group(1)), match.group(2).lower(), (match.group(3) or "bit").lower()
    scale = {"": 1.0, "k": 1e-3, "m": 1.0, "g": 1e3}[prefix]
    if not match.group(2) and match.group(3):
        scale = 1e-6  # plain "bit"/"bps"
    mbit = value * scale * (8.0 if unit == "bps" else 1.0)
    if mbit <= 0:
        raise ValueError(f"bandwidth {text!r} must be positive")
    return mbit


@dataclass(frozen=True)
class Shaping:
    """How the namespace's loopback is shaped."""

    rate_mbit: float
    """Token-bucket rate (Mbit/s), shared by all traffic on the loopback."""
    delay_ms: float = 0.0
    """One-way delay added by netem to every packet (0: no netem)."""
    burst_bytes: int = MIN_BURST_BYTES
    """Token-bucket size; must be >= 4 x loopback MTU."""
    queue_ms: float = 200.0
    """tbf ``latency``: how long a packet may wait in the queue before being dropped."""

    def __post_init__(self):
        if not self.rate_mbit > 0:
            raise ValueError(f"rate {self.rate_mbit} Mbit/s must be positive")
        if self.delay_ms < 0:
            raise ValueError(f"delay {self.delay_ms} ms must be >= 0")
        if self.burst_bytes < MIN_BURST_BYTES:
            raise ValueError(f"burst {self.burst_bytes} bytes is below 4 x loopback MTU ({MIN_BURST_BYTES}); "
                             "packets would be dropped")
        if not self.queue_ms > 0:
            raise ValueError(f"queue latency {self.queue_ms} ms must be positive")

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def describe(self) -> str:
        text = f"{self.rate_mbit:g} Mbit/s"
        if self.delay_ms:
            text += f", +{self.delay_ms:g} ms delay"
        return text


def new_namespace_name(prefix: str = "pmbench") -> str:
    """A unique namespace name (pid + random suffix; at most 15 characters is not required for netns)."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _rate_arg(mbit: float) -> str:
    return f"{mbit * 1000:.0f}kbit"


def setup_commands(name: str, shaping: Optional[Shaping]) -> List[List[str]]:
    """The commands that create namespace ``name`` with loopback up and (when given) shaped."""
    cmds = [["ip", "netns", "add", name], ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"]]
    if shaping is None:
        return cmds
    tc = ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo"]
    tbf = ["tbf", "rate", _rate_arg(shaping.rate_mbit), "burst", str(shaping.burst_bytes),
           "latency", f"{shaping.queue_ms:g}ms"]
    if shaping.delay_ms > 0:
        cmds.append(tc + ["root", "handle", "1:", "netem", "delay", f"{shaping.delay_ms:g}ms"])
        cmds.append(tc + ["parent", "1:1", "handle", "10:"] + tbf)
    else:
        cmds.append(tc + ["root"] + tbf)
    return cmds


def teardown_commands(name: str) -> List[List[str]]:
    return [["ip", "netns", "delete", name]]


def exec_prefix(name: str) -> List[str]:
    """Prefix of a command that runs inside the namespace."""
    return ["ip", "netns", "exec", name]


def permission_problem() -> Optional[str]:
    """None when this process can create namespaces; otherwise a sentence saying why not."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if shutil.which("tc") is None:
        return "the `tc` command (iproute2) is not installed"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "creating a network namespace and shaping it with tc needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN)"
    return None


def _run(cmd: Sequence[str]) -> None:
    result = subprocess.run(list(cmd), capture_output=True, text=True)
    if result.returncode != 0:
        raise NamespaceError(f"`{' '.join(cmd)}` failed (exit {result.returncode}): "
                             f"{(result.stderr or result.stdout).strip()}")


class ShapedNamespace:
    """Context manager: create + shape on enter, delete on exit (also after errors and Ctrl-C)."""

    def __init__(self, shaping: Optional[Shaping], name: Optional[str] = None, runner=_run):
        self.shaping, self.name, self._run = shaping, name or new_namespace_name(), runner
        self.created = False

    def __enter__(self) -> "ShapedNamespace":
        problem = permission_problem()
        if problem:
            raise NamespaceError(f"cannot emulate the slow network: {problem}. Run as root, or pass --unshaped "
                                 "to benchmark over the plain loopback (no shaping)")
        try:
            for i, cmd in enumerate(setup_commands(self.name, self.shaping)):
                self._run(cmd)
                if i == 0:
                    self.created = True
        except BaseException:
            self.close()
            raise
        return self

    def prefix(self) -> List[str]:
        return exec_prefix(self.name)

    def close(self) -> None:
        if self.created:
            self.created = False
            for cmd in teardown_commands(self.name):
                try:
                    self._run(cmd)
                except NamespaceError:
                    pass

    def __exit__(self, *exc) -> None:
        self.close()
