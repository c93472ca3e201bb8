"""ggrun imatrix against llama-imatrix b11434, and the imatrix file formats (GGUF, legacy .dat)."""
from __future__ import annotations

import struct
import subprocess

import numpy as np
import pytest
from click.testing import CliRunner

from gguf_io.imatrix import Imatrix, ImatrixEntry, read_imatrix, write_imatrix
from runner.terminal.cli import main

from .llama_cpp import PERPLEXITY_TEXT, beside


def test_gguf_imatrix_round_trips_and_reads_as_llama_cpp_keys_it(tmp_path):
    import gguf
    rng = np.random.default_rng(0)
    written = Imatrix({"blk.0.ffn_up.weight": ImatrixEntry(rng.random((1, 64), np.float32), np.array([256]),
                                                           rng.standard_normal((1, 64), np.float32)),
                       "blk.0.ffn_down_exps.weight": ImatrixEntry(rng.random((4, 32), np.float32),
                                                                  np.array([10, 0, 3, 7]))},
                      ["text.txt"], 2, 128)
    write_imatrix(tmp_path / "m.gguf", written)
    read = read_imatrix(tmp_path / "m.gguf")
    assert (read.datasets, read.chunk_count, read.chunk_size, read.legacy) == (["text.txt"], 2, 128, False)
    assert read.entries.keys() == written.entries.keys()
    for name, e in written.entries.items():
        r = read.entries[name]
        assert np.array_equal(r.sums, e.sums) and np.array_equal(r.counts, e.counts)
        assert (r.activations is None) == (e.activations is None)
        assert e.activations is None or np.array_equal(r.activations, e.activations)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")  # (gguf-py, which llama.cpp's scripts use)
    assert reader.fields["general.type"].contents() == "imatrix"
    shapes = {t.name: list(t.shape) for t in reader.tensors}
    assert shapes["blk.0.ffn_down_exps.weight.in_sum2"] == [32, 4] and shapes["blk.0.ffn_up.weight.counts"] == [1]


def test_legacy_dat_imatrix_is_read(tmp_path):
    """As llama-imatrix --output-format dat writes it: per entry its name, chunks and values, then
    the chunk count and the dataset's name."""
    values = np.arange(1, 9, dtype=np.float32)
    name = b"blk.3.attn_q.weight"
    raw = (struct.pack("<ii", 1, len(name)) + name + struct.pack("<ii", 5, len(values)) + values.tobytes()
           + struct.pack("<ii", 5, 8) + b"wiki.txt")
    (tmp_path / "m.dat").write_bytes(raw)
    read = read_imatrix(tmp_path / "m.dat")
    assert read.legacy and (read.datasets, read.chunk_count) == (["wiki.txt"], 5)
    e = read.entries["blk.3.attn_q.weight"]
    assert np.array_equal(e.sums, values[None]) and e.counts.tolist() == [5] and e.activations is None
    (tmp_path / "cut.dat").write_bytes(raw[:30])
    from gguf_io import GGUFError
    with pytest.raises(GGUFError, match="complete .dat"):
        read_imatrix(tmp_path / "cut.dat")


@pytest.mark.parametrize("model", ["smollm_f32", "smollm_path"])
def test_imatrix_equals_llama_imatrix(model, request, llama_cpp_tools, tmp_path):
    """2 chunks of 128 tokens. On the F32 file both compute in float32: every sum agrees within
    float32 rounding. On the Q4_1 file llama.cpp's products round their activations to 8 bits,
    ggrun's prefill products do not: the first products' inputs (layer 0's Q, K, V) agree as
    closely, the rest within that rounding's spread."""
    path = request.getfixturevalue(model)
    text = tmp_path / "text.txt"
    text.write_text(PERPLEXITY_TEXT)
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    command = [llama_cpp_tools / "llama-imatrix", "-m", path, "-f", text, "-o", theirs, "-c", "128", "--chunks", "2",
               "-t", "1", "--no-ppl", "-fa", "off", "-ctk", "f32", "-ctv", "f32"]
    ggrun = ["imatrix", str(path), "-f", str(text), "-o", str(ours), "-c", "128", "--chunks", "2", "-t", "1",
             "--kv-type", "f32"]
    result = beside(lambda: subprocess.run(command, capture_output=True, check=True, timeout=300),
                    lambda: CliRunner().invoke(main, ggrun))
    assert result.exit_code == 0, result.output
    a, b = read_imatrix(ours), read_imatrix(theirs)
    assert (a.datasets, a.chunk_count, a.chunk_size) == (b.datasets, b.chunk_count, b.chunk_size)
    assert (b.datasets, b.chunk_count, b.chunk_size) == ([str(text)], 2, 128)
    assert a.entries.keys() == b.entries.keys() and len(a.entries) == 30 * 7
    rel = {}
    for name, e in b.entries.items():
        assert a.entries[name].counts.tolist() == e.counts.tolist() == [256]
        rel[name] = (np.abs(a.entries[name].sums - e.sums) / e.sums).ravel()
    first = np.concatenate([rel[f"blk.0.attn_{m}.weight"] for m in "qkv"])
    assert first.max() < 1e-5
    spread = np.concatenate(list(rel.values()))
    if model == "smollm_f32":
        assert spread.max() < 1e-3 and np.median(spread) < 1e-5
    else:
        assert np.median(spread) < 0.02


