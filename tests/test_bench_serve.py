"""scripts/bench_serve on SmolLM2 against ggrun alone, small: levels 1 and 2 of 4 tokens, a prefix
of 200 tokens, one thread (as tests/test_serve.py's servers: on 2 cores a second thread fights
whatever else runs)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_serve"


def run_script(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The script in a process group of its own, the group killed on a timeout (its servers with it)."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"bench_serve ran past {timeout} s:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def table_rows(text: str, model: str) -> list[list[str]]:
    """The cells of the Markdown tables' rows of model."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {model} |")]


def test_bench_serve_smoke(smollm_path, tmp_path):
    report = tmp_path / "bench.json"
    r = run_script("--only", "ggrun", "--models", str(smollm_path), "--levels", "1,2", "--tokens", "4",
                   "--prefix-tokens", "200", "--kv-tokens", "64", "--ctx", "1024", "--threads", "1",
                   "--json", str(report))
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^cpu: .*\(.*\)", r.stdout, re.MULTILINE)  # the CPU and its vector features
    rows = table_rows(r.stdout, smollm_path.stem)  # (a model given by its path is named by its file)
    decode = {row[2]: row for row in rows if len(row) == 7}
    assert set(decode) == {"1", "2"}, r.stdout
    for row in decode.values():
        assert row[1] == "ggrun" and float(row[3]) > 0 and float(row[4]) > 0, row
    assert float(decode["1"][5]) == 1.0
    (other,) = [row for row in rows if len(row) == 9]
    assert float(other[7]) > 0, other  # the shared prefix's TTFT2 / TTFT1
    assert float(other[4]) > 0, other  # the first token under load against alone
    assert other[8] == "n/a" or float(other[8]) > 0, other  # ggrun's KV bytes against the tokens held
    saved = json.loads(report.read_text())
    assert saved["summary"][smollm_path.stem]["ggrun"]["levels"]["2"]["aggregate"] > 0
