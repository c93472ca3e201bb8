"""scripts/bench_constrained on SmolLM2, small: one round of 8 tokens, one thread (a few seconds)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_constrained"


def test_bench_constrained_smoke(smollm_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--models", str(smollm_path), "--tokens", "8", "--rounds", "1",
                        "--threads", "1"], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert re.search(r"^cpu: .*\(.*\)", out, re.MULTILINE)  # the CPU and its vector features
    label = re.escape(smollm_path.stem)  # (a model given by its path is named by its file)
    ratio = re.search(rf"^{label}: ratio constrained/unconstrained (\d+\.\d+) .*tokens generated: constrained (\d+), "
                      rf"unconstrained (\d+); \[.*\(.*\).*\]$", out, re.MULTILINE)
    assert ratio, out
    assert float(ratio[1]) > 0 and ratio[2] == ratio[3] == "8", out  # both runs decode the same count
    mask = re.search(rf"^{label}: mask (\d+) us/token .*compute_bitmask (\d+)", out, re.MULTILINE)
    assert mask and int(mask[1]) >= 0 and int(mask[2]) >= 0, out  # (greedy rarely needs the whole mask)
    assert re.search(rf"^{label}: ratio from the parts (\d+\.\d+)", out, re.MULTILINE), out
    (row,) = [line for line in out.splitlines() if line.startswith(f"| {smollm_path.stem} |")]
    cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
    assert cells[1] == "8" and float(cells[2]) > 0 and float(cells[3]) > 0, row
    assert float(cells[4].strip("*")) == float(ratio[1]), row
