"""Every flag of the user's command either enters the costs or is named: the inventory of Megatron's arguments
(:mod:`.megatron_flags`) and what it says about one command.

:func:`classify` says which table a ``dest`` is in; :func:`unpriced` lists the flags a command sets away from
Megatron's default that the costs leave out (``pipemesh plan``'s notes and its ``unpriced`` JSON);
:func:`refusal` is the one line that refuses a command whose rows would be wrong in kind.

Pure: no torch, no Megatron (the caller reads the command with Megatron's parser and passes what it set).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from .megatron_flags import NO_COST, NOT_PRICED, PRICED, REFUSED

KINDS = ("priced", "not_priced", "refused", "no_cost")
"""The inventory's classes, in the order :func:`classify` reports them."""


def _no_cost() -> Dict[str, str]:
    """dest -> the reason of its group."""
    out: Dict[str, str] = {}
    for reason, dests in NO_COST.items():
        for dest in dests.split():
            out[dest] = reason
    return out


NO_COST_BY_DEST = _no_cost()
"""Every no-cost dest with its group's reason."""

TABLES: Tuple[Tuple[str, Mapping[str, str]], ...] = (("priced", PRICED), ("not_priced", NOT_PRICED),
                                                     ("refused", REFUSED), ("no_cost", NO_COST_BY_DEST))
"""Each class with its table (dest -> what it changes, why it is refused, or why it costs nothing)."""


def classify(dest: str) -> Optional[Tuple[str, str]]:
    """(class, its text) of ``dest``: the first table that has it; None where the inventory misses it."""
    for kind, table in TABLES:
        if dest in table:
            return kind, table[dest]
    return None


def duplicates() -> List[str]:
    """Dests that more than one table holds (each must be in exactly one)."""
    seen: Dict[str, str] = {}
    out = []
    for kind, table in TABLES:
        for dest in table:
            if dest in seen:
                out.append(f"{dest} ({seen[dest]} and {kind})")
            seen.setdefault(dest, kind)
    return out


@dataclass(frozen=True)
class SetFlag:
    """One setting of the user's command that differs from Megatron's default."""

    dest: str
    """The argument's name in Megatron's namespace."""
    flag: str
    """The option string that sets it (the one the command used where known)."""
    value: object
    """The value the command gives it."""

    def shown(self) -> str:
        """The value as the command wrote it (a store-true flag alone)."""
        if self.value is True:
            return self.flag
        if isinstance(self.value, (list, tuple)):
            return f"{self.flag} {' '.join(map(str, self.value))}"
        return f"{self.flag} {self.value}"


@dataclass(frozen=True)
class Unpriced:
    """A flag of the command that the costs leave out."""

    flag: str
    """Its option string."""
    value: str
    """Its value as given."""
    effect: str
    """What it would change."""

    def to_dict(self) -> dict:
        return {"flag": self.flag, "value": self.value, "effect": self.effect}

    def note(self) -> str:
        return f"{self.flag} {self.value}".strip() + f": not priced ({self.effect})"


def unpriced(set_flags: Mapping[str, SetFlag], for_this_command: Mapping[str, str] = {}) -> List[Unpriced]:
    """The not-priced flags among ``set_flags`` (dest -> its setting), in the command's order. ``for_this_command``:
    dests the inventory prices in general that the costs leave out with this command's value (dest -> what it would
    change; e.g. an offloading of modules the costs do not model)."""
    out = []
    for dest, setting in set_flags.items():
        found = classify(dest)
        if dest in for_this_command:
            out.append(Unpriced(setting.flag, _value(setting), for_this_command[dest]))
        elif found is not None and found[0] == "not_priced":
            out.append(Unpriced(setting.flag, _value(setting), found[1]))
    return out


def _value(setting: SetFlag) -> str:
    return "" if setting.value is True else " ".join(map(str, setting.value)) if isinstance(
        setting.value, (list, tuple)) else str(setting.value)


def refusal(set_flags: Mapping[str, SetFlag]) -> Optional[str]:
    """The one line refusing the command (the first refused flag it sets), or None."""
    for dest, setting in set_flags.items():
        if dest in REFUSED:
            return (f"{setting.shown()}: {REFUSED[dest]}, so pipemesh plan refuses the command; drop the flag to "
                    "price the rest")
    return None


def missing(dests) -> List[str]:
    """The dests of a parser that the inventory does not classify (sorted)."""
    return sorted(dest for dest in set(dests) if classify(dest) is None)
