"""A careless or hostile user's inputs: crafted model files, impossible options and sizes, endless
input, outputs that name an input, hostile templates and session files, Ctrl-C and SIGTERM. Each
case runs ggrun in a process of its own (a crash fails the test, not the test run) and checks its
exit status, that it ends within a time limit without a traceback, and that every input file is
byte for byte what it was."""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as V

from gguf_io import MetadataValue

from .gguf_copy import retyped, rewritten

ROOT = Path(__file__).parents[1]


def _as_in_a_terminal():
    """Ctrl-C's default disposition in the child, as a terminal's foreground command has it (a
    test run started in the background of a non-interactive shell ignores SIGINT, and its
    children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def ggrun(*args, status: int, inputs=(), stdin: str | bytes | None = None, limit: float = 120, **popen):
    """ggrun's exit status, stdout and stderr for args, checked: the status expected, within `limit`
    seconds, no traceback or raw [Errno] text, and every file of `inputs` unchanged."""
    before = {Path(p): _sha256(p) for p in inputs}
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "runner", *map(str, args)], input=stdin, capture_output=True,
                       timeout=limit, text=not isinstance(stdin, bytes), cwd=popen.pop("cwd", ROOT), **popen)
    out = r.stdout + r.stderr if isinstance(r.stdout, str) else (r.stdout + r.stderr).decode(errors="replace")
    assert "Traceback" not in out and "[Errno" not in out, out[-3000:]
    assert r.returncode == status, (r.returncode, out[-3000:])
    assert time.monotonic() - start < limit
    assert {p: _sha256(p) for p in before} == before, "an input file changed"
    return r


def refused(*args, inputs=(), **kw) -> str:
    """The one error line of a command that must refuse (exit status 1)."""
    r = ggrun(*args, status=1, inputs=inputs, **kw)
    errors = [line for line in r.stderr.splitlines() if line.startswith(("error: ", "Error: "))]
    assert len(errors) == 1, r.stderr
    return errors[0]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    """A cache of the tests' own (chat's history file goes there); every model is given by path."""
    monkeypatch.setenv("GGRUN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def model(smollm_path, tmp_path_factory) -> Path:
    """A copy of SmolLM2 in a folder of the test's own: commands may try to write over it."""
    path = tmp_path_factory.mktemp("model") / "smollm2.gguf"
    shutil.copyfile(smollm_path, path)
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return path


def _edited(model: Path, folder: Path, **changes) -> Path:
    """model with metadata keys changed (key spelt with __ for dots)."""
    name = "-".join(f"{k}={v.value if isinstance(v, MetadataValue) else v}" for k, v in changes.items())[:80]
    return rewritten(model, folder / f"{name}.gguf", {k.replace("__", "."): v for k, v in changes.items()})


def u32(value: int) -> MetadataValue:
    return MetadataValue(V.UINT32, value)


# --- 1. crashes ----------------------------------------------------------------------------

@pytest.mark.parametrize("dims", [128, 66, 63])
def test_rope_dimensions_beyond_or_not_the_head_are_refused(model, tmp_path, dims):
    bad = _edited(model, tmp_path, llama__rope__dimension_count=u32(dims))
    line = refused("run", bad, "-p", "Hello", "-n", "4", inputs=[bad])
    assert f"llama.rope.dimension_count = {dims}" in line and "head size 64" in line


def test_chat_cannot_save_over_the_running_model(model, tmp_path):
    r = ggrun("chat", model, "--temp", "0", "-n", "4", status=0, inputs=[model],
              stdin=f"Hi\n/save {model}\n/stats\n/bye\n")
    assert "which this command reads" in r.stdout and "context " in r.stdout.split("which this command reads")[-1]
    link = tmp_path / "state"
    (tmp_path / "state.kv.npz").symlink_to(model)
    r = ggrun("chat", model, "--save-kv", "-n", "2", status=0, inputs=[model], stdin=f"/save {link}\n/bye\n")
    assert "which this command reads" in r.stdout and not link.exists()


# --- 2. hangs ------------------------------------------------------------------------------

