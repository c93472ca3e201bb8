"""A metadata fuzzer on the real SmolLM2 file: every key the loader reads (found by watching it read
them, the keys the file lacks included) set to values of the wrong type, size and sign. Loading
either succeeds or raises ggrun's own GGUFError; then each file that loaded runs a forward pass in a
process of its own, which must end without a signal or an exception."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType as V

from gguf_io import GGUFError, GGUFFile, MetadataValue

from .gguf_copy import rewritten

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

ROOT = Path(__file__).parents[1]
EXAMPLES = int(os.environ.get("GGRUN_FUZZ_EXAMPLES", "40"))  # (bounded for CI; raise it to search longer)


class _Watched(dict):
    """A file's metadata that records every key looked up in it, found or not."""

    def __init__(self, items, seen: set):
        super().__init__(items)
        self.seen = seen

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)


def keys_read(path: Path, monkeypatch) -> list[str]:
    """The metadata keys that loading `path` looks up."""
    from runner.engine.load import LoadOptions, load_model
    seen: set[str] = set()
    init = GGUFFile.__init__

    def watching(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.metadata = _Watched(self.metadata, seen)
    with monkeypatch.context() as m:
        m.setattr(GGUFFile, "__init__", watching)
        load_model(path, LoadOptions(kv_type="f32"))
    return sorted(seen - {"general.architecture"})  # (the copies' architecture is the file's, by design)


def _typed(vtype, item_type=None):
    return lambda value: MetadataValue(vtype, value, item_type)


VALUES = st.one_of(
    st.none(),  # (the key left out)
    st.text(max_size=6).map(_typed(V.STRING)),
    st.booleans().map(_typed(V.BOOL)),
    st.integers(-2**31, 2**31 - 1).map(_typed(V.INT32)),
    st.one_of(st.sampled_from([0, 1, 2, 3, 30, 63, 64, 65, 128, 576, 49152, 2**31, 2**32 - 1]),
              st.integers(0, 2**32 - 1)).map(_typed(V.UINT32)),
    st.integers(0, 2**64 - 1).map(_typed(V.UINT64)),
    st.floats(width=32).map(_typed(V.FLOAT32)),
    st.lists(st.integers(-3, 70), min_size=1, max_size=40).map(_typed(V.ARRAY, V.INT32)),  # (GGUFWriter writes no empty array)
    st.lists(st.text(max_size=3), min_size=1, max_size=4).map(_typed(V.ARRAY, V.STRING)),
)


def _as_json(value: MetadataValue | None):
    return None if value is None else [int(value.type), value.value, None if value.item_type is None
                                       else int(value.item_type)]


def forward_each(cases_file: str, model: str, folder: str) -> None:
    """For each (key, value) of cases_file: the model with it, loaded, through a forward pass of
    a few tokens and a decode step."""
    from runner.engine.load import LoadOptions, load_model
    for key, raw in json.loads(Path(cases_file).read_text()):
        value = None if raw is None else MetadataValue(V(raw[0]), raw[1], None if raw[2] is None else V(raw[2]))
        path = rewritten(model, Path(folder) / "case.gguf", {key: value})
        print(key, raw, flush=True)
        lm = load_model(path, LoadOptions(kv_type="f16"))
        cache = lm.model.new_cache(lm.default_context())
        logits = lm.model.forward(lm.tokenizer.encode("Hello there", parse_special=False) or [0], cache)
        lm.model.forward([int(logits.argmax())], cache)
    print("all ran", flush=True)


def test_hostile_metadata_loads_or_is_refused(smollm_path, tmp_path, monkeypatch):
    from runner.engine.load import LoadOptions, load_model
    keys = keys_read(smollm_path, monkeypatch)
    assert {"llama.rope.dimension_count", "llama.block_count", "tokenizer.ggml.tokens",
            "llama.rope.scaling.type"} <= set(keys)  # (read, and one the file lacks)
    loaded = []

    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(key=st.sampled_from(keys), value=VALUES)
    def load(key, value):
        path = rewritten(smollm_path, tmp_path / "fuzz.gguf", {key: value})
        try:
            load_model(path, LoadOptions(kv_type="f32"))
        except GGUFError as e:
            assert str(e) and "\n" not in str(e)
            return
        loaded.append((key, _as_json(value)))
    load()

    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(loaded))
    run = subprocess.run([sys.executable, "-c", "import sys; from tests.test_metadata_fuzz import forward_each; "
                          "forward_each(*sys.argv[1:])", str(cases), str(smollm_path), str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0 and run.stdout.endswith("all ran\n"), (run.returncode, run.stdout[-2000:],
                                                                       run.stderr[-3000:])
