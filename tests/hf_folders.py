"""Hugging Face model folders for converter tests: the real SmolLM2 weights, and small
randomly initialized models of every supported architecture (made with transformers)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from gguf import TokenType


def smollm_folder(gguf_path: Path, folder: Path) -> Path:
    """The real SmolLM2 weights as a safetensors checkpoint, via transformers' GGUF loader."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # SmolLM2's published tokenizer.json splits digits before the byte-level step
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # a checkpoint as published: not marked as loaded from a GGUF
    model = LlamaForCausalLM(config)  # a plain copy: the GGUF-loaded model refuses to save itself
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _llama_cpp_vocab(source: Path, name: str):
    """One of the vocabularies of llama.cpp's tokenizer suite (models/ggml-vocab-NAME.gguf in its
    source package, which the tests fetch anyway as their oracle): real tokenizers, no download of
    a model for them."""
    from gguf_io import GGUFFile, read_vocab
    return read_vocab(GGUFFile(source / "models" / f"ggml-vocab-{name}.gguf"))


GPT2_VOCAB = 50257  # the byte-level BPE tokenizer of the random folders but Gemma's


def gpt2_tokenizer(source: Path, folder: Path) -> None:
    """GPT-2's tokenizer.json, as openai-community/gpt2 publishes it: llama.cpp's converter knows it by
    its hash of a test text ("gpt-2"), ggrun's by its pre-tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    vocab = _llama_cpp_vocab(source, "gpt-2")
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab.tokens)}, [tuple(m.split(" ")) for m in vocab.merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    end = "<|endoftext|>"
    tok.add_special_tokens([AddedToken(end, special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "bos_token": end, "eos_token": end, "unk_token": end}))


def sentencepiece_tokenizer(source: Path, folder: Path, n_pieces: int) -> None:
    """A SentencePiece tokenizer.model holding the first n_pieces of Llama 2's vocabulary."""
    from sentencepiece import sentencepiece_model_pb2 as sp
    vocab = _llama_cpp_vocab(source, "llama-spm")
    proto = sp.ModelProto()
    for i in range(n_pieces):
        piece = proto.pieces.add()  # (GGUF's token types number as SentencePiece's piece types)
        piece.piece, piece.score, piece.type = vocab.tokens[i], float(vocab.scores[i]), int(vocab.token_types[i])
    proto.trainer_spec.model_type = sp.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True  # (its byte pieces; sentencepiece refuses them otherwise)
    proto.normalizer_spec.add_dummy_prefix = False
    (folder / "tokenizer.model").write_bytes(proto.SerializeToString())
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true}')


