"""Schedule operations and their compact text form.

A schedule is data: per-rank lists of :class:`Op`. Compute ops read ``F1.3`` (forward of model
chunk 1 on micro-batch 3) and ``B0.7``; the lowering adds communication and data-parallel ops
(``RECV_F1.3<0``: post the receive of F1.3's input from rank 0, ``SEND_F1.3>2``: send F1.3's
output to rank 2, ``PARAM_SYNC1``, ``GRAD_SYNC1``), mixed-sharding ops (``GATHER1.0``/``RELEASE1.0``: gather and free a ZeRO-3 chunk's
parameters around its first group span; ``REDUCE1.0``: reduce a ZeRO-2/3 chunk's gradients after a backward group)
and host copies of saved activations (``OFFLOAD1.3``: move the
tensors F1.3 saved for its backward to host memory; ``RELOAD1.3``: bring them back for B1.3). The text form is used for printing, saving,
diffing and error messages, and parses back with :func:`parse_op`.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Iterable, Optional


class OpKind(str, enum.Enum):
    """What an op does. Values are the text prefixes."""

    FORWARD = "F"
    BACKWARD = "B"
    RECV_FORWARD = "RECV_F"
    """Post the receive of a forward op's input activation (non-blocking)."""
    SEND_FORWARD = "SEND_F"
    """Send a forward op's output activation to the next stage (non-blocking)."""
    RECV_BACKWARD = "RECV_B"
    """Post the receive of a backward op's output-gradient (non-blocking)."""
    SEND_BACKWARD = "SEND_B"
    """Send a backward op's input-gradient to the previous stage (non-blocking)."""
    PARAM_SYNC = "PARAM_SYNC"
    """Launch the data-parallel parameter gather of a chunk (must finish before its first F)."""
    GRAD_SYNC = "GRAD_SYNC"
    """Launch the data-parallel gradient reduction of a chunk (after its last B)."""
    OFFLOAD = "OFFLOAD"
    """Launch the copy of a forward's saved activations to host memory (after that forward; non-blocking)."""
    RELOAD = "RELOAD"
    """Launch the copy of a chunk-micro-batch's activations back from host memory (its backward waits on it)."""
    GATHER = "GATHER"
    """Launch the all-gather of a ZeRO-3 chunk's parameters before its k-th gather span (``GATHER c.k``); the
    span's compute ops wait on it."""
    RELEASE = "RELEASE"
    """Free a ZeRO-3 chunk's gathered parameters after its k-th gather span (keep only the shard)."""
    REDUCE = "REDUCE"
    """Launch the reduce-scatter of a ZeRO-2/3 chunk's gradients after its k-th backward group (not the
    last: that one is its GRAD_SYNC) and free the whole gradient buffer."""

    # Plain string sets: these run in the simulator's inner loop (enum member lookups are slow).
    @property
    def is_compute(self) -> bool:
        return self._value_ in _COMPUTE

    @property
    def is_p2p(self) -> bool:
        return self._value_ in _P2P

    @property
    def is_dp(self) -> bool:
        return self._value_ in _DP

    @property
    def is_host(self) -> bool:
        """Copies between device and host memory (OFFLOAD / RELOAD)."""
        return self._value_ in _HOST

    @property
    def is_shard(self) -> bool:
        """Mixed-sharding ops of one chunk's k-th span (GATHER / RELEASE / REDUCE)."""
        return self._value_ in _SHARD


_COMPUTE = frozenset({"F", "B"})
_P2P = frozenset({"RECV_F", "SEND_F", "RECV_B", "SEND_B"})
_DP = frozenset({"PARAM_SYNC", "GRAD_SYNC"})
_HOST = frozenset({"OFFLOAD", "RELOAD"})
_SHARD = frozenset({"GATHER", "RELEASE", "REDUCE"})
_FORWARD_SIDE = frozenset({"RECV_F", "SEND_F", "OFFLOAD"})


@dataclass(frozen=True, order=True)
class Op:
    """One step of a per-rank program.

    For compute, p2p and host ops ``microbatch`` is set; p2p ops name the compute op they serve (the
    producer for sends, the consumer for receives) and carry the ``peer`` rank; host ops name the
    forward that saved the activations (OFFLOAD) or the backward that needs them (RELOAD).
    Data-parallel ops name only the chunk; sharding ops (GATHER/RELEASE/REDUCE) carry the span index k
    in ``microbatch`` (``GATHER1.0``: the first gather of chunk 1).
    """

    kind: OpKind
    chunk: int
    microbatch: Optional[int] = None
    peer: Optional[int] = None

    @property
    def compute(self) -> "Op":
        """The compute op this op belongs to (itself for F/B)."""
        kind = self.kind._value_
        if kind in _COMPUTE:
            return self
        if kind in _P2P or kind in _HOST:
            return Op(OpKind.FORWARD if kind in _FORWARD_SIDE else OpKind.BACKWARD, self.chunk, self.microbatch)
        raise ValueError(f"{self} is not tied to a compute op")

    def __str__(self) -> str:
        if self.kind.is_dp:
            return f"{self.kind.value}{self.chunk}"
        text = f"{self.kind.value}{self.chunk}.{self.microbatch}"
        if self.peer is not None:
            text += (">" if self.kind in (OpKind.SEND_FORWARD, OpKind.SEND_BACKWARD) else "<") + str(self.peer)
        return text

    def __repr__(self) -> str:
        return f"Op({self})"


def F(chunk: int, microbatch: int) -> Op:
    """Forward compute op."""
    return Op(OpKind.FORWARD, chunk, microbatch)


def B(chunk: int, microbatch: int) -> Op:
    """Backward compute op."""
    return Op(OpKind.BACKWARD, chunk, microbatch)


_OP_RE = re.compile(
    r"^(?P<kind>RECV_F|SEND_F|RECV_B|SEND_B|PARAM_SYNC|GRAD_SYNC|OFFLOAD|RELOAD|GATHER|RELEASE|REDUCE|F|B)(?P<chunk>\d+)"
    r"(?:\.(?P<mb>\d+))?(?:(?P<dir>[<>])(?P<peer>\d+))?$"
)


def parse_op(text: str) -> Op:
    """Parse the text form produced by ``str(op)``."""
    match = _OP_RE.match(text.strip())
    if not match:
        raise ValueError(f"cannot parse schedule op {text!r}; expected e.g. 'F1.3', 'B0.7', 'SEND_F1.3>2', 'GRAD_SYNC1', 'OFFLOAD1.3', 'GATHER1.0'")
    kind = OpKind(match["kind"])
    mb = match["mb"]
    if kind.is_dp != (mb is None):
        raise ValueError(f"schedule op {text!r}: {'data-parallel ops take no micro-batch' if kind.is_dp else 'a micro-batch is required'}")
    peer = int(match["peer"]) if match["peer"] is not None else None
    if match["dir"] is not None:
        expected = ">" if kind in (OpKind.SEND_FORWARD, OpKind.SEND_BACKWARD) else "<" if kind.is_p2p else None
        if match["dir"] != expected:
            raise ValueError(f"schedule op {text!r}: " + ("only sends ('>') and receives ('<') name a peer" if expected is None
                                                          else f"a {kind.value} names its peer with '{expected}'"))
    return Op(kind, int(match["chunk"]), int(mb) if mb is not None else None, peer)


def format_ops(ops: Iterable[Op], mark: Optional[int] = None) -> str:
    """Space-separated text form; ``mark`` brackets the op at that index (for error messages)."""
    parts = []
    for index, op in enumerate(ops):
        parts.append(f"[{op}]" if index == mark else str(op))
    return " ".join(parts)
