"""Memory levers (placeholder API; replaced by the vocabulary module on merge)."""
from __future__ import annotations

import enum
from functools import lru_cache
from typing import FrozenSet

SELECTIVE_MODULES = ("core_attn", "layernorm", "mlp")


class LeverKind(enum.Enum):
    DEVICE = "none"
    HOST = "host"
    SELECTIVE = "selective"
    FULL = "full"
    UNIFORM = "uniform"
    BLOCK = "block"


class LeverError(ValueError):
    pass


class Lever(str):
    kind: LeverKind
    modules: FrozenSet[str]
    layers: int

    @classmethod
    def parse(cls, text) -> "Lever":
        return _parse(str(text))

    @property
    def is_device(self) -> bool:
        return self.kind is LeverKind.DEVICE

    @property
    def is_host(self) -> bool:
        return self.kind is LeverKind.HOST

    @property
    def recomputes(self) -> bool:
        return self.kind not in (LeverKind.DEVICE, LeverKind.HOST)

    @property
    def runtime_applicable(self) -> bool:
        return self.kind in (LeverKind.DEVICE, LeverKind.HOST, LeverKind.SELECTIVE, LeverKind.FULL)


@lru_cache(maxsize=None)
def _parse(text: str) -> Lever:
    lever = str.__new__(Lever, text)
    kind, _, arg = text.partition(":")
    try:
        lever.kind = LeverKind(kind)
    except ValueError:
        raise LeverError(f"unknown recompute level {text!r}") from None
    lever.modules = frozenset(arg.split("+")) if kind == "selective" and arg else (
        frozenset({"core_attn"}) if kind == "selective" else frozenset())
    if kind == "selective" and (":" in text) and not (arg and lever.modules <= set(SELECTIVE_MODULES)):
        raise LeverError(f"unknown recompute level {text!r}")
    if kind in ("uniform", "block") and not arg.isdigit():
        raise LeverError(f"unknown recompute level {text!r}")
    lever.layers = int(arg) if kind in ("uniform", "block") else (1 if kind == "full" else 0)
    return lever


DEVICE = Lever.parse("none")
HOST = Lever.parse("host")
SELECTIVE = Lever.parse("selective")
FULL = Lever.parse("full")
