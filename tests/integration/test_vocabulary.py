"""integration/vocabulary.py: the vocabulary size from the flag or the tokenizer's files, padded as Megatron pads it,
and the assumption said where nothing gives it."""
import json
from types import SimpleNamespace

from megatron_pipemesh.integration.vocabulary import GPT2_VOCAB, vocabulary


def _args(**kw):
    base = dict(padded_vocab_size=None, vocab_size=None, tokenizer_type="HuggingFaceTokenizer", vocab_file=None,
                tokenizer_model=None)
    return SimpleNamespace(**{**base, **kw})


def test_a_given_size_is_padded_per_tp():
    vocab = vocabulary(_args(vocab_size=128256))
    assert (vocab.size, vocab.source, vocab.assumed) == (128256, "--vocab-size", False)
    assert vocab.padded_for(1, 128) == 128256 and vocab.padded_for(5, 128) == 128640
    assert vocabulary(_args(vocab_size=50257)).padded_for(1, 128) == 50304


def test_a_huggingface_tokenizer_json_gives_its_size(tmp_path):
    data = {"model": {"vocab": {f"t{i}": i for i in range(1000)}},
            "added_tokens": [{"id": 1000, "content": "<|x|>"}, {"id": 1001, "content": "<|y|>"}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    vocab = vocabulary(_args(tokenizer_model=str(tmp_path)))
    assert vocab.size == 1002 and "tokenizer.json" in vocab.source and not vocab.assumed


def test_a_bpe_vocab_file_gives_its_size(tmp_path):
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps({f"t{i}": i for i in range(500)}))
    assert vocabulary(_args(tokenizer_type="GPT2BPETokenizer", vocab_file=str(path))).size == 500


def test_without_a_size_gpt2_is_assumed_and_said():
    vocab = vocabulary(_args(tokenizer_model="meta-llama/Llama-3-8B"))
    assert vocab.assumed and vocab.size == GPT2_VOCAB
    assert "assumed GPT-2's 50257 tokens" in vocab.source and "meta-llama/Llama-3-8B is not readable here" in vocab.source
    assert "give --vocab-size" in vocab.source
