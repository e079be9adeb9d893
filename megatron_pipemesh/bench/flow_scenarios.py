"""What ``pipemesh bench --network-check`` sends: transfers between ranks, as data both sides read.

A :class:`Scenario` is a set of transfers started together on the per-rank network: point-to-point sends (each on
the process group of its two ranks, as Megatron's pipeline links are) and at most one ring all-reduce (on the
group of its ranks, as a data-parallel gradient reduction). :mod:`.flow_probe` runs a scenario with gloo inside the
rank namespaces and times it; :mod:`.network_check` prices the same scenario with the product's network model.
Each scenario has up to two *measures*: ``sends`` (start to the last byte received of its sends) and
``all-reduce`` (start to the last rank done with the collective).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

SENDS = "sends"
ALL_REDUCE = "all-reduce"
MEASURES = (SENDS, ALL_REDUCE)


@dataclass(frozen=True)
class Send:
    """One point-to-point transfer."""

    src: int
    """Sending rank."""
    dst: int
    """Receiving rank."""
    nbytes: int
    """Payload bytes (a float32 tensor of nbytes / 4 elements)."""


@dataclass(frozen=True)
class AllReduce:
    """One ring all-reduce (gloo's sum of a float32 tensor) over ``ranks``."""

    ranks: Tuple[int, ...]
    """Ranks of the ring, in ring order."""
    nbytes: int
    """Bytes of the tensor every rank holds."""


@dataclass(frozen=True)
class Scenario:
    """Transfers started together."""

    name: str
    """What it is, e.g. ``two-peers 8MiB``."""
    sends: Tuple[Send, ...] = ()
    """Point-to-point transfers."""
    all_reduce: Optional[AllReduce] = None
    """The ring all-reduce running at the same time, if any."""

    def __post_init__(self):
        if not self.sends and self.all_reduce is None:
            raise ValueError(f"scenario {self.name!r} transfers nothing")
        for send in self.sends:
            if send.src == send.dst or min(send.src, send.dst) < 0 or send.nbytes <= 0:
                raise ValueError(f"scenario {self.name!r}: a send needs two different ranks and a positive size, "
                                 f"not {send}")
        if self.all_reduce is not None and (len(set(self.all_reduce.ranks)) < 2 or self.all_reduce.nbytes <= 0):
            raise ValueError(f"scenario {self.name!r}: an all-reduce needs two or more ranks and a positive size")

    @property
    def measures(self) -> Tuple[str, ...]:
        """The durations this scenario reports (:data:`MEASURES`)."""
        return tuple(m for m, present in ((SENDS, bool(self.sends)), (ALL_REDUCE, self.all_reduce is not None))
                     if present)

    @property
    def world(self) -> int:
        """Ranks the scenario needs (0 .. the highest rank it names)."""
        ranks = [r for s in self.sends for r in (s.src, s.dst)] + list(self.all_reduce.ranks if self.all_reduce else ())
        return max(ranks) + 1

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> "Scenario":
        ring = data.get("all_reduce")
        return Scenario(data["name"], tuple(Send(**s) for s in data.get("sends", ())),
                        AllReduce(tuple(ring["ranks"]), ring["nbytes"]) if ring else None)


MIB = 2 ** 20


def check_scenarios(sizes: Sequence[int], pipeline_fraction: float = 0.25) -> List[Scenario]:
    """The network check's scenarios at each size S (bytes), on ranks 0-2 (0 and 1 a data-parallel pair, 2 rank 0's
    pipeline peer):

    * ``alone``: 0 -> 2, S bytes, nothing else on the network;
    * ``two-peers``: 0 -> 1 and 0 -> 2 at once, S bytes each (one NIC's uplink shared by two flows);
    * ``ring+pipeline``: the all-reduce of S bytes over 0 and 1, with a pipeline send of ``pipeline_fraction`` x S
      each way between 0 and 2 at the same time (rank 0's uplink and downlink each shared by the ring and a
      pipeline flow)."""
    scenarios = []
    for size in sizes:
        label = f"{size / MIB:g}MiB"
        pipe = int(size * pipeline_fraction) // 4 * 4
        scenarios += [Scenario(f"alone {label}", (Send(0, 2, size),)),
                      Scenario(f"two-peers {label}", (Send(0, 1, size), Send(0, 2, size))),
                      Scenario(f"ring+pipeline {label}", (Send(0, 2, pipe), Send(2, 0, pipe)), AllReduce((0, 1), size))]
    return scenarios


@dataclass(frozen=True)
class MeasuredScenario:
    """One timed run of a scenario (seconds from the first rank's start)."""

    scenario: str
    """:attr:`Scenario.name`."""
    repeat: int
    """Which run (0-based, after the warm-up runs)."""
    seconds: Dict[str, float] = field(default_factory=dict)
    """Measure (:data:`MEASURES`), transfer (``receive 0->2``, ...) or ``start rank R`` -> seconds."""
