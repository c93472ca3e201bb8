"""Model hyperparameters read from `{architecture}.*` metadata keys into one small dataclass: the
shared decoder's, with the defaults its architecture declares (architectures.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from gguf import Keys

from .architectures import ARCHITECTURES
from .errors import GGUFError
from .file import GGUFFile


@dataclass(frozen=True)
class ModelParams:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int          # key length per head; independent of n_embd (Gemma)
    value_dim: int
    rope_dim: int          # leading dimensions of each head that RoPE rotates
    rope_base: float
    rope_scale: float      # linear position scaling: positions are divided by this
    rope_attn_factor: float  # RoPE's magnitude scaling of the rotated dimensions (LongRoPE's and YaRN's)
    rope_orig_context: int   # the context the model was trained at before RoPE scaling
    rms_eps: float
    context_length: int
    vocab_size: int
    sliding_window: int    # 0: no sliding-window layers
    swa_layers: tuple[bool, ...]  # per layer: whether it slides (where sliding_window > 0)
    rope_base_swa: float   # RoPE base of sliding-window layers
    logit_softcap: float   # 0: none
    attn_softcap: float    # 0: none
    # mixtures of experts (n_expert 0: a dense model)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0      # hidden size of one expert
    n_ff_shexp: int = 0    # hidden size of the shared expert (Qwen2-MoE)
    expert_gating: str = "softmax"  # router logits -> weights: "softmax", "sigmoid" or "softmax_weight"
    expert_weights_norm: bool = False  # renormalize the chosen experts' probabilities to sum to 1
    expert_weights_scale: float = 1.0
    # YaRN (yarn_factor 0: none): frequencies between interpolation by the factor and extrapolation,
    # ramped over the dimensions between the beta_fast and beta_slow rotation counts
    yarn_factor: float = 0.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_ext_factor: float = 1.0
    attn_temp_scale: float = 0.0  # Llama 4's query temperature per position (Ministral 3; 0: none)
    # Granite's multipliers (0: none; attention_scale 0: 1 / sqrt(head_dim); Gemma's query scale is one)
    embedding_scale: float = 0.0
    residual_scale: float = 0.0
    attention_scale: float = 0.0
    logit_scale: float = 0.0
    # Gemma 4: the sliding layers' head size and rotated dimensions (0: the global layers'); KV heads
    # and feed-forward widths that differ by layer (empty: n_head_kv, n_ff in every layer); layers
    # that attend over an earlier layer's cache (the last n_layer - n_layer_kv); per-layer token
    # embeddings of this width (0: none)
    head_dim_swa: int = 0
    rope_dim_swa: int = 0
    kv_heads_by_layer: tuple[int, ...] = ()
    ff_by_layer: tuple[int, ...] = ()
    n_layer_kv: int = 0
    n_embd_per_layer: int = 0

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        return self.kv_heads_by_layer[i] if self.kv_heads_by_layer else self.n_head_kv

    def layer_head_dim(self, i: int) -> int:
        """Layer i's key (and value) size per head."""
        return self.head_dim_swa if self.head_dim_swa and self.layer_windows[i] else self.head_dim

    def layer_value_dim(self, i: int) -> int:
        return self.head_dim_swa if self.head_dim_swa and self.layer_windows[i] else self.value_dim  # (= keys')

    def layer_rope_dim(self, i: int) -> int:
        return self.rope_dim_swa if self.rope_dim_swa and self.layer_windows[i] else self.rope_dim

    def layer_ff(self, i: int) -> int:
        return self.ff_by_layer[i] if self.ff_by_layer else self.n_ff

    def kv_source(self, i: int) -> int:
        """The layer whose cache layer i attends over: its own, or for the last n_layer - n_layer_kv
        layers the last layer with a cache of its own of the same kind (sliding or global; -1: none)."""
        if not self.n_layer_kv or i < self.n_layer_kv:
            return i
        slides = bool(self.layer_windows[i])
        return max((j for j in range(self.n_layer_kv) if bool(self.layer_windows[j]) == slides), default=-1)

    @property
    def layer_windows(self) -> list[int]:
        """Each layer's sliding window (0: global attention)."""
        if self.sliding_window <= 0:
            return [0] * self.n_layer
        return [self.sliding_window if slides else 0 for slides in self.swa_layers]


# gguf's ExpertGatingFuncType, and llama.cpp's own 3 (the softmax over the chosen experts' logits)
_GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


def _int_array_or_scalar(value, n_layer: int, key: str) -> int:
    """Per-layer counts may be arrays; ggrun needs them uniform (true of every supported model)."""
    if isinstance(value, np.ndarray):
        if value.size != n_layer or np.any(value != value[0]):
            raise GGUFError(f"per-layer {key} values {value.tolist()} are not supported")
        return int(value[0])
    return int(value)


