"""Mixtures of experts: routing, products over chosen experts on both backends, and whole models
(Qwen3-MoE, Qwen2-MoE with its shared expert, OLMoE, Mixtral) against transformers in fp32."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from convert.convert import convert_hf, requantize
from gguf_io import GGUFFile
from kernels_cpu.backend import CpuBackend
from kernels_cpu.experts import GATING, route
from kernels_cpu.step_program import Op
from runner.engine.load import LoadOptions, load_model

from .hf_folders import GPT2_VOCAB, MOE_CONFIGS, converted_files, logits_by_passes, transformers_logits
from .llama_cpp import PERPLEXITY_TEXT, convert_with_llama_cpp, llama_cpp_perplexity
from .test_kernels import _random_blocks

TYPES = [T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q2_K, T.Q4_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]


def _experts(rng, qtype, experts, n, k):
    """Raw rows of an expert tensor (experts * n rows of k weights) and its exact values."""
    if qtype in (T.Q2_K, T.Q4_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS):
        raw = _random_blocks(rng, qtype, experts * n, k, "random")
    else:
        raw = quantize(rng.standard_normal((experts * n, k)).astype(np.float32), qtype)
        raw = raw.view(np.uint8).reshape(experts * n, -1)  # (float types come back as values)
    return raw, dequantize(raw, qtype).reshape(experts, n, k).astype(np.float32)


def _close(got, want, precise):
    tolerance = 1e-4 if precise else 3e-2  # (8-bit activations: test_kernels_int8's bound, loosely)
    assert np.abs(got - want).max() <= tolerance * np.abs(want).max()


@pytest.mark.parametrize("precise", [False, True], ids=["int8", "precise"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_expert_products_are_each_chosen_experts_product(qtype, precise):
    rng = np.random.default_rng(int(qtype))
    experts, n, k = 6, 48, 512
    be = CpuBackend(precise=precise)
    raw, dense = _experts(rng, qtype, experts, n, k)
    w = be.load_experts(qtype, raw, k, experts)
    x = rng.standard_normal((1, k)).astype(np.float32)
    # (experts scattered, the first ones, the last ones: neighbours whose tasks one thread runs)
    for ids in ([[4, 1, 5]], [[0, 1, 2]], [[5, 4, 3]], [[2]]):
        ids = np.array(ids, dtype=np.int32)
        (got,) = be.expert_matmuls([w], x, ids)
        # one token's slots: the same kernel as each expert's own product, bit for bit
        assert np.array_equal(got, np.concatenate([be.matmul(w.expert(e), x) for e in ids[0]]))
        _close(got, np.stack([dense[e] @ x[0] for e in ids[0]]), precise)
    ids = np.array([[4, 1, 5]], dtype=np.int32)
    # an input per slot (the down products)
    xs = rng.standard_normal((3, k)).astype(np.float32)
    (got,) = be.expert_matmuls([w], xs, ids)
    _close(got, np.stack([dense[e] @ xs[j] for j, e in enumerate(ids[0])]), precise)
    # many tokens, expert by expert
    many = rng.standard_normal((20, k)).astype(np.float32)
    chosen = rng.integers(0, experts, (20, 2)).astype(np.int32)
    (got,) = be.expert_matmuls([w], many, chosen)
    _close(got, np.stack([dense[e] @ many[t] for t in range(20) for e in chosen[t]]), precise)


def test_expert_ids_outside_the_experts_are_refused():
    be = CpuBackend()
    raw, _ = _experts(np.random.default_rng(0), T.Q8_0, 4, 32, 64)
    w = be.load_experts(T.Q8_0, raw, 64, 4)
    with pytest.raises(IndexError):
        be.expert_matmuls([w], np.ones((1, 64), np.float32), np.array([[1, 4]], dtype=np.int32))
    with pytest.raises(ValueError):  # rows that do not divide into the experts
        be.load_experts(T.Q8_0, raw[:-1], 64, 4)


def _softmax(x):
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _route_reference(logits, k, gating, norm, scale, bias=0.0):
    probs = {"softmax": _softmax, "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "softmax_weight": lambda x: x}[gating](logits)
    ids = np.argsort(-(probs + bias), axis=1, kind="stable")[:, :k]  # (the bias chooses, the weights are without it)
    weights = np.take_along_axis(probs, ids, 1)
    if gating == "softmax_weight":  # (gpt-oss: the softmax over the chosen logits)
        weights = _softmax(weights)
    if norm:
        weights /= weights.sum(1, keepdims=True)
    return ids, weights * scale


def _route_case(gating, biased):
    """Router logits of 7 tokens over 16 experts, with a tie in token 0 (broken by the bias's
    experts where there is one), and a selection bias (zeros where not biased) as large as the
    probabilities' spread, so that it changes choices."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((7, 16)).astype(np.float32) * 3
    logits[0, 3] = logits[0, 9] = logits[0].max() + 1  # a tie goes to the lower id
    scale = 3.0 if gating == "softmax_weight" else 0.3 if gating == "softmax" else 0.5
    bias = (rng.standard_normal(16) * scale).astype(np.float32) if biased else np.zeros(16, np.float32)
    return logits, bias


