"""megatron_pipemesh.data.prepare: byte tokenizer, .bin/.idx output readable by Megatron."""
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pipemesh.data.prepare import (
    BYTE_VOCAB_SIZE,
    EOD_ID,
    ByteTokenizer,
    default_corpus_dir,
    iter_documents,
    megatron_data_args,
    prepare_corpus,
)

REPO = Path(__file__).resolve().parents[2]


def test_tokenizer_roundtrip_and_nulltokenizer_consistency():
    """The byte tokenizer round-trips text, and its vocabulary and EOD id match Megatron's NullTokenizer(257)."""
    tok = ByteTokenizer()
    text = "Bread, water & salt — café."
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids + [EOD_ID]) == text
    assert (BYTE_VOCAB_SIZE, EOD_ID) == (257, 256)
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    null = NullTokenizer(vocab_size=BYTE_VOCAB_SIZE)
    assert null.eod == EOD_ID and null.vocab_size == BYTE_VOCAB_SIZE
    assert megatron_data_args("p") == ["--data-path", "p", "--tokenizer-type", "NullTokenizer",
                                       "--vocab-size", "257"]


def test_shipped_corpus_size_and_documents():
    """The shipped corpus has at least 5 files, 30-80 kB and more than 50 non-empty documents."""
    files = sorted(default_corpus_dir().glob("*.txt"))
    assert len(files) >= 5
    total = sum(f.stat().st_size for f in files)
    assert 30_000 <= total <= 80_000
    docs = list(iter_documents(files))
    assert len(docs) > 50 and all(docs)


def test_prepare_writes_readable_dataset_and_skips_empty(tmp_path):
    """prepare_corpus writes an IndexedDataset: one EOD-terminated document per paragraph, empty ones skipped."""
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.txt").write_text("First paragraph\nwrapped line.\n\n\n   \n\nSecond one.\n")
    (src / "b.txt").write_text("   \n\n")  # only empty documents
    (src / "c.txt").write_text("Third.")
    stats = prepare_corpus(src, tmp_path / "out" / "ds")
    assert stats["documents"] == 3 and stats["files"] == 3
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(tmp_path / "out" / "ds"))
    assert len(ds) == 3
    tok = ByteTokenizer()
    first = [int(x) for x in ds[0]]
    assert first[-1] == EOD_ID and tok.decode(first) == "First paragraph wrapped line."
    assert tok.decode(ds[2]) == "Third."
    assert stats["tokens"] == sum(len(ds[i]) for i in range(3))
    assert all(len(ds[i]) > 1 for i in range(3))  # never a zero-length document


def test_split_per_file(tmp_path):
    """split='file' makes one document per file."""
    (tmp_path / "a.txt").write_text("one\n\ntwo\n")
    stats = prepare_corpus(tmp_path / "a.txt", tmp_path / "ds", split="file")
    assert stats["documents"] == 1


def test_errors(tmp_path):
    """A missing path, a folder without .txt files or only blank documents raise clear errors and write nothing."""
    with pytest.raises(FileNotFoundError, match="no such file"):
        prepare_corpus(tmp_path / "missing", tmp_path / "x")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.txt"):
        prepare_corpus(tmp_path / "empty_dir", tmp_path / "x")
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    with pytest.raises(ValueError, match="no non-empty documents"):
        prepare_corpus(tmp_path / "blank.txt", tmp_path / "x")
    assert not (tmp_path / "x.bin").exists()


def test_cli(tmp_path):
    """The prepare command tokenizes the shipped corpus and prints Megatron's data flags; a missing input exits 2."""
    out = subprocess.run([sys.executable, "-m", "megatron_pipemesh.data.prepare",
                          "--output-prefix", str(tmp_path / "corpus")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--tokenizer-type NullTokenizer --vocab-size 257" in out.stdout
    assert (tmp_path / "corpus.bin").stat().st_size > 30_000
    bad = subprocess.run([sys.executable, "-m", "megatron_pipemesh.data.prepare", "--input",
                          str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "y")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "no such file" in bad.stderr
