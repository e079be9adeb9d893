"""Memory levers: what a chunk-micro-batch does with the activations its backward needs.

One vocabulary for the planner, the simulator, the schedule and the runtime. A :class:`Lever` is a
``str`` whose value is its canonical name, so levers stay dict keys of the cost tables and JSON values
of plan files (byte-identical to the bare names they replace) and hash as fast as ``str``:

==============================  =====================================================================
name                            what the chunk-micro-batch does
==============================  =====================================================================
``none``                        keeps its activations on the device
``host``                        keeps them whole, in host memory between the forward and the backward
``selective``                   recomputes core attention in the backward (Megatron's default module)
``selective:<m1>+<m2>``         recomputes those modules (:data:`SELECTIVE_MODULES`)
``full``                        recomputes every layer from its input (uniform, one layer per checkpoint)
``uniform:<k>`` / ``block:<k>`` stock Megatron only, per chunk: ``--recompute-method uniform|block
                                --recompute-num-layers k``
==============================  =====================================================================

The memory and time methods take what the cost model knows of one layer (its saved bytes by the
module whose recomputation frees them, the bytes of a layer checkpoint, the forward seconds) and say
what a lever keeps, re-creates and re-runs; :attr:`Lever.switches` says which of Megatron's switches
the runtime sets for it. Pure Python: no torch.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import FrozenSet, Iterable, Mapping, Optional, Tuple

SELECTIVE_MODULES = ("core_attn", "layernorm", "mlp")
"""``--recompute-modules`` values that act on a dense GPT layer in megatron-core 0.19.2
(``moe_act``/``moe``/``shared_experts`` need MoE, ``mla_up_proj`` MLA, ``gdn_norm_out`` GatedDeltaNet),
in the order names print."""


class LeverKind(enum.Enum):
    """The kinds of levers; the value is the name's prefix."""

    DEVICE = "none"
    """Activations stay on the device."""
    HOST = "host"
    """Activations stay whole, offloaded to host memory after the forward and reloaded before the backward."""
    SELECTIVE = "selective"
    """Some modules of every layer are recomputed in the backward."""
    FULL = "full"
    """Every layer keeps only its input and is recomputed in the backward."""
    UNIFORM = "uniform"
    """Stock, per chunk: each group of k layers keeps only its input."""
    BLOCK = "block"
    """Stock, per chunk: the first k layers keep only their input, the others keep everything."""


class LeverError(ValueError):
    """A name that is not a lever (or not one that this use accepts)."""


_BASIC_NAMES = ", ".join(kind.value for kind in (LeverKind.DEVICE, LeverKind.SELECTIVE, LeverKind.FULL))

_PARSE_HELP = (f"use one of {_BASIC_NAMES}, {LeverKind.HOST.value!r}, 'selective:<modules joined by +>' (modules from "
               f"{', '.join(SELECTIVE_MODULES)}), 'uniform:<k>' or 'block:<k>'")

_RUNTIME_HELP = (f"{_BASIC_NAMES} or 'selective:<modules joined by +>' with modules from {', '.join(SELECTIVE_MODULES)} "
                 "(e.g. 'selective:core_attn+mlp')")


@dataclass(frozen=True)
class RecomputeSwitches:
    """What PipeMesh's runtime sets in megatron-core 0.19.2 for one chunk-micro-batch (``runtime/recompute.py``
    applies it: the config fields are Megatron's ``--recompute-*`` values, read at call time)."""

    granularity: Optional[str] = None
    """``config.recompute_granularity``: 'full', 'selective' or None."""
    method: Optional[str] = None
    """``config.recompute_method``: 'uniform' under full granularity, else None."""
    num_layers: Optional[int] = None
    """``config.recompute_num_layers``: 1 under full granularity (each layer its own checkpoint), else None."""
    modules: FrozenSet[str] = frozenset()
    """The module switches turned on (``checkpoint_core_attention``, ``recompute_input_layernorm`` /
    ``recompute_pre_mlp_layernorm``, ``recompute_mlp``); off inside fully recomputed layers, as Megatron's
    construction leaves them under full granularity."""

    @property
    def whole_layers(self) -> bool:
        """Whether every layer is recomputed from its input (needs a ``TransformerBlock`` decoder)."""
        return self.granularity == "full"