@pytest.mark.parametrize("biased", [False, True], ids=["unbiased", "biased"])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("gating", ["softmax", "sigmoid", "softmax_weight"])
@pytest.mark.parametrize("norm", [False, True])
def test_route_picks_the_most_probable_experts(gating, norm, k, biased):
    logits, bias = _route_case(gating, biased)
    ids, weights = np.empty((7, k), np.int32), np.empty((7, k), np.float32)
    route(logits, GATING[gating], norm, np.float32(2.5), bias, ids, weights)
    want_ids, want_weights = _route_reference(logits.astype(np.float64), k, gating, norm, 2.5, bias)
    assert np.array_equal(ids, want_ids)
    assert np.allclose(weights, want_weights, rtol=1e-5)
    if biased:  # (the bias changed some choice: not a vacuous case)
        assert not np.array_equal(ids, _route_reference(logits.astype(np.float64), k, gating, norm, 2.5)[0])


def test_route_of_nan_logits_still_names_distinct_experts():
    logits = np.full((1, 8), np.nan, dtype=np.float32)
    ids, weights = np.empty((1, 3), np.int32), np.empty((1, 3), np.float32)
    route(logits, GATING["softmax"], True, np.float32(1.0), np.zeros(8, np.float32), ids, weights)
    assert sorted(ids[0]) == [0, 1, 2]


def test_a_selection_bias_of_another_size_is_refused():
    with pytest.raises(ValueError, match="selection bias"):
        CpuBackend().route(np.zeros((2, 8), np.float32), 2, "sigmoid", True, 1.0, np.zeros(7, np.float32))


def test_torch_mixture_ops_match_the_cpu_kernels():
    torch = pytest.importorskip("torch")
    from kernels_gpu.backend import TorchBackend
    rng = np.random.default_rng(2)
    be, cpu = TorchBackend("cpu"), CpuBackend(precise=True)
    logits = rng.standard_normal((5, 8)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32) * 0.5
    for gating, selection_bias in itertools.product(("softmax", "sigmoid", "softmax_weight"), (None, bias)):
        ids, weights = be.route(torch.from_numpy(logits), 2, gating, True, 1.5,
                                None if selection_bias is None else torch.from_numpy(selection_bias))
        want_ids, want_weights = cpu.route(logits, 2, gating, True, 1.5,
                                           None if selection_bias is None else cpu.load_vector(selection_bias))
        assert np.array_equal(ids.numpy(), want_ids) and np.allclose(weights.numpy(), want_weights, rtol=1e-5)
    raw, dense = _experts(rng, T.Q4_K, 4, 32, 256)
    w = be.load_experts(T.Q4_K, raw, 256, 4)
    for tokens in (1, 9):
        x = rng.standard_normal((tokens, 256)).astype(np.float32)
        chosen = rng.integers(0, 4, (tokens, 2))
        (got,) = be.expert_matmuls([w], torch.from_numpy(x), torch.from_numpy(chosen))
        want = np.stack([dense[e] @ x[t] for t in range(tokens) for e in chosen[t]])
        assert np.allclose(got.numpy(), want, atol=1e-4 * np.abs(want).max())
    table = rng.standard_normal((4, 7)).astype(np.float32)  # (gpt-oss's per-expert biases)
    ids = np.array([[3, 0], [1, 1]], dtype=np.int32)
    assert np.array_equal(be.expert_rows(torch.from_numpy(table), torch.from_numpy(ids)).numpy(),
                          cpu.expert_rows(cpu.load_vector(table), ids))
    assert np.array_equal(cpu.expert_rows(cpu.load_vector(table), ids), table[[3, 0, 1, 1]])
    gate, up = (rng.standard_normal((3, 40)).astype(np.float32) * 6 for _ in range(2))
    g = np.minimum(gate, 7.0)
    want = g / (1 + np.exp(-1.702 * g)) * (np.clip(up, -7.0, 7.0) + 1)
    assert np.allclose(cpu.clamped_swiglu(gate.copy(), up, 1.702, 7.0), want, rtol=1e-5, atol=1e-5)
    assert np.allclose(be.clamped_swiglu(torch.from_numpy(gate), torch.from_numpy(up), 1.702, 7.0).numpy(), want,
                       rtol=1e-5, atol=1e-5)
    y = rng.standard_normal((6, 5)).astype(np.float32)
    mix = rng.standard_normal((3, 2)).astype(np.float32)
    assert np.allclose(be.expert_combine(torch.from_numpy(y), torch.from_numpy(mix)).numpy(),
                       cpu.expert_combine(y, mix), atol=1e-6)


