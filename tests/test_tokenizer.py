"""Tokenizer ids against an independent implementation (transformers/tokenizers loading the same GGUF)."""
import pytest

from gguf_io import GGUFFile, read_vocab
from runner.text.tokenizer import StreamDecoder, Tokenizer

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


SPECIAL_MIXES = ["<start_of_turn>user\n<b>Hi</b>   there\t\t<unused3><end_of_turn>\n<start_of_turn>model\n",
                 "<table><tr><td>1</td></tr></table>\n\n\n<br>  <br/>", "a<<b>>c </p ><p>", "<start_of_tur"]


def test_special_token_texts_match_reference(gemma_tokenizers):
    """Gemma 3 has thousands of special tokens (HTML tags, runs of spaces, tabs and newlines)."""
    ours, hf = gemma_tokenizers
    assert len(ours.vocab.special_ids()) > 6000
    for s in SPECIAL_MIXES:
        assert ours.encode(s) == hf(s).input_ids, s


def test_special_tokens_split_as_the_longest_match_leftmost(gemma_path):
    """The trie finds what a regex alternation of the texts, longest first, finds (the regex
    module as the oracle), over random mixes of whole tokens, their prefixes and other text."""
    import random

    import regex
    from runner.text.tokenizer import SpecialTokens
    vocab = read_vocab(GGUFFile(gemma_path))
    texts = sorted({vocab.tokens[i] for i in vocab.special_ids()} - {""}, key=len, reverse=True)
    alternation = regex.compile("|".join(regex.escape(t) for t in texts))

    def reference(text):
        start = 0
        for m in alternation.finditer(text):
            if m.start() > start:
                yield text[start:m.start()], False
            yield m.group(), True
            start = m.end()
        if start < len(text):
            yield text[start:], False

    specials, rnd, alphabet = SpecialTokens(texts), random.Random(0), list("ab<>/ \n\t[]|_é🎉")
    for _ in range(2000):
        parts = []
        for _ in range(rnd.randint(0, 12)):
            kind, token = rnd.random(), rnd.choice(texts)
            parts.append(token if kind < 0.3 else token[:rnd.randint(0, len(token))] if kind < 0.5
                         else "".join(rnd.choices(alphabet, k=rnd.randint(0, 6))))
        text = "".join(parts)
        assert list(specials.split(text)) == list(reference(text)), text


# llama.cpp's own tokenizer suite (b11434's models/ggml-vocab-*.gguf with their .inp/.out cases):
# every vocabulary ggrun accepts gives llama.cpp's ids on every case (tokenized as its
# test-tokenizer-0 does: no BOS/EOS, special tokens not parsed); the embedding models' vocabularies
# are refused by name. (aquila, baichuan and gpt-neox come without cases.)
VOCAB_SUITE = ["command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe", "llama-spm",
               "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"]
REFUSED_VOCABS = {"bert-bge": "tokenizer model 'bert' is not supported",
                  "nomic-bert-moe": "tokenizer model 't5' is not supported"}


@pytest.mark.parametrize("name", VOCAB_SUITE)
def test_llama_cpp_tokenizer_suite(llama_cpp_source, name):
    path = llama_cpp_source / "models" / f"ggml-vocab-{name}.gguf"
    tok = Tokenizer(read_vocab(GGUFFile(path)))
    cases = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(expected) >= len(cases) > 40
    for text, ids in zip(cases, expected):
        assert tok.encode(text, add_special=False, parse_special=False) == [int(i) for i in ids.split()], text


@pytest.mark.parametrize("name", sorted(REFUSED_VOCABS))
def test_llama_cpp_suite_vocabularies_ggrun_cannot_run_are_refused_by_name(llama_cpp_source, name):
    from gguf_io import GGUFError
    with pytest.raises(GGUFError, match=REFUSED_VOCABS[name]):
        read_vocab(GGUFFile(llama_cpp_source / "models" / f"ggml-vocab-{name}.gguf"))