def test_a_huge_block_count_is_refused_at_once(model, tmp_path):
    bad = _edited(model, tmp_path, llama__block_count=u32(0xFFFFFFFF))
    assert "llama.block_count = 4294967295" in refused("run", bad, "-p", "Hi", inputs=[bad], limit=30)
    bad = _edited(model, tmp_path, llama__block_count=u32(29))
    assert "30 blocks" in refused("info", bad, inputs=[bad], limit=30)


@pytest.mark.parametrize("expression", ["(((9999**64)**64)**64)**64", "(((9**64)**64)**64)**64"])
def test_big_numbers_in_a_template_stop_at_once(model, tmp_path, expression):
    bad = rewritten(model, tmp_path / "template.gguf",
                    {"tokenizer.chat_template": MetadataValue(V.STRING, "{{ " + expression + " }}")})
    r = ggrun("run", bad, "-sys", "Be brief.", "-p", "Hi", "-n", "2", status=0, inputs=[bad], limit=60)
    assert "oversized number" in r.stderr and "built-in chatml template" in r.stderr


@pytest.mark.parametrize("args", [["run", "{model}", "-f", "/dev/zero"], ["tokenize", "{model}", "-f", "/dev/urandom"],
                                  ["run", "{model}", "-f", "{fifo}"], ["perplexity", "{model}", "-f", "/dev/zero"]])
def test_endless_input_is_refused(model, tmp_path, args):
    os.mkfifo(tmp_path / "fifo")
    args = [a.format(model=model, fifo=tmp_path / "fifo") for a in args]
    assert "not a regular file" in refused(*args, inputs=[model], limit=60)