@pytest.fixture(scope="module")
def moe_files(moe_folders, tmp_path_factory):
    """Each mixture converted by ggrun to F32, and to Q4_K_M with its exact values (F32 again)."""
    return converted_files(moe_folders, tmp_path_factory.mktemp("moe-gguf"))


@pytest.mark.parametrize("device", ["cpu", "torch-cpu"])
@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_moe_models_match_transformers(moe_folders, moe_files, arch, device):
    if device == "torch-cpu":
        pytest.importorskip("torch")
    lm = load_model(moe_files[arch][0], LoadOptions(kv_type="f32", device=device))
    ids = np.random.default_rng(1).integers(0, lm.params.vocab_size, 64).tolist()
    want = transformers_logits(moe_folders[arch], ids)
    prefill, steps = logits_by_passes(lm, ids)
    for got in (prefill, steps):
        assert np.array_equal(got.argmax(1), want.argmax(1))
        assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    if device == "cpu":  # the steps replayed a recorded program that routes inside it
        program = lm.backend.recorded_program(lm.model, lm.model.kv_type, 1, False)
        assert {Op.ROUTE, Op.EXPERT_PRODUCTS, Op.COMBINE} <= set(program.code[:, 0].tolist())
        assert program.mixture.dtype.names == ("mixture",)
        assert lm.backend.replay_checked


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_quantized_moe_models_compute_their_exact_values(moe_files, arch):
    """A Q4_K_M mixture on the precise path against the same weights widened to F32; the default
    8-bit path's decode steps against its own prefill."""
    _, q4, widened = moe_files[arch]
    ids = np.random.default_rng(3).integers(0, load_model(q4, LoadOptions(kv_type="f32")).params.vocab_size, 24).tolist()
    exact = load_model(widened, LoadOptions(kv_type="f32")).model.forward(ids, load_model(widened, LoadOptions(kv_type="f32")).model.new_cache(128), all_logits=True)
    prefill, steps = logits_by_passes(load_model(q4, LoadOptions(kv_type="f32", precise=True)), ids)
    for got in (prefill, steps):
        assert np.abs(got - exact).max() < 5e-3 * np.abs(exact).max()
    prefill, steps = logits_by_passes(load_model(q4, LoadOptions(kv_type="f32")), ids)
    assert np.corrcoef(prefill.ravel(), exact.ravel())[0, 1] > 0.9
    assert np.corrcoef(steps.ravel(), prefill.ravel())[0, 1] > 0.999


