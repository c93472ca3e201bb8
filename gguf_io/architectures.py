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
    rope_theta_default: float = 10000.0
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
    # checkpoint tensors (by name suffix) llama.cpp's converter renames: (suffix, tensor, GGUF suffix)
    renamed: tuple[tuple[str, MODEL_TENSOR, str], ...] = ()

    def tensor_name(self, tensor: MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> str:
        """The GGUF name of one of its tensors, e.g. blk.3.attn_q.weight."""
        if tensor not in self.tensors:
            raise KeyError(f"{self.name} has no {tensor.name} tensor")
        base = TENSOR_NAMES[tensor]
        return f"{base.format(bid=layer) if layer is not None else base}.{suffix}"

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
