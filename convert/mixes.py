"""Which type each tensor gets for a file type (`--type`), following llama.cpp's quantize tool
(src/llama-quant.cpp, with or without an importance matrix), for dense models and mixtures of experts.

A mix such as Q4_K_M has a default type (Q4_K) and promotes the tensors that hurt most when
quantized: the output / tied embedding, attn_v and ffn_down in chosen layers. A type whose block
does not divide the row length falls back to a 32-block type (SmolLM2's 576-wide rows do this).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, LlamaFileType
from gguf import GGMLQuantizationType as T

from gguf_io import ggml_dims
from gguf_io.quant_types import FLOAT_TYPES, QUANT_TYPES

# llama-quantize's type that keeps every tensor as it is (to rewrite or split a file)
COPY = "COPY"
# --type name -> (default tensor type, llama.cpp file type written as general.file_type)
FILE_TYPES: dict[str, tuple[T, LlamaFileType]] = {
    "F32": (T.F32, LlamaFileType.ALL_F32),
    "F16": (T.F16, LlamaFileType.MOSTLY_F16),
    "BF16": (T.BF16, LlamaFileType.MOSTLY_BF16),
    "Q8_0": (T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (T.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": (T.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "Q5_0": (T.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "Q5_1": (T.Q5_1, LlamaFileType.MOSTLY_Q5_1),
    "Q2_K": (T.Q2_K, LlamaFileType.MOSTLY_Q2_K),
    "Q3_K_S": (T.Q3_K, LlamaFileType.MOSTLY_Q3_K_S),
    "Q3_K_M": (T.Q3_K, LlamaFileType.MOSTLY_Q3_K_M),
    "Q3_K_L": (T.Q3_K, LlamaFileType.MOSTLY_Q3_K_L),
    "Q4_K_S": (T.Q4_K, LlamaFileType.MOSTLY_Q4_K_S),
    "Q4_K_M": (T.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_S": (T.Q5_K, LlamaFileType.MOSTLY_Q5_K_S),
    "Q5_K_M": (T.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
    "Q6_K": (T.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "IQ4_NL": (T.IQ4_NL, LlamaFileType.MOSTLY_IQ4_NL),
    "IQ4_XS": (T.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS),
    "MXFP4_MOE": (T.MXFP4, LlamaFileType.MOSTLY_MXFP4_MOE),  # a mixture's experts MXFP4, the rest Q8_0 (gpt-oss)
    "IQ1_S": (T.IQ1_S, LlamaFileType.MOSTLY_IQ1_S),
    "IQ1_M": (T.IQ1_M, LlamaFileType.MOSTLY_IQ1_M),
    "IQ2_XXS": (T.IQ2_XXS, LlamaFileType.MOSTLY_IQ2_XXS),
    "IQ2_XS": (T.IQ2_XS, LlamaFileType.MOSTLY_IQ2_XS),
    "IQ2_S": (T.IQ2_XS, LlamaFileType.MOSTLY_IQ2_S),
    "IQ2_M": (T.IQ2_S, LlamaFileType.MOSTLY_IQ2_M),
    "IQ3_XXS": (T.IQ3_XXS, LlamaFileType.MOSTLY_IQ3_XXS),
    "IQ3_XS": (T.IQ3_S, LlamaFileType.MOSTLY_IQ3_XS),
    "IQ3_S": (T.IQ3_S, LlamaFileType.MOSTLY_IQ3_S),
    "IQ3_M": (T.IQ3_S, LlamaFileType.MOSTLY_IQ3_M),
    "TQ1_0": (T.TQ1_0, LlamaFileType.MOSTLY_TQ1_0),
    "TQ2_0": (T.TQ2_0, LlamaFileType.MOSTLY_TQ2_0),
}
# the mixes below 2.5 bits a weight, which promote their own set of tensors (llama-quant.cpp's first
# branch after the embeddings)
_LOW_BIT = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M")


@dataclass(frozen=True)
class MixOptions:
    """llama-quantize's options that change a mix, built by keyword; each default is defined here alone."""
    pure: bool = False                    # --pure: every quantizable tensor of the default type (or its fallback)
    output_type: T | None = None          # --output-tensor-type: the output's (a tied embedding's too)
    token_embedding_type: T | None = None  # --token-embedding-type
    imatrix: str | None = None            # --imatrix: an importance matrix file (GGUF or .dat), as named
    include_weights: tuple[str, ...] = ()  # --include-weights: only the matrix's entries whose names contain one
    exclude_weights: tuple[str, ...] = ()  # --exclude-weights: not those (the two exclude each other)

    def overrides(self) -> dict[str, T]:
        """The types given by name, as the option spells them."""
        named = {"--output-tensor-type": self.output_type, "--token-embedding-type": self.token_embedding_type}
        return {option: t for option, t in named.items() if t is not None}


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """The layers the _M mixes give more bits: the first and last eighth, and every third between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize quantizes the tensor: a matrix (ggml_n_dims: trailing 1s do not
    count) of weights, not a norm, nor a mixture's router, nor Gemma 4's per-layer projection
    ("not too big"), nor a hybrid's small convolution kernels (LFM2's, a gated DeltaNet's)."""
    return (len(ggml_dims(shape)) >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name and "per_layer_model_proj" not in name
            and "shortconv.conv.weight" not in name and "ssm_conv1d" not in name)


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):  # (Gemma 4's is one too)
        return "token_embd"
    for key in ("attn_qkv", "attn_v", "attn_k", "attn_q", "attn_output"):
        if f"{key}.weight" in name:
            return key
    for key in ("ffn_up", "ffn_gate", "ffn_down"):
        if key in name:
            return key
    return "other"