def _per_layer(value, n_layer: int, key: str) -> tuple[int, ...]:
    """A count given per layer (Gemma 4's KV heads and feed-forward widths), as a tuple; () where
    it is one number, or the same in every layer."""
    if not isinstance(value, np.ndarray) or (value.size and np.all(value == value[0])):
        return ()
    if value.size != n_layer or value.min() <= 0:
        raise GGUFError(f"per-layer {key} values {value.tolist()} do not fit {n_layer} layers")
    return tuple(int(v) for v in value)


def _sliding_layers(value, n_layer: int, where: str) -> tuple[bool, ...]:
    """Which layers slide, from a sliding_window_pattern value as llama.cpp reads it: one flag
    per layer, or a period n (every n-th layer global, the others sliding; 0: all sliding)."""
    if isinstance(value, np.ndarray):
        if value.size != n_layer:
            raise GGUFError(f"{where}: sliding_window_pattern has {value.size} entries for {n_layer} layers")
        return tuple(bool(v) for v in value)
    n = int(value)
    return tuple(n == 0 or i % n < n - 1 for i in range(n_layer))


def _yarn_mscale(factor: float, mul: float = 1.0) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mul * math.log(factor) + 1.0


def read_params(f: GGUFFile) -> ModelParams:
    """The hyperparameters of any architecture's file (info and quantize read those ggrun does not
    run), with the defaults of the options its declaration sets, where ggrun knows it."""
    arch_name = f.architecture
    arch = ARCHITECTURES.get(arch_name)

    def get(key, default=None):
        return f.get(key.format(arch=arch_name), default)

    def need(key):
        value = get(key)
        if value is None:
            raise GGUFError(f"{f.path.name}: metadata key {key.format(arch=arch_name)!r} is missing")
        return value

    n_layer = int(need(Keys.LLM.BLOCK_COUNT))
    n_embd = int(need(Keys.LLM.EMBEDDING_LENGTH))
    n_head = _int_array_or_scalar(need(Keys.Attention.HEAD_COUNT), n_layer, "head_count")
    kv_heads, ff_lengths = get(Keys.Attention.HEAD_COUNT_KV, n_head), need(Keys.LLM.FEED_FORWARD_LENGTH)
    kv_heads_by_layer = _per_layer(kv_heads, n_layer, "head_count_kv")
    ff_by_layer = _per_layer(ff_lengths, n_layer, "feed_forward_length")
    # (layer 0's where they differ by layer, as llama.cpp's quantizer reads them)
    n_head_kv = kv_heads_by_layer[0] if kv_heads_by_layer else _int_array_or_scalar(kv_heads, n_layer, "head_count_kv")
    n_ff = ff_by_layer[0] if ff_by_layer else _int_array_or_scalar(ff_lengths, n_layer, "feed_forward_length")
    if (min(n_layer, n_embd, n_head, n_head_kv, n_ff) <= 0 or n_head % n_head_kv
            or any(n_head % k for k in kv_heads_by_layer)):
        raise GGUFError(f"{f.path.name}: inconsistent hyperparameters (layers {n_layer}, width {n_embd}, "
                        f"heads {n_head}/{n_head_kv}, ffn {n_ff})")
    head_dim = int(get(Keys.Attention.KEY_LENGTH, n_embd // n_head))
    scaling = get(Keys.Rope.SCALING_TYPE, "none")
    if scaling not in ("none", "linear", "yarn"):
        raise GGUFError(f"{f.path.name}: RoPE scaling {scaling!r} is not supported")
    factor = float(get(Keys.Rope.SCALING_FACTOR, 1.0)) or 1.0
    rope_scale = factor if scaling == "linear" else 1.0
    yarn_factor = factor if scaling == "yarn" else 0.0
    # the magnitude RoPE gives the rotated dimensions, as llama.cpp's context derives it
    magnitude = float(get(Keys.Rope.SCALING_ATTN_FACTOR, 1.0))
    ext_factor = float(get(Keys.Rope.SCALING_YARN_EXT_FACTOR, -1.0))  # (negative: unset, 1 under YaRN)
    ext_factor = (1.0 if ext_factor < 0 else ext_factor) if yarn_factor else 0.0
    if yarn_factor:
        log_mul = float(get(Keys.Rope.SCALING_YARN_LOG_MUL, 0.0))
        magnitude *= _yarn_mscale(yarn_factor) / (_yarn_mscale(yarn_factor, log_mul) if log_mul else 1.0)
    else:
        magnitude *= float(get(Keys.Rope.SCALING_YARN_ATTN_FACTOR, 1.0))
    rope_base = float(get(Keys.Rope.FREQ_BASE, 10000.0))
    n_expert = int(get(Keys.LLM.EXPERT_COUNT, 0))
    n_expert_used = int(get(Keys.LLM.EXPERT_USED_COUNT, 0)) if n_expert else 0
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise GGUFError(f"{f.path.name}: {n_expert_used} experts used of {n_expert}")
    n_ff_exp = (int(get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, 0)) or n_ff) if n_expert else 0
    gating = int(get(Keys.LLM.EXPERT_GATING_FUNC, arch.expert_gating if arch else 1))
    if gating not in _GATING:
        raise GGUFError(f"{f.path.name}: expert gating function {gating} is not supported")
    n_shared_kv = int(get(Keys.Attention.SHARED_KV_LAYERS, 0))
    if not 0 <= n_shared_kv < n_layer:
        raise GGUFError(f"{f.path.name}: {n_shared_kv} layers sharing KV of {n_layer}")
    head_dim_swa = int(get(Keys.Attention.KEY_LENGTH_SWA, 0))
    if int(get(Keys.Attention.VALUE_LENGTH_SWA, head_dim_swa)) != head_dim_swa:
        raise GGUFError(f"{f.path.name}: sliding layers whose keys and values differ in size are not supported")
    context_length = int(get(Keys.LLM.CONTEXT_LENGTH, 2048))
    vocab = get(Keys.LLM.VOCAB_SIZE)
    if vocab is None:
        tokens = f.get(Keys.Tokenizer.LIST)
        vocab = len(tokens) if tokens is not None else 0
    return ModelParams(
        arch=arch_name, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim,
        value_dim=int(get(Keys.Attention.VALUE_LENGTH, head_dim)),
        rope_dim=int(get(Keys.Rope.DIMENSION_COUNT, head_dim)),
        rope_base=rope_base,
        rope_scale=rope_scale,
        rope_attn_factor=magnitude,
        rope_orig_context=int(get(Keys.Rope.SCALING_ORIG_CTX_LEN, 0)) or context_length,
        rms_eps=float(get(Keys.Attention.LAYERNORM_RMS_EPS, 1e-5)),
        context_length=context_length,
        vocab_size=int(vocab),
        # (only where the architecture's graph has sliding layers: llama.cpp ignores the key elsewhere)
        sliding_window=int(get(Keys.Attention.SLIDING_WINDOW, 0)) if arch and arch.swa_pattern is not None else 0,
        swa_layers=_sliding_layers(get(Keys.Attention.SLIDING_WINDOW_PATTERN, arch and arch.swa_pattern or 0),
                                   n_layer, f.path.name),
        rope_base_swa=float(get(Keys.Rope.FREQ_BASE_SWA, arch and arch.rope_base_swa or rope_base)),
        logit_softcap=float(get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, arch.softcap_defaults[0] if arch else 0.0)),
        attn_softcap=float(get(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, arch.softcap_defaults[1] if arch else 0.0)),
        n_expert=n_expert, n_expert_used=n_expert_used, n_ff_exp=n_ff_exp,
        n_ff_shexp=int(get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, n_ff_exp)),
        expert_gating=_GATING[gating],
        expert_weights_norm=bool(get(Keys.LLM.EXPERT_WEIGHTS_NORM, arch.expert_weights_norm if arch else False)),
        expert_weights_scale=float(get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0)) or 1.0,
        embedding_scale=float(get(Keys.LLM.EMBEDDING_SCALE, 0.0)),
        residual_scale=float(get(Keys.LLM.RESIDUAL_SCALE, 0.0)),
        yarn_factor=yarn_factor,
        yarn_beta_fast=float(get(Keys.Rope.SCALING_YARN_BETA_FAST, 32.0)),
        yarn_beta_slow=float(get(Keys.Rope.SCALING_YARN_BETA_SLOW, 1.0)),
        yarn_ext_factor=ext_factor,
        attn_temp_scale=float(get(Keys.Attention.TEMPERATURE_SCALE, 0.0)),
        attention_scale=float(get(Keys.Attention.SCALE, 0.0)) or (
            1.0 / math.sqrt(n_embd // n_head) if arch and n_layer == arch.wide_query_scale_layers else 0.0),
        logit_scale=float(get(Keys.LLM.LOGIT_SCALE, 0.0)),
        head_dim_swa=head_dim_swa,
        rope_dim_swa=int(get(Keys.Rope.DIMENSION_COUNT_SWA, 0)),
        kv_heads_by_layer=kv_heads_by_layer,
        ff_by_layer=ff_by_layer,
        n_layer_kv=n_layer - n_shared_kv if n_shared_kv else 0,
        n_embd_per_layer=int(get(Keys.LLM.EMBD_LENGTH_PER_LAYER_INP, 0)),
    )