CATEGORIES = ("device", "host", "selective", "full")
"""The columns of placement counts (:attr:`Lever.category`), in print order."""

_CATEGORY_OF = {LeverKind.DEVICE: "device", LeverKind.HOST: "host", LeverKind.SELECTIVE: "selective"}


class _Interned(dict):
    """Every lever parsed so far, by each text it was parsed from (and its canonical name); looking up a
    text not seen yet parses it."""

    def __missing__(self, text) -> "Lever":
        lever = self[text] = Lever._build(*_read(text))
        return lever


_INTERNED = _Interned()


class Lever(str):
    """A memory lever; the str value is its canonical name ('none', 'host', 'selective',
    'selective:core_attn+mlp', 'full', 'uniform:2', 'block:1'), which is what plan files and digests store.

    Levers are interned: :meth:`parse` returns the same object for every spelling of one lever.
    Read-only once built."""

    # Fields, set once by _build (plain attributes, not properties: the simulator reads them per op).
    kind: LeverKind
    """What the lever does."""
    modules: FrozenSet[str]
    """Modules recomputed in every layer (SELECTIVE), else empty."""
    layers: int
    """k for UNIFORM and BLOCK, 1 for FULL (one layer per checkpoint), 0 otherwise."""
    is_device: bool
    """Kept whole on the device ('none')."""
    is_host: bool
    """Kept whole in host memory between the offload after the forward and the reload before the backward."""
    is_selective: bool
    """Recomputes some modules of every layer."""
    recomputes: bool
    """Recomputes something in the backward (every lever but 'none' and 'host')."""
    checkpoints_layers: bool
    """Recomputes whole layers from checkpointed inputs (full, uniform, block)."""
    per_chunk: bool
    """Stock-only (uniform, block): what a layer keeps depends on its place in the chunk."""
    runtime_applicable: bool
    """Applied by PipeMesh's runtime per chunk-micro-batch ('none', 'host', selective levers, 'full')."""
    kept: "Lever"
    """The lever whose bytes and recomputation apply while the activations are on the device: 'host' keeps
    them whole, as 'none' does; itself otherwise."""
    category: str
    """Its column in placement counts (:data:`CATEGORIES`; 'full' for every layer-checkpointing lever)."""
    _ordered: Tuple[str, ...]
    """``modules`` in :data:`SELECTIVE_MODULES` order: sums of per-module seconds in a fixed order (a set's
    order follows the process's string hashes)."""

    def __new__(cls, text) -> "Lever":
        return cls.parse(text)

    @classmethod
    def parse(cls, text) -> "Lever":
        """The lever named ``text`` (a :class:`Lever` or a name, any module order); :class:`LeverError` if it
        names none. One dict lookup once ``text`` was parsed (the planner parses plan values in its loops)."""
        try:
            return _INTERNED[text]
        except TypeError:  # not hashable, so not a name either
            pass
        raise LeverError(_unknown(text))

    @classmethod
    def selective(cls, modules: Iterable[str]) -> "Lever":
        """Selective recomputation of ``modules`` (a non-empty subset of :data:`SELECTIVE_MODULES`):
        'selective' for Megatron's default ``core_attn``, else 'selective:<m1>+<m2>' in that order."""
        chosen = frozenset(modules)
        if not chosen or not chosen <= set(SELECTIVE_MODULES):
            raise LeverError(f"--recompute-modules {' '.join(sorted(chosen))}: use a non-empty subset of "
                             f"{' '.join(SELECTIVE_MODULES)} for a dense GPT layer")
        return cls._build(LeverKind.SELECTIVE, chosen, 0)

    @classmethod
    def parse_runtime(cls, text) -> "Lever":
        """The lever named ``text`` if PipeMesh's runtime applies it per chunk-micro-batch
        (:attr:`runtime_applicable`); :class:`LeverError` otherwise (per-chunk levers are stock-only:
        the runtime recomputes a chunk-micro-batch's layers all alike)."""
        lever = runtime_lever(text)
        if lever is None:
            raise LeverError(f"unknown recompute level {text!r}; use one of {_RUNTIME_HELP}")
        return lever

    @classmethod
    def _build(cls, kind: LeverKind, modules: FrozenSet[str], layers: int) -> "Lever":
        """The interned lever of these fields."""
        ordered = tuple(m for m in SELECTIVE_MODULES if m in modules)
        if kind is LeverKind.SELECTIVE:
            name = "selective" if ordered == ("core_attn",) else "selective:" + "+".join(ordered)
        elif kind in (LeverKind.UNIFORM, LeverKind.BLOCK):
            name = f"{kind.value}:{layers}"
        else:
            name = kind.value
        lever = _INTERNED.get(name)
        if lever is not None:
            return lever
        lever = str.__new__(cls, name)
        per_chunk = kind in (LeverKind.UNIFORM, LeverKind.BLOCK)
        fields = {
            "kind": kind, "modules": modules, "layers": layers,
            "is_device": kind is LeverKind.DEVICE, "is_host": kind is LeverKind.HOST,
            "is_selective": kind is LeverKind.SELECTIVE, "recomputes": kind not in (LeverKind.DEVICE, LeverKind.HOST),
            "checkpoints_layers": layers > 0, "per_chunk": per_chunk, "runtime_applicable": not per_chunk,
            "kept": cls._build(LeverKind.DEVICE, frozenset(), 0) if kind is LeverKind.HOST else lever,
            "category": _CATEGORY_OF.get(kind, "full"), "_ordered": ordered,
        }
        for attribute, value in fields.items():
            object.__setattr__(lever, attribute, value)
        _INTERNED[name] = lever
        return lever

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"lever {str(self)!r} is read-only")

    def __reduce__(self):
        return Lever.parse, (str(self),)  # unpickled levers are the interned ones

    # Memory and time in the cost model -----------------------------------------------------------------
    def layer_bytes(self, terms: Mapping[str, float], checkpoint: float) -> float:
        """Bytes one layer keeps for its backward. ``terms``: the layer's saved bytes by the module whose
        recomputation frees them (any other key: kept at every selective lever); ``checkpoint``: what a
        layer recomputed from its input keeps (the input)."""
        if self.per_chunk:
            raise LeverError(f"{str(self)!r} is a per-chunk recompute level: a layer's bytes depend on its place "
                             "in the chunk (chunk_bytes)")
        if self.checkpoints_layers:
            return checkpoint
        return sum(size for name, size in terms.items() if name not in self.modules)

    def chunk_bytes(self, layers: int, terms: Mapping[str, float], checkpoint: float) -> float:
        """Bytes ``layers`` layers of one chunk keep for their backward (see :meth:`layer_bytes`): 'uniform:k'
        keeps ceil(L/k) checkpoints, 'block:k' min(k, L) checkpoints and the other layers whole."""
        if self.kind is LeverKind.UNIFORM:
            return math.ceil(layers / self.layers) * checkpoint
        if self.kind is LeverKind.BLOCK:
            done = min(self.layers, layers)
            return done * checkpoint + (layers - done) * sum(terms.values())
        return layers * self.layer_bytes(terms, checkpoint)

    def transient_bytes(self, layers: int, terms: Mapping[str, float], checkpoint: float) -> float:
        """Bytes the recomputation re-creates inside the chunk's backward on top of what it kept: the
        largest unit recomputed at once (k layers for 'uniform:k', one layer for 'full' and 'block:k', the
        recomputed modules of one layer for selective levers)."""
        if not self.recomputes or not layers:
            return 0.0
        if self.is_selective:
            return sum(size for name, size in terms.items() if name in self.modules)
        unit = min(self.layers, layers) if self.kind is LeverKind.UNIFORM else 1
        return unit * (sum(terms.values()) - checkpoint)

    def recompute_seconds(self, layers: int, forward_s: float, module_s: Mapping[str, float]) -> float:
        """Extra backward seconds of a chunk of ``layers`` layers whose forward takes ``forward_s``;
        ``module_s``: one layer's forward seconds of each recomputable module."""
        if self.is_selective:
            return layers * sum(module_s[m] for m in self._ordered)
        if self.kind is LeverKind.BLOCK:
            return min(self.layers, layers) * (forward_s / layers)
        return forward_s if self.checkpoints_layers else 0.0

    # What the runtime applies --------------------------------------------------------------------------
    @property
    def switches(self) -> RecomputeSwitches:
        """Megatron's switches the runtime sets for this lever (all off for 'none' and 'host': offloading is
        the offloader's); :class:`LeverError` for per-chunk levers."""
        if self.per_chunk:
            raise LeverError(f"unknown recompute level {str(self)!r}; use one of {_RUNTIME_HELP}")
        if self.checkpoints_layers:
            return RecomputeSwitches("full", "uniform", 1)
        if self.is_selective:
            return RecomputeSwitches("selective", modules=self.modules)
        return RecomputeSwitches()


