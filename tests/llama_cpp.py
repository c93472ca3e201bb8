"""Running llama.cpp b11434's own tools from the tests: its converter and llama-perplexity, the
oracles for files and for whole-model arithmetic."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# a text to measure perplexity on: the first 6000 characters of the Declaration of Independence
# (public domain; tests/data/README.md), English prose that no edit to the project changes
PERPLEXITY_TEXT = (Path(__file__).parent / "data" / "declaration_of_independence.txt").read_text()[:6000]


def convert_with_llama_cpp(source: Path, folder: Path, out: Path, *options: str) -> Path:
    """folder converted by convert_hf_to_gguf.py --outtype f32 (and options) into out."""
    subprocess.run([sys.executable, source / "convert_hf_to_gguf.py", folder, "--outtype", "f32", *options,
                    "--outfile", out],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(source / "gguf-py")})
    return out


def beside(reference, ours):
    """ours() while reference() (llama.cpp's tools: subprocesses, which a thread waits on) runs in a
    thread beside it, the two on the machine's two cores; ours()'s result once both are done."""
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(reference)
        result = ours()
        done.result()
    return result


def llama_cpp_perplexity(tools: Path, model: Path, text_file: Path) -> float:
    """llama-perplexity's final estimate on text_file, -c 128, exact where the file is (F32 cache,
    no flash attention's float16 products)."""
    command = [tools / "llama-perplexity", "-m", model, "-f", text_file, "-c", "128", "-t", "2", "-fa", "off",
               "-ctk", "f32", "-ctv", "f32"]
    final = re.compile(r"Final estimate: PPL = ([0-9.]+|[-a-z]+)")
    # llama.cpp's logger writes from a thread of its own and is not flushed at exit (b11434's
    # common/log.cpp says logs "may be lost"): on a loaded machine a run can end with status 0 and
    # its last lines, the final estimate's among them, missing. A file that truly breaks it does so
    # every time.
    for _ in range(4):
        r = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if r.returncode >= 0 and final.search(r.stderr + r.stdout):
            break
    assert r.returncode == 0, f"llama-perplexity exited with {r.returncode}: {r.stderr[-2000:]}"
    found = final.search(r.stderr + r.stdout)
    assert found, (r.stderr + r.stdout)[-2000:]
    return float(found.group(1))