def test_endless_standard_input_is_cut_off(model):
    with open("/dev/zero", "rb") as zero:
        r = subprocess.run([sys.executable, "-m", "runner", "run", str(model), "-n", "1"], stdin=zero,
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1 and "longer than 64 MiB" in r.stderr and "Traceback" not in r.stderr


# --- 3. data loss --------------------------------------------------------------------------

def test_convert_refuses_an_output_that_is_a_file_of_the_checkpoint(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"\x08" + bytes(7) + b"{}" + bytes(6))
    (tmp_path / "link.safetensors").symlink_to(folder / "model.safetensors")
    files = list(folder.iterdir())
    for out in (folder / "model.safetensors", folder / "config.json", tmp_path / "link.safetensors"):
        assert "which this command reads" in refused("convert", folder, "-o", out, inputs=files)


def test_perplexity_refuses_to_save_logits_over_its_inputs(model, text_file):
    for target in (model, text_file):
        assert "which this command reads" in refused("perplexity", model, "-f", text_file, "-c", "64",
                                                     "--save-logits", target, inputs=[model, text_file])


def _limit_file_size(size: int):
    """For a child process: files it writes stop at `size` bytes (a full disk), with EFBIG rather
    than the signal that would kill it."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return apply


def test_a_full_disk_during_save_keeps_the_last_save(model, tmp_path):
    saved = tmp_path / "talk.json"
    r = ggrun("chat", model, "-n", "2", status=0, inputs=[model], preexec_fn=_limit_file_size(4096),
              stdin=f"/save {saved}\n/system {'Be very brief. ' * 400}\n/save {saved}\n/stats\n/bye\n")
    assert "cannot write" in r.stdout and "context " in r.stdout.split("cannot write")[-1]
    assert json.loads(saved.read_text())["system"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["talk.json"]


def test_a_failed_save_of_logits_leaves_no_file(model, text_file, tmp_path):
    out = tmp_path / "logits.npz"
    assert "cannot write" in refused("perplexity", model, "-f", text_file, "-c", "64", "--save-logits", out,
                                     inputs=[model, text_file], preexec_fn=_limit_file_size(2000))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_convert_leaves_nothing_behind(smollm_hf, tmp_path, sig, status):
    checkpoint = smollm_hf
    out = tmp_path / "out.gguf"
    files = [p for p in checkpoint.iterdir() if p.is_file()]
    before = {p: _sha256(p) for p in files}
    child = subprocess.Popen([sys.executable, "-m", "runner", "convert", str(checkpoint), "-o", str(out),
                              "--type", "Q8_0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=_as_in_a_terminal)
    deadline = time.monotonic() + 120
    # (the signal comes once the output is begun: its header written in the partial folder)
    while not list(tmp_path.glob(".out.gguf.*.partial/*")) and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.02)
    assert child.poll() is None, "convert ended before it was interrupted"
    child.send_signal(sig)
    _, err = child.communicate(timeout=60)
    assert child.returncode == status and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []
    assert {p: _sha256(p) for p in files} == before


# --- 4. tracebacks -------------------------------------------------------------------------

@pytest.mark.parametrize("option,value,flag", [("--temp", "nan", "--temp"), ("--temp", "inf", "--temp"),
                                               ("--repeat-penalty", "0", "--repeat-penalty"),
                                               ("--top-p", "2", "--top-p"), ("--top-p", "nan", "--top-p"),
                                               ("--min-p", "-1", "--min-p"), ("--seed", "-2", "--seed"),
                                               ("--presence-penalty", "inf", "--presence-penalty"),
                                               ("--repeat-last-n", "-2", "--repeat-last-n"), ("-r", "", "-r")])
def test_impossible_sampling_options_are_refused(model, option, value, flag):
    assert flag in refused("run", model, "-p", "Hi", "-n", "2", option, value, inputs=[model])


@pytest.mark.parametrize("options", [["--temp", "1e-40"], ["--temp", "-1"], ["--seed", "-1"], ["--top-k", "-5"],
                                     ["--repeat-penalty", "1e-40", "--repeat-last-n", "-1"], ["--top-p", "0"]])
def test_llama_cpp_meanings_of_sampling_options(model, options):
    """A vanishing temperature samples the top token, as a negative one does (greedy); seed -1 is
    random; top-k <= 0 is off; a tiny penalty stays finite."""
    r = ggrun("run", model, "-p", "The capital of France is", "-n", "6", "--ignore-eos", "--json", *options, status=0)
    assert len(json.loads(r.stdout)["token_ids"]) == 6


def test_chat_refuses_bad_settings_and_goes_on(model):
    r = ggrun("chat", model, "-n", "4", "--temp", "0", status=0, inputs=[model],
              stdin="/set seed -1\n/set temp nan\n/set top_p 2\n/set top_k x\n/set repeat_penalty 0\nHello\n"
                    "/stats\n/bye\n")
    assert r.stdout.count("error: ") == 4 and "seed = None" in r.stdout
    assert "temperature stays 0" in r.stdout and "last turn:" in r.stdout


def _chat_file(folder: Path, messages, name="talk.json", **extra) -> Path:
    path = folder / name
    path.write_text(json.dumps({"format": "ggrun-chat/1", "system": None, "messages": messages, **extra}))
    return path


def test_crafted_session_files_leave_the_chat_as_it_was(model, tmp_path):
    files = [_chat_file(tmp_path, {"0": {"role": "user", "content": "x"}}, "object.json"),
             _chat_file(tmp_path, [{"role": "user", "content": 5}], "number.json"),
             _chat_file(tmp_path, [{"role": "user", "content": "a"}], "system.json", system=["x"]),
             _chat_file(tmp_path, [{"role": "root", "content": "a"}], "role.json")]
    (tmp_path / "not-json.json").write_text("{")
    files.append(tmp_path / "not-json.json")
    commands = "".join(f"/load {f}\n" for f in files) + f"/load {tmp_path}\n/load /dev/zero\n"
    r = ggrun("chat", model, "-n", "4", "--temp", "0", status=0, inputs=[model, *files],
              stdin="Hello\n" + commands + "/stats\n/bye\n")
    assert r.stdout.count("the conversation goes on as it was") == len(files) + 2
    assert "allow_pickle" not in r.stdout and "switched to the built-in" not in r.stdout
    assert "last turn:" in r.stdout


def _kv_state(tmp_path: Path, model: Path) -> Path:
    """A conversation saved with its KV state by chat."""
    talk = tmp_path / "saved.json"
    ggrun("chat", model, "--save-kv", "-n", "2", "--temp", "0", status=0, stdin=f"Hi\n/save {talk}\n/bye\n")
    return talk


def _rewrite_member(npz: Path, name: str, header: dict | None = None, data: bytes = b"", compress=False):
    """npz with member `name` replaced by an .npy of this header (dict of descr, fortran_order,
    shape) and data."""
    members = {}
    with zipfile.ZipFile(npz) as zf:
        for info in zf.infolist():
            members[info.filename] = zf.read(info)
    raw = repr(header).encode() if header is not None else b""
    npy = b"\x93NUMPY\x01\x00" + len(raw).to_bytes(2, "little") + raw + data
    members[name] = npy
    with zipfile.ZipFile(npz, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as zf:
        for n, content in members.items():
            zf.writestr(n, content)


def test_crafted_kv_states_are_refused_before_they_are_read(model, tmp_path):
    talk = _kv_state(tmp_path, model)
    kv = talk.with_name(talk.name + ".kv.npz")
    good = kv.read_bytes()
    cases = {
        "huge": ("keys_0.npy", {"descr": "<f2", "fortran_order": False, "shape": (10**12, 3, 64)}, b""),
        "bomb": ("values_0.npy", {"descr": "<f2", "fortran_order": False, "shape": (3, 2**28, 64)}, bytes(1 << 24)),
        "pickle": ("keys_1.npy", {"descr": "|O", "fortran_order": False, "shape": (1,)}, b"\x80\x04K\x01."),
        "short": ("values_2.npy", {"descr": "<f2", "fortran_order": False, "shape": (3, 3, 64)}, bytes(10)),
        "header": ("header.npy", {"descr": "<U8", "fortran_order": False, "shape": ()}, "[1, 2]  ".encode("utf-32-le")),
    }
    for name, (member, header, data) in cases.items():
        kv.write_bytes(good)
        _rewrite_member(kv, member, header, data, compress=name == "bomb")
        start = time.monotonic()
        r = ggrun("chat", model, "-n", "2", status=0, inputs=[model, kv, talk], stdin=f"/load {talk}\n/bye\n")
        assert "not used" in r.stdout and "prefilling the conversation instead" in r.stdout, r.stdout
        assert "loaded 2 messages" in r.stdout and "allow_pickle" not in r.stdout
        assert time.monotonic() - start < 60


def test_a_bad_load_does_not_switch_the_template(model, tmp_path):
    """Two user turns in a row make many real templates raise; /load refuses such a file, and the
    model's template stays."""
    strict = "{% for m in messages %}{% if not loop.first and m.role == loop.previtem.role %}{{ raise_exception(" \
             "'roles must alternate') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n" \
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    strict_model = rewritten(model, tmp_path / "strict.gguf", {"tokenizer.chat_template": strict})
    bad = _chat_file(tmp_path, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    r = ggrun("chat", strict_model, "-n", "2", status=0, inputs=[strict_model, bad],
              stdin=f"/load {bad}\nHello\n/bye\n")
    assert "roles must alternate" in r.stdout and "switched to the built-in" not in r.stdout + r.stderr


@pytest.mark.parametrize("length,status", [(0, 1), (1, 0)])
def test_a_context_length_of_zero_or_one(model, tmp_path, length, status):
    bad = _edited(model, tmp_path, llama__context_length=u32(length))
    r = ggrun("run", bad, "-p", "Hello", "-n", "4", status=status, inputs=[bad])
    assert ("llama.context_length = 0" in r.stderr) if length == 0 else ("trained on" in r.stderr)


@pytest.mark.parametrize("args", [["run", "{model}", "-p", "Hi", "-c", "1000000000"],
                                  ["chat", "{model}", "-c", "1000000000"],
                                  ["bench", "{model}", "-d", "99999999999"],
                                  ["perplexity", "{model}", "-f", "{text}", "-c", "2000000000"]])
def test_impossible_sizes_say_what_fits(model, text_file, args):
    line = refused(*[a.format(model=model, text=text_file) for a in args], inputs=[model], stdin="")
    assert "GiB" in line and "longest context that fits is 8192 tokens" in line


@pytest.fixture(scope="module")
def saved_logits(smollm_path, tmp_path_factory) -> dict:
    """The arrays perplexity --save-logits writes for the text below, at -c 64."""
    folder = tmp_path_factory.mktemp("logits")
    text = folder / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    ggrun("perplexity", smollm_path, "-f", text, "-c", "64", "--save-logits", folder / "base.npz", status=0)
    with np.load(folder / "base.npz") as f:
        return {name: f[name] for name in f.files}


@pytest.mark.parametrize("change", [
    lambda a: {"top_ids": a["top_ids"] + 10**6},                        # ids past the vocabulary
    lambda a: {"top_ids": a["top_ids"][:, :5]},                         # fewer candidates than top_logprobs
    lambda a: {"top_logprobs": a["top_logprobs"][:7]},                  # fewer positions
    lambda a: {"target_logprobs": np.full_like(a["target_logprobs"], np.nan)},
    lambda a: {"top_logprobs": a["top_logprobs"].astype(np.float64)},   # another type
    lambda a: {"top_ids": np.zeros((10**5, 32), np.int32)},             # more positions than the text has tokens
    lambda a: {"n_ctx": np.array([64, 64])},
    lambda a: {"vocab_size": np.array([49152], dtype=object)},          # a pickled object
    lambda a: {"top_ids": None},                                        # missing
])
def test_crafted_kl_bases_are_refused(model, text_file, tmp_path, saved_logits, change):
    base = tmp_path / "base.npz"
    arrays = {**saved_logits, **change(saved_logits)}
    np.savez(base, **{k: v for k, v in arrays.items() if v is not None})
    line = refused("perplexity", model, "-f", text_file, "-c", "64", "--kl-base", base, inputs=[model, base])
    assert "is not a logits file" in line and "allow_pickle" not in line


def test_a_saved_kl_base_is_read(model, text_file, tmp_path, saved_logits):
    np.savez(tmp_path / "base.npz", **saved_logits)
    r = ggrun("perplexity", model, "-f", text_file, "-c", "64", "--kl-base", tmp_path / "base.npz", status=0)
    assert "KLD mean" in r.stdout


# --- 5. sloppy -----------------------------------------------------------------------------

def test_a_context_above_the_trained_length_is_warned_of(model):
    r = ggrun("run", model, "-p", "Hi", "-n", "1", "-c", "9000", status=0)
    assert "longer than the 8192 this model was trained on" in r.stderr


def test_ctrl_c_during_run_exits_130(model):
    child = subprocess.Popen([sys.executable, "-m", "runner", "run", str(model), "-p", "Once upon a time", "-n",
                              "100000", "--ignore-eos"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             preexec_fn=_as_in_a_terminal)
    assert child.stdout.read(20)  # (generating)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130 and b"Traceback" not in err


def test_a_nan_perplexity_is_an_error(model, text_file, tmp_path):
    bad = retyped(model, tmp_path / "flipped.gguf", "blk.0.ffn_down.weight", 2)
    assert "NaN" in refused("perplexity", bad, "-f", text_file, "-c", "64", inputs=[bad, text_file])


def test_quant_report_refuses_a_quantized_source_at_once(model, text_file):
    assert "already quantized" in refused("quant-report", model, "-f", text_file, inputs=[model], limit=60)


def test_progress_bars_stay_out_of_logs(model, text_file):
    r = ggrun("perplexity", model, "-f", text_file, "-c", "64", status=0)
    assert "\r" not in r.stderr and "PPL" in r.stdout


def test_bench_with_nothing_to_measure_is_refused(model):
    assert "nothing to measure" in refused("bench", model, "-p", "0", "-n", "0")


def test_help_says_the_default_model_is_downloaded():
    for command in ([], ["run"], ["chat"]):
        r = ggrun(*command, "--help", status=0)
        assert "downloaded" in " ".join(r.stdout.split())


def test_a_local_file_wins_over_a_registry_name(model, tmp_path):
    (tmp_path / "gemma3-270m").symlink_to(model)
    r = ggrun("info", "gemma3-270m", status=0, cwd=tmp_path)
    assert "architecture:  llama" in r.stdout


def test_chat_history_is_bounded(model, tmp_path):
    history = tmp_path / "chat_history"
    history.write_text("".join(f"line {i}\n" for i in range(5000)))
    ggrun("chat", model, "-n", "1", status=0, stdin="Hi\n/bye\n", env={**os.environ, "GGRUN_CACHE_DIR": str(tmp_path)})
    assert len(history.read_text().splitlines()) <= 1000


def test_usage_mistakes_exit_1():
    for args in (["run", "--no-such-option"], ["no-such-command"], ["run", "-n", "many"]):
        assert refused(*args).startswith("Error: ")
