"""Tokenizer ids against an independent implementation (transformers/tokenizers loading the same GGUF)."""
import pytest

from gguf_io import GGUFFile, read_vocab
from runner.tokenizer import StreamDecoder, Tokenizer

from .hard_strings import hard_strings

STRINGS = hard_strings()


def test_enough_hard_strings():
    assert len(STRINGS) >= 200


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_path):
    return Tokenizer(read_vocab(GGUFFile(smollm_path)))


def test_bpe_matches_reference(smollm_tokenizer, hf_smollm_tokenizer):
    mismatches = [(s, smollm_tokenizer.encode(s), hf_smollm_tokenizer(s).input_ids) for s in STRINGS
                  if smollm_tokenizer.encode(s) != hf_smollm_tokenizer(s).input_ids]
    assert not mismatches, mismatches[:5]


def test_bpe_round_trips(smollm_tokenizer):
    for s in STRINGS:
        assert smollm_tokenizer.decode(smollm_tokenizer.encode(s), render_special=True) == s


def test_special_tokens_are_parsed(smollm_tokenizer):
    ids = smollm_tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == smollm_tokenizer.token_to_id["<|im_start|>"]
    assert ids[-1] == smollm_tokenizer.token_to_id["<|im_end|>"]


def test_stream_decoder_never_splits_characters(smollm_tokenizer):
    text = "日本語 🎉 café 👨‍👩‍👧‍👦"
    stream = StreamDecoder(smollm_tokenizer)
    pieces = [stream.push(i) for i in smollm_tokenizer.encode(text)] + [stream.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


@pytest.fixture(scope="module")
def gemma_tokenizers(gemma_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
    return Tokenizer(read_vocab(GGUFFile(gemma_path))), hf


def test_sentencepiece_matches_reference(gemma_tokenizers):
    ours, hf = gemma_tokenizers
    assert ours.vocab.model == "llama"
    mismatches = [(s, ours.encode(s), hf(s).input_ids) for s in STRINGS if ours.encode(s) != hf(s).input_ids]
    assert not mismatches, mismatches[:5]
