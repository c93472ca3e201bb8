"""Truncated and corrupted GGUF files: every one is refused with a one-line GGUFError."""
from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from gguf_io import GGUFError, GGUFFile


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """A valid little llama-shaped file with strings, arrays and two tensors."""
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_string("general.name", "tiny")
    w.add_token_list(["<s>", "</s>", "a", "b"])
    w.add_token_scores([0.0, 0.0, -1.0, -2.0])
    w.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b.weight", np.zeros((4, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _check_refused(tmp_path, data: bytes, name="bad.gguf"):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(GGUFError) as err:
        GGUFFile(path)
    message = str(err.value)
    assert message and "\n" not in message
    return message


def test_valid_file_opens(tmp_path, small_gguf):
    (tmp_path / "ok.gguf").write_bytes(small_gguf)
    f = GGUFFile(tmp_path / "ok.gguf")
    assert f.get("general.name") == "tiny" and set(f.tensors) == {"a.weight", "b.weight"}


def test_truncated_at_every_point_is_refused(tmp_path, small_gguf):
    for cut in range(0, len(small_gguf) - 1, 3):
        _check_refused(tmp_path, small_gguf[:cut])


def test_truncated_real_file_is_refused(tmp_path, smollm_path):
    data = smollm_path.read_bytes()
    for cut in (0, 3, 4, 10, 24, 1000, 100_000, 1_785_000, 1_785_700, len(data) // 2, len(data) - 1):
        message = _check_refused(tmp_path, data[:cut])
        assert "truncated" in message or "bad magic" in message or "empty" in message or "past the end" in message


def _header(n_tensors, n_kv):
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _kv_string(key: str, value: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, len(value)) + value


@pytest.mark.parametrize("data,expect", [
    (b"GGML" + bytes(20), "bad magic"),
    (b"GGUF" + struct.pack("<IQQ", 7, 0, 0), "version"),
    (_header(2**62, 0), "tensor table claims"),
    (_header(0, 2**60), "metadata claims"),
    (_header(0, 1) + struct.pack("<Q", 2**62) + b"k", "truncated"),
    (_header(0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99), "unknown value type"),
    # an array of u8 whose count runs far past the end: gguf.GGUFReader would loop on this
    (_header(0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 0, 2**61), "claims"),
    (_header(0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2**40), "claims"),
    (_header(0, 2) + _kv_string("a", b"x") + _kv_string("a", b"y"), "appears twice"),
    (_header(0, 1) + _kv_string("s", b"\xff\xfe" * 4)[:-3], "truncated"),
])
def test_corrupt_headers(tmp_path, data, expect):
    assert expect in _check_refused(tmp_path, data)


def _one_tensor_file(n_dims=2, dims=(32, 2), ttype=0, offset=0, data_bytes=256, extra_tensor=None):
    tensors = [("t", n_dims, dims, ttype, offset)] + ([extra_tensor] if extra_tensor else [])
    body = _header(len(tensors), 0)
    for name, nd, ds, tt, off in tensors:
        body += struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", nd)
        body += struct.pack(f"<{len(ds)}Q", *ds) + struct.pack("<IQ", tt, off)
    body += bytes(-len(body) % 32)
    return body + bytes(data_bytes)


@pytest.mark.parametrize("kwargs,expect", [
    (dict(ttype=200), "unknown type"),
    (dict(data_bytes=100), "past the end"),
    (dict(offset=2**60), "past the end"),
    (dict(offset=8), "not aligned"),
    (dict(n_dims=9, dims=(1,) * 9), "dimensions"),
    (dict(dims=(0, 2)), "invalid shape"),
    (dict(dims=(2**50, 2**50)), "invalid shape"),
    (dict(dims=(33, 2), ttype=int(GGMLQuantizationType.Q4_0)), "block size"),
    (dict(extra_tensor=("u", 1, (32,), 0, 128)), "overlap"),
])
def test_corrupt_tensor_table(tmp_path, kwargs, expect):
    assert expect in _check_refused(tmp_path, _one_tensor_file(**kwargs))


def test_cli_reports_one_line_and_exit_1(tmp_path, small_gguf):
    path = tmp_path / "cut.gguf"
    path.write_bytes(small_gguf[:100])
    for args in (["info", str(path)], ["run", str(path), "-p", "hi"], ["tokenize", str(path), "hi"]):
        result = subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=120)
        assert result.returncode == 1, result.stderr
        # (after a kernel change, run's first line may say that the kernels compile)
        lines = [line for line in result.stderr.splitlines() if not line.startswith("compiling the Numba kernels")]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert "Traceback" not in result.stderr


def test_gguf_version_2_opens(tmp_path, small_gguf):
    (tmp_path / "v2.gguf").write_bytes(small_gguf[:4] + struct.pack("<I", 2) + small_gguf[8:])
    assert GGUFFile(tmp_path / "v2.gguf").version == 2


def test_mutated_counts_are_refused_fast_with_a_short_message(tmp_path, smollm_path):
    """The tensor count (byte 8) and the first tensor's name length and dimension count, raised:
    the reader met tensor data as names (11 s, 1.7 GB and a 127 MB message before names were bounded)."""
    import time
    data = bytearray(smollm_path.read_bytes())
    n_tensors = struct.unpack_from("<Q", data, 8)[0]
    f = GGUFFile(smollm_path)
    first = next(iter(f.tensors))
    at = data.find(struct.pack("<Q", len(first)) + first.encode())  # the first tensor's name in the table
    for offset, value in ((8, n_tensors + 7), (8, n_tensors * 1000), (at, 10**6), (at, 2**40),
                          (at + 8 + len(first), 3)):
        bad = bytearray(data)
        struct.pack_into("<Q" if offset != at + 8 + len(first) else "<I", bad, offset, value)
        start = time.monotonic()
        message = _check_refused(tmp_path, bytes(bad))
        assert time.monotonic() - start < 3 and len(message) < 300, (offset, value, message[:300])
