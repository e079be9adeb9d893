"""Which transformer layers each pipeline stage holds: Megatron's split flags, and the splits the advice tries.

Megatron-core 0.19.2 places the L transformer layers of a GPT on p x V stages (stage s = c*p + r is chunk c of
pipeline rank r; the embedding is always on stage 0 and the output layer and loss on the last stage):

* even (no flag): L / (p V) layers per stage (Megatron asserts the division);
* ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers K``: pipeline *rank* 0 holds F
  layers, F / V in each of its chunks, the last rank K, and the other ranks share the rest evenly
  (``transformer_block.get_num_layers_to_build``). With V > 1 and no rank in between (p = 2, both given) Megatron
  0.19.2 divides by zero placing the layers (``get_transformer_layer_offset``), so that is refused here;
* ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the embedding (the
  loss) counts as one layer: (L + 1 [+ 1]) / (p V) per stage, and stage 0 (the last stage) builds one fewer;
* ``--pipeline-model-parallel-layout "Et|tt|tt|tL"``: the stages from 0 to p V - 1 separated by ``|``, ``t`` a
  transformer layer, ``E`` the embedding (first in stage 0), ``L`` the loss (last in the last stage); ``t*3``,
  ``(tt|)*2`` and commas are expanded as Megatron expands them. It sets V (the stages over p).

:func:`split_candidates` gives what the advice tries for one (p, V): the even split when there is one, and layouts
with fewer layers on the stages that also hold the embedding and the output layer.

Pure: no torch, no Megatron.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"
VPP_FLAGS = ("--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage")
SPLIT_FLAGS = (FIRST_FLAG, LAST_FLAG, EMBEDDING_FLAG, LOSS_FLAG, LAYOUT_FLAG)
"""Every Megatron flag that changes which stage holds which layer (with :data:`VPP_FLAGS`, which set V)."""


class LayoutError(ValueError):
    """A layer split that Megatron would refuse (or cannot build) for this model and pipeline; the message names the
    flag and gives a valid example."""


def layout_string(layers: Sequence[int]) -> str:
    """The ``--pipeline-model-parallel-layout`` text of per-stage layer counts: 'E' opens stage 0, 'L' closes the
    last stage, 't' per transformer layer."""
    stages = ["t" * n for n in layers]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return "|".join(stages)


def _expand(text: str) -> str:
    """Megatron's shorthand expanded: commas dropped, then every '(...)*n', then every 'x*n'."""
    text = text.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda match: match.group(1) * int(match.group(2)), text)
    return re.sub(r"(.)\*(\d+)", lambda match: match.group(1) * int(match.group(2)), text)


def parse_layout(text: str) -> Tuple[int, ...]:
    """Transformer layers per stage of a ``--pipeline-model-parallel-layout`` text; LayoutError where Megatron (or
    PipeMesh's planner, for MTP layers) would refuse it."""
    example = f'{LAYOUT_FLAG} "Et|tt|tt|tL"'
    stages = _expand(text).split("|")
    for stage in stages:
        unknown = sorted(set(stage) - set("EtL"))
        if unknown:
            what = "multi-token prediction layers ('m') are not planned here" if unknown == ["m"] else \
                f"unknown layer character(s) {' '.join(unknown)} (use E, t, L)"
            raise LayoutError(f"{LAYOUT_FLAG} {text!r}: {what}. Example: {example}")
    flat = "".join(stages)
    if flat.count("E") != 1 or flat.count("L") != 1 or not stages[0].startswith("E") or not stages[-1].endswith("L"):
        raise LayoutError(f"{LAYOUT_FLAG} {text!r}: the embedding 'E' must open the first stage and the loss 'L' close "
                          f"the last one, once each. Example: {example}")
    return tuple(stage.count("t") for stage in stages)