def runtime_lever(text) -> Optional[Lever]:
    """The lever named ``text`` if PipeMesh's runtime applies it per chunk-micro-batch, else None."""
    try:
        lever = Lever.parse(text)
    except LeverError:
        return None
    return lever if lever.runtime_applicable else None


_KINDS = {kind.value: kind for kind in LeverKind}


def _read(text) -> Tuple[LeverKind, FrozenSet[str], int]:
    """(kind, modules, layers) of a lever name; :class:`LeverError` if it names none."""
    if isinstance(text, str):
        head, colon, arg = text.partition(":")
        kind = _KINDS.get(head)
        if not colon and kind is LeverKind.SELECTIVE:
            return kind, frozenset({"core_attn"}), 0
        if not colon and kind in (LeverKind.DEVICE, LeverKind.HOST, LeverKind.FULL):
            return kind, frozenset(), 1 if kind is LeverKind.FULL else 0
        if kind is LeverKind.SELECTIVE and arg:
            modules = frozenset(arg.split("+"))
            if modules <= set(SELECTIVE_MODULES):
                return kind, modules, 0
        if kind in (LeverKind.UNIFORM, LeverKind.BLOCK) and arg.isascii() and arg.isdigit() and int(arg) >= 1:
            return kind, frozenset(), int(arg)
    raise LeverError(_unknown(text))