def test_every_vocabulary_of_the_suite_is_covered(llama_cpp_source):
    """Those with cases are above; those without load (and make a tokenizer) or are refused."""
    paths = {p.name[len("ggml-vocab-"):-len(".gguf")]: p
             for p in (llama_cpp_source / "models").glob("ggml-vocab-*.gguf")}
    with_cases = {name for name, p in paths.items() if p.with_suffix(".gguf.inp").exists()}
    assert with_cases <= set(VOCAB_SUITE) | set(REFUSED_VOCABS) and set(VOCAB_SUITE) <= with_cases
    for name in set(paths) - with_cases - set(REFUSED_VOCABS):
        assert Tokenizer(read_vocab(GGUFFile(paths[name]))).encode("Hello world") != []


def test_gpt4o_pre_tokenizer_splits_as_llama_cpps(llama_cpp_source, llama_cpp_tools, tmp_path):
    """o200k's pre-tokenizer (gpt-oss, Llama 4), which the suite has no vocabulary for: the suite's
    llama-bpe vocabulary under tokenizer.ggml.pre "gpt-4o", tokenized by llama-tokenize and by
    ggrun, on the hard strings (cased words with contractions, non-ASCII letters, digit runs)."""
    import json
    import os
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from convert.gguf_out import write_gguf

    from .hard_strings import BASE
    f = GGUFFile(llama_cpp_source / "models" / "ggml-vocab-llama-bpe.gguf")
    metadata = [(k, "gpt-4o" if k == "tokenizer.ggml.pre" else m.value.tolist() if hasattr(m.value, "tolist")
                 else m.value, m.type, m.item_type) for k, m in f.metadata.items() if k != "general.architecture"]
    path = write_gguf(tmp_path / "gpt-4o.gguf", f.architecture, metadata, [], progress=False).path
    tok = Tokenizer(read_vocab(GGUFFile(path)))
    cases = [s for s in BASE if s] + ["McDONALD'S iPhone HTTPServer camelCase ÉCOLE élève ĲsselMeer", "x/\n/y 1234567"]

    def llama_cpp_ids(i: int) -> list[int]:  # (a process a case: loading the vocabulary is most of its time)
        (tmp_path / f"prompt{i}.txt").write_text(cases[i], encoding="utf-8")
        r = subprocess.run([llama_cpp_tools / "llama-tokenize", "-m", path, "-f", tmp_path / f"prompt{i}.txt", "--ids",
                            "--no-bos", "--no-parse-special", "--no-escape", "--log-disable"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-1000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        for text, want in zip(cases, pool.map(llama_cpp_ids, range(len(cases)))):
            assert tok.encode(text, add_special=False, parse_special=False) == want, text


@pytest.mark.parametrize("tokens,ends", [(["a", "<|end|>", "<|return|>", "<|call|>"], {"<|return|>", "<|call|>"}),
                                         (["a", "<|end|>", "<|return|>"], {"<|end|>", "<|return|>"}),
                                         (["a", "<|end|>", "<|calls|>", "<|flush|>"], {"<|calls|>", "<|flush|>"})])
def test_harmony_vocabularies_do_not_end_at_end_of_message(tmp_path, tokens, ends):
    """gpt-oss's <|end|> closes a message (its reasoning) but not the reply, where <|return|> and
    <|call|> do: llama.cpp's rule drops it from the end-of-generation set then."""
    from gguf import GGUFValueType as V

    from convert.gguf_out import write_gguf
    metadata = [("tokenizer.ggml.model", "gpt2", V.STRING, None), ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
                ("tokenizer.ggml.token_type", [3] * len(tokens), V.ARRAY, V.INT32),
                ("tokenizer.ggml.merges", ["a a"], V.ARRAY, V.STRING)]
    vocab = read_vocab(GGUFFile(write_gguf(tmp_path / "v.gguf", "gpt-oss", metadata, [], progress=False).path))
    assert {vocab.tokens[i] for i in vocab.end_of_generation} == ends
