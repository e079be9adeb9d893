"""Turn plain-text files into a Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``).

Tokenizer: deterministic byte level.  Token ``b`` (0..255) is the UTF-8 byte ``b``; token 256 is the
end-of-document (EOD) token appended to every document.  That is exactly megatron-core 0.19.2's
``NullTokenizer`` with ``--vocab-size 257``: its EOD id defaults to ``vocab_size - 1``
(``megatron/core/tokenizers/text/libraries/null_tokenizer.py:18``) and it never needs a vocabulary
file.  Megatron pads the embedding table to a multiple of ``--make-vocab-size-divisible-by`` (384 with
the default 128); the padding ids never occur in the data.

Documents: by default one per paragraph (blocks separated by blank lines), or one per file with
``--split file``.  Empty documents are skipped: a zero-length document makes
``GPTDataset._get_num_epochs`` loop forever.

Usage::

    python -m megatron_pipemesh.data.prepare --input megatron_pipemesh/data/corpus \\
        --output-prefix data-cache/corpus
    # then train with the printed flags:
    #   --data-path data-cache/corpus_text_document --tokenizer-type NullTokenizer --vocab-size 257
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Sequence, Union

__all__ = [
    "BYTE_VOCAB_SIZE",
    "EOD_ID",
    "ByteTokenizer",
    "default_corpus_dir",
    "iter_documents",
    "megatron_data_args",
    "prepare_corpus",
    "main",
]

#: Byte tokens 0..255 plus EOD.
BYTE_VOCAB_SIZE = 257
#: NullTokenizer's default EOD id for ``--vocab-size 257`` (= vocab_size - 1).
EOD_ID = BYTE_VOCAB_SIZE - 1

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n+")


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus an EOD token; consistent with ``NullTokenizer(257)``."""

    vocab_size = BYTE_VOCAB_SIZE
    eod = EOD_ID

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def default_corpus_dir() -> Path:
    """The small English corpus shipped with the package."""
    return Path(__file__).resolve().parent / "corpus"


def _input_files(inputs: Sequence[Union[str, os.PathLike]]) -> List[Path]:
    files: List[Path] = []
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(f"--input {path}: no such file or directory")
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not found:
                raise FileNotFoundError(f"--input {path}: directory contains no *.txt files")
            files.extend(found)
        else:
            files.append(path)
    return files


def iter_documents(files: Sequence[Path], split: str = "paragraph") -> Iterator[str]:
    """Non-empty documents of ``files`` in order (``split``: ``paragraph`` or ``file``)."""
    if split not in ("paragraph", "file"):
        raise ValueError(f"split must be 'paragraph' or 'file', got {split!r}")
    for path in files:
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
        pieces = _PARAGRAPH_BREAK.split(text) if split == "paragraph" else [text]
        for piece in pieces:
            doc = piece.strip()
            if split == "paragraph":
                doc = " ".join(doc.split())  # re-flow hard-wrapped lines into one paragraph
            if doc:
                yield doc


def megatron_data_args(prefix: Union[str, os.PathLike]) -> List[str]:
    """Megatron flags that train on ``prefix`` with the matching tokenizer."""
    return ["--data-path", str(prefix), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(BYTE_VOCAB_SIZE)]


def prepare_corpus(
    inputs: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
    output_prefix: Union[str, os.PathLike],
    split: str = "paragraph",
    min_document_bytes: int = 1,
) -> Dict[str, object]:
    """Tokenize ``inputs`` (files and/or directories of ``*.txt``) into ``output_prefix.{bin,idx}``.

    Returns statistics: documents, tokens (incl. one EOD per document), skipped documents, files,
    the prefix and the Megatron flags to use.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    files = _input_files(inputs)

    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    import numpy
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    prefix = str(output_prefix)
    parent = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(parent, exist_ok=True)
    tok = ByteTokenizer()
    dtype = DType.optimal_dtype(tok.vocab_size)
    n_docs = n_tokens = n_skipped = 0
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    try:
        for doc in iter_documents(files, split):
            ids = tok.encode(doc)
            if len(ids) < max(1, min_document_bytes):
                n_skipped += 1
                continue
            ids.append(tok.eod)
            builder.add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
            n_docs += 1
            n_tokens += len(ids)
    finally:
        builder.finalize(get_idx_path(prefix))
    if n_docs == 0:
        for path in (get_bin_path(prefix), get_idx_path(prefix)):
            if os.path.exists(path):
                os.remove(path)
        raise ValueError(f"no non-empty documents in {[str(f) for f in files]}")
    return {
        "prefix": prefix,
        "files": len(files),
        "documents": n_docs,
        "tokens": n_tokens,
        "skipped": n_skipped,
        "vocab_size": tok.vocab_size,
        "eod_id": tok.eod,
        "megatron_args": megatron_data_args(prefix),
    }


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_pipemesh.data.prepare",
        description="Tokenize text (bytes + EOD) into a Megatron indexed dataset (.bin/.idx) for "
                    "--tokenizer-type NullTokenizer --vocab-size 257.",
    )
    parser.add_argument("--input", nargs="+", default=None,
                        help="text file(s) and/or directories of *.txt (default: the shipped corpus "
                             f"{default_corpus_dir()})")
    parser.add_argument("--output-prefix", required=True,
                        help="output path prefix; writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--split", choices=("paragraph", "file"), default="paragraph",
                        help="one document per paragraph (blank-line separated) or per file")
    parser.add_argument("--min-document-bytes", type=int, default=1,
                        help="skip documents shorter than this many bytes (default 1: skip empty)")
    args = parser.parse_args(argv)
    try:
        stats = prepare_corpus(args.input or [default_corpus_dir()], args.output_prefix,
                               split=args.split, min_document_bytes=args.min_document_bytes)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {stats['prefix']}.bin / .idx: {stats['documents']} documents, "
          f"{stats['tokens']} tokens from {stats['files']} file(s)"
          + (f", {stats['skipped']} skipped" if stats["skipped"] else ""))
    print("Megatron flags: " + " ".join(stats["megatron_args"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
