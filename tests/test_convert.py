"""`ggrun convert` and `ggrun quantize`: real SmolLM2 weights, random models of every architecture,
and refusals of broken folders (the quant mixes against llama.cpp's: test_mixes.py)."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from convert.convert import convert_hf, requantize
from convert.errors import ConversionError
from convert.mixes import mix_types
from gguf_io import GGUFFile, read_params, read_vocab

from .gguf_copy import rewritten
from .hf_folders import HYBRID_CONFIGS, MOE_CONFIGS, RANDOM_ARCHS, transformers_logits
from .llama_cpp import PERPLEXITY_TEXT, beside, convert_with_llama_cpp, llama_cpp_perplexity

pytest.importorskip("transformers")


def test_f32_conversion_reproduces_the_source(smollm_path, smollm_f32):
    src, out = GGUFFile(smollm_path), GGUFFile(smollm_f32)
    assert list(out.tensors) == list(src.tensors)  # llama.cpp's converter order, name for name
    for name, t in src.tensors.items():
        assert out.tensors[name].type == T.F32 and out.tensors[name].shape == t.shape
        want = dequantize(src.tensor_bytes(name).reshape(-1), t.type).reshape(-1)
        assert np.array_equal(out.tensor_bytes(name).reshape(-1).view(np.float32), want), name
    assert read_params(out) == read_params(src)
    a, b = read_vocab(src), read_vocab(out)
    for field in ("model", "pre", "tokens", "merges", "bos_id", "eos_id", "unk_id", "add_bos",
                  "chat_template", "end_of_generation"):
        assert getattr(a, field) == getattr(b, field), field
    assert np.array_equal(a.token_types, b.token_types)


def test_f32_conversion_gives_the_same_logits(smollm_path, smollm_f32):
    """(the quantized model on exact arithmetic, --precise: its default 8-bit activations are
    not what the F32 file's products compute)"""
    from runner.engine.load import LoadOptions, load_model
    smollm, converted = load_model(smollm_path, LoadOptions(kv_type="f32", precise=True)), load_model(smollm_f32, LoadOptions(kv_type="f32"))
    ids = smollm.tokenizer.encode("The history of the printing press begins in the fifteenth century")
    a = smollm.model.forward(ids, smollm.model.new_cache(64), all_logits=True)
    b = converted.model.forward(ids, converted.model.new_cache(64), all_logits=True)
    assert np.array_equal(a.argmax(1), b.argmax(1)) and np.abs(a - b).max() < 1e-3


def test_chooser_reproduces_a_llama_cpp_quantized_file(gemma_path):
    """The real Gemma 3 Q4_K_M file was typed by llama.cpp; our rules give every tensor the same type."""
    f = GGUFFile(gemma_path)
    p = read_params(f)
    types = mix_types("Q4_K_M", {n: t.shape for n, t in f.tensors.items()}, p.n_layer, p.n_head, p.n_head_kv)
    assert types == {n: t.type for n, t in f.tensors.items()}


@pytest.mark.parametrize("device", ["cpu", "torch-cpu"])
@pytest.mark.parametrize("arch", RANDOM_ARCHS)
def test_random_models_match_transformers(random_models, tmp_path, arch, device):
    """At every position of an input longer than the sliding windows (16) of the models that have them."""
    from runner.engine.load import LoadOptions, load_model
    if device == "torch-cpu":
        pytest.importorskip("torch")
    folder = random_models[arch]
    out = tmp_path / f"{arch}.gguf"
    convert_hf(folder, out, "F32", progress=False)
    lm = load_model(out, LoadOptions(kv_type="f32", device=device))
    assert lm.params.arch == arch
    ids = np.random.default_rng(1).integers(0, lm.params.vocab_size, 40).tolist()
    want = transformers_logits(folder, ids)
    got = np.asarray(lm.model.forward(ids, lm.model.new_cache(64), all_logits=True))
    assert np.array_equal(got.argmax(1), want.argmax(1))
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("arch", RANDOM_ARCHS)
def test_random_models_at_q8_0_compute_their_own_weights(random_models, tmp_path, arch):
    """Quantized to Q8_0, a model computes nearly the function of its own weights widened back to
    F32 (random weights leave top-1 margins thin, so the logits are compared as a whole). A random
    model amplifies rounding: GLM-4's, with four norms a layer, reaches 0.989 against its widened
    weights on the default path's 8-bit activations, and 0.975 against transformers with the
    weights' rounding added; the precise path computes the widened weights' function exactly."""
    from runner.engine.load import LoadOptions, load_model
    folder = random_models[arch]
    ids = np.random.default_rng(1).integers(0, 1024, 40).tolist()
    want = transformers_logits(folder, ids)
    q8, widened = tmp_path / f"{arch}-q8.gguf", tmp_path / f"{arch}-q8-f32.gguf"
    convert_hf(folder, q8, "Q8_0", progress=False)
    requantize(q8, widened, "F32", progress=False)
    lq, lw = load_model(q8, LoadOptions(kv_type="f32")), load_model(widened, LoadOptions(kv_type="f32"))
    quantized = lq.model.forward(ids, lq.model.new_cache(64), all_logits=True)
    exact = lw.model.forward(ids, lw.model.new_cache(64), all_logits=True)
    lp = load_model(q8, LoadOptions(kv_type="f32", precise=True))
    precise = lp.model.forward(ids, lp.model.new_cache(64), all_logits=True)
    assert np.corrcoef(precise.ravel(), exact.ravel())[0, 1] > 0.99999
    assert np.corrcoef(quantized.ravel(), exact.ravel())[0, 1] > 0.985
    assert np.corrcoef(quantized.ravel(), want.ravel())[0, 1] > 0.97


def test_lookup_tables_are_read_in_place(random_models, tmp_path):
    """An untied token embedding and Gemma 4's per-layer embeddings are only looked up by rows: the
    CPU backend reads them from the mapped file (E2B's per-layer table alone is ~1.9 GB at Q6_K),
    where the matrices it multiplies are copied into interleaved groups."""
    from runner.engine.load import LoadOptions, load_model
    for arch in ("glm4", "gemma4"):  # (vocabularies of whole interleaved groups: 50304, 1024)
        out = tmp_path / f"{arch}.gguf"
        convert_hf(random_models[arch], out, "Q8_0", progress=False)
        m = load_model(out, LoadOptions(kv_type="f32")).model
        table = m.tok_embd if arch == "glm4" else m.per_layer_token_embd
        assert table.reads_file and not m.layers[0].attn.wq.reads_file, arch


def test_long_rope_takes_its_long_factors_past_the_original_context(random_models, tmp_path):
    """Phi-3's LongRoPE: a context longer than the trained one (64 here) rotates by the long
    factors, as llama.cpp chooses them (by context size) and transformers (by sequence length)."""
    from runner.engine.load import LoadOptions, load_model
    out = tmp_path / "phi3.gguf"
    convert_hf(random_models["phi3"], out, "F32", progress=False)
    lm = load_model(out, LoadOptions(kv_type="f32"))
    assert lm.params.rope_orig_context == 64 and lm.params.rope_attn_factor > 1
    ids = np.random.default_rng(2).integers(0, lm.params.vocab_size, 80).tolist()
    want = transformers_logits(random_models["phi3"], ids)
    got = lm.model.forward(ids, lm.model.new_cache(128), all_logits=True)
    assert np.array_equal(got.argmax(1), want.argmax(1))
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


# (llama.cpp's converter takes ERNIE's tokenizer from a tokenizer.model alone, and reads the Qwen 2
# folder's through transformers' Qwen 2 tokenizer, whose own pre-tokenizer changes the hash it knows
# GPT-2's by; Qwen 2's tensors are held to llama.cpp by test_mixes)
@pytest.mark.parametrize("arch", [a for a in RANDOM_ARCHS if a not in ("qwen2", "ernie4_5")])
def test_random_models_convert_as_llama_cpp_does(random_models, llama_cpp_source, llama_cpp_tools, tmp_path, arch):
    """F32 and Q4_K_M, tensor by tensor, as convert_hf_to_gguf.py and llama-quantize (b11434) write them;
    the metadata too (the name and size label among it), but for LLAMA_CPP_LACKS."""
    import subprocess

    from .test_mixes import tensor_digests
    folder = random_models[arch]
    theirs = tmp_path / "theirs-f32.gguf"

    def llama_cpps():
        convert_with_llama_cpp(llama_cpp_source, folder, theirs)
        subprocess.run([llama_cpp_tools / "llama-quantize", theirs, tmp_path / "theirs-q4.gguf", "Q4_K_M"],
                       check=True, capture_output=True)
    beside(llama_cpps, lambda: [convert_hf(folder, tmp_path / f"ours-{t}.gguf", t, progress=False) for t in ("F32", "Q4_K_M")])
    for file_type, reference in (("F32", theirs), ("Q4_K_M", tmp_path / "theirs-q4.gguf")):
        ours = tmp_path / f"ours-{file_type}.gguf"
        assert sorted(tensor_digests(ours)) == sorted(tensor_digests(reference)), file_type
        a, b = GGUFFile(ours), GGUFFile(reference)
        differ = {k for k in set(a.metadata) | set(b.metadata) if str(a.get(k)) != str(b.get(k))}
        assert differ == LLAMA_CPP_LACKS.get(arch, set()), file_type


def _typed_metadata(path) -> dict:
    """key -> (type, array item type, value as a plain Python value)."""
    f = GGUFFile(path)
    return {k: (mv.type, mv.item_type, np.asarray(f.get(k)).tolist()) for k, mv in f.metadata.items()}


# convert_hf_to_gguf.py's options for a hybrid: Qwen3.5's text model without its multi-token prediction
# layer (which the converter otherwise asks of the checkpoint, and transformers' checkpoints lack)
LLAMA_CPP_OPTIONS = {"qwen3_5_text": ("--no-mtp",), "qwen3_5_moe_text": ("--no-mtp",), "qwen3_next": ("--no-mtp",)}
# What runs before convert_hf_to_gguf.py, by model type:
# - Qwen3.5-MoE's folder: transformers reads it with its own tokenizer class whatever
#   tokenizer_config.json names (its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), where the random
#   folders' GPT-2 tokenizer would become a Qwen3_5Tokenizer, whose pre-tokenizer llama.cpp's converter
#   knows by no hash with GPT-2's vocabulary. Its reference is converted with transformers reading the
#   class the folder names, as it does for qwen3_5_text's (ggrun reads tokenizer.json alike either way).
# - Nemotron-H's: the converter reads config.json as it is. transformers' AutoConfig, which it asks
#   first, gives Nemotron-H every default, the mixture's included (num_experts_per_tok), with which the
#   converter takes a dense Nemotron-H for Nemotron-H-MoE.
_TOKENIZER_AS_NAMED = """
from transformers.models.auto import tokenization_auto
tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard("qwen3_5_moe_text")
"""
_CONFIG_AS_IS = """
import transformers
def as_is(*args, **kwargs):
    raise ValueError("config.json as it is")
transformers.AutoConfig.from_pretrained = as_is
"""
_BEFORE_CONVERTING = {"qwen3_5_moe_text": _TOKENIZER_AS_NAMED, "nemotron_h": _CONFIG_AS_IS}
_THEN_CONVERT = """
import runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).parent))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _assert_same_tensors_but_a_within_an_ulp(ours: Path, theirs: Path) -> None:
    """Every tensor byte for byte with its type, but the recurrent layers' A (ssm_a, -exp(A_log)),
    whose values are within one unit in the last place."""
    from .test_mixes import tensor_digests

    def is_a(name: str) -> bool:  # (blk.N.ssm_a, not Qwen3.5's blk.N.ssm_alpha)
        return name.endswith(".ssm_a")
    a, b = (sorted(d for d in tensor_digests(path) if not is_a(d[0])) for path in (ours, theirs))
    assert a == b
    mine, reference = GGUFFile(ours), GGUFFile(theirs)
    assert sorted(filter(is_a, mine.tensors)) == sorted(filter(is_a, reference.tensors))
    for name in filter(is_a, mine.tensors):
        x, y = (f.tensor_bytes(name).view(np.int32).astype(np.int64) for f in (mine, reference))
        assert mine.tensors[name].type == reference.tensors[name].type == T.F32 and np.abs(x - y).max() <= 1, name


def _convert_hybrid_with_llama_cpp(source: Path, folder: Path, out: Path, arch: str) -> Path:
    """folder (of hybrid_folders[arch]) converted by convert_hf_to_gguf.py --outtype f32 with
    LLAMA_CPP_OPTIONS[arch], after _BEFORE_CONVERTING[arch]."""
    import os
    import subprocess
    import sys
    if arch not in _BEFORE_CONVERTING:
        return convert_with_llama_cpp(source, folder, out, *LLAMA_CPP_OPTIONS.get(arch, ()))
    subprocess.run([sys.executable, "-c", _BEFORE_CONVERTING[arch] + _THEN_CONVERT, source / "convert_hf_to_gguf.py",
                    folder, "--outtype", "f32", *LLAMA_CPP_OPTIONS.get(arch, ()), "--outfile", out],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(source / "gguf-py")})
    return out


@pytest.mark.parametrize("arch", list(HYBRID_CONFIGS))
def test_hybrids_convert_and_quantize_as_llama_cpp_does(hybrid_folders, llama_cpp_source, llama_cpp_tools, tmp_path,
                                                        arch):
    """A hybrid at F32 and Q4_K_M, tensor by tensor and key by key with their types, as
    convert_hf_to_gguf.py and llama-quantize (b11434) write it; and llama.cpp's F32 file requantized
    to Q4_K_M as llama-quantize writes it, in its order. LFM2 (short convolutions among attention
    layers): the KV heads per layer, 0 in a convolution layer, as an i32 array; the MLP width as the
    model sizes it; the convolution kernels 2-D, kept F32. Qwen3.5 (gated DeltaNet layers among
    gated attention layers): the value heads tiled, A as -exp(A_log), norms stored as w + 1 but the
    DeltaNet's, the ssm sizes, recurrent layers and M-RoPE sections; the small DeltaNet tensors
    kept F32, its fused QKV counted with attn_v in Q4_K_M. Qwen3.5-MoE (the same layers, each MLP a
    mixture beside a shared expert): the experts stacked, the shared expert's gate, the expert sizes.
    LFM2-MoE (LFM2's layers, the first dense, the others experts): the experts stacked from their
    w1/w2/w3, the selection bias as exp_probs_b.bias, the sigmoid gating and leading dense layers.
    Nemotron-H-MoE (Mamba2, attention and mixture blocks): the ungated experts stacked, the latent
    projections, the feed-forward widths per layer as the experts', the mixture's keys. Plain Mamba2
    (no attention): head_count and feed_forward_length 0, no KV heads, the vocabulary rounded up to 16.
    Falcon-H1 (attention beside a Mamba2 mixer): every multiplier folded into its weights, the MLP's
    norm without a suffix. A, -exp(A_log), within one unit in the last place: llama.cpp's converter
    takes torch's float32 exp (the machine's math library's rounding), ggrun the exact one."""
    import subprocess

    from .test_mixes import tensor_digests
    folder = hybrid_folders[arch]
    theirs, theirs_q4 = tmp_path / "theirs-f32.gguf", tmp_path / "theirs-q4.gguf"

    def llama_cpps():
        _convert_hybrid_with_llama_cpp(llama_cpp_source, folder, theirs, arch)
        subprocess.run([llama_cpp_tools / "llama-quantize", theirs, theirs_q4, "Q4_K_M"], check=True,
                       capture_output=True)
    beside(llama_cpps, lambda: [convert_hf(folder, tmp_path / f"ours-{t}.gguf", t, progress=False) for t in ("F32", "Q4_K_M")])
    for file_type, reference in (("F32", theirs), ("Q4_K_M", theirs_q4)):
        ours = tmp_path / f"ours-{file_type}.gguf"
        _assert_same_tensors_but_a_within_an_ulp(ours, reference)
        assert _typed_metadata(ours) == _typed_metadata(reference), file_type
    requantized = tmp_path / "requantized.gguf"
    requantize(theirs, requantized, "Q4_K_M", progress=False)
    assert tensor_digests(requantized) == tensor_digests(theirs_q4)
    assert _typed_metadata(requantized) == _typed_metadata(theirs_q4)


def test_lfm2_layers_from_full_attn_idxs_as_transformers_reads_them(hybrid_folders):
    """An LFM2 config that gives its attention layers as full_attn_idxs, without layer_types (as
    older ones do), converts to the same hyperparameters; transformers reads the same layers from it."""
    import transformers

    from convert.hf_model import model_from_config
    cfg = json.loads((hybrid_folders["lfm2"] / "config.json").read_text())
    older = {k: v for k, v in cfg.items() if k != "layer_types"}
    older["full_attn_idxs"] = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    assert transformers.Lfm2Config(**older).layer_types == cfg["layer_types"]
    assert model_from_config(older).metadata == model_from_config(cfg).metadata


def test_lfm2_config_names_as_transformers_reads_them(hybrid_folders):
    """LiquidAI's LFM2 config.json names the MLP width block_ff_dim and the tied embeddings
    tie_embedding: transformers reads them as intermediate_size and tie_word_embeddings, winning over
    those (and llama.cpp's converter through it), and so does ggrun's."""
    import transformers

    from convert.hf_model import model_from_config
    cfg = json.loads((hybrid_folders["lfm2"] / "config.json").read_text())
    published = {k: v for k, v in cfg.items() if k not in ("intermediate_size", "tie_word_embeddings")}
    published.update(block_ff_dim=cfg["intermediate_size"], tie_embedding=False)
    read = transformers.Lfm2Config(**published)
    assert (read.intermediate_size, read.tie_word_embeddings) == (cfg["intermediate_size"], False)
    ours = model_from_config(published)
    assert ours.metadata == model_from_config(cfg).metadata and not ours.tied
    both = {**cfg, "block_ff_dim": 2048, "tie_embedding": False}
    read = transformers.Lfm2Config(**both)
    assert (read.intermediate_size, read.tie_word_embeddings) == (2048, False)
    ours = model_from_config(both)
    assert ours.metadata == model_from_config({**cfg, "intermediate_size": 2048}).metadata and not ours.tied


@pytest.mark.parametrize("name, value", [("norm_topk_prob", False), ("routed_scaling_factor", 2.0),
                                         ("use_expert_bias", False), ("num_dense_layers", None)])
def test_lfm2_moe_configs_llama_cpp_would_compute_otherwise_are_refused(hybrid_folders, name, value):
    """llama.cpp's LFM2-MoE graph always renormalizes the chosen experts' weights, scales them by 1
    and adds the selection bias, and reads the leading dense layers from the file: a config that says
    otherwise (or leaves the dense layers out) is refused, not converted into a file computed wrongly."""
    from convert.hf_model import model_from_config
    cfg = json.loads((hybrid_folders["lfm2_moe"] / "config.json").read_text())
    assert model_from_config(cfg).metadata["leading_dense_block_count"] == 1
    changed = {k: v for k, v in cfg.items() if k != name} if value is None else {**cfg, name: value}
    with pytest.raises(ConversionError, match=name):
        model_from_config(changed)


@pytest.mark.parametrize("change, message", [({"n_group": 2, "topk_group": 1}, "grouped expert routing"),
                                             ({"hybrid_override_pattern": "ME*-M"}, "MLPs beside mixtures")])
def test_nemotron_h_moe_configs_ggrun_cannot_compute_are_refused(hybrid_folders, change, message):
    """A Nemotron-H config whose layers have experts converts to nemotron_h_moe (its multi-token
    prediction layer left out, as llama.cpp's converter with --no-mtp does); grouped expert routing
    (n_group above 1), which ggrun's router does not compute, and MLP blocks beside mixture blocks,
    which llama.cpp's converter would write as Mamba2 layers, are refused."""
    from convert.hf_model import model_from_config
    cfg = json.loads((hybrid_folders["nemotron_h_moe"] / "config.json").read_text())
    model = model_from_config(cfg)
    assert model.arch.name == "nemotron_h_moe" and model.left_out("mtp.layers.0.eh_proj.weight")
    with pytest.raises(ConversionError, match=message):
        model_from_config({**cfg, **change})


def test_a_mamba2_vocabulary_rounds_up_as_llama_cpp_rounds_it(hybrid_folders, tmp_path):
    """llama.cpp's converter rounds a plain Mamba2 vocabulary up to the config's pad_vocab_size_multiple
    (16 where it gives none) with [PAD] tokens, and leaves the embedding as it is: ggrun writes the
    same tokens, and refuses a checkpoint whose embedding then falls short of them (a file
    llama.cpp's loader refuses), naming the sizes."""
    from convert.hf_model import model_from_config
    folder = hybrid_folders["mamba2"]
    cfg = json.loads((folder / "config.json").read_text())
    assert model_from_config({**cfg, "vocab_size": 50257}).vocab_size == 50272
    assert model_from_config({**cfg, "pad_vocab_size_multiple": 8}).vocab_size == 50272
    folder = shutil.copytree(folder, tmp_path / "padded")
    (folder / "config.json").write_text(json.dumps({**cfg, "pad_vocab_size_multiple": 64}))
    with pytest.raises(ConversionError, match="vocabulary of 50304 tokens .* the embedding's 50272 rows"):
        convert_hf(folder, tmp_path / "padded.gguf", "F32", progress=False)


@pytest.mark.parametrize("change, message", [
    ({"tie_word_embeddings": True}, "tied embedding with embedding_multiplier and lm_head_multiplier apart"),
    ({"mamba_rms_norm": True, "mamba_norm_before_gate": True}, "mamba_norm_before_gate"),
    ({"attention_bias": True}, "attention_bias"), ({"mamba_proj_bias": True}, "mamba_proj_bias")])
def test_falcon_h1_configs_llama_cpp_would_compute_otherwise_are_refused(hybrid_folders, change, message):
    """Falcon-H1 configs whose multipliers llama.cpp's converter cannot fold (a tied embedding under
    two multipliers, Q/K/V biases, which it would scale as their weights), whose mixer norms before its
    gate (llama.cpp's graph norms after it) or has projection biases (llama.cpp's loader has none) are
    refused; its published form (a mixer without norm) and one normed after the gate convert."""
    from convert.hf_model import model_from_config
    cfg = json.loads((hybrid_folders["falcon_h1"] / "config.json").read_text())
    assert model_from_config(cfg).folded and model_from_config({**cfg, "mamba_rms_norm": True}).folded
    with pytest.raises(ConversionError, match=message):
        model_from_config({**cfg, **change})


def test_qwen35_multimodal_checkpoint_converts_its_text_model(hybrid_folders, llama_cpp_source, tmp_path):
    """A Qwen3.5 checkpoint as Qwen publishes it (Qwen3_5ForConditionalGeneration: the text model
    under model.language_model, a vision tower, a multi-token prediction layer) converts to its text
    model alone, as convert_hf_to_gguf.py --no-mtp writes it (the vision tower goes to its mmproj
    file), and the summary says what the file leaves out. (The reference is llama.cpp's file of the
    text model's own folder: it writes this folder's alike, but only where transformers lets it read
    GPT-2's tokenizer, which transformers 5 replaces by Qwen3.5's own in a qwen3_5 folder.)"""
    from safetensors.numpy import load_file, save_file

    from .test_mixes import tensor_digests
    text = hybrid_folders["qwen3_5_text"]
    folder = shutil.copytree(text, tmp_path / text.name)  # (named as the text model: general.name)
    text_config = json.loads((text / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text_config,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 64, "intermediate_size": 128,
                          "num_heads": 2, "out_hidden_size": text_config["hidden_size"]}}))
    weights = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(text / "model.safetensors").items()}
    rng = np.random.default_rng(0)
    for name, shape in (("model.visual.patch_embed.proj.weight", (64, 3, 2, 16, 16)),
                        ("model.visual.blocks.0.attn.qkv.weight", (192, 64)), ("mtp.fc.weight", (256, 512)),
                        ("mtp.layers.0.input_layernorm.weight", (256,)), ("mtp.norm.weight", (256,))):
        weights[name] = rng.standard_normal(shape, dtype=np.float32)
    save_file(weights, folder / "model.safetensors")
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    convert_with_llama_cpp(llama_cpp_source, text, theirs, *LLAMA_CPP_OPTIONS["qwen3_5_text"])
    summary = convert_hf(folder, ours, "F32", progress=False)
    assert sorted(tensor_digests(ours)) == sorted(tensor_digests(theirs))
    assert _typed_metadata(ours) == _typed_metadata(theirs)
    assert summary.lines()[-1] == ("left out: 2 tensors of the vision tower; 3 tensors of the multi-token "
                                   "prediction layer (llama.cpp's converter with --no-mtp)")