def test_mixture_imatrix_counts_each_expert_as_llama_imatrix(llama_cpp_tools, tmp_path):
    """A random F32 mixture (8 experts, 2 per token): per expert, the same counts and sums. And
    llama-imatrix reads ggrun's file: rewritten as GGUF, the same values; as .dat, which ggrun
    reads, each expert's mean times the chunks its entry saw."""
    from convert.random_model import LlamaShape, write_random_llama
    shape = LlamaShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, vocab_size=1000, n_expert=8,
                       n_expert_used=2, n_ff_exp=256, head_dim=64)
    path, text = tmp_path / "moe.gguf", tmp_path / "text.txt"
    write_random_llama(path, shape, "F32", progress=False)
    text.write_text(PERPLEXITY_TEXT)
    command = [llama_cpp_tools / "llama-imatrix", "-m", path, "-f", text, "-o", tmp_path / "theirs.gguf", "-c", "128",
               "--chunks", "2", "-t", "1", "--no-ppl", "-fa", "off", "-ctk", "f32", "-ctv", "f32"]
    ggrun = ["imatrix", str(path), "-f", str(text), "-o", str(tmp_path / "ours.gguf"), "-c", "128", "--chunks", "2",
             "-t", "1", "--kv-type", "f32"]
    result = beside(lambda: subprocess.run(command, capture_output=True, check=True, timeout=300),
                    lambda: CliRunner().invoke(main, ggrun))
    assert result.exit_code == 0, result.output
    a, b = read_imatrix(tmp_path / "ours.gguf"), read_imatrix(tmp_path / "theirs.gguf")
    assert a.entries.keys() == b.entries.keys() and "blk.1.ffn_down_exps.weight" in a.entries
    for name, e in b.entries.items():
        assert a.entries[name].counts.tolist() == e.counts.tolist()
        assert e.counts.sum() == (2 * 256 if "_exps" in name else 256)
        assert np.abs(a.entries[name].sums - e.sums).max() < 1e-4 * e.sums.max()
    for out, fmt in (("again.gguf", "gguf"), ("legacy.dat", "dat")):
        subprocess.run([llama_cpp_tools / "llama-imatrix", "-m", path, "--in-file", tmp_path / "ours.gguf", "-o",
                        tmp_path / out, "--output-format", fmt, "-c", "128"], capture_output=True, check=True, timeout=60)
    again, legacy = read_imatrix(tmp_path / "again.gguf"), read_imatrix(tmp_path / "legacy.dat")
    assert (again.datasets, again.chunk_count, again.chunk_size) == (a.datasets, 2, 128)
    assert legacy.legacy and (legacy.datasets, legacy.chunk_count) == (a.datasets, 2)
    for name, e in a.entries.items():
        r = again.entries[name]
        assert np.array_equal(r.sums, e.sums) and np.array_equal(r.counts, e.counts)
        assert np.array_equal(r.activations, e.activations)
        chunks = -(-e.counts.max() // 128)  # (the chunks its most counted expert saw, rounded up)
        assert legacy.entries[name].counts.tolist() == [chunks]
        assert np.allclose(legacy.entries[name].sums, (e.sums / e.counts[:, None] * chunks).reshape(1, -1), rtol=1e-6)
