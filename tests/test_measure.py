"""perplexity, KL divergence, memory fit, bench and quant-report."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from convert.convert import requantize
from gguf_io import GGUFFile, read_params
from runner.engine.load import LoadOptions, load_model, memory_fit
from runner.engine.memory_fit import MemoryFit, parse_size
from runner.measure.perplexity import (
    compare_to_base,
    load_base,
    perplexity,
    save_logits,
)

TEXT_PATH = Path(__file__).parent / "data" / "ppl_text.txt"
TEXT = TEXT_PATH.read_text()


def ggrun(*args):
    return subprocess.run([sys.executable, "-m", "runner", *map(str, args)], capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def quantized(smollm_f32, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for t in ("Q4_K_M", "Q2_K"):
        out[t] = root / f"{t}.gguf"
        requantize(smollm_f32, out[t], t, progress=False)
    return out


def test_perplexity_orders_the_quantizations(smollm_f32, quantized):
    ppl = {name: perplexity(load_model(path, LoadOptions(kv_type="f32")), TEXT, 256, progress=False)
           for name, path in [("F32", smollm_f32), *quantized.items()]}
    assert ppl["F32"].tokens_scored == 4 * 127  # 1063 tokens: four chunks, second halves scored
    assert ppl["F32"].ppl < ppl["Q4_K_M"].ppl < ppl["Q2_K"].ppl
    assert 1 < ppl["F32"].ppl < 50 and ppl["F32"].ppl_stderr > 0


def test_perplexity_matches_a_direct_computation(smollm):
    """Scoring by hand: log-softmax of full logits, second half of each chunk."""
    result = perplexity(smollm, TEXT, 128, progress=False)
    ids = smollm.tokenizer.encode(TEXT)
    nll = []
    for c in range(len(ids) // 128):
        chunk = ids[c * 128:(c + 1) * 128]
        logits = smollm.model.forward(chunk, smollm.model.new_cache(128), all_logits=True).astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
        nll += [-logp[j, chunk[j + 1]] for j in range(64, 127)]
    assert np.isclose(result.ppl, np.exp(np.mean(nll)), rtol=1e-6)


def test_perplexity_reads_special_token_texts_as_plain_text(smollm):
    """As llama-perplexity tokenizes a document: "<|im_start|>" written in it is text, not a
    control token."""
    from runner.measure.perplexity import text_tokens
    text = "A prompt is plain text: `<|im_start|>` typed in it is those characters."
    im_start = smollm.tokenizer.encode("<|im_start|>", add_special=False)
    assert len(im_start) == 1 and im_start[0] not in text_tokens(smollm, text)


def test_kl_against_itself_is_zero(smollm, tmp_path):
    first = perplexity(smollm, TEXT, 128, progress=False)
    save_logits(first, tmp_path / "base.npz", len(smollm.tokenizer.vocab))
    assert (tmp_path / "base.npz").stat().st_size < 200 * first.tokens_scored  # top-k only, compressed
    base = load_base(tmp_path / "base.npz", first.tokens_scored)
    kl = compare_to_base(perplexity(smollm, TEXT, 128, base=base, progress=False), base)
    assert kl["kld_mean"] < 1e-4 and kl["kld_max"] < 1e-3
    assert kl["top1_agreement"] == 1.0 and abs(kl["ppl_ratio"] - 1) < 1e-6


def test_kl_of_a_quantization_is_positive(smollm_f32, quantized, tmp_path):
    r = ggrun("perplexity", smollm_f32, "-f", TEXT_PATH, "-c", "256", "--save-logits", tmp_path / "f32.npz", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"model", "ppl", "ppl_stderr", "tokens_scored", "chunks", "n_ctx", "seconds", "kl"}
    assert doc["kl"] is None and doc["chunks"] == 4 and doc["n_ctx"] == 256
    r = ggrun("perplexity", quantized["Q2_K"], "-f", TEXT_PATH, "-c", "256", "--kl-base", tmp_path / "f32.npz", "--json")
    assert r.returncode == 0, r.stderr
    kl = json.loads(r.stdout)["kl"]
    assert set(kl) == {"kld_mean", "kld_p50", "kld_p90", "kld_p99", "kld_max", "top1_agreement", "ppl_base", "ppl_ratio"}
    assert kl["kld_mean"] > 0.01 and 0.3 < kl["top1_agreement"] < 1.0 and kl["ppl_ratio"] > 1
    r = ggrun("perplexity", quantized["Q2_K"], "-f", TEXT_PATH, "-c", "128", "--kl-base", tmp_path / "f32.npz")
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "different" in r.stderr


def test_fit_figures_by_hand(smollm_path, gemma_path):
    # SmolLM2: 30 layers, 3 KV heads of 64 for keys and values, f16 -> 2 x 30 x 3 x 64 x 2 bytes per token
    f = GGUFFile(smollm_path)
    p = read_params(f)
    fit = MemoryFit.of(f, p, "f16")
    assert fit.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 2 == 23040
    assert fit.weight_bytes == sum(t.nbytes for t in f.tensors.values())
    # Q4_1 blocks: 32 weights in 20 bytes; per layer q, o (576x576), k, v (576x192), gate, up, down (576x1536)
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    assert fit.weight_bytes_by_type["Q4_1"] == 30 * per_layer // 32 * 20 == 66_355_200
    assert fit.weight_bytes_by_type["Q8_0"] == 49152 * 576 // 32 * 34  # the tied embedding
    assert fit.kv_bytes(4096, users=2) == 2 * 4096 * 23040
    assert fit.max_context(fit.weight_bytes + 1000 * 23040) == 1000
    assert MemoryFit.of(f, p, "q8_0").kv_bytes_per_token() == 2 * 30 * 3 * 64 * 34 / 32
    # Gemma 3 270M: 18 layers, 1 KV head of 256; 15 sliding layers never hold more than 512 tokens
    g = GGUFFile(gemma_path)
    q = read_params(g)
    gfit = MemoryFit.of(g, q, "f16")
    per_layer = 2 * 1 * 256 * 2
    assert gfit.kv_bytes_per_token() == 3 * per_layer
    assert gfit.kv_bytes(8192) == 3 * 8192 * per_layer + 15 * 512 * per_layer
    assert gfit.kv_bytes(300) == 18 * 300 * per_layer
    assert gfit.max_context(10**12) == 32768
    assert parse_size("8G") == 8 * 2**30 and parse_size("512MiB") == 512 * 2**20


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_fit_counts_the_cache_the_cpu_backend_allocates(smollm_path, kv_type):
    lm = load_model(smollm_path, LoadOptions(kv_type=kv_type))
    cache = lm.model.new_cache(256)
    assert sum(a.nbytes for a in cache.keys + cache.values) == memory_fit(lm.file, lm.params, kv_type).kv_bytes(256)


def test_fit_command(gemma_path):
    r = ggrun("info", gemma_path, "--fit", "--ctx", "8192", "--users", "2", "--mem", "300M")
    assert r.returncode == 0, r.stderr
    assert "3.0 KiB per token over 3 global layers" in r.stdout and "15 layers capped" in r.stdout
    assert "KV 63.0 MiB" in r.stdout and "longest context in 300 MiB" in r.stdout


def test_bench_json_schema(smollm_path):
    r = ggrun("bench", smollm_path, "-p", "16", "-n", "4", "-r", "2", "-t", "2", "-d", "0,40", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["test"] for row in rows] == ["pp16", "tg4", "tg4@d40"]
    keys = {"model", "arch", "quant", "size_mib", "params_m", "active_params_m", "bits_per_weight", "backend", "threads", "kv_type",
            "cpu", "decode_products", "test", "n_tokens", "depth", "repetitions", "tok_s_mean", "tok_s_std", "tok_s",
            "bandwidth_gb_s", "read_mib_per_token", "bandwidth_fraction", "speed_vs_first_depth",
            "bandwidth_limit_vs_first_depth"}
    assert all(set(row) == keys for row in rows)
    assert rows[0]["decode_products"].startswith("8-bit activations")
    # depths compared by alternating steps: the first is the reference (how fast the deeper one is,
    # is for benchmarks to judge, not a test)
    assert rows[0]["speed_vs_first_depth"] is None and rows[1]["speed_vs_first_depth"] == 1.0
    assert rows[2]["speed_vs_first_depth"] > 0
    # reading 40 tokens more of cache (0.9 MiB) at the machine's bandwidth costs a few percent at most
    assert rows[0]["bandwidth_limit_vs_first_depth"] is None and rows[1]["bandwidth_limit_vs_first_depth"] == 1.0
    assert 0.9 < rows[2]["bandwidth_limit_vs_first_depth"] < 1.0
    assert rows[0]["quant"] == "Q4_1" and rows[0]["threads"] == 2 and len(rows[1]["tok_s"]) == 2
    assert rows[0]["bandwidth_fraction"] is None and rows[0]["kv_type"] == "f16"
    # a step reads every weight (SmolLM2 ties its output to the embedding, so that one too)
    weights = sum(t.nbytes for t in GGUFFile(smollm_path).tensors.values()) / 2**20
    assert rows[1]["read_mib_per_token"] <= weights + 1
    assert rows[2]["read_mib_per_token"] > rows[1]["read_mib_per_token"]  # 40 more tokens of KV cache
    tg = rows[1]
    assert tg["bandwidth_fraction"] == pytest.approx(tg["read_mib_per_token"] * 2**20 * tg["tok_s_mean"]
                                                     / (tg["bandwidth_gb_s"] * 1e9))
    assert 1 < tg["bandwidth_gb_s"] < 10_000


def test_quant_report(tmp_path):
    """A row per type, and with an importance matrix a second row for each type it changes and
    the only row of a type that needs one (refused without a matrix, before any work). On a small
    random Llama (the report's arithmetic is perplexity's and the converter's, tested on the real
    models elsewhere)."""
    from convert.random_model import LlamaShape, write_random_llama
    f32, png, imatrix, text = (tmp_path / name for name in ("f32.gguf", "report.png", "imatrix.gguf", "text.txt"))
    write_random_llama(f32, LlamaShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, vocab_size=512,
                                       context_length=256), "F32", progress=False, tiled=False)
    text.write_text(TEXT[:400])
    report = ["quant-report", f32, "-f", text, "-c", "128", "--types", "Q2_K,IQ2_XXS"]
    r = ggrun(*report)
    assert r.returncode == 1 and "IQ2_XXS needs an importance matrix: make one with `ggrun imatrix" in r.stderr
    text.with_suffix(".dat").write_bytes(b"not a matrix")
    r = ggrun(*report, "--imatrix", text.with_suffix(".dat"))
    assert r.returncode == 1 and "cannot read the importance matrix" in r.stderr and "Traceback" not in r.stderr
    assert ggrun("imatrix", f32, "-f", text, "-o", imatrix, "-c", "128", "--chunks", "2").returncode == 0
    r = ggrun(*report, "--imatrix", imatrix, "--plot", png)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["type", "size", "MiB"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert list(rows) == ["F32", "Q2_K", "Q2_K+imatrix", "IQ2_XXS+imatrix"]
    assert rows["Q2_K+imatrix"][5] != rows["Q2_K"][5]  # (the KL divergence)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quant_report_makes_each_type_with_an_importance_matrix_where_it_changes_it():
    from runner.measure.quant_report import _variants
    assert _variants(["Q8_0", "Q4_K_M", "IQ3_S", "TQ1_0", "IQ2_XS"], Path("imatrix.gguf")) == [
        ("Q8_0", False), ("Q4_K_M", False), ("Q4_K_M", True), ("IQ3_S", False), ("IQ3_S", True), ("TQ1_0", False),
        ("IQ2_XS", True)]
    assert _variants(["Q8_0", "Q4_K_M"], None) == [("Q8_0", False), ("Q4_K_M", False)]
    with pytest.raises(ValueError, match="IQ1_S, IQ2_M need an importance matrix"):
        _variants(["Q4_K_M", "IQ1_S", "IQ2_M"], None)


@pytest.mark.parametrize("model", ["smollm_path", "gemma_path"])
def test_prefill_on_amx_tiles_keeps_greedy_text_and_perplexity(request, model, monkeypatch):
    """Prefill's products on AMX's integer tiles are the vector path's bits, so greedy text
    after a long prompt and perplexity come out the same on both real models."""
    from kernels_cpu import amx_int8
    from runner.engine.generate import generate
    from runner.engine.sampler import Sampler, SamplingOptions
    if not amx_int8.usable():
        pytest.skip("this CPU has no AMX integer tiles")
    lm = load_model(request.getfixturevalue(model), LoadOptions(kv_type="f32"))
    prompt = lm.tokenizer.encode(TEXT[:600])

    def outcomes():
        text = list(generate(lm.model, lm.model.new_cache(512), prompt, Sampler(SamplingOptions(temperature=0)), 24,
                             stop_ids=()))
        return text, perplexity(lm, TEXT, 256, progress=False).ppl
    on_tiles = outcomes()
    monkeypatch.setattr(amx_int8, "usable", lambda: False)
    assert outcomes() == on_tiles