@dataclass(frozen=True)
class LayerSplit:
    """How Megatron splits a GPT's layers over the pipeline stages (its flags in brackets; all unset: evenly)."""

    first: Optional[int] = None
    """[--decoder-first-pipeline-num-layers] Layers on pipeline rank 0, over all its chunks."""
    last: Optional[int] = None
    """[--decoder-last-pipeline-num-layers] Layers on the last pipeline rank, over all its chunks."""
    embedding_counts: bool = False
    """[--account-for-embedding-in-pipeline-split] The embedding counts as a layer of stage 0."""
    loss_counts: bool = False
    """[--account-for-loss-in-pipeline-split] The loss counts as a layer of the last stage."""
    layout: Optional[Tuple[int, ...]] = None
    """[--pipeline-model-parallel-layout] Transformer layers per stage, stage 0 first (fixes p x V)."""
    layout_text: Optional[str] = None
    """The layout as the user wrote it (shorthand kept in the flags); None: :func:`layout_string` of ``layout``."""

    def __post_init__(self) -> None:
        if self.layout is not None and (self.first is not None or self.last is not None or self.embedding_counts
                                        or self.loss_counts):
            raise LayoutError(f"{LAYOUT_FLAG} cannot be combined with {FIRST_FLAG}, {LAST_FLAG}, {EMBEDDING_FLAG} or "
                              f"{LOSS_FLAG} (Megatron refuses it); keep the layout alone")
        if (self.first is not None or self.last is not None) and (self.embedding_counts or self.loss_counts):
            raise LayoutError(f"{FIRST_FLAG}/{LAST_FLAG} cannot be combined with {EMBEDDING_FLAG}/{LOSS_FLAG} "
                              "(Megatron refuses it); use one of them")
        for flag, value in ((FIRST_FLAG, self.first), (LAST_FLAG, self.last)):
            if value is not None and value < 1:
                raise LayoutError(f"{flag} {value} is invalid: Megatron needs at least one layer there. "
                                  f"Example: {flag} 2")
        if self.layout is not None and (not self.layout or min(self.layout) < 0):
            raise LayoutError(f"{LAYOUT_FLAG}: every stage needs zero or more layers, got {list(self.layout)}")

    @classmethod
    def of_layout(cls, text: str) -> "LayerSplit":
        """The split a ``--pipeline-model-parallel-layout`` text describes."""
        return cls(layout=parse_layout(text), layout_text=text)

    @classmethod
    def of_stages(cls, layers: Sequence[int]) -> "LayerSplit":
        """The split with these layers per stage: even flags where they say it, else a layout."""
        layers = tuple(layers)
        if len(set(layers)) == 1:
            return cls()
        return cls(layout=layers)

    @property
    def even(self) -> bool:
        """No split flag: L / (p V) layers on every stage."""
        return self == LayerSplit()

    def vpp(self, pp: int) -> Optional[int]:
        """V the layout fixes (its stages over p), or None when the split works at any V."""
        if self.layout is None:
            return None
        if len(self.layout) % pp:
            raise LayoutError(f"{LAYOUT_FLAG} has {len(self.layout)} stages, not a multiple of "
                              f"--pipeline-model-parallel-size {pp}. Example for p = {pp}, V = 2: "
                              f"{LAYOUT_FLAG} \"{layout_string(balanced(2 * pp * 2, pp, 2))}\"")
        return len(self.layout) // pp

    def stage_layers(self, num_layers: int, pp: int, vpp: int) -> Tuple[int, ...]:
        """Transformer layers of each stage s = c*p + r (stage order) as Megatron builds them; LayoutError naming the
        flag (with a valid example) where Megatron would refuse or fail."""
        stages = pp * vpp
        example = f'{LAYOUT_FLAG} "{layout_string(balanced(num_layers, pp, vpp))}"' if num_layers >= 1 else ""
        if self.layout is not None:
            if len(self.layout) != stages:
                raise LayoutError(f"{LAYOUT_FLAG} has {len(self.layout)} stages but p x V = {pp} x {vpp} = {stages}. "
                                  f"Example: {example}")
            if sum(self.layout) != num_layers:
                raise LayoutError(f"{LAYOUT_FLAG} places {sum(self.layout)} transformer layers but --num-layers is "
                                  f"{num_layers}. Example: {example}")
            return self.layout
        if self.first is not None or self.last is not None:
            return self._first_last(num_layers, pp, vpp, example)
        counted = num_layers + self.embedding_counts + self.loss_counts
        if counted % stages:
            counts = (" (+1 for the embedding)" if self.embedding_counts else "") + \
                (" (+1 for the loss)" if self.loss_counts else "")
            raise LayoutError(f"--num-layers {num_layers}{counts} does not split evenly over p x V = {pp} x {vpp} = "
                              f"{stages} stages, as Megatron requires without a layout. Use a multiple of {stages}, "
                              f"or {example}")
        layers = [counted // stages] * stages
        layers[0] -= self.embedding_counts
        layers[-1] -= self.loss_counts
        if min(layers) < 0:
            raise LayoutError(f"{EMBEDDING_FLAG}/{LOSS_FLAG} with {num_layers} layers over {stages} stages leaves no "
                              f"layer to take out of an end stage. Example: {example}")
        return tuple(layers)

    def _first_last(self, num_layers: int, pp: int, vpp: int, example: str) -> Tuple[int, ...]:
        ends = {0: self.first, pp - 1: self.last} if pp > 1 else {0: self.first if self.first is not None else self.last}
        given = {rank: value for rank, value in ends.items() if value is not None}
        middle_ranks = pp - len(given)
        rest = num_layers - sum(given.values())
        if pp < 2:
            raise LayoutError(f"{FIRST_FLAG}/{LAST_FLAG} need pipeline parallelism (--pipeline-model-parallel-size >= 2)")
        if vpp > 1 and middle_ranks == 0:
            if all(count % vpp == 0 for count in given.values()) and rest == 0:
                # The same placement as a layout, which Megatron builds.
                example = f'{LAYOUT_FLAG} "{layout_string([given[s % pp] // vpp for s in range(pp * vpp)])}"'
            raise LayoutError(f"{FIRST_FLAG} with {LAST_FLAG} at --pipeline-model-parallel-size {pp} and V = {vpp}: "
                              f"megatron-core 0.19.2 divides by zero placing the layers (no pipeline rank in between). "
                              f"Use {example} instead")
        if rest < 0 or bool(rest) != bool(middle_ranks) or (middle_ranks and rest % middle_ranks):
            raise LayoutError(f"{FIRST_FLAG} {self.first} / {LAST_FLAG} {self.last} leave {rest} layers for {middle_ranks} "
                              f"middle pipeline ranks: Megatron needs them to split evenly. Example: {example}")
        per_rank = [given.get(rank, rest // middle_ranks if middle_ranks else 0) for rank in range(pp)]
        for rank, count in enumerate(per_rank):
            if count % vpp:
                flag = FIRST_FLAG if rank == 0 and rank in given else LAST_FLAG if rank in given else "the middle ranks"
                raise LayoutError(f"{flag}: {count} layers on pipeline rank {rank} do not split over V = {vpp} chunks, as "
                                  f"Megatron requires. Example: {example}")
        return tuple(per_rank[s % pp] // vpp for s in range(pp * vpp))

    def virtual_sizes(self, num_layers: int, pp: int) -> List[int]:
        """Every V (1 = no interleaving) at which Megatron builds this split on p ranks: a layout's own V; otherwise
        every V from 1 to the layers per rank that :meth:`stage_layers` accepts (evenly: the divisors)."""
        fixed = self.vpp(pp) if self.layout is not None and len(self.layout) % pp == 0 else None
        candidates = [fixed] if fixed else range(1, max(num_layers // pp, 1) + 1)
        return [vpp for vpp in candidates if self.valid(num_layers, pp, vpp)]

    def valid(self, num_layers: int, pp: int, vpp: int) -> bool:
        """Whether :meth:`stage_layers` has an answer for this (p, V)."""
        try:
            self.stage_layers(num_layers, pp, vpp)
        except LayoutError:
            return False
        return True

    def flags(self) -> List[str]:
        """Megatron's flags for this split (V comes from the layout itself; the other splits take
        ``--num-virtual-stages-per-pipeline-rank``)."""
        if self.layout is not None:
            return [LAYOUT_FLAG, self.layout_text or layout_string(self.layout)]
        out = []
        for flag, value in ((FIRST_FLAG, self.first), (LAST_FLAG, self.last)):
            if value is not None:
                out += [flag, str(value)]
        return out + [EMBEDDING_FLAG] * self.embedding_counts + [LOSS_FLAG] * self.loss_counts

    def describe(self, num_layers: int, pp: int, vpp: int) -> str:
        """'even', or the layers per stage."""
        if self.even:
            return "even"
        return "layers per stage " + " ".join(map(str, self.stage_layers(num_layers, pp, vpp)))


def balanced(num_layers: int, pp: int, vpp: int) -> Tuple[int, ...]:
    """The most even split of ``num_layers`` over p x V stages: the layers left over by the division go to the middle
    stages first (the end stages also hold the embedding and the output layer), one each, spread over the ranks."""
    stages = pp * vpp
    layers = [num_layers // stages] * stages
    order = _middle_first(stages)
    for k in range(num_layers % stages):
        layers[order[k]] += 1
    return tuple(layers)


def _middle_first(stages: int) -> List[int]:
    """Stage indices, the middle stages in order first, then the last stage and stage 0."""
    return list(range(1, stages - 1)) + ([stages - 1, 0] if stages > 1 else [0])


def shifted(base: Sequence[int], off_first: int, off_last: int) -> Optional[Tuple[int, ...]]:
    """``base`` with ``off_first`` layers taken from stage 0 and ``off_last`` from the last stage, each given to the
    middle stage holding the fewest layers (the lowest index among equals); None where a stage would go below zero
    or there is no middle stage to take them."""
    layers = list(base)
    stages = len(layers)
    if stages < 3 or off_first > layers[0] or off_last > layers[-1]:
        return None
    layers[0] -= off_first
    layers[-1] -= off_last
    for _ in range(off_first + off_last):
        target = min(range(1, stages - 1), key=lambda s: (layers[s], s))
        layers[target] += 1
    return tuple(layers)


MAX_SHIFT_LAST = 2
"""Layers the advice takes at most off the last stage (the output layer costs 0.8-1.8 layers of compute for the
study's GPTs: 2 b s h vocab against a layer's 24 b s h^2 + 4 b s^2 h)."""
MAX_SHIFT_FIRST = 1
"""Layers the advice takes at most off stage 0 (the embedding costs memory, little compute)."""


def split_candidates(num_layers: int, pp: int, vpp: int) -> List[LayerSplit]:
    """The splits the advice tries for one (p, V): the even split (or, where L does not divide, the most even one),
    and up to :data:`MAX_SHIFT_FIRST` / :data:`MAX_SHIFT_LAST` layers fewer on stage 0 / the last stage, moved to the
    middle stages. Without a middle stage (p V = 2) only the even split."""
    base = balanced(num_layers, pp, vpp)
    seen, out = set(), []
    for off_last in range(MAX_SHIFT_LAST + 1):
        for off_first in range(MAX_SHIFT_FIRST + 1):
            layers = shifted(base, off_first, off_last) if (off_first or off_last) else base
            if layers is not None and layers not in seen:
                seen.add(layers)
                out.append(LayerSplit.of_stages(layers))
    return out
