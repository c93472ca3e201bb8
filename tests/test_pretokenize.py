"""Pre-tokenizer splits against the `tokenizers` library running the models' published regexes."""
import pytest

from runner.text.pretokenize import PreTokenizer, canonical_name

from .hard_strings import hard_strings

tokenizers = pytest.importorskip("tokenizers")

# The patterns as the models' own tokenizer.json files state them (llama.cpp rewrites the (?i:...)
# contractions by hand, which is what this comparison checks).
PUBLISHED = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_split_matches_reference_regex_engine(name):
    ref = tokenizers.pre_tokenizers.Split(tokenizers.Regex(PUBLISHED[name]), behavior="isolated")
    ours = PreTokenizer(name)
    for s in hard_strings():
        assert ours.split(s) == [piece for piece, _ in ref.pre_tokenize_str(s)], repr(s)


def test_aliases():
    assert canonical_name("llama-bpe") == "llama3" and canonical_name("gpt-2") == "gpt2"
    assert canonical_name("qwen2") == "qwen2" and canonical_name("smollm") == "smollm"
    assert canonical_name("default") == "default" and canonical_name("no-such-pre") is None