@dataclass
class _TypeChooser:
    """Per-tensor choice for one file; `choose` must see the tensors in llama_quantize_order, as
    the attn_v / ffn_down counters promote by position in that order."""

    file_type: str
    n_layer: int
    n_gqa: int            # query heads per KV head
    tied_embeddings: bool
    n_attn_v: int         # attn_v tensors in the file
    n_expert: int = 0     # a mixture's experts per layer (0: dense)
    options: MixOptions = MixOptions()
    has_imatrix: bool = False  # quantized with an importance matrix (some of its entries left)
    i_attn_v: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0

    def choose(self, name: str, shape: tuple[int, ...]) -> T:
        """shape in GGML order (shape[0] = row length). A type given by name is taken as given,
        without a fallback, as llama-quantize takes it."""
        default, cat, o = FILE_TYPES[self.file_type][0], _category(name), self.options
        if not quantizable(name, shape):
            return T.F32
        if cat == "token_embd" and o.token_embedding_type is not None:
            return o.token_embedding_type
        if cat == "output" and o.output_type is not None:
            return o.output_type
        if default in FLOAT_TYPES:
            return default
        return self._fallback(default if o.pure else self._mix(name, shape, default), shape[0])

    def _mix(self, name: str, shape: tuple[int, ...], t: T) -> T:
        ft, cat = self.file_type, _category(name)
        if cat == "output" or (cat == "token_embd" and self.tied_embeddings):
            if self.options.output_type is not None:
                return self.options.output_type
            if ft == "MXFP4_MOE" or shape[0] % GGML_QUANT_SIZES[t][0]:
                return T.Q8_0
            if ft in _LOW_BIT or ft == "IQ3_XXS":
                return T.Q5_K
            return t if t == T.Q8_0 else T.Q6_K
        if ft == "MXFP4_MOE":  # (experts are the 3-D tensors)
            return T.MXFP4 if len(ggml_dims(shape)) > 2 else T.Q8_0
        if cat == "token_embd":
            return {"IQ2_XXS": T.Q2_K, "IQ2_XS": T.Q2_K, "IQ1_S": T.Q2_K, "IQ1_M": T.Q2_K, "IQ2_S": T.IQ3_S,
                    "IQ2_M": T.IQ3_S, "IQ3_XXS": T.IQ3_S, "TQ1_0": T.Q4_K, "TQ2_0": T.Q4_K}.get(ft, t)
        if ft in _LOW_BIT:
            return self._low_bit(cat, t)
        if cat == "attn_k" and self.n_expert == 8:
            return T.Q8_0  # llama.cpp's rule for 8-expert models (Mixtral): "trades just ~128MB"
        if cat in ("attn_k", "attn_q"):
            return {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(ft, t)
        if cat in ("ffn_gate", "ffn_up"):
            i = self._count(cat) if not self.n_expert else _layer(name)
            return T.IQ3_XXS if ft == "IQ3_XS" and self.n_layer // 8 <= i < 7 * self.n_layer // 8 else t
        if cat in ("attn_v", "attn_qkv"):
            i = self.i_attn_v
            self.i_attn_v += 1
            if self.n_expert == 8:
                return T.Q8_0
            if ft == "Q2_K":
                t = T.Q4_K if self.n_gqa >= 4 else T.Q3_K
            elif ft == "IQ3_XXS":
                t = T.Q4_K if self.n_gqa >= 4 else T.IQ3_XXS if self.has_imatrix else T.IQ3_S
            elif ft in ("IQ3_XS", "IQ3_S") and self.n_gqa >= 4 or ft == "IQ3_M":
                t = T.Q4_K
            elif ft == "Q3_K_M":
                t = T.Q5_K if i < 2 else T.Q4_K
            elif ft == "Q3_K_L":
                t = T.Q5_K
            elif ft in ("IQ4_NL", "IQ4_XS") and self.n_gqa >= 4:
                t = T.Q5_K
            elif ft in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, self.n_attn_v):
                t = T.Q6_K
            elif ft == "Q4_K_S" and i < 4:
                t = T.Q5_K
            return t
        if cat == "ffn_down":
            # a mixture's ffn_down tensors (experts, shared expert) count by their layer
            i, n = self.i_ffn_down if not self.n_expert else _layer(name), self.n_layer
            self.i_ffn_down += 1
            if ft == "Q2_K":
                t = T.Q3_K
            elif ft == "IQ3_XXS" and not self.has_imatrix:
                t = T.Q4_K if i < n // 8 else T.Q3_K
            elif ft == "IQ3_M" and (i < n // 8 or self.n_expert == 8 and use_more_bits(i, n)):
                t = T.Q4_K
            elif ft == "Q3_K_M":
                t = T.Q5_K if i < n // 16 else T.Q4_K
            elif ft == "Q3_K_L":
                t = T.Q5_K
            elif ft in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
                t = T.Q6_K
            elif i < n // 8 and (ft == "Q4_K_S" or ft in ("IQ4_NL", "IQ4_XS") and not self.has_imatrix):
                t = T.Q5_K
            elif i < n // 8 and ft in ("Q4_0", "Q5_0") and self.has_imatrix:
                t = T.Q4_1 if ft == "Q4_0" else T.Q5_1
            return t
        if cat == "attn_output":
            if self.n_expert == 8:
                return T.Q5_K if ft in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M", "IQ4_NL", "IQ4_XS", "IQ3_XXS",
                                        "IQ3_XS", "IQ3_S", "IQ3_M") else t
            return {"Q2_K": T.Q3_K, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K, "IQ3_XXS": T.IQ3_S, "IQ3_M": T.Q4_K}.get(ft, t)
        return t

    def _low_bit(self, cat: str, t: T) -> T:
        """The mixes of _LOW_BIT: attn_v, the first eighth of ffn_down and attn_output a type up."""
        ft = self.file_type
        up = T.IQ3_S if ft in ("IQ2_S", "IQ2_M") else T.Q2_K
        if cat in ("attn_v", "attn_qkv"):
            self.i_attn_v += 1
            return T.Q4_K if self.n_gqa >= 4 or self.n_expert >= 4 else up
        if cat == "attn_k" and self.n_expert == 8:
            return T.Q4_K
        if cat == "ffn_down":  # (counted tensor by tensor here, experts too, against the layers)
            i = self._count(cat)
            return up if i < self.n_layer // 8 else t
        if cat == "attn_output":
            if self.n_expert == 8:
                return T.Q5_K
            return {"IQ1_S": T.IQ2_XXS, "IQ1_M": T.IQ2_XXS, "IQ2_S": T.IQ3_S, "IQ2_M": T.IQ3_S}.get(ft, t)
        return t

    def _count(self, cat: str) -> int:
        """The count of `cat` tensors seen before this one (ffn_down, ffn_gate, ffn_up)."""
        i = getattr(self, f"i_{cat}")
        setattr(self, f"i_{cat}", i + 1)
        return i

    @staticmethod
    def _fallback(t: T, n_cols: int) -> T:
        if n_cols % GGML_QUANT_SIZES[t][0] == 0:
            return t
        t = QUANT_TYPES[t].fallback or t
        return t if n_cols % GGML_QUANT_SIZES[t][0] == 0 else T.F16


