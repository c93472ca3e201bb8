"""Split GGUF files: written by ggrun (convert, quantize --split-max-size) and by llama-gguf-split,
loaded as one model from any part, and every part validated like a whole file."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from convert.gguf_out import PlannedTensor, write_gguf
from gguf_io import GGUFError, GGUFFile
from gguf_io.split import parse_part_name, part_name

PROMPT = ["-p", "The capital of France is", "--temp", "0", "-n", "12"]


def ggrun(*args):
    return subprocess.run([sys.executable, "-m", "runner", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def split_toy(folder: Path, name: str, n_tensors: int, max_size: int) -> list[Path]:
    """A file of n_tensors F32 tensors of 4 KiB, each its index, written in parts of max_size."""
    tensors = [PlannedTensor(f"t{i}", (1024,), T.F32, lambda i=i: np.full(1024, i, np.float32))
               for i in range(n_tensors)]
    return write_gguf(folder / name, "llama", [], tensors, progress=False, split_max_size=max_size).parts


def test_part_names_are_llama_cpps():
    assert part_name("model-Q4_K_M", 1, 3) == "model-Q4_K_M-00002-of-00003.gguf"
    assert parse_part_name("model-Q4_K_M-00002-of-00003.gguf") == ("model-Q4_K_M", 1, 3)
    for not_part in ("model.gguf", "m-00004-of-00003.gguf", "m-00000-of-00003.gguf", "m-1-of-3.gguf"):
        assert parse_part_name(not_part) is None


def test_parts_open_as_one_file_from_any_part(tmp_path):
    parts = split_toy(tmp_path, "toy.gguf", 10, 3 * 4096)
    assert [p.name for p in parts] == [f"toy-{i:05d}-of-00004.gguf" for i in (1, 2, 3, 4)]
    for given in parts:
        f = GGUFFile(given)
        assert f.parts == parts and f.path == parts[0] and len(f.tensors) == 10
        assert f.size == sum(p.stat().st_size for p in parts)
        for i in range(10):
            assert (f.tensor_bytes(f"t{i}").view(np.float32) == i).all()
    assert {t.part for t in GGUFFile(parts[0]).tensors.values()} == {0, 1, 2, 3}
    whole = write_gguf(tmp_path / "whole.gguf", "llama", [], [], progress=False, split_max_size=10**9)
    assert whole.parts == [tmp_path / "whole.gguf"]  # (what fits is written whole)


def test_a_missing_or_foreign_part_is_named(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    parts = split_toy(tmp_path / "a", "toy.gguf", 9, 3 * 4096)
    foreign = split_toy(tmp_path / "b", "toy.gguf", 8, 3 * 4096)
    whole = write_gguf(tmp_path / "b" / "whole.gguf", "llama", [], [], progress=False).parts[0]

    shutil.move(parts[1], tmp_path / "kept")
    with pytest.raises(GGUFError, match=r"part 2, .*toy-00002-of-00003.gguf, is missing"):
        GGUFFile(parts[0])
    shutil.copy(foreign[1], parts[1])
    with pytest.raises(GGUFError, match="disagree on split.tensors.count"):
        GGUFFile(parts[2])
    shutil.copy(whole, parts[1])
    with pytest.raises(GGUFError, match="toy-00002-of-00003.gguf is not part 2 of 3"):
        GGUFFile(parts[0])
    shutil.move(tmp_path / "kept", parts[1])
    renamed = parts[0].with_name("toy.gguf")
    shutil.copy(parts[0], renamed)
    with pytest.raises(GGUFError, match="toy.gguf is part 1 of 3 of a split model, but its name does not say so"):
        GGUFFile(renamed)
    with open(parts[2], "r+b") as f:  # (a part is checked as a whole file is)
        f.truncate(parts[2].stat().st_size - 100)
    with pytest.raises(GGUFError, match="toy-00003-of-00003.gguf: .*truncated"):
        GGUFFile(parts[0])
    r = ggrun("info", parts[1])
    assert r.returncode == 1 and r.stderr.startswith("error: toy-00003-of-00003.gguf") and "Traceback" not in r.stderr


def test_parts_never_replace_the_input(tmp_path, smollm_path):
    assert ggrun("quantize", smollm_path, tmp_path / "s.gguf", "COPY", "--split-max-size", "40M").returncode == 0
    parts = sorted(tmp_path.glob("s-*.gguf"))
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in parts]
    r = ggrun("quantize", parts[0], tmp_path / "s.gguf", "COPY", "--split-max-size", "40M")
    assert r.returncode == 1 and "which this command reads" in r.stderr
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in parts] == before and sorted(tmp_path.iterdir()) == parts
    r = ggrun("quantize", smollm_path, tmp_path / "x.gguf", "COPY", "--split-max-size", "40X")
    assert r.returncode == 1 and "e.g. 500M, 2G" in r.stderr


def test_ggrun_and_llama_cpp_splits_load_with_the_same_text(smollm_path, llama_cpp_tools, tmp_path):
    ours = tmp_path / "ours" / "smollm2.gguf"
    ours.parent.mkdir()
    r = ggrun("quantize", smollm_path, ours, "COPY", "--split-max-size", "40M")
    assert r.returncode == 0, r.stderr
    our_parts = sorted(ours.parent.glob("smollm2-*-of-00003.gguf"))
    assert len(our_parts) == 3
    (tmp_path / "theirs").mkdir()
    subprocess.run([llama_cpp_tools / "llama-gguf-split", "--split", "--split-max-size", "40M", smollm_path,
                    tmp_path / "theirs" / "smollm2"], check=True, capture_output=True)
    their_parts = sorted((tmp_path / "theirs").glob("smollm2-*-of-*.gguf"))
    assert len(their_parts) == 3

    whole = ggrun("run", smollm_path, *PROMPT)
    assert whole.returncode == 0 and "Paris" in whole.stdout
    for part in (our_parts[0], our_parts[2], their_parts[0], their_parts[1]):
        r = ggrun("run", part, *PROMPT)
        assert r.returncode == 0 and r.stdout == whole.stdout, (part, r.stderr)
    ours_meta, theirs_meta = GGUFFile(our_parts[0]).metadata, GGUFFile(their_parts[0]).metadata
    for key in ("split.no", "split.count", "split.tensors.count"):
        assert (ours_meta[key].type, ours_meta[key].value) == (theirs_meta[key].type, theirs_meta[key].value)

    def llama_text(model):
        r = subprocess.run([llama_cpp_tools / "llama-simple", "-m", model, "-n", "12", PROMPT[1]],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout
    assert llama_text(our_parts[0]) == llama_text(smollm_path)


def test_convert_writes_parts(tmp_path, llama_cpp_source):
    pytest.importorskip("transformers")
    from .hf_folders import random_folder
    folder = random_folder("llama", tmp_path / "hf", llama_cpp_source)
    for out, extra in ((tmp_path / "whole.gguf", []), (tmp_path / "split" / "m.gguf", ["--split-max-size", "1M"])):
        out.parent.mkdir(exist_ok=True)
        r = ggrun("convert", folder, "-o", out, "--type", "Q8_0", *extra)
        assert r.returncode == 0, r.stderr
    parts = sorted((tmp_path / "split").iterdir())
    whole, split = GGUFFile(tmp_path / "whole.gguf"), GGUFFile(parts[-1])
    assert len(parts) > 1 and split.parts == parts
    for i in range(len(parts)):  # (within the size, or a tensor larger alone)
        held = [t.nbytes for t in split.tensors.values() if t.part == i]
        assert sum(held) <= 1_000_000 or len(held) == 1
    assert list(whole.tensors) == list(split.tensors)
    for name in whole.tensors:
        assert np.array_equal(whole.tensor_bytes(name), split.tensor_bytes(name))
    assert os.path.getsize(tmp_path / "whole.gguf") <= split.size