def test_qwen35_moe_experts_as_published_convert_as_llama_cpp_does(hybrid_folders, llama_cpp_source, tmp_path):
    """Qwen publishes Qwen3.5-MoE's experts as two tensors a layer (transformers' own layout), not one
    a matrix each as transformers saves them: mlp.experts.gate_up_proj (experts, 2 x expert width,
    hidden: each expert's gate rows, then its up rows) and mlp.experts.down_proj (experts, hidden,
    expert width); and its config gives no intermediate_size (the model has no dense MLP). That
    folder converts to the same tensors (gate and up apart, as llama.cpp writes them) and to the
    keys convert_hf_to_gguf.py writes of it: no feed_forward_length."""
    import re

    from safetensors.numpy import load_file, save_file

    from .test_mixes import tensor_digests
    src = hybrid_folders["qwen3_5_moe_text"]
    folder = shutil.copytree(src, tmp_path / src.name)
    weights, experts = load_file(src / "model.safetensors"), {}
    for name in [n for n in weights if ".mlp.experts." in n]:
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight", name)
        experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = weights.pop(name)
    for base, parts in experts.items():
        stacked = {part: np.stack([w[e] for e in sorted(w)]) for part, w in parts.items()}
        weights[f"{base}.gate_up_proj"] = np.concatenate([stacked["gate"], stacked["up"]], axis=1)
        weights[f"{base}.down_proj"] = stacked["down"]
    save_file(weights, folder / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    del config["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(config))
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    _convert_hybrid_with_llama_cpp(llama_cpp_source, folder, theirs, "qwen3_5_moe_text")
    convert_hf(folder, ours, "F32", progress=False)
    assert sorted(tensor_digests(ours)) == sorted(tensor_digests(theirs))
    assert _typed_metadata(ours) == _typed_metadata(theirs)
    assert "qwen35moe.feed_forward_length" not in _typed_metadata(ours)
    assert "blk.0.ffn_gate_exps.weight" in GGUFFile(ours).tensors


def test_granite_hybrid_without_experts_converts_as_llama_cpp_does_and_computes(hybrid_folders, llama_cpp_source,
                                                                                tmp_path):
    """Granite 4.0-H without experts (Micro): its shared MLP is the dense one (ffn_gate, ffn_up,
    ffn_down), with the expert keys llama.cpp's converter writes of the config still; the logits of
    the folder (the hybrid's without its experts) as transformers computes them."""
    from safetensors.numpy import load_file, save_file

    from runner.engine.load import LoadOptions, load_model

    from .test_mixes import tensor_digests
    src = hybrid_folders["granitemoehybrid"]
    folder = shutil.copytree(src, tmp_path / src.name)
    weights = load_file(src / "model.safetensors")
    save_file({n: w for n, w in weights.items() if "block_sparse_moe" not in n}, folder / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.update(num_local_experts=0, num_experts_per_tok=0, intermediate_size=config["shared_intermediate_size"])
    (folder / "config.json").write_text(json.dumps(config))
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    convert_with_llama_cpp(llama_cpp_source, folder, theirs)
    convert_hf(folder, ours, "F32", progress=False)
    assert sorted(tensor_digests(ours)) == sorted(tensor_digests(theirs))
    assert _typed_metadata(ours) == _typed_metadata(theirs)
    assert "blk.0.ffn_gate.weight" in GGUFFile(ours).tensors
    model = load_model(ours, LoadOptions(kv_type="f32")).model
    ids = list(range(1000, 1032))
    want = transformers_logits(folder, ids)
    got = model.forward(ids, model.new_cache(64), all_logits=True)
    assert np.array_equal(got.argmax(1), want.argmax(1)) and np.abs(got - want).max() < 1e-4 * np.abs(want).max()


# convert.random_model's Qwen3.5 shapes scaled down: tiny sizes, the same tensors and keys
_TINY_QWEN35 = dict(n_layer=4, n_embd=256, n_head=2, n_head_kv=1, vocab_size=512, head_dim=64, linear_k_heads=2,
                    linear_head_dim=32, context_length=64)


@pytest.mark.parametrize("shape_name, model_type", [("qwen35-2b", "qwen3_5_text"),
                                                    ("qwen35-35b-a3b", "qwen3_5_moe_text")])
def test_random_qwen35_shapes_are_converted_ones_and_compute(hybrid_folders, tmp_path, shape_name, model_type):
    """convert.random_model's Qwen3.5-2B and Qwen3.5-MoE shapes (--shape), scaled down: each layer
    has the tensors, by name and dimensions, that a converted checkpoint's layer of its kind
    (DeltaNet or attention) has, the file the converted one's keys (but the dense MLP width, which
    Qwen's MoE config does not give); ggrun loads it and computes finite logits."""
    from dataclasses import replace

    from convert.random_model import SHAPES, write_random_llama
    from runner.engine.load import LoadOptions, load_model
    big = SHAPES[shape_name]
    tiny = replace(big, **_TINY_QWEN35, n_ff=512 if big.n_ff else 0, linear_v_heads=2 * big.linear_v_heads // 16,
                   **(dict(n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff_shexp=128) if big.n_expert else {}))
    path, converted = tmp_path / "random.gguf", tmp_path / "converted.gguf"
    write_random_llama(path, tiny, "Q4_K_M", progress=False, tiled=False)
    convert_hf(hybrid_folders[model_type], converted, "F32", progress=False)
    ours, theirs = GGUFFile(path), GGUFFile(converted)

    def layers(f, recurrent):
        kinds = f.get(f"{f.architecture}.attention.recurrent_layers")
        return [{n.split(".", 2)[2]: len(t.shape) for n, t in f.tensors.items() if n.startswith(f"blk.{i}.")}
                for i in range(len(kinds)) if kinds[i] == recurrent]
    for recurrent in (True, False):  # (every layer of a kind alike, in both files)
        want = layers(theirs, recurrent)[0]
        assert all(layer == want for layer in layers(ours, recurrent) + layers(theirs, recurrent)), recurrent
    assert {n for n in ours.tensors if not n.startswith("blk.")} == (
        {"token_embd.weight", "output_norm.weight"} | (set() if big.tied else {"output.weight"}))
    hyper = [{k for k in f.metadata if k.startswith(f.architecture)} for f in (ours, theirs)]
    assert hyper[0] ^ hyper[1] == (set() if big.n_ff else {f"{ours.architecture}.feed_forward_length"})
    lm = load_model(path, LoadOptions())
    assert np.isfinite(lm.model.forward([1, 2, 3], lm.model.new_cache(16))).all()


def test_qwen35_tokenizer_converts_with_its_pre_tokenizer(hybrid_folders, tmp_path):
    """Qwen 3.5's tokenizer.json (as transformers writes a Qwen3_5Tokenizer) splits text as
    llama.cpp's qwen35 pre-tokenizer does, which its converter names by the vocabulary's hash."""
    import transformers

    from convert.hf_tokenizer import read_tokenizer
    from gguf_io.architectures import ARCHITECTURES
    folder = hybrid_folders["qwen3_5_text"]
    transformers.Qwen3_5Tokenizer.from_pretrained(folder).save_pretrained(tmp_path)
    tok, _ = read_tokenizer(tmp_path, json.loads((folder / "config.json").read_text())["vocab_size"],
                            ARCHITECTURES["qwen35"])
    assert tok.pre == "qwen35"


# SmolLM2 as a Hub download holds it: a model card, generation settings, its Hub id in config.json
SMOLLM2_CARD = """---
library_name: transformers
license: apache-2.0
language:
- en
- no
pipeline_tag: text-generation
tags:
- safetensors
- onnx
- transformers.js
base_model:
- HuggingFaceTB/SmolLM2-135M
- https://huggingface.co/HuggingFaceTB/SmolLM2-135M-v0.1
datasets:
- HuggingFaceTB/smoltalk
- https://example.com/data
---

# SmolLM2
"""


@pytest.mark.parametrize("published", [False, True], ids=["as-saved", "as-published"])
def test_smollm2_metadata_is_llama_cpps_key_for_key(smollm_hf, llama_cpp_source, tmp_path, published):
    """The real 30-layer SmolLM2, converted by ggrun and by convert_hf_to_gguf.py (b11434): every
    key, its type and value alike, the general keys in the same order. As transformers saves the
    folder, named hf-smollm2: the name title-cased and the size label from the parameter count; as
    the Hub publishes it, in a folder of another name: the name and its parts from the Hub id,
    the version from the folder's name, license, tags, languages, base models and data sets from
    the model card, sampling settings from generation_config.json."""
    folder = tmp_path / ("hf-smollm2-v2" if published else "hf-smollm2")
    folder.mkdir()
    for path in smollm_hf.iterdir():  # (linked: the weights are 0.5 GB)
        (folder / path.name).symlink_to(path)
    if published:
        config = json.loads((smollm_hf / "config.json").read_text())
        generation = json.loads((smollm_hf / "generation_config.json").read_text())
        for name, data in (("config.json", {**config, "_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}),
                           ("generation_config.json", {**generation, "temperature": 0.2, "top_p": 0.9, "top_k": 50,
                                                       "repetition_penalty": 1.1})):
            (folder / name).unlink()
            (folder / name).write_text(json.dumps(data))
        (folder / "README.md").write_text(SMOLLM2_CARD)
    ours = tmp_path / "ours.gguf"
    convert_hf(folder, ours, "F32", progress=False)
    theirs = convert_with_llama_cpp(llama_cpp_source, folder, tmp_path / "theirs.gguf")
    a, b = _typed_metadata(ours), _typed_metadata(theirs)
    assert sorted(a) == sorted(b)
    assert {k: v for k, v in a.items() if v != b[k]} == {}
    assert [k for k in a if k.startswith("general.")] == [k for k in b if k.startswith("general.")]
    if published:
        assert (a["general.name"][2], a["general.basename"][2], a["general.finetune"][2], a["general.version"][2],
                a["general.languages"][2]) == ("SmolLM2 135M Instruct", "SmolLM2", "Instruct", "v2", ["en", "no"])
    else:
        assert (a["general.name"][2], a["general.size_label"][2]) == ("Hf Smollm2", "135M")


@pytest.mark.parametrize("arch", [*MOE_CONFIGS, "gpt_oss_mxfp4"])
def test_mixture_size_labels_are_llama_cpps(moe_folders, llama_cpp_source, tmp_path, arch):
    """A mixture's size label counts its experts and one expert's share (4x..., 8x...), as
    convert_hf_to_gguf.py does, also of experts carried in MXFP4; the other general keys alike too."""
    from .hf_folders import mxfp4_folder
    folder = (mxfp4_folder(moe_folders["gpt_oss"], tmp_path / "gpt_oss_mxfp4") if arch == "gpt_oss_mxfp4"
              else moe_folders[arch])
    ours = tmp_path / "ours.gguf"
    convert_hf(folder, ours, "F32", progress=False)
    theirs = convert_with_llama_cpp(llama_cpp_source, folder, tmp_path / "theirs.gguf")
    a, b = _typed_metadata(ours), _typed_metadata(theirs)
    assert {k: v for k, v in a.items() if k.startswith("general.")} == {
        k: v for k, v in b.items() if k.startswith("general.")}
    assert "x" in a["general.size_label"][2]


# llama.cpp's gguf-py (b11434) on names, parameter counts and model cards: what its converter
# writes for them (Metadata.load, its fallbacks of prepare_metadata), as JSON
_GGUF_PY_METADATA = """
import json, sys
from pathlib import Path
import gguf
from gguf.metadata import Metadata
cases = json.loads(sys.stdin.read())
out = {"names": [list(Metadata.get_model_id_components(n, t)) for n, t in cases["names"]],
       "titles": [Metadata.id_to_title(t) for t in cases["titles"]],
       "sizes": [gguf.size_label(*c) for c in cases["sizes"]], "folders": []}
for folder, total in cases["folders"]:
    m = Metadata.load(None, Path(folder), None, total)
    m.name = Path(folder).name if m.name is None else m.name
    m.size_label = gguf.size_label(total, total, 0, 0) if m.size_label is None else m.size_label
    w = gguf.GGUFWriter(None, "llama")
    m.set_gguf_meta_model(w)
    out["folders"].append([[k, v.type.name, v.value] for k, v in w.kv_data[0].items() if k != "general.architecture"])
print(json.dumps(out))
"""

# (model card, config.json's _name_or_path, folder name) of folders beside the SmolLM2 test's
MODEL_CARD_CASES = [
    ("name: My Model\nmodel_creator: someone\nlicense: [mit, apache-2.0]\nsize_label: 1B\n"
     "base_model: {name: x}\ntags: chat\nlanguage: fr\n", None, "Mixtral-8x7B-Instruct-v0.1"),
    ("model_name: Named\nmodel_version: v3\nlicense: ''\ndatasets: []\nbase_model:\n- org/Base-7b1-chat\n- 5\n"
     "pipeline_tag: text-generation\n", "./local", "phi-3-mini-128k-instruct"),
    (None, "/fsx/checkpoints/run-3", "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M"),
    ("license: other\nlicense_name: custom\nlicense_link: LICENSE\nmodel_type: llama\nlanguages:\n- no\n",
     "meta-llama/Llama-2-7b-chat-hf", "SmolLM2-135M-8k"),
]


def test_names_sizes_and_model_cards_read_as_llama_cpp_reads_them(llama_cpp_source, tmp_path):
    """Hub ids and folder names split into basename, size label, finetune and version, title-cased
    names, size labels of parameter counts, and whole folders' general keys, against gguf-py's."""
    import os
    import subprocess
    import sys
    from types import SimpleNamespace

    from convert.hf_metadata import general_metadata, model_id_parts, size_label, title
    names = ["SmolLM2-135M-Instruct", "hf-smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct",
             "Mixtral-8x7B-Instruct-v0.1", "bloom-7b1", "Qwen2.5-Coder-1.5B-Instruct", "gpt2-xl", "x-small-7B",
             "Phi-3-mini-128k-instruct", "./local", "Llama-2-7b-chat-hf", "Qwen3-30B-A3B-Instruct-2507", "model-Q4_K_M",
             "llama-bf16", "v2-model", "1st-model-7b", "My Model Name", "/x", "stablelm-2-1_6b", "iter5-abc-7B",
             "ab-c1-d-v1.2-3.4", "foo--bar"]
    totals = [0, 134515008, 7_000_000_000, 47_000_000_000]
    sizes = [[n, n, 0, 0] for n in (12, 1_000, 999_999, 1_000_000, 1_234_567, 9_500_000, 134515008, 999_500_000,
                                    20_900_000_000_000)] + [[46_702_792_704, 1_600_000_000, 5_630_000_000, 8]]
    folders = []
    for i, (card, hub_id, name) in enumerate(MODEL_CARD_CASES):
        folder = tmp_path / str(i) / name
        folder.mkdir(parents=True)
        if card is not None:
            (folder / "README.md").write_text(f"---\n{card}---\ntext\n")
        (folder / "config.json").write_text(json.dumps({} if hub_id is None else {"_name_or_path": hub_id}))
        (folder / "generation_config.json").write_text('{"top_k": 20, "temperature": 0.6, "penalty_repeat": null}')
        folders.append([str(folder), [134515008, 7_000_000_000, 46_702_792_704, 1_500_000_000][i]])
    cases = {"names": [[n, t] for n in names for t in totals], "titles": names + ["v2", "7b model", " a1b2 "],
             "sizes": sizes, "folders": folders}
    r = subprocess.run([sys.executable, "-c", _GGUF_PY_METADATA], input=json.dumps(cases), capture_output=True,
                       text=True, check=True, env={**os.environ, "PYTHONPATH": str(llama_cpp_source / "gguf-py")})
    want = json.loads(r.stdout)
    assert [list(model_id_parts(n, t).values()) for n, t in cases["names"]] == want["names"]
    assert [title(t) for t in cases["titles"]] == want["titles"]
    assert [size_label(*c) for c in sizes] == want["sizes"]
    for (folder, total), keys in zip(folders, want["folders"]):
        got = general_metadata(Path(folder), [SimpleNamespace(name="w.weight", shape=(total,))])
        assert [[k, t.name, v] for k, v, t, _ in got] == keys, folder


def test_a_model_card_that_is_not_yaml_is_left_unread(tmp_path, capsys):
    """(where llama.cpp's converter stops with YAML's error) with a warning, the rest read as without it"""
    from types import SimpleNamespace

    from convert.hf_metadata import general_metadata
    folder = tmp_path / "SmolLM2-135M"
    folder.mkdir()
    tensors = [SimpleNamespace(name="token_embd.weight", shape=(576, 49152))]
    want = general_metadata(folder, tensors)
    (folder / "README.md").write_text("---\nlicense: [mit\n---\n")
    assert general_metadata(folder, tensors) == want
    assert "README.md: the model card's metadata is not valid YAML" in capsys.readouterr().err
    # (135M, far from the 28M parameters given, reads as a context length: a finetune)
    assert [v for k, v, *_ in want] == ["SmolLM2 135M", "135m", "SmolLM2", "28M"]


# keys ggrun writes that llama.cpp's converter leaves out: Gemma 2's query scale where
# query_pre_attn_scalar differs from what llama.cpp's graph assumes, and its RoPE base
LLAMA_CPP_LACKS = {"gemma2": {"gemma2.attention.scale", "gemma2.rope.freq_base"}}


# where llama.cpp's graph computes another function than the model's definition, which ggrun follows:
# it ignores Phi-3's window, slides EXAONE 4's layers only in the 64-layer model, and scales Gemma 2's
# queries by the head size whatever query_pre_attn_scalar says (the test model's differs)
LLAMA_CPP_DIFFERS = ("phi3", "exaone4", "gemma2")


@pytest.mark.parametrize("arch", [a for a in RANDOM_ARCHS if a not in LLAMA_CPP_DIFFERS])
def test_llama_cpp_computes_ggruns_files_alike(random_models, llama_cpp_tools, tmp_path, arch):
    """llama.cpp loads ggrun's F32 file of each architecture and its perplexity over 128-token
    windows (past every sliding window, YaRN's original context and the query temperature's
    period of the test models) is ggrun's: both exact (F32 cache, no flash attention's float16)."""
    from runner.engine.load import LoadOptions, load_model
    from runner.measure.perplexity import perplexity
    out = tmp_path / f"{arch}.gguf"
    convert_hf(random_models[arch], out, "F32", progress=False)
    (tmp_path / "text.txt").write_text(PERPLEXITY_TEXT)
    theirs = llama_cpp_perplexity(llama_cpp_tools, out, tmp_path / "text.txt")
    ours = perplexity(load_model(out, LoadOptions(kv_type="f32")), PERPLEXITY_TEXT, 128, progress=False).ppl
    assert abs(ours / theirs - 1) < 1e-4, (ours, theirs)


def test_llama_3_rope_scaling_converts_as_llama_cpp_does(random_models, llama_cpp_source, tmp_path):
    """Llama 3.1's rope_type "llama3" becomes llama.cpp's rope_freqs tensor, its bytes equal to
    what convert_hf_to_gguf.py writes (and the rest of the file too); the logits are transformers'
    with the same scaling, on a context that takes the scaled band (original context 128)."""
    from runner.engine.load import LoadOptions, load_model

    from .test_mixes import tensor_digests
    folder = tmp_path / "llama3"
    shutil.copytree(random_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    (folder / "config.json").write_text(json.dumps(config))
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    convert_hf(folder, ours, "F32", progress=False)
    convert_with_llama_cpp(llama_cpp_source, folder, theirs)
    assert sorted(tensor_digests(ours)) == sorted(tensor_digests(theirs))
    factors = GGUFFile(ours).tensor_bytes("rope_freqs.weight").view(np.float32).ravel()
    assert factors.min() == 1 and factors.max() == 8 and ((factors > 1) & (factors < 8)).any()
    lm = load_model(ours, LoadOptions(kv_type="f32"))
    ids = np.random.default_rng(1).integers(0, lm.params.vocab_size, 40).tolist()
    want = transformers_logits(folder, ids)
    got = lm.model.forward(ids, lm.model.new_cache(64), all_logits=True)
    assert np.array_equal(got.argmax(1), want.argmax(1)) and np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_a_file_with_tensors_the_graph_does_not_take_is_refused(random_models, tmp_path):
    """ERNIE 4.5 with biases on every projection converts, but neither llama.cpp's graph nor
    ggrun's takes the feed-forward's biases: the file is refused, naming one, not run without them."""
    import json

    from gguf_io import GGUFError
    from runner.engine.load import LoadOptions, load_model
    folder = tmp_path / "biased"
    shutil.copytree(random_models["ernie4_5"], folder)
    config = json.loads((folder / "config.json").read_text())
    import transformers
    model = transformers.Ernie4_5ForCausalLM(transformers.Ernie4_5Config(**{**config, "use_bias": True}))
    model.save_pretrained(folder)
    out = tmp_path / "biased.gguf"
    convert_hf(folder, out, "F32", progress=False)
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.ffn_.*\.bias'.* not used by ggrun's ernie4_5 model"):
        load_model(out, LoadOptions(kv_type="f32"))


def test_gemma_4_reads_its_files_as_llama_cpp_does(random_models, tmp_path):
    """Where a Gemma 4 file gives no final softcap, llama.cpp's graph caps at 30 (as it does Gemma 2's,
    where also the attention scores' cap is 50 unless the file says); and a file whose shared-KV
    layers would read other layers' caches than llama.cpp's fixed choice (the second-last layer
    with its own cache for sliding layers, the last for global ones) is refused."""
    from gguf_io import GGUFError
    from runner.engine.load import LoadOptions, load_model
    out = tmp_path / "gemma4.gguf"
    convert_hf(random_models["gemma4"], out, "F32", progress=False)
    assert read_params(GGUFFile(out)).logit_softcap == 10.0
    uncapped = rewritten(out, tmp_path / "uncapped.gguf", {"gemma4.final_logit_softcapping": None})
    assert (read_params(GGUFFile(uncapped)).logit_softcap, read_params(GGUFFile(uncapped)).attn_softcap) == (30.0, 0.0)
    convert_hf(random_models["gemma2"], tmp_path / "gemma2.gguf", "F32", progress=False)
    uncapped = rewritten(tmp_path / "gemma2.gguf", tmp_path / "gemma2-uncapped.gguf",
                         {"gemma2.final_logit_softcapping": None, "gemma2.attn_logit_softcapping": None})
    assert (read_params(GGUFFile(uncapped)).logit_softcap, read_params(GGUFFile(uncapped)).attn_softcap) == (30.0, 50.0)
    p = load_model(out, LoadOptions(kv_type="f32")).params
    assert [p.kv_source(i) for i in range(p.n_layer)] == [0, 1, 2, 3, 2, 3]
    from click.testing import CliRunner

    from runner.terminal.cli import main
    info = CliRunner().invoke(main, ["info", str(out)]).output
    assert "head_dim:      64/128 (by layer)" in info and "n_ff:          512/1024 (by layer)" in info, info
    moved = rewritten(out, tmp_path / "moved.gguf",
                       {"gemma4.attention.sliding_window_pattern": [True, False, False, True, True, False]})
    with pytest.raises(GGUFError, match="layer 4 shares the cache of layer 3, not the one llama.cpp's"):
        load_model(moved, LoadOptions(kv_type="f32"))


def _safetensors(folder, header: object, data: bytes = bytes(8)):
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _broken(folder, tmp_path, change):
    copy = tmp_path / "broken"
    shutil.copytree(folder, copy)
    change(copy)
    return copy


@pytest.mark.parametrize("change,message", [
    (lambda d: (d / "config.json").unlink(), "config.json is missing"),
    (lambda d: (d / "config.json").write_text('{"model_type": "mamba", "hidden_size": 8}'), "model_type 'mamba'"),
    (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda d: (d / "model.safetensors").unlink(), "no .safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), "corrupt safetensors header"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100_000]),
     "out-of-file"),
    (lambda d: ((d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors"),
                (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
                    "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                    "model.norm.weight": "model-00002-of-00002.safetensors"}}))), "missing checkpoint shard"),
    (lambda d: (d / "model.safetensors.index.json").write_text("[]"), "not a valid safetensors index"),
    (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": {"x": 5}}'),
     "not a valid safetensors index"),
    (lambda d: _safetensors(d, [1, 2]), "not a JSON object"),
    (lambda d: _safetensors(d, {"x": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}}), "corrupt entry"),
    (lambda d: _safetensors(d, {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}), "corrupt entry"),
    (lambda d: ((d / "model.safetensors").unlink(), (d / "pytorch_model.bin").write_bytes(b"pickle")),
     "pickle checkpoint"),
    (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer"),
])
def test_broken_folders_are_refused_and_leave_nothing(random_models, tmp_path, change, message):
    folder = _broken(random_models["llama"], tmp_path, change)
    out = tmp_path / "out.gguf"
    with pytest.raises(ConversionError, match=message):
        convert_hf(folder, out, "Q4_K_M", progress=False)
    assert not out.exists() and not list(tmp_path.glob(".out.gguf*"))


def test_nan_weight_is_reported_with_its_name(random_models, tmp_path):
    from safetensors.numpy import load_file, save_file
    folder = _broken(random_models["llama"], tmp_path, lambda d: None)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    save_file(weights, folder / "model.safetensors")
    out = tmp_path / "out.gguf"
    with pytest.raises(ConversionError, match=r"blk\.1\.ffn_up\.weight contains NaN"):
        convert_hf(folder, out, "Q8_0", progress=False)
    assert not out.exists()


def test_merges_as_strings_convert_like_merges_as_pairs(smollm_hf, smollm_f32, tmp_path):
    """tokenizer.json from older tokenizers writes each merge as "a b", newer ones as ["a", "b"]."""
    folder = _broken(smollm_hf, tmp_path, lambda d: None)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    out = tmp_path / "strings.gguf"
    convert_hf(folder, out, "F32", progress=False)
    assert read_vocab(GGUFFile(out)).merges == read_vocab(GGUFFile(smollm_f32)).merges


def test_unsupported_dtype_and_tensor_name_are_refused(random_models, tmp_path):
    from safetensors.numpy import load_file, save_file
    for change, message in ((lambda w: w.update(extra=np.zeros(4, np.int8)), "dtype I8"),
                            (lambda w: w.update({"model.mystery.weight": np.zeros(4, np.float32)}),
                             "mystery.weight' is not part of a supported llama checkpoint"),
                            (lambda w: w.update({"model.vision_tower.weight": np.zeros(4, np.float32)}),
                             "vision_tower.weight' belongs to a vision or audio part")):
        folder = tmp_path / message.split()[0].strip("'")
        shutil.copytree(random_models["llama"], folder)
        weights = load_file(folder / "model.safetensors")
        change(weights)
        save_file(weights, folder / "model.safetensors")
        with pytest.raises(ConversionError, match=message):
            convert_hf(folder, tmp_path / "out.gguf", "Q8_0", progress=False)
        assert not (tmp_path / "out.gguf").exists()


def test_random_llama_command_asks_for_its_output(tmp_path, monkeypatch):
    """--help or no argument is a message, not a 4 GB file named after the option."""
    from click.testing import CliRunner

    from convert.random_model import main
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0 and "OUT" in result.output
    assert CliRunner().invoke(main, []).exit_code == 2
    assert list(tmp_path.iterdir()) == []
    # any shape and type, as benchmarks of other sizes need
    result = CliRunner().invoke(main, ["small.gguf", "--layers", "2", "--embd", "256", "--ff", "512", "--heads", "4",
                                       "--kv-heads", "2", "--vocab", "1000", "--type", "q8_0"])
    assert result.exit_code == 0, result.output
    p = read_params(GGUFFile(tmp_path / "small.gguf"))
    assert (p.n_layer, p.n_embd, p.n_ff, p.n_head, p.n_head_kv, p.vocab_size) == (2, 256, 512, 4, 2, 1000)
    assert GGUFFile(tmp_path / "small.gguf").tensors["blk.0.attn_q.weight"].type == T.Q8_0


def test_random_llama_for_benchmarks_loads_and_runs(tmp_path):
    from convert.random_model import ROWS, LlamaShape, write_random_llama
    from runner.engine.load import LoadOptions, load_model
    shape = LlamaShape(n_layer=3, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, vocab_size=1000)
    path = tmp_path / "random.gguf"
    write_random_llama(path, shape, progress=False)
    f = GGUFFile(path)
    p = read_params(f)
    assert (p.n_layer, p.n_embd, p.n_head, p.n_head_kv, p.n_ff, p.vocab_size) == (3, 256, 4, 2, 512, 1000)
    # the Q4_K_M mix of ggrun convert: Q6_K output, Q4_K for most matrices
    assert f.tensors["output.weight"].type == T.Q6_K and f.tensors["blk.1.attn_q.weight"].type == T.Q4_K
    raw = f.tensor_bytes("blk.0.ffn_gate.weight")
    assert np.array_equal(raw[:ROWS], raw[ROWS:2 * ROWS])  # blocks repeat down the tensor
    w = dequantize(raw[:ROWS].reshape(-1), T.Q4_K)
    assert np.isfinite(w).all() and 0.01 < w.std() < 0.03
    lm = load_model(path, LoadOptions(kv_type="f32"))
    logits = lm.model.forward(lm.tokenizer.encode("hello"), lm.model.new_cache(32))
    assert logits.shape == (1000,) and np.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_sentencepiece_added_tokens_convert_as_llama_cpp_does(random_models, llama_cpp_source, tmp_path, arch):
    """A SentencePiece vocabulary shorter than the model's (padded with [PADn]) with added tokens
    over it: added_tokens.json's, and tokenizer_config.json's marked special or not, looking
    special or not, over a piece, past the vocabulary. Tokens, scores and types as
    convert_hf_to_gguf.py writes them, by its generic rules and by Phi-3's own."""
    from .hf_folders import GPT2_VOCAB, sentencepiece_tokenizer
    folder = tmp_path / arch
    shutil.copytree(random_models[arch], folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    sentencepiece_tokenizer(llama_cpp_source, folder, 1000)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    added = {"1000": {"content": "<|user|>", "special": True}, "1001": {"content": "<|assistant|>", "special": False},
             "1002": {"content": "\u2581custom\u2581word", "special": False},
             "5": {"content": "<replaced>", "special": True}}
    if arch != "phi3":  # (one past the vocabulary, which llama.cpp's Phi-3 converter fails on; ggrun leaves it out)
        added["70000"] = {"content": "<|far|>", "special": True}
    config.update(tokenizer_class="LlamaTokenizer", added_tokens_decoder=added)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "added_tokens.json").write_text(json.dumps({"<|extra|>": 1003, "<|beyond|>": 60000}))
    ours = tmp_path / "ours.gguf"
    convert_hf(folder, ours, "F32", progress=False)
    theirs = convert_with_llama_cpp(llama_cpp_source, folder, tmp_path / "theirs.gguf")
    a, b = GGUFFile(ours), GGUFFile(theirs)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert np.array_equal(np.asarray(a.get(key)), np.asarray(b.get(key))), key
    assert a.get("tokenizer.ggml.tokens")[GPT2_VOCAB - 1] == f"[PAD{GPT2_VOCAB - 1}]"


@pytest.mark.parametrize("single", [["<s>", "A"], ["A", "</s>"], ["<s>", "A", "<unk>"], ["A"]])
def test_post_processor_sets_bos_and_eos_as_llama_cpp_does(random_models, llama_cpp_source, tmp_path, single):
    """Whether BOS and EOS are added, and which token ends a text, from tokenizer.json's
    post-processor beside a SentencePiece model (a template here, byte-level in every BPE random
    folder), as convert_hf_to_gguf.py reads them; tokenizer_config.json's flags lose to it. (A BPE
    tokenizer whose template adds tokens would change the hash llama.cpp's converter knows it by.)"""
    from .hf_folders import sentencepiece_tokenizer
    folder = tmp_path / "folder"
    shutil.copytree(random_models["llama"], folder)
    (folder / "tokenizer.json").unlink()
    sentencepiece_tokenizer(llama_cpp_source, folder, 1000)
    pieces = [{"Sequence": {"id": "A", "type_id": 0}} if t == "A" else {"SpecialToken": {"id": t, "type_id": 0}}
              for t in single]
    (folder / "tokenizer.json").write_text(json.dumps({
        "added_tokens": [{"id": i, "content": t, "special": True} for i, t in enumerate(("<unk>", "<s>", "</s>"))],
        "post_processor": {"type": "TemplateProcessing", "single": pieces, "special_tokens": {}}}))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False,
                                                              "add_eos_token": False}))
    ours = tmp_path / "ours.gguf"
    convert_hf(folder, ours, "F32", progress=False)
    theirs = convert_with_llama_cpp(llama_cpp_source, folder, tmp_path / "theirs.gguf")
    a, b = GGUFFile(ours), GGUFFile(theirs)
    keys = [k for k in set(a.metadata) | set(b.metadata) if k.endswith(("_token_id", "_token"))]
    assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}