def _layer(name: str) -> int:
    """The layer of a blk.N. tensor, -1 for the others (sscanf("blk.%d.") in llama.cpp)."""
    m = re.match(r"blk\.(-?\d+)\.", name)
    return int(m.group(1)) if m else -1


def llama_quantize_order(names) -> list[str]:
    """The order llama-quantize walks (and writes) tensors: by layer, the layerless ones first,
    then by name (its loader's weight_name_comparer). Layer 10 comes after 9, not after 1 as in a
    checkpoint's alphabetical order."""
    return sorted(names, key=lambda n: (_layer(n), n))


def mix_types(file_type: str, shapes: dict[str, tuple[int, ...]], n_layer: int, n_head: int,
              n_head_kv: int, n_expert: int = 0, options: MixOptions = MixOptions(),
              has_imatrix: bool = False) -> dict[str, T]:
    """The type of every tensor of a file of `file_type`; shapes in GGML order (row length first);
    has_imatrix: quantized with an importance matrix. ValueError where a type given by name cannot
    hold a tensor's rows."""
    names = llama_quantize_order(shapes)
    # (n_head_kv: layer 0's, as llama.cpp's n_gqa() reads it; 0, and then n_gqa 0, in a hybrid's
    # recurrent layer)
    chooser = _TypeChooser(file_type, n_layer, n_head // n_head_kv if n_head_kv else 0, "output.weight" not in shapes,
                           sum(_category(n) in ("attn_v", "attn_qkv") for n in names), n_expert, options,
                           has_imatrix)
    types = {name: chooser.choose(name, shapes[name]) for name in names}
    for option, t in options.overrides().items():
        for name in names:
            if types[name] == t and shapes[name][0] % GGML_QUANT_SIZES[t][0]:
                raise ValueError(f"{option} {t.name}: {name}'s rows of {shapes[name][0]} weights are not whole "
                                 f"{t.name} blocks of {GGML_QUANT_SIZES[t][0]}")
    return types