def gemma4_tokenizer(source: Path, folder: Path, n_tokens: int) -> None:
    """Gemma 4's tokenizer.json (byte-fallback BPE over pieces with \u2581 for spaces, split into
    lines and runs of newlines) cut to its first n_tokens and the merges among them, its special
    tokens as added tokens, the control ones named special in tokenizer_config.json."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    vocab = _llama_cpp_vocab(source, "gemma-4")
    kept = {t: i for i, t in enumerate(vocab.tokens[:n_tokens])}
    merges = [tuple(m.split(" ")) for m in vocab.merges
              if all(part in kept for part in m.split(" ")) and m.replace(" ", "") in kept]
    tok = Tokenizer(models.BPE(kept, merges, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[^\\n]+|[\\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    added = [i for i in range(n_tokens) if vocab.token_types[i] in (TokenType.CONTROL, TokenType.USER_DEFINED)]
    tok.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False) for i in added])
    tok.save(str(folder / "tokenizer.json"))
    named = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
             "mask_token": "<mask>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **named,
        "extra_special_tokens": [vocab.tokens[i] for i in added if vocab.token_types[i] == TokenType.CONTROL
                                 and vocab.tokens[i] not in named.values()]}))


# the dense architectures random_folder builds
RANDOM_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "granite", "olmo2", "smollm3", "ernie4_5", "phi3",
                "glm4", "exaone4", "seed_oss", "mistral3", "gemma4")
GEMMAS = ("gemma2", "gemma3")  # (their norms are stored as w - 1, and they read a SentencePiece tokenizer)
# Gemma 4 with a window shorter than the tests' inputs, wider heads and one KV head on the global
# layers (which take values from their keys' projection), the last two layers over the cache of
# earlier ones (each its own kind's) with double-wide MLPs, per-layer embeddings, a softcap that bites
GEMMA4_CONFIG = dict(vocab_size=1024, num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                     head_dim=64, global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True,
                     sliding_window=16, num_kv_shared_layers=2, use_double_wide_mlp=True,
                     hidden_size_per_layer_input=32, vocab_size_per_layer_input=1024, final_logit_softcapping=10.0)


def random_folder(arch: str, folder: Path, llama_cpp_source: Path) -> Path:
    """A small random model of `arch`, its weights scaled so that logits are far from uniform."""
    import torch
    import transformers as tf
    common = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2)
    if arch == "gemma3":
        config = tf.Gemma3TextConfig(vocab_size=1024, num_hidden_layers=7, head_dim=64, query_pre_attn_scalar=64,
                                     sliding_window=16, **common)
        model_class = tf.Gemma3ForCausalLM
    elif arch == "gemma4":  # what sets Gemma 4 apart, all switched on (GEMMA4_CONFIG)
        config = tf.Gemma4TextConfig(**{**common, **GEMMA4_CONFIG})
        model_class = tf.Gemma4ForCausalLM
    elif arch == "gemma2":  # caps that bite, a query scalar other than the head size
        config = tf.Gemma2Config(vocab_size=1024, num_hidden_layers=4, head_dim=64, query_pre_attn_scalar=32,
                                 sliding_window=16, attn_logit_softcapping=5.0, final_logit_softcapping=10.0, **common)
        model_class = tf.Gemma2ForCausalLM
    else:
        config_class, model_class = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                                     "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                                     "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
                                     "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
                                     "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
                                     "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
                                     "ernie4_5": (tf.Ernie4_5Config, tf.Ernie4_5ForCausalLM),
                                     "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
                                     "glm4": (tf.Glm4Config, tf.Glm4ForCausalLM),
                                     "exaone4": (tf.Exaone4Config, tf.Exaone4ForCausalLM),
                                     "seed_oss": (tf.SeedOssConfig, tf.SeedOssForCausalLM),
                                     "mistral3": (tf.Ministral3Config, tf.Ministral3ForCausalLM)}[arch]
        extra = {"head_dim": 64} if arch in ("qwen3", "seed_oss") else {}
        if arch == "smollm3":  # layer 3 of 4 attends without RoPE
            extra = dict(num_hidden_layers=4, pad_token_id=None)
        if arch == "granite":  # its multipliers, none of them 1
            extra = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.05,
                         logits_scaling=4.0)
        if arch == "phi3":  # a window shorter than the test input, a partial rotary share, LongRoPE
            rng = np.random.default_rng(0)
            extra = dict(sliding_window=16, partial_rotary_factor=0.75, pad_token_id=None,
                         original_max_position_embeddings=64, rope_parameters=dict(
                rope_type="longrope", rope_theta=10000.0,
                short_factor=(1 + rng.random(24)).tolist(), long_factor=(2 + 4 * rng.random(24)).tolist()))
        if arch == "glm4":  # RoPE on half of each head; two added tokens (below)
            extra = dict(head_dim=64, partial_rotary_factor=0.5, vocab_size=GPT2_VOCAB + 47, pad_token_id=None)
        if arch == "exaone4":  # three sliding layers, then a global one without RoPE
            extra = dict(head_dim=64, num_hidden_layers=4, sliding_window=16, sliding_window_pattern=4,
                         pad_token_id=None)
        if arch == "mistral3":  # YaRN with a magnitude other than 1, query temperatures past position 16
            extra = dict(head_dim=64, pad_token_id=None, rope_parameters=dict(
                rope_type="yarn", rope_theta=1_000_000.0, factor=16.0, original_max_position_embeddings=16,
                beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.5, llama_4_scaling_beta=0.1))
        config = config_class(**{"vocab_size": GPT2_VOCAB, "num_hidden_layers": 3, "tie_word_embeddings": False,
                                 **common, **extra})
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # random norms too, so that a missed +1 or permutation shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if arch in GEMMAS else 1.0))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # (Gemma 4's output scale of each block)
                b.copy_(torch.rand_like(b) + 0.5)
    model.save_pretrained(folder)
    if arch in GEMMAS:
        sentencepiece_tokenizer(llama_cpp_source, folder, 1024)
    elif arch == "gemma4":
        gemma4_tokenizer(llama_cpp_source, folder, 1024)
    else:  # (byte-level BPE, as Phi-4's folders declare it for llama.cpp's converter too)
        gpt2_tokenizer(llama_cpp_source, folder)
        if arch == "glm4":  # the special tokens llama.cpp's converter looks up by their text
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(folder)
            tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|user|>"]})
            tok.save_pretrained(folder)
    return folder


def _draw_weights(model) -> None:
    """Every parameter from a fixed numpy generator (not transformers' initialization, which differs
    by machine): vectors near 1, matrices small; a DeltaNet's A_log near -3, so that its decays are
    near 1 and its state carries far; then the experts' selection biases (LFM2-MoE's expert_bias and
    Nemotron-H's e_score_correction_bias buffers, zeros as initialized) spread as wide as the sigmoid
    probabilities they steer."""
    import torch
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            values = rng.standard_normal(p.shape, dtype=np.float32)
            values = values * 0.3 + 1.0 if p.dim() == 1 else values * 0.1
            p.copy_(torch.from_numpy(values - 4.0 if name.endswith("A_log") else values))
        for name, b in sorted(model.named_buffers()):
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                b.copy_(torch.from_numpy(rng.standard_normal(b.shape, dtype=np.float32) * 0.3))


def converted_files(folders: dict, root: Path) -> dict:
    """Each folder converted by ggrun to F32, and to Q4_K_M with its exact values (F32 again), by key."""
    from convert.convert import convert_hf, requantize
    files = {}
    for key, folder in folders.items():
        f32, q4, widened = (root / f"{key}-{t}.gguf" for t in ("f32", "q4_k_m", "q4_k_m-f32"))
        convert_hf(folder, f32, "F32", progress=False)
        requantize(f32, q4, "Q4_K_M", progress=False)
        requantize(q4, widened, "F32", progress=False)
        files[key] = f32, q4, widened
    return files


# Small mixtures of experts, 8 experts (4 for Mixtral) so that llama-quantize's 8-expert rules show
MOE_CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=64, num_experts=8, num_experts_per_tok=2,
                                                                 moe_intermediate_size=128, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2,
                                                                 moe_intermediate_size=128,
                                                                 shared_expert_intermediate_size=256)),
    # (llama.cpp's converter writes OLMoE's epsilon as 1e-5, whatever the config says, and its graph
    # takes as many KV heads as query heads, as OLMoE has)
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=128,
                                                      rms_norm_eps=1e-5, num_key_value_heads=4)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # Granite's multipliers other than 1, experts fused gate-and-up in the checkpoint, a shared expert
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=256, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.05, logits_scaling=4.0)),
    # a window shorter than the tests' inputs; YaRN as gpt-oss's, its correction range truncated to
    # whole dimensions as llama.cpp computes it (gpt-oss's own config says truncate: false)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=128, head_dim=64, sliding_window=16,
        rms_norm_eps=1e-5, rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                                truncate=True, original_max_position_embeddings=16,
                                                rope_theta=150000.0))),
    # Gemma 4's mixture (26B-A4B): a dense MLP beside the experts, fused gate-and-up experts with a
    # scale each, the global layer's wider head and single KV head with values from its keys, a window
    # shorter than the inputs, a final softcap (llama.cpp's graph caps at 30 where the file has none;
    # transformers does not)
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        vocab_size=1024, layer_types=["sliding_attention", "full_attention"], head_dim=64, global_head_dim=128,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=16, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=128,
        final_logit_softcapping=10.0)),
}


def moe_folder(model_type: str, folder: Path, llama_cpp_source: Path) -> Path:
    """A small mixture of experts of model_type with GPT-2's tokenizer (Gemma 4's its own), its
    weights drawn from a fixed numpy generator (not transformers' initialization), so that the
    folder is the same on every machine and llama.cpp's references
    (tests/data/llama_cpp_moe_mixes.json) hold."""
    import transformers as tf
    config_name, model_name, extra = MOE_CONFIGS[model_type]
    common = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, vocab_size=GPT2_VOCAB, num_hidden_layers=2,
                  tie_word_embeddings=False)
    config = getattr(tf, config_name)(**{**common, **extra})
    model = getattr(tf, model_name)(config).eval()
    _draw_weights(model)
    model.save_pretrained(folder)
    if model_type == "gemma4_text":
        gemma4_tokenizer(llama_cpp_source, folder, config.vocab_size)
    else:
        gpt2_tokenizer(llama_cpp_source, folder)
    return folder


# Small hybrids, their recurrent layers among attention layers, with GPT-2's tokenizer
HYBRID_CONFIGS = {
    # LFM2: short-convolution layers first and last, attention between (tied embeddings, as published);
    # its MLPs 2/3 of intermediate_size wide, rounded up to 256: 768
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention", "conv"], conv_L_cache=3,
        conv_bias=False, norm_eps=1e-5, tie_word_embeddings=True, intermediate_size=1024)),
    # LFM2-MoE: a leading dense layer (a convolution), then attention, convolution and attention layers
    # whose MLPs are 8 experts (2 chosen by their sigmoid probabilities plus the drawn selection bias)
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3, conv_bias=False,
        norm_eps=1e-5, tie_word_embeddings=True, num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128)),
    # Qwen3.5: three DeltaNet layers, then gated attention, twice; two value heads per key head,
    # RoPE on a quarter of each attention head (multimodal sections, as published)
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[4, 2, 2], mrope_interleaved=True))),
    # Qwen3.5's mixture (35B-A3B): the same layers, every MLP 8 experts (2 chosen, renormalized) beside
    # a shared expert behind its own sigmoid gate (transformers saves the experts one matrix each;
    # Qwen publishes them fused, as test_convert builds from this folder)
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=256, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[4, 2, 2], mrope_interleaved=True))),
    # Qwen3-Next: Qwen3.5-MoE's layers in their earlier layout (value heads grouped by key head, fused
    # projections), one attention layer after three DeltaNet layers
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        layer_types=["linear_attention"] * 3 + ["full_attention"], head_dim=64, linear_conv_kernel_dim=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))),
    # Granite 4.0-H: Mamba2 layers (8 heads of 64, two groups of B and C, conv bias) around GQA layers
    # without RoPE (as published), 8 experts (2 chosen) beside the shared MLP, Granite's multipliers; the
    # vocabulary a multiple of 8, as llama.cpp's converter pads it
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, num_local_experts=8, num_experts_per_tok=2, intermediate_size=128,
        shared_intermediate_size=256, position_embedding_type="nope", embedding_multiplier=12.0,
        logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.0078125, vocab_size=50264)),
    # Nemotron-H: Mamba2 (8 heads of 64, two groups), ReLU^2 MLP, attention (no RoPE), MLP, Mamba2 blocks
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        layer_types=["mamba", "mlp", "attention", "mlp", "mamba"], head_dim=64, mamba_num_heads=8, mamba_head_dim=64,
        n_groups=2, ssm_state_size=16, conv_kernel=4, vocab_size=50264)),
    # Nemotron-H's mixture (Nemotron 3): its MLP blocks 8 ReLU^2 experts (2 chosen by their sigmoid
    # probabilities plus the drawn selection bias, renormalized, scaled by 2.5) beside a shared expert,
    # the experts within latent projections (Nemotron 3 Super's; Nano has none); its model_type nemotron_h
    "nemotron_h_moe": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        layer_types=["mamba", "moe", "attention", "moe", "mamba"], head_dim=64, mamba_num_heads=8, mamba_head_dim=64,
        n_groups=2, ssm_state_size=16, conv_kernel=4, vocab_size=50264, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, moe_shared_expert_intermediate_size=256, moe_latent_size=128,
        routed_scaling_factor=2.5)),
    # plain Mamba2: three Mamba2 layers (8 heads of 64, two groups), no attention, tied embeddings; the
    # vocabulary a multiple of 16, as llama.cpp's converter pads it
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        num_hidden_layers=3, num_heads=8, head_dim=64, n_groups=2, state_size=16, conv_kernel=4, vocab_size=50272,
        tie_word_embeddings=True)),
    # Falcon-H1: attention (RoPE) beside a Mamba2 mixer (8 heads of 64, two groups, no norm, as published)
    # in each of two layers, every multiplier other than 1
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        num_hidden_layers=2, head_dim=64, mamba_d_ssm=512, mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_rms_norm=False, mamba_norm_before_gate=False,
        embedding_multiplier=5.66, lm_head_multiplier=0.039, attention_in_multiplier=0.75,
        attention_out_multiplier=0.94, key_multiplier=0.39, ssm_in_multiplier=1.25, ssm_out_multiplier=0.24,
        mlp_multipliers=[0.88, 0.59], ssm_multipliers=[0.35, 0.25, 0.71, 0.5, 1.41])),
}


def _published_granite(cfg: dict) -> dict:
    """Granite 4.0-H's layer_types as published (mamba, attention), not as transformers 5 renames them."""
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    return {**cfg, "layer_types": [names.get(t, t) for t in cfg["layer_types"]]}


def _published_nemotron_h(cfg: dict) -> dict:
    """Nemotron-H's config as published: the layers as hybrid_override_pattern, their count, and
    none of the multi-token prediction's keys; a dense one's none of the mixture's either (with which
    llama.cpp's converter takes it for Nemotron-H-MoE)."""
    symbols = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    mixture = {k for k in cfg if k.startswith(("moe_", "n_routed", "n_shared", "num_experts"))} | {
        "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob"}
    dropped = {k for k in cfg if k.startswith("mtp_")} | {"layers_block_type"} | (
        set() if "moe" in cfg["layers_block_type"] else mixture)
    kept = {k: v for k, v in cfg.items() if k not in dropped}
    return {**kept, "hybrid_override_pattern": "".join(symbols[t] for t in cfg["layers_block_type"]),
            "num_hidden_layers": len(cfg["layers_block_type"])}


# the config.json as published, where transformers saves it otherwise
PUBLISHED_CONFIGS = {"granitemoehybrid": _published_granite, "nemotron_h": _published_nemotron_h,
                     "nemotron_h_moe": _published_nemotron_h}


def hybrid_folder(model_type: str, folder: Path, llama_cpp_source: Path) -> Path:
    """A small hybrid of model_type (HYBRID_CONFIGS), its weights drawn from a fixed numpy generator,
    so that the folder is the same on every machine."""
    import transformers as tf
    config_name, model_name, extra = HYBRID_CONFIGS[model_type]
    common = dict(hidden_size=256, vocab_size=GPT2_VOCAB, num_hidden_layers=len(extra.get("layer_types", ())))
    if model_type != "mamba2":  # (plain Mamba2 has neither attention nor MLPs)
        common.update(intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config = getattr(tf, config_name)(**{**common, **extra})
    model = getattr(tf, model_name)(config).eval()
    _draw_weights(model)
    model.save_pretrained(folder)
    if model_type in PUBLISHED_CONFIGS:
        saved = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(PUBLISHED_CONFIGS[model_type](saved), indent=2))
    gpt2_tokenizer(llama_cpp_source, folder)
    return folder


def mxfp4_folder(src: Path, folder: Path) -> Path:
    """src (a gpt-oss folder) as OpenAI publishes gpt-oss: its experts' matrices in MXFP4, as
    x_blocks (two E2M1 codes a byte, element 2i in the low nibble) and x_scales (E8M0), rows
    the outputs; the blocks are llama.cpp's quantizer's (via ggrun's, equal to it)."""
    import json

    from gguf import GGMLQuantizationType
    from safetensors.numpy import load_file, save_file

    from convert.quants import quantize
    shutil.copytree(src, folder)
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = np.ascontiguousarray(tensors.pop(name).swapaxes(-1, -2))  # (experts, out, in)
        ggml = quantize(rows.reshape(-1, rows.shape[-1]), GGMLQuantizationType.MXFP4).reshape(*rows.shape[:2], -1, 17)
        codes = np.stack([ggml[..., 1:] & 15, ggml[..., 1:] >> 4], axis=-2).reshape(*ggml.shape[:-1], 32)
        tensors[name + "_blocks"] = np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))
        tensors[name + "_scales"] = np.ascontiguousarray(ggml[..., 0])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def logits_by_passes(lm, ids: list[int], splits: tuple[int, ...] = ()) -> list[np.ndarray]:
    """All-position logits of one prefill, of one-token steps (replayed), and, where splits are
    given, of prefills split there."""
    model = lm.model
    prefill = model.forward(ids, model.new_cache(128), all_logits=True)
    cache = model.new_cache(128)
    passes = [prefill, np.array([model.forward([t], cache) for t in ids])]
    if splits:
        cache, bounds = model.new_cache(128), [0, *(s for s in splits if s < len(ids)), len(ids)]
        passes.append(np.concatenate([model.forward(ids[a:b], cache, all_logits=True)
                                      for a, b in zip(bounds, bounds[1:])]))
    return passes


def transformers_logits(folder: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()