def test_info_and_bench_count_the_active_experts(tmp_path):
    """A mixture's token reads its chosen experts only: info and bench count those bytes and
    parameters beside the totals."""
    import json

    from click.testing import CliRunner

    from convert.random_model import LlamaShape, write_random_llama
    from runner.terminal.cli import main
    shape = LlamaShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, vocab_size=1000, n_expert=8,
                       n_expert_used=2, n_ff_exp=256, head_dim=64)
    path = tmp_path / "moe.gguf"
    write_random_llama(path, shape, progress=False)
    expert_params = 2 * 3 * 8 * 256 * 256  # layers, gate/up/down, experts, one expert matrix
    r = CliRunner().invoke(main, ["info", str(path)])
    assert r.exit_code == 0, r.output
    total = float(r.output.split(" M parameters")[0].split()[-1])
    active = float(r.output.split(" M active per token")[0].split("(")[-1])
    assert abs((total - active) * 1e6 - expert_params * 6 / 8) < 1e5 and "n_expert:      8" in r.output
    r = CliRunner().invoke(main, ["info", str(path), "--fit"])
    assert r.exit_code == 0 and "active per token (2 of 8 experts)" in r.output, r.output
    r = CliRunner().invoke(main, ["bench", str(path), "-p", "8", "-n", "4", "-r", "1", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output[r.output.index("["):])
    decode = next(row for row in rows if row["test"].startswith("tg"))
    assert rows[0]["active_params_m"] < rows[0]["params_m"]
    assert decode["read_mib_per_token"] < decode["size_mib"] * 0.8


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_llama_cpp_computes_ggruns_moe_files_alike(moe_files, llama_cpp_tools, tmp_path, arch):
    """llama.cpp loads ggrun's converted file and its perplexity on a text is ggrun's (both
    exact: F32 weights and cache, llama.cpp without flash attention's float16 products)."""
    from runner.measure.perplexity import perplexity
    (tmp_path / "text.txt").write_text(PERPLEXITY_TEXT)
    theirs = llama_cpp_perplexity(llama_cpp_tools, moe_files[arch][0], tmp_path / "text.txt")
    ours = perplexity(load_model(moe_files[arch][0], LoadOptions(kv_type="f32")), PERPLEXITY_TEXT, 128, progress=False).ppl
    assert abs(ours / theirs - 1) < 1e-4, (ours, theirs)


def test_mxfp4_checkpoint_converts_and_runs_as_llama_cpps(moe_folders, llama_cpp_source, llama_cpp_tools, tmp_path):
    """gpt-oss as published, its experts in MXFP4: the blocks carried through unchanged, the file
    byte for byte what convert_hf_to_gguf.py writes; ggrun's MXFP4 products give its exact
    values' logits (precise path) and llama.cpp's perplexity on the file."""
    from runner.measure.perplexity import perplexity

    from .hf_folders import mxfp4_folder
    from .test_mixes import tensor_digests
    folder = mxfp4_folder(moe_folders["gpt_oss"], tmp_path / "gpt_oss_mxfp4")
    ours, widened = tmp_path / "ours.gguf", tmp_path / "widened.gguf"
    convert_hf(folder, ours, "F32", progress=False)
    theirs = convert_with_llama_cpp(llama_cpp_source, folder, tmp_path / "theirs.gguf")
    assert sorted(tensor_digests(ours)) == sorted(tensor_digests(theirs))
    assert {t.type.name for t in GGUFFile(ours).tensors.values()} == {"F32", "MXFP4"}
    assert GGUFFile(ours).get("general.file_type") == GGUFFile(theirs).get("general.file_type") == 38
    requantize(ours, widened, "F32", progress=False)
    ids = np.random.default_rng(4).integers(0, GPT2_VOCAB, 40).tolist()
    exact = load_model(widened, LoadOptions(kv_type="f32")).model.forward(ids, load_model(widened, LoadOptions(kv_type="f32")).model.new_cache(64), all_logits=True)
    for device in ("cpu", "torch-cpu"):
        lm = load_model(ours, LoadOptions(kv_type="f32", device=device, precise=True)) if device == "cpu" else load_model(ours, LoadOptions(kv_type="f32", device=device))
        got = lm.model.forward(ids, lm.model.new_cache(64), all_logits=True)
        assert np.abs(got - exact).max() < 1e-4 * np.abs(exact).max(), device
    (tmp_path / "text.txt").write_text(PERPLEXITY_TEXT)
    theirs_ppl = llama_cpp_perplexity(llama_cpp_tools, ours, tmp_path / "text.txt")
    ours_ppl = perplexity(load_model(ours, LoadOptions(kv_type="f32")), PERPLEXITY_TEXT, 128, progress=False).ppl  # (both round activations to Q8_0)
    assert abs(ours_ppl / theirs_ppl - 1) < 2e-3, (ours_ppl, theirs_ppl)


def test_random_gpt_oss_shapes_run_as_in_llama_cpp(llama_cpp_tools, tmp_path):
    """convert.random_model's gpt-oss (the benchmarks' gpt-oss-20b shape, small here): MXFP4
    experts, Q8_0 elsewhere, biases and sinks; llama.cpp's perplexity on the file is ggrun's."""
    from convert.random_model import LlamaShape, write_random_llama
    from runner.measure.perplexity import perplexity
    shape = LlamaShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=256, vocab_size=1000, n_expert=4,
                       n_expert_used=2, n_ff_exp=256, head_dim=64, gpt_oss=True)
    path = tmp_path / "gpt-oss.gguf"
    summary = write_random_llama(path, shape, "MXFP4_MOE", progress=False, tiled=False)
    assert summary.by_type["MXFP4"] == 6 and GGUFFile(path).architecture == "gpt-oss"
    (tmp_path / "text.txt").write_text(PERPLEXITY_TEXT)
    theirs = llama_cpp_perplexity(llama_cpp_tools, path, tmp_path / "text.txt")
    ours = perplexity(load_model(path, LoadOptions(kv_type="f32")), PERPLEXITY_TEXT, 128, progress=False).ppl
    assert abs(ours / theirs - 1) < 2e-3, (ours, theirs)