def _unknown(text) -> str:
    return f"unknown recompute level {text!r}; {_PARSE_HELP}"


DEVICE = Lever.parse("none")
"""Kept on the device."""
HOST = Lever.parse("host")
"""Kept whole in host memory between forward and backward."""
SELECTIVE = Lever.parse("selective")
"""Core attention recomputed (Megatron's default ``--recompute-modules``)."""
FULL = Lever.parse("full")
"""Every layer recomputed from its input."""

class _Kept(dict):
    """Plan value (a lever or its name) -> the lever's :attr:`Lever.kept`, filled on first use."""

    def __missing__(self, level) -> Lever:
        kept = self[level] = Lever.parse(level).kept
        return kept


KEPT = _Kept()
"""``KEPT[level]`` is ``Lever.parse(level).kept`` in one dict lookup, for loops that ask it per op or per
chunk-micro-batch (a lever's attributes take the generic attribute path: a str subclass keeps its
``__dict__`` at a negative offset)."""

BASIC_LEVERS = (DEVICE, SELECTIVE, FULL)
"""The basic recompute levers: what the cost model prices when not told otherwise."""


RECOMPUTE_ONLY = "recompute-only"
"""The placement mode where recomputation is the only memory lever (the default)."""

PLACEMENT_MODES = (RECOMPUTE_ONLY, "auto", "device")
"""Which levers the planner may use (``--pipemesh-activation-placement``): recomputation only; host placement and
recomputation per chunk-micro-batch ('auto'); none ('device': a plan over its budget does not fit)."""
