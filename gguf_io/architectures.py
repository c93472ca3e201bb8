"""One declaration per architecture, read by the runner and by the converter alike: its GGUF name,
the defaults of the options it declares on the shared decoder, its tensors by gguf's constants, and
how a Hugging Face checkpoint maps onto it (gguf's TensorNameMap, plus the few facts in which a
checkpoint differs from what llama.cpp's graph reads).

Adding an architecture is one entry here and a model file in runner/models that computes it.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import MODEL_ARCH, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES, TensorNameMap

from .errors import GGUFError


@dataclass(frozen=True)
class Architecture:
    name: str                         # general.architecture
    gguf_arch: MODEL_ARCH             # gguf's constants for it: its tensors and their Hugging Face names
    hf_model_types: tuple[str, ...]   # the config.json model_type values that convert to it
    # options of the shared decoder, where the file does not set them:
    # sliding-window layers where the file gives a window: every swa_pattern-th layer attends
    # globally, the others slide (0: every layer slides; None: the graph has no sliding layers)
    swa_pattern: int | None = None
    rope_base_swa: float | None = None  # RoPE base of the sliding layers (None: the global layers')
    # mixtures of experts: llama.cpp fixes these per architecture in its graph
    expert_weights_norm: bool = False  # the chosen experts' weights are renormalized to sum to 1
    expert_gating: int = 1            # router logits -> weights, by llama.cpp's gating function id (hparams.py)
    partial_rope: bool = False        # RoPE may rotate part of each head (rope.dimension_count below the head size)
    # how llama.cpp's converter writes it from a checkpoint:
    permute_qk: bool = False          # Q/K rows permuted for the interleaved rotary pairing of llama.cpp's graph
    norm_plus_one: bool = False       # the checkpoint stores RMSNorm weights as w - 1
    tied_by_default: bool = False     # tie_word_embeddings when config.json does not say
    rope_theta_default: float | None = 10000.0  # (None: rope.freq_base only where config.json gives one)
    rotary_share: float = 1.0         # the share of each head RoPE rotates, where config.json does not say
    writes_swa_layers: bool = False   # sliding_window_pattern as one flag per layer, always
    special_tokens: tuple[tuple[str, str], ...] = ()  # special token ids the converter sets by the token's text
    no_bos_vocab_size: int = 0        # llama.cpp's Llama converter writes add_bos_token false at this vocabulary size
    llama4_temperature: bool = False  # YaRN's log multiplier and Llama 4's query temperature (Ministral 3)
    long_rope: bool = False           # LongRoPE: short and long frequency factors, chosen by context (Phi-3)
    # the layer count of the model whose queries llama.cpp scales by 1/sqrt(n_embd / n_head), not by
    # 1/sqrt(head size) (Gemma 2 and 3 27B's query_pre_attn_scalar, which their files do not hold)
    wide_query_scale_layers: int = 0
    writes_vocab_size: bool = False   # {arch}.vocab_size, always
    writes_rope_dims: bool = False    # rope.dimension_count, also when it is the head size
    writes_head_dims: bool = False    # attention.key_length / value_length, also when implied
    # checkpoint tensors (by name suffix) holding gate and up as one, that llama.cpp writes apart:
    # (suffix, gate tensor, up tensor, GGUF suffix), gate rows first or, if gate_up_interleaved,
    # alternating (gpt-oss)
    fused_gate_up: tuple[tuple[str, MODEL_TENSOR, MODEL_TENSOR, str], ...] = ()
    gate_up_interleaved: bool = False
    experts_in_out: bool = False      # the checkpoint's stacked expert matrices are [experts, in, out] (gpt-oss)
    writes_expert_ff_length: bool = False  # expert_feed_forward_length, from intermediate_size where no other says
    sentencepiece_first: bool = False  # a tokenizer.model wins over tokenizer.json
    added_tokens_as_marked: bool = False  # its SentencePiece added tokens as llama.cpp's Phi-3 converter takes them
    space_prefix: bool | None = None  # tokenizer.ggml.add_space_prefix, when the architecture fixes it
    # the tokenizer model llama.cpp writes for a byte-fallback BPE tokenizer.json, read as its
    # LlamaHfVocab reads one (Gemma 4's "gemma4"; None: refused)
    byte_fallback_model: str | None = None
    # the global layers' own head size and KV heads, proportional RoPE as frequency divisors,
    # the last layers sharing earlier ones' KV, per-layer embeddings (Gemma 4's config)
    global_layers_apart: bool = False
    # the final logits' and attention scores' softcaps where the file gives none (0: none): llama.cpp's
    # defaults for Gemma 2 and 4, which its converter leaves out where a config has no cap
    softcap_defaults: tuple[float, float] = (0.0, 0.0)
    # checkpoint tensors (by name suffix) llama.cpp's converter renames: (suffix, tensor, GGUF suffix,
    # None for a name without one)
    renamed: tuple[tuple[str, MODEL_TENSOR, str | None], ...] = ()
    rms_eps_key: str = "rms_norm_eps"  # config.json's name for the RMSNorm epsilon
    rms_eps_as_layer_norm: bool = False  # written as attention.layer_norm_epsilon (Nemotron-H's, as llama.cpp does)
    # the layer_types value of short-convolution layers (LFM2's "conv"): llama.cpp's converter writes
    # them 0 KV heads (head_count_kv per layer) and the kernel's length (shortconv.l_cache)
    conv_layer_type: str | None = None
    # feed_forward_length as the model sizes its MLP from intermediate_size where the config says
    # block_auto_adjust_ff_dim: 2/3 of it, times block_ffn_dim_multiplier, rounded up to block_multiple_of
    ff_auto_adjust: bool = False
    # checkpoint tensors (by name suffix) held [rows, 1, n] that llama.cpp's converter writes 2-D
    # (LFM2's convolution kernels, which its graph takes as [channels, kernel])
    squeezed: tuple[str, ...] = ()
    # config.json names the model's transformers config reads as the usual ones, winning over them
    # (older LFM2 configs' block_ff_dim and tie_embedding), as llama.cpp's converter reads them through it
    config_aliases: tuple[tuple[str, str], ...] = ()
    # the norms norm_plus_one leaves as they are (Qwen3.5's gated DeltaNet norm, stored as its weight)
    plain_norms: tuple[MODEL_TENSOR, ...] = ()
    # gated DeltaNet layers (layer_types "linear_attention") among attention layers: llama.cpp's converter
    # writes their sizes (ssm.*) and which layers they are, A as -exp(A_log), and their value heads, which
    # the checkpoint groups by key head, tiled (each key head's first, then each one's second...) as
    # llama.cpp's graph broadcasts the key heads over them
    gated_delta_net: bool = False
    # ... except where llama.cpp's graph repeats each key head over its value heads, which stay grouped
    # (Qwen3-Next), and Q, K, V and the output gate z come fused, per key head its q, k, v and z
    # (written as attn_qkv, every head's q, then k, then v, and attn_gate, z)
    delta_net_heads_grouped: bool = False
    # Mamba2 layers (layer_types "mamba" or "linear_attention") among attention layers, in the module of
    # this name ("mamba": Granite 4.0-H): llama.cpp's converter writes their sizes (ssm.*), 0 KV heads in
    # them, A as -exp(A_log), A and D as [1, heads] and the norm's weights per group as [d_inner /
    # groups, groups]; and whether the attention layers rotate (rope.scaling.finetuned: where the config's
    # position_embedding_type is "rope", which llama.cpp's converter does not read, writing false for every
    # hybrid but Bamba: the published ones apply none; without RoPE, a context of 2^20)
    mamba2: str | None = None
    # without experts, the shared expert is the dense MLP (Granite 4.0-H-Micro's shared_mlp), as llama.cpp's
    # converter writes it, with the experts' count used and the shared width still among its keys
    shared_mlp_dense: bool = False
    # each layer one block with its norm and residual (Nemotron-H): Mamba2 (0 KV heads and 0 feed-forward
    # width), attention (0 feed-forward width) or a feed-forward (0 KV heads); llama.cpp's converter writes
    # both per layer, from hybrid_override_pattern (M, *, -) or the layer types
    separate_blocks: bool = False
    # every layer a Mamba2 block, no attention and no feed-forward (plain Mamba2): llama.cpp's converter
    # writes head_count and feed_forward_length 0, no KV heads, a context of 2^20
    attention_free: bool = False
    # each layer runs attention and a Mamba2 mixer side by side on the same normed input, then a
    # feed-forward (Falcon-H1): every layer attends and carries a recurrent state
    parallel_mixers: bool = False
    # Falcon-H1's µP multipliers (embedding, lm_head, attention in and out, key, SSM in and out, the
    # mup_vector's five ssm_multipliers over in_proj's z, x, B, C and dt rows, the MLP's gate and
    # down), which llama.cpp's converter folds into the weights they scale: its graph has none
    folded_multipliers: bool = False
    # the vocabulary llama.cpp's converter rounds up to a multiple of this (its Mamba2 models': 8 for
    # Granite 4.0-H and Nemotron-H, the config's pad_vocab_size_multiple or 16 for plain Mamba2), with
    # [PAD] tokens, leaving the embedding as the checkpoint holds it
    vocab_multiple: int = 1
    vocab_multiple_key: str | None = None  # config.json's name for it, where the config may give it
    # M-RoPE's rope.dimension_sections where the config gives no mrope_section (llama.cpp's loader
    # requires them of Qwen3.5, and its converter writes its published [11, 11, 10])
    rope_sections_default: tuple[int, ...] = ()
    # checkpoint tensors (by name prefix) the converter leaves out, saying so: (prefix, what they are)
    left_out: tuple[tuple[str, str], ...] = ()
    writes_expert_gating: bool = False  # expert_gating_func (expert_gating above), always
    # config.json's count of the first layers whose MLP is dense, not a mixture, which llama.cpp's
    # converter writes as leading_dense_block_count (LFM2-MoE's num_dense_layers)
    leading_dense_key: str | None = None
    # config.json values that llama.cpp's graph takes for granted (it reads no key for them): the
    # converter refuses a checkpoint with another value, whose file llama.cpp would compute otherwise
    config_fixed: tuple[tuple[str, object], ...] = ()
    # the architecture a checkpoint of these model types converts to where some of its layers are
    # mixtures of experts (Nemotron-H's "E" blocks: nemotron_h_moe, which declares no model type of its
    # own). llama.cpp's converter decides by num_experts_per_tok, which the published configs give
    # exactly where they have such layers (transformers 5 saves it, with the other mixture defaults, in
    # a dense model's config too, which llama.cpp's converter then writes as a mixture without experts)
    mixture_variant: str | None = None
    # a mixture's config.json values llama.cpp's converter writes as these keys: (config name, GGUF key,
    # transformers' default, which it reads through AutoConfig where config.json gives none; None: the
    # key is written only where config.json gives a value), typed as the default (None: an integer)
    expert_config_keys: tuple[tuple[str, str, object], ...] = ()

    def tensor_name(self, tensor: MODEL_TENSOR, layer: int | None = None, suffix: str | None = "weight") -> str:
        """The GGUF name of one of its tensors, e.g. blk.3.attn_q.weight."""
        if tensor not in self.tensors:
            raise KeyError(f"{self.name} has no {tensor.name} tensor")
        base = TENSOR_NAMES[tensor]
        base = base.format(bid=layer) if layer is not None else base
        return base if suffix is None else f"{base}.{suffix}"  # (None: a name without one, as ssm_a's)

    @property
    def tensors(self) -> frozenset:
        return frozenset(MODEL_TENSORS[self.gguf_arch])

    def hf_names(self, n_layer: int) -> TensorNameMap:
        """Hugging Face tensor names -> GGUF names, for a checkpoint of n_layer layers."""
        return TensorNameMap(self.gguf_arch, n_layer)


ARCHITECTURES = {a.name: a for a in (
    # llama.cpp converts these with its Llama converter: a tokenizer.model first, and no BOS for a
    # 49152-token vocabulary (Granite's and SmolLM's)
    Architecture("llama", MODEL_ARCH.LLAMA, ("llama", "mistral", "mixtral"), permute_qk=True, no_bos_vocab_size=49152,
                 sentencepiece_first=True, writes_vocab_size=True, writes_rope_dims=True, expert_weights_norm=True),
    Architecture("mistral3", MODEL_ARCH.MISTRAL3, ("ministral3",), permute_qk=True, no_bos_vocab_size=49152,
                 sentencepiece_first=True, writes_vocab_size=True, writes_rope_dims=True, llama4_temperature=True),
    Architecture("qwen2", MODEL_ARCH.QWEN2, ("qwen2",)),
    Architecture("qwen3", MODEL_ARCH.QWEN3, ("qwen3",), writes_head_dims=True),
    Architecture("qwen2moe", MODEL_ARCH.QWEN2MOE, ("qwen2_moe",)),
    Architecture("qwen3moe", MODEL_ARCH.QWEN3MOE, ("qwen3_moe",), writes_head_dims=True, expert_weights_norm=True),
    Architecture("olmoe", MODEL_ARCH.OLMOE, ("olmoe",)),
    Architecture("olmo2", MODEL_ARCH.OLMO2, ("olmo2",)),
    Architecture("ernie4_5", MODEL_ARCH.ERNIE4_5, ("ernie4_5",)),
    Architecture("smollm3", MODEL_ARCH.SMOLLM3, ("smollm3",), permute_qk=True, no_bos_vocab_size=49152,
                 sentencepiece_first=True, writes_vocab_size=True, writes_rope_dims=True),
    Architecture("granite", MODEL_ARCH.GRANITE, ("granite",), permute_qk=True, no_bos_vocab_size=49152,
                 sentencepiece_first=True, writes_vocab_size=True, writes_rope_dims=True),
    Architecture("granitemoe", MODEL_ARCH.GRANITE_MOE, ("granitemoe", "granitemoeshared"), partial_rope=True,
                 permute_qk=True, no_bos_vocab_size=49152, sentencepiece_first=True, writes_vocab_size=True,
                 writes_rope_dims=True, expert_weights_norm=True,
                 fused_gate_up=(
                     ("block_sparse_moe.input_linear.weight", MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP,
                      "weight"),
                     ("shared_mlp.input_linear.weight", MODEL_TENSOR.FFN_GATE_SHEXP, MODEL_TENSOR.FFN_UP_SHEXP,
                      "weight"))),
    # Granite 4.0-H: Mamba2 layers among GQA layers (those with 0 KV heads), Granite's multipliers, its
    # MoE's fused experts and shared expert as granitemoe's
    Architecture("granitehybrid", MODEL_ARCH.GRANITE_HYBRID, ("granitemoehybrid",), partial_rope=True,
                 permute_qk=True, no_bos_vocab_size=49152, sentencepiece_first=True, writes_vocab_size=True,
                 writes_rope_dims=True, expert_weights_norm=True, mamba2="mamba", shared_mlp_dense=True,
                 vocab_multiple=8,
                 fused_gate_up=(
                     ("block_sparse_moe.input_linear.weight", MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP,
                      "weight"),
                     ("shared_mlp.input_linear.weight", MODEL_TENSOR.FFN_GATE_SHEXP, MODEL_TENSOR.FFN_UP_SHEXP,
                      "weight")),
                 renamed=(("mamba.dt_bias", MODEL_TENSOR.SSM_DT, "bias"), ("mamba.A_log", MODEL_TENSOR.SSM_A, None),
                          ("mamba.D", MODEL_TENSOR.SSM_D, None)),
                 squeezed=("mamba.conv1d.weight",)),
    # Nemotron-H: Mamba2, attention (without RoPE) and ReLU^2 feed-forward blocks, one a layer
    Architecture("nemotron_h", MODEL_ARCH.NEMOTRON_H, ("nemotron_h",), partial_rope=True, permute_qk=True,
                 writes_vocab_size=True, writes_rope_dims=True, writes_head_dims=True, rms_eps_key="layer_norm_epsilon",
                 rms_eps_as_layer_norm=True, rope_theta_default=None, mamba2="mixer", separate_blocks=True,
                 vocab_multiple=8,
                 renamed=(("mixer.dt_bias", MODEL_TENSOR.SSM_DT, "bias"), ("mixer.A_log", MODEL_TENSOR.SSM_A, None),
                          ("mixer.D", MODEL_TENSOR.SSM_D, None)),
                 squeezed=("mixer.conv1d.weight",), mixture_variant="nemotron_h_moe"),
    # Nemotron-H's mixture (Nemotron 3): Nemotron-H's blocks, its feed-forward blocks ("E") a mixture of
    # ReLU^2 experts (up and down, no gate) under a sigmoid router with a selection bias (the checkpoint's
    # e_score_correction_bias, exp_probs_b), beside a shared expert, the experts optionally within latent
    # projections (moe_latent_size: ffn_latent_down before them, ffn_latent_up after); the per-expert
    # tensors stacked. Reached from nemotron_h checkpoints whose layers have experts (mixture_variant).
    Architecture("nemotron_h_moe", MODEL_ARCH.NEMOTRON_H_MOE, (), partial_rope=True, permute_qk=True,
                 writes_vocab_size=True, writes_rope_dims=True, writes_head_dims=True, rms_eps_key="layer_norm_epsilon",
                 rms_eps_as_layer_norm=True, rope_theta_default=None, mamba2="mixer", separate_blocks=True,
                 expert_gating=2, vocab_multiple=8, config_aliases=(("n_routed_experts", "num_local_experts"),),
                 expert_config_keys=(("n_shared_experts", "expert_shared_count", 1),
                                     ("norm_topk_prob", "expert_weights_norm", True),
                                     ("routed_scaling_factor", "expert_weights_scale", 1.0),
                                     ("n_group", "expert_group_count", 1), ("topk_group", "expert_group_used_count", 1),
                                     ("moe_latent_size", "moe_latent_size", None)),
                 renamed=(("mixer.dt_bias", MODEL_TENSOR.SSM_DT, "bias"), ("mixer.A_log", MODEL_TENSOR.SSM_A, None),
                          ("mixer.D", MODEL_TENSOR.SSM_D, None),
                          ("mixer.experts.up_proj.weight", MODEL_TENSOR.FFN_UP_EXP, "weight"),
                          ("mixer.experts.down_proj.weight", MODEL_TENSOR.FFN_DOWN_EXP, "weight")),
                 squeezed=("mixer.conv1d.weight",),
                 left_out=(("mtp.", "the multi-token prediction layer (llama.cpp's converter with --no-mtp)"),)),
    # plain Mamba2: every layer a Mamba2 block (Nemotron-H's blocks, of one kind), no attention; its
    # projections without biases and its convolution with one, as llama.cpp's loader reads them
    Architecture("mamba2", MODEL_ARCH.MAMBA2, ("mamba2",), partial_rope=True, rms_eps_key="layer_norm_epsilon",
                 rope_theta_default=None, mamba2="mixer", separate_blocks=True, attention_free=True,
                 vocab_multiple=16, vocab_multiple_key="pad_vocab_size_multiple",
                 config_fixed=(("use_bias", False), ("use_conv_bias", True), ("hidden_act", "silu")),
                 renamed=(("mixer.dt_bias", MODEL_TENSOR.SSM_DT, "bias"), ("mixer.A_log", MODEL_TENSOR.SSM_A, None),
                          ("mixer.D", MODEL_TENSOR.SSM_D, None)),
                 squeezed=("mixer.conv1d.weight",)),
    # Falcon-H1: attention (NeoX RoPE) and a Mamba2 mixer side by side in every layer, then a SwiGLU MLP;
    # its multipliers folded into the weights. llama.cpp's converter names the MLP's norm without a
    # suffix (blk.N.ffn_norm), as its loader reads it; its graph computes the biases below as absent
    # (llama.cpp's converter would scale Q, K and V's biases as their weights, and its loader has no
    # SSM projection biases)
    Architecture("falcon-h1", MODEL_ARCH.FALCON_H1, ("falcon_h1",), partial_rope=True, writes_vocab_size=True,
                 writes_head_dims=True, mamba2="mamba", parallel_mixers=True, folded_multipliers=True,
                 config_fixed=(("attention_bias", False), ("mamba_proj_bias", False), ("projectors_bias", False),
                               ("hidden_act", "silu")),
                 renamed=(("mamba.dt_bias", MODEL_TENSOR.SSM_DT, "bias"), ("mamba.A_log", MODEL_TENSOR.SSM_A, None),
                          ("mamba.D", MODEL_TENSOR.SSM_D, None),
                          ("pre_ff_layernorm.weight", MODEL_TENSOR.FFN_PRE_NORM, None)),
                 squeezed=("mamba.conv1d.weight",)),
    # gpt-oss: attention sinks and biases, experts picked by their logits (llama.cpp's softmax_weight
    # gating), sliding layers alternating with global ones from the first, YaRN from the file
    Architecture("gpt-oss", MODEL_ARCH.GPT_OSS, ("gpt_oss",), partial_rope=True, swa_pattern=2, expert_gating=3,
                 fused_gate_up=(
                     ("mlp.experts.gate_up_proj", MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP, "weight"),
                     ("mlp.experts.gate_up_proj_bias", MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP, "bias")),
                 gate_up_interleaved=True, experts_in_out=True, writes_expert_ff_length=True),
    Architecture("glm4", MODEL_ARCH.GLM4, ("glm4",), partial_rope=True, rotary_share=0.5, writes_rope_dims=True,
                 writes_head_dims=True,
                 special_tokens=(("eos", "<|endoftext|>"), ("eot", "<|user|>"), ("unk", "<|endoftext|>"),
                                 ("bos", "<|endoftext|>"))),
    # (llama.cpp's graph slides EXAONE 4's layers only in its 64-layer model; ggrun wherever the file says)
    Architecture("exaone4", MODEL_ARCH.EXAONE4, ("exaone4",), swa_pattern=4, writes_swa_layers=True,
                 writes_vocab_size=True, writes_head_dims=True),
    Architecture("seed_oss", MODEL_ARCH.SEED_OSS, ("seed_oss",), writes_head_dims=True),
    # (llama.cpp's graph ignores Phi-3's window, which transformers applies to every layer: ggrun follows
    # the model's definition)
    Architecture("phi3", MODEL_ARCH.PHI3, ("phi3",), partial_rope=True, swa_pattern=0, long_rope=True,
                 writes_rope_dims=True, sentencepiece_first=True, added_tokens_as_marked=True),
    Architecture("gemma2", MODEL_ARCH.GEMMA2, ("gemma2",), partial_rope=True, swa_pattern=2, wide_query_scale_layers=46,
                 softcap_defaults=(30.0, 50.0),
                 norm_plus_one=True, tied_by_default=True, writes_head_dims=True, sentencepiece_first=True,
                 space_prefix=False),
    # llama.cpp hard-codes Gemma 3's pattern (five sliding layers, then a global one) and local base
    Architecture("gemma3", MODEL_ARCH.GEMMA3, ("gemma3", "gemma3_text"), partial_rope=True, swa_pattern=6,
                 rope_base_swa=10000.0, wide_query_scale_layers=62, norm_plus_one=True, tied_by_default=True,
                 rope_theta_default=1_000_000.0, writes_head_dims=True, sentencepiece_first=True, space_prefix=False),
    # LFM2: short-convolution layers among attention layers (the recurrent ones have 0 KV heads)
    Architecture("lfm2", MODEL_ARCH.LFM2, ("lfm2",), partial_rope=True, tied_by_default=True,
                 rope_theta_default=1_000_000.0, writes_vocab_size=True, rms_eps_key="norm_eps",
                 conv_layer_type="conv", ff_auto_adjust=True, squeezed=("conv.conv.weight",),
                 config_aliases=(("block_ff_dim", "intermediate_size"), ("tie_embedding", "tie_word_embeddings"))),
    # LFM2-MoE: LFM2's layers, the first num_dense_layers with a dense MLP, the others a mixture whose
    # sigmoid router picks experts by their probabilities plus a selection bias (the checkpoint's
    # expert_bias, llama.cpp's exp_probs_b), weighted by the probabilities renormalized (llama.cpp's
    # graph always renormalizes, scales by 1 and has the bias)
    Architecture("lfm2moe", MODEL_ARCH.LFM2MOE, ("lfm2_moe",), partial_rope=True, tied_by_default=True,
                 rope_theta_default=1_000_000.0, writes_vocab_size=True, rms_eps_key="norm_eps",
                 conv_layer_type="conv", squeezed=("conv.conv.weight",), expert_weights_norm=True,
                 expert_gating=2, writes_expert_gating=True, leading_dense_key="num_dense_layers",
                 config_aliases=(("tie_embedding", "tie_word_embeddings"),),
                 config_fixed=(("norm_topk_prob", True), ("routed_scaling_factor", 1.0), ("use_expert_bias", True)),
                 renamed=(("feed_forward.expert_bias", MODEL_TENSOR.FFN_EXP_PROBS_B, "bias"),
                          ("feed_forward.experts.w1.weight", MODEL_TENSOR.FFN_GATE_EXP, "weight"),
                          ("feed_forward.experts.w2.weight", MODEL_TENSOR.FFN_DOWN_EXP, "weight"),
                          ("feed_forward.experts.w3.weight", MODEL_TENSOR.FFN_UP_EXP, "weight"))),
    # Qwen3.5: gated DeltaNet layers among gated attention layers; RoPE on a quarter of each head
    # (M-RoPE's sections, which text positions make plain RoPE); its multimodal checkpoint's text model
    # alone, as llama.cpp's converter writes it with --no-mtp (the vision tower goes to its mmproj file)
    Architecture("qwen35", MODEL_ARCH.QWEN35, ("qwen3_5", "qwen3_5_text"), partial_rope=True, rotary_share=0.25,
                 writes_rope_dims=True, writes_head_dims=True, norm_plus_one=True, plain_norms=(MODEL_TENSOR.SSM_NORM,),
                 gated_delta_net=True, rope_sections_default=(11, 11, 10),
                 renamed=(("linear_attn.A_log", MODEL_TENSOR.SSM_A, None),
                          ("linear_attn.dt_bias", MODEL_TENSOR.SSM_DT, "bias")),
                 squeezed=("linear_attn.conv1d.weight",),
                 left_out=(("model.visual.", "the vision tower"),
                           ("mtp.", "the multi-token prediction layer (llama.cpp's converter with --no-mtp)"))),
    # Qwen3.5's mixture (35B-A3B): Qwen3.5's layers, each MLP a mixture of experts (renormalized) and a
    # shared expert behind its sigmoid gate (ffn_gate_inp_shexp); the experts stacked from one tensor
    # each, or, as Qwen publishes them, held fused: gate and up as one (E, 2I, H), gate rows first,
    # which llama.cpp's converter writes apart (as ffn_gate_exps and ffn_up_exps), and down (E, H, I)
    Architecture("qwen35moe", MODEL_ARCH.QWEN35MOE, ("qwen3_5_moe", "qwen3_5_moe_text"), partial_rope=True,
                 rotary_share=0.25, writes_rope_dims=True, writes_head_dims=True, norm_plus_one=True,
                 plain_norms=(MODEL_TENSOR.SSM_NORM,), gated_delta_net=True, rope_sections_default=(11, 11, 10),
                 expert_weights_norm=True,
                 fused_gate_up=(("mlp.experts.gate_up_proj", MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP,
                                 "weight"),),
                 renamed=(("linear_attn.A_log", MODEL_TENSOR.SSM_A, None),
                          ("linear_attn.dt_bias", MODEL_TENSOR.SSM_DT, "bias")),
                 squeezed=("linear_attn.conv1d.weight",),
                 left_out=(("model.visual.", "the vision tower"),
                           ("mtp.", "the multi-token prediction layer (llama.cpp's converter with --no-mtp)"))),
    # Qwen3-Next: Qwen3.5-MoE's layers in their earlier layout (value heads grouped by key head, fused
    # projections: see delta_net_heads_grouped, and b and a as one, ssm_ba), with plain NeoX RoPE
    Architecture("qwen3next", MODEL_ARCH.QWEN3NEXT, ("qwen3_next",), partial_rope=True, rotary_share=0.25,
                 writes_rope_dims=True, norm_plus_one=True, plain_norms=(MODEL_TENSOR.SSM_NORM,),
                 gated_delta_net=True, delta_net_heads_grouped=True, expert_weights_norm=True,
                 renamed=(("linear_attn.A_log", MODEL_TENSOR.SSM_A, None),
                          ("linear_attn.dt_bias", MODEL_TENSOR.SSM_DT, "bias")),
                 squeezed=("linear_attn.conv1d.weight",),
                 left_out=(("mtp.", "the multi-token prediction layer (llama.cpp's converter with --no-mtp)"),)),
    # (its sliding pattern is always written, one flag per layer)
    Architecture("gemma4", MODEL_ARCH.GEMMA4, ("gemma4", "gemma4_text"), partial_rope=True, swa_pattern=6,
                 writes_swa_layers=True, tied_by_default=True, rope_theta_default=1_000_000.0, writes_head_dims=True,
                 space_prefix=False, byte_fallback_model="gemma4", global_layers_apart=True, expert_weights_norm=True,
                 softcap_defaults=(30.0, 0.0),
                 renamed=(("router.scale", MODEL_TENSOR.FFN_GATE_INP, "scale"),
                          ("router.per_expert_scale", MODEL_TENSOR.FFN_DOWN_EXP, "scale"))),
)}
HF_MODEL_TYPES = {t: a for a in ARCHITECTURES.values() for t in a.hf_model_types}


def architecture(name: str, where: str = "") -> Architecture:
    """The declaration of a GGUF architecture; a clear GGUFError for one ggrun does not run."""
    if name not in ARCHITECTURES:
        raise GGUFError(f"{where}architecture {name!r} is not supported "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[name]
