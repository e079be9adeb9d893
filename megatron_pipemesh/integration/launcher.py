"""The launcher and program in front of a user's training flags (``torchrun --nnodes 2 --nproc-per-node 8
pretrain_gpt.py --num-layers ...``): where the flags start, the cluster the launcher asks for, and the program a
PipeMesh row must run instead of a stock script (which would ignore ``--pipeline-schedule``).

Pure: no torch, no Megatron.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

ENTRY_MODULE = "megatron_pipemesh.training.pretrain_gpt"
"""PipeMesh's training entry point as a module (``python -m`` / ``torchrun -m``)."""
ENTRY_SCRIPT = "pipemesh-pretrain-gpt"
"""PipeMesh's training entry point as a console script."""
SCRIPT_FLAG = "--megatron-lm-script"
"""The entry point's own flag: run a Megatron-LM checkout's ``pretrain_gpt.py`` with PipeMesh installed."""

TORCHRUN = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
"""Launchers with torchrun's flags (``torchrun``, ``python -m torch.distributed.run``)."""


@dataclass(frozen=True)
class Launch:
    """A command split into its launcher, its program and the training flags."""

    prefix: Tuple[str, ...]
    """The launcher's words before the program (``torchrun --nproc-per-node 8``; empty: none)."""
    program: Tuple[str, ...]
    """The program: a script (``pretrain_gpt.py``), a module (``-m pkg.mod``), PipeMesh's entry point with its own
    flag, or empty where only flags were given."""
    flags: Tuple[str, ...]
    """The training flags (what Megatron's parser reads)."""

    @property
    def words(self) -> Tuple[str, ...]:
        """Launcher and program: what goes before the flags."""
        return self.prefix + self.program

    @property
    def kind(self) -> str:
        """'torchrun', 'srun', 'python', 'none' (flags only) or 'other'."""
        if not self.prefix and not self.program:
            return "none"
        joined = " ".join(self.prefix)
        if any(name in joined for name in TORCHRUN):
            return "torchrun"
        if self.prefix and self.prefix[0].endswith("srun"):
            return "srun"
        if not self.prefix or self.prefix[-1].split("/")[-1].startswith("python"):
            return "python"
        return "other"

    @property
    def runs_pipemesh(self) -> bool:
        """The program is PipeMesh's entry point (which installs PipeMesh before Megatron reads its flags)."""
        return ENTRY_MODULE in self.program or any(word.endswith(ENTRY_SCRIPT) for word in self.program) or any(
            word.endswith("scripts/pretrain_gpt.py") for word in self.program)

    def pipemesh_words(self) -> Tuple[str, ...]:
        """The launcher and program of a PipeMesh row: the same launcher running PipeMesh's entry point, with the
        user's ``pretrain_gpt.py`` through ``--megatron-lm-script`` (a module of the user's own is replaced by the
        entry point, which builds Megatron's GPT from the same flags)."""
        if self.runs_pipemesh:
            return self.words
        script = next((word for word in self.program if word.endswith(".py")), None)
        tail = (SCRIPT_FLAG, script) if script else ()
        if not self.prefix and not self.program:
            return (ENTRY_SCRIPT,)
        if not self.prefix and script:  # the script run directly (it is executable)
            return (ENTRY_SCRIPT,) + tail
        return self.prefix + ("-m", ENTRY_MODULE) + tail

    def sizes(self) -> Tuple[Optional[Tuple[int, int]], Optional[int]]:
        """((least, most) nodes, processes per node) the launcher asks for; None where it does not say (torchrun's
        defaults where it is torchrun: one node, one process)."""
        kind = self.kind
        if kind == "torchrun":
            nodes = _value(self.prefix, ("--nnodes",)) or "1"
            least, _, most = nodes.partition(":")
            per_node = _value(self.prefix, ("--nproc-per-node", "--nproc_per_node")) or "1"
            return ((int(least), int(most or least)) if least.isdigit() and (most or least).isdigit() else None,
                    int(per_node) if per_node.isdigit() else None)
        if kind == "srun":
            nodes = _value(self.prefix, ("-N", "--nodes"))
            least, _, most = (nodes or "").partition("-")
            per_node = _value(self.prefix, ("--ntasks-per-node",))
            return ((int(least), int(most or least)) if least.isdigit() and (most or least).isdigit() else None,
                    int(per_node) if per_node and per_node.isdigit() else None)
        return None, None

    def disagreement(self, nodes: int, gpus_per_node: int) -> Optional[str]:
        """The one line refusing a launcher that asks for another cluster than ``nodes`` x ``gpus_per_node``; None
        where it agrees or does not say."""
        span, per_node = self.sizes()
        launcher = shlex.join(self.prefix)
        if span is not None and not span[0] <= nodes <= span[1]:
            asked = f"{span[0]}" if span[0] == span[1] else f"{span[0]} to {span[1]}"
            return (f"the command's launcher ({launcher}) runs {asked} node(s), and --nodes is {nodes}: give the "
                    "cluster the command runs on, or fix the launcher's node count")
        if per_node is not None and per_node != gpus_per_node:
            return (f"the command's launcher ({launcher}) runs {per_node} process(es) per node, and --gpus-per-node "
                    f"is {gpus_per_node}: give the cluster the command runs on, or fix the launcher's processes per "
                    "node")
        return None


def _value(words: Sequence[str], names: Sequence[str]) -> Optional[str]:
    """The value of the first of ``names`` in ``words`` (``--flag value`` or ``--flag=value``)."""
    for index, word in enumerate(words):
        name, equals, value = word.partition("=")
        if name in names:
            if equals:
                return value
            return words[index + 1] if index + 1 < len(words) else None
    return None


def split_launch(command: Union[str, Sequence[str]]) -> Launch:
    """``command`` (a shell string or its words) split at its program: a ``.py`` script, a module after ``-m``, or
    PipeMesh's console script (whose ``--megatron-lm-script PATH`` stays with the program); without one, the flags
    start at the first word that starts with '-'."""
    words = shlex.split(command) if isinstance(command, str) else list(command)
    start = None
    for index, word in enumerate(words):
        if word.endswith(".py") or word.endswith(ENTRY_SCRIPT):
            start, end = index, index + 1
            break
        if (word in ("-m", "--module") and index + 1 < len(words) and not words[index + 1].startswith("-")
                and words[index + 1] not in TORCHRUN):
            start, end = index, index + 2
            break
    if start is None:
        first = next((i for i, word in enumerate(words) if word.startswith("-")), len(words))
        return Launch(tuple(words[:first]), (), tuple(words[first:]))
    program: List[str] = words[start:end]
    rest = words[end:]
    if SCRIPT_FLAG in rest:  # PipeMesh's entry point's own flag, not Megatron's
        at = rest.index(SCRIPT_FLAG)
        program += rest[at:at + 2]
        rest = rest[:at] + rest[at + 2:]
    return Launch(tuple(words[:start]), tuple(program), tuple(rest))
