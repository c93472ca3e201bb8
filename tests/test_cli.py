"""The ggrun command line end to end on the real SmolLM2 file, in a fresh process each time."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFWriter


def ggrun(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "runner", *map(str, args)], capture_output=True, text=True,
                          input=stdin, timeout=600)


def test_run_greedy_mentions_paris(smollm_path):
    r = ggrun("run", smollm_path, "-p", "The capital of France is", "--temp", "0", "-n", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "decode" in r.stderr and "tok/s" in r.stderr and "time to first token" in r.stderr


def test_run_with_a_q8_0_cache(smollm_path):
    r = ggrun("run", smollm_path, "-p", "The capital of France is", "--temp", "0", "-n", "4", "--cache-type", "q8_0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_default_model_is_smollm(smollm_path):
    r = ggrun("run", "-p", "The capital of France is", "--temp", "0", "-n", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert "Paris" in json.loads(r.stdout)["text"]


def test_same_seed_same_text_and_json_schema(smollm_path):
    args = ("run", smollm_path, "-p", "-", "--seed", "42", "--temp", "1.0", "-n", "24", "--json")
    first, second = ggrun(*args, stdin="Once upon a time"), ggrun(*args, stdin="Once upon a time")
    assert first.returncode == 0, first.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["text"] == b["text"] and a["token_ids"] == b["token_ids"] and a["generated_tokens"] > 0
    assert set(a) == {"text", "prompt_tokens", "prompt_ids", "generated_tokens", "token_ids", "token_logprobs",
                      "stop_reason", "time_to_first_token_s", "prefill_tok_s", "decode_tok_s"}
    assert len(a["token_logprobs"]) == len(a["token_ids"]) and all(lp <= 0 for lp in a["token_logprobs"])
    different = json.loads(ggrun(*args[:-4], "43", *args[-3:], stdin="Once upon a time").stdout)
    assert different["token_ids"] != a["token_ids"]


def test_prompt_longer_than_context_is_a_clear_error(smollm_path):
    """Without the ring (which otherwise streams a long prompt through the context)."""
    r = ggrun("run", smollm_path, "-p", "word " * 100, "-c", "32", "--no-ring")
    # (the one line of the error, after the compile message where kernels compiled first)
    assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith("error: ") and "context" in r.stderr
    assert "Traceback" not in r.stderr


def test_tokenize_and_info(smollm_path):
    r = ggrun("tokenize", smollm_path, "Hello world", "--json")
    assert json.loads(r.stdout) == {"ids": [19556, 905], "pieces": ["Hello", " world"]}
    r = ggrun("info", smollm_path)
    assert r.returncode == 0 and "llama" in r.stdout and "Q4_1" in r.stdout and "bits per weight" in r.stdout
    r = ggrun("info", smollm_path, "--fit", "--cache-type", "q8_0")  # (3 KV heads x (64 + 64) x 34 / 32 bytes)
    assert r.returncode == 0 and "KV cache (q8_0): 408 bytes per token per layer" in r.stdout


def test_unknown_architecture_and_type_are_refused(tmp_path):
    path = tmp_path / "odd.gguf"
    w = GGUFWriter(str(path), "mamba-9000")
    w.add_tensor("x.weight", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = ggrun("run", path, "-p", "hi")
    assert r.returncode == 1 and "architecture 'mamba-9000' is not supported" in r.stderr


def test_bench_json(smollm_path):
    r = ggrun("bench", smollm_path, "-p", "16", "-n", "4", "-r", "1", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["test"] for row in rows] == ["pp16", "tg4"]
    assert all(row["tok_s_mean"] > 0 for row in rows)
    assert all("AVX" in row["cpu"] or "no AVX2" in row["cpu"] for row in rows)  # the CPU and its vector features
    # llama-bench's conventions: -p 0 skips prefill, -n 0 skips decode
    for args, tests in ((("-p", "0", "-n", "4"), ["tg4"]), (("-p", "16", "-n", "0"), ["pp16"])):
        r = ggrun("bench", smollm_path, *args, "-r", "1", "--json")
        assert r.returncode == 0, r.stderr
        assert [row["test"] for row in json.loads(r.stdout)] == tests


def test_unsupported_tensor_type_is_refused(tmp_path):
    from gguf import GGMLQuantizationType
    path = tmp_path / "nvfp4.gguf"
    w = GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256),
                       ("attention.head_count", 4)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_token_merges([])
    w.add_tensor("token_embd.weight", np.zeros((2, 144), dtype=np.uint8), raw_dtype=GGMLQuantizationType.NVFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = ggrun("run", path, "-p", "hi")
    assert r.returncode == 1 and "unsupported tensor type NVFP4" in r.stderr, r.stderr


def test_run_timings_break_down_the_start_up(smollm_path):
    r = ggrun("run", smollm_path, "-p", "The capital of France is", "--temp", "0", "-n", "2", "--timings")
    assert r.returncode == 0, r.stderr
    line = next(line for line in r.stderr.splitlines() if line.startswith("startup:"))
    stages = dict(part.rsplit(" ", 2)[:2] for part in line.removeprefix("startup: ").split(" · "))
    assert list(stages)[:4] == ["interpreter and CLI", "imports", "file mapping and model", "kernel cache load"]
    assert "prompt of 5 tokens to first token" in stages and "first token at" in stages
    seconds = {name: float(value) for name, value in stages.items()}
    assert all(s >= 0 for s in seconds.values())
    # each figure is rounded to the millisecond, so the printed parts may miss the printed total by half
    # a millisecond each
    assert seconds["first token at"] == pytest.approx(sum(s for n, s in seconds.items() if n != "first token at"),
                                                      abs=5e-4 * len(seconds) + 1e-9)


def test_paused_gc_gives_the_collector_back_as_it_was():
    """A warm start loads with the garbage collector paused (runner/terminal/cli.py _load); whatever
    happens inside, it comes back as it was, and stays off for a caller who had it off."""
    import gc
    from runner.engine.startup import paused_gc
    with pytest.raises(RuntimeError), paused_gc():
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()
    with paused_gc(False):
        assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_bench_refuses_a_bad_depth(smollm_path):
    r = ggrun("bench", smollm_path, "-d", "16,x")
    assert r.returncode == 1 and "comma-separated non-negative integers" in r.stderr


def test_run_skips_imports_it_does_not_use(smollm_path):
    """Jinja (chat templates), tqdm (downloads) and what Numba would import for cffi and np.dot support
    cost `ggrun run` 0.1-0.17 s of start-up (python -X importtime) and are never used by it."""
    unused = ("jinja2", "tqdm", "cffi", "scipy.linalg")
    code = ("import atexit, sys\n"
            f"atexit.register(lambda: print('loaded:', [m for m in {unused!r} if sys.modules.get(m)],"
            " file=sys.stderr))\n"
            "from runner.terminal.cli import entry\n"
            f"sys.argv = ['ggrun', 'run', {str(smollm_path)!r}, '-p', 'Hello', '-n', '2', '--temp', '0']\n"
            "entry()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "loaded: []" in r.stderr.splitlines()


@pytest.mark.parametrize("prompt", ["The capital of France is", "The capital of France is " * 4])
def test_a_first_run_compiles_everything_under_its_message(tmp_path, smollm_path, prompt):
    """On a fresh Numba cache, `run` compiles while its message shows and nothing after the first
    token: Numba saves no kernel after the start-up line (the replayed step's kernel compiling
    at the second token stalled it ~16 s). A prompt longer than decode's kernels take compiles
    prefill's too, before its first token. (The marks of what compiled live with the Numba
    cache, so a fresh NUMBA_CACHE_DIR has none.)"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "NUMBA_DEBUG_CACHE": "1",
           "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "runner", "run", smollm_path, "-p", prompt, "-n", "4", "--temp", "0",
                        "--timings"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                       env=env)
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stdout[-3000:]
    message = next(i for i, line in enumerate(lines) if line.startswith("compiling the Numba kernels"))
    started = next(i for i, line in enumerate(lines) if line.startswith("startup:"))
    saved = [i for i, line in enumerate(lines) if "data saved" in line]
    assert saved and message < min(saved), lines[:5]
    assert max(saved) < started, [lines[i] for i in saved if i > started]
    assert ("prefill kernels" in lines[started]) == (len(prompt) > 30)  # (only the long prompt compiles them)


def test_bench_compares_depths_in_one_line(smollm_path):
    r = ggrun("bench", smollm_path, "-p", "16", "-n", "4", "-r", "1", "-d", "16,48")
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("decode at depth 48: ") and "x the speed at depth 16" in line
    assert float(line.split(": ")[1].split(" x")[0]) > 0  # (its size is for benchmarks to judge, not a test)
    assert "MiB more of KV cache at" in line and 0.9 < float(line.split("allows at most ")[1]) <= 1.0
    r = ggrun("bench", smollm_path, "-p", "16", "-n", "4", "-r", "1")
    assert r.returncode == 0 and "decode at depth" not in r.stdout
