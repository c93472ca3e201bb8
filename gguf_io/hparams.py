"""Model hyperparameters read from `{architecture}.*` metadata keys into one small dataclass."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    rms_eps: float
    context_length: int
    vocab_size: int
    sliding_window: int    # 0: no sliding-window layers
    swa_pattern: int       # every swa_pattern-th layer is global; 0: the architecture's default
    rope_base_swa: float   # RoPE base of sliding-window layers; 0: the architecture's default
    logit_softcap: float   # 0: none
    attn_softcap: float    # 0: none

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def _int_array_or_scalar(value, n_layer: int, key: str) -> int:
    """Per-layer counts may be arrays; ggrun needs them uniform (true of every supported model)."""
    if isinstance(value, np.ndarray):
        if value.size != n_layer or np.any(value != value[0]):
            raise GGUFError(f"per-layer {key} values {value.tolist()} are not supported")
        return int(value[0])
    return int(value)


def read_params(f: GGUFFile) -> ModelParams:
    arch = f.architecture

    def key(name):
        return f"{arch}.{name}"

    def need(name):
        value = f.get(key(name))
        if value is None:
            raise GGUFError(f"{f.path.name}: metadata key {key(name)!r} is missing")
        return value

    n_layer = int(need("block_count"))
    n_embd = int(need("embedding_length"))
    n_head = _int_array_or_scalar(need("attention.head_count"), n_layer, "head_count")
    n_head_kv = _int_array_or_scalar(f.get(key("attention.head_count_kv"), n_head), n_layer, "head_count_kv")
    n_ff = _int_array_or_scalar(need("feed_forward_length"), n_layer, "feed_forward_length")
    if min(n_layer, n_embd, n_head, n_head_kv, n_ff) <= 0 or n_head % n_head_kv:
        raise GGUFError(f"{f.path.name}: inconsistent hyperparameters (layers {n_layer}, width {n_embd}, "
                        f"heads {n_head}/{n_head_kv}, ffn {n_ff})")
    head_dim = int(f.get(key("attention.key_length"), n_embd // n_head))
    scaling = f.get(key("rope.scaling.type"), "none")
    if scaling not in ("none", "linear"):
        raise GGUFError(f"{f.path.name}: RoPE scaling {scaling!r} is not supported")
    rope_scale = float(f.get(key("rope.scaling.factor"), 1.0)) if scaling == "linear" else 1.0
    vocab = f.get(key("vocab_size"))
    if vocab is None:
        tokens = f.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else 0
    return ModelParams(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim,
        value_dim=int(f.get(key("attention.value_length"), head_dim)),
        rope_dim=int(f.get(key("rope.dimension_count"), head_dim)),
        rope_base=float(f.get(key("rope.freq_base"), 10000.0)),
        rope_scale=rope_scale or 1.0,
        rms_eps=float(f.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
        context_length=int(f.get(key("context_length"), 2048)),
        vocab_size=int(vocab),
        sliding_window=int(f.get(key("attention.sliding_window"), 0)),
        swa_pattern=int(f.get(key("attention.sliding_window_pattern"), 0)),
        rope_base_swa=float(f.get(key("rope.freq_base_swa"), 0.0)),
        logit_softcap=float(f.get(key("final_logit_softcapping"), 0.0)),
        attn_softcap=float(f.get(key("attn_logit_softcapping"), 0.0)),
    )
