"""The vocabulary a command's output layer has, and where that size came from.

Megatron learns the size from the tokenizer it builds after argument validation (``megatron/training/tokenizer``),
so a command that names no ``--vocab-size`` leaves it to the tokenizer's files. This module reads them the same way
where they are on this machine (a GPT-2 BPE ``--vocab-file``, a HuggingFace ``tokenizer.json`` under
``--tokenizer-model``), pads the size as Megatron does (``_vocab_size_with_padding``: to a multiple of
``--make-vocab-size-divisible-by`` x TP), and otherwise says that it assumes GPT-2's, so the plan can print it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

GPT2_VOCAB = 50257
"""GPT-2's BPE vocabulary (the size assumed where nothing names one)."""


@dataclass(frozen=True)
class Vocabulary:
    """The unpadded vocabulary of a command and where it came from."""

    size: int
    """Tokens before padding."""
    source: str
    """Where the size came from (a flag, a file, or the assumption)."""
    assumed: bool = False
    """Nothing in the command gave the size: GPT-2's is assumed."""
    padded: Optional[int] = None
    """The size as given by --padded-vocab-size (no further padding); None: pad :attr:`size` per TP."""

    def padded_for(self, tp: int, multiple: int, pad: bool = True) -> int:
        """The output layer's rows at tensor-parallel size ``tp`` (Megatron's padding)."""
        if self.padded is not None:
            return self.padded
        if not pad:
            return self.size
        step = max(multiple, 1) * tp
        return -(-self.size // step) * step


def _hf_size(path: str) -> Optional[int]:
    """Tokens of a HuggingFace tokenizer: its ``tokenizer.json`` model vocabulary plus the added tokens beyond it."""
    candidate = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(candidate) or not candidate.endswith(".json"):
        return None
    try:
        with open(candidate, encoding="utf-8") as handle:
            data = json.load(handle)
        vocab = data["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
    ids |= {token["id"] for token in data.get("added_tokens", ()) if isinstance(token, dict) and "id" in token}
    return max(ids) + 1 if ids else None


def _bpe_size(path: str) -> Optional[int]:
    """Tokens of a GPT-2 BPE vocabulary file (a JSON object of token -> id)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return len(data) if isinstance(data, dict) else None


def vocabulary(args) -> Vocabulary:
    """The vocabulary of Megatron's validated ``args`` (module docstring)."""
    if getattr(args, "padded_vocab_size", None):
        return Vocabulary(args.padded_vocab_size, "--padded-vocab-size", padded=args.padded_vocab_size)
    if getattr(args, "vocab_size", None):
        return Vocabulary(args.vocab_size, "--vocab-size")
    kind = getattr(args, "tokenizer_type", None) or "GPT2BPETokenizer"
    vocab_file, model = getattr(args, "vocab_file", None), getattr(args, "tokenizer_model", None)
    if vocab_file:
        size = _bpe_size(vocab_file)
        if size:
            return Vocabulary(size, f"--vocab-file {vocab_file}")
    if model:
        size = _hf_size(model)
        if size:
            return Vocabulary(size, f"--tokenizer-model {model} (tokenizer.json)")
    given = vocab_file or model
    where = f" ({given} is not readable here)" if given else ""
    return Vocabulary(GPT2_VOCAB, f"assumed GPT-2's {GPT2_VOCAB} tokens: --tokenizer-type {kind} names no size"
                                  f"{where}; give --vocab-size", assumed=True)
