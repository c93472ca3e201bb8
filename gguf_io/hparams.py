"""Model hyperparameters read from `{architecture}.*` metadata keys into one small dataclass: the
shared decoder's, with the defaults its architecture declares (architectures.py)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
from gguf import Keys

from .architectures import ARCHITECTURES
from .errors import GGUFError
from .file import _REQUIRED, U32_MAX, GGUFFile


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
    n_layer_dense_lead: int = 0  # the first layers' feed-forward is dense whatever else the file holds (LFM2-MoE)
    moe_latent_size: int = 0  # the experts' input and output width, projected to and from (Nemotron 3; 0: n_embd)
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
    # hybrids: which layers are recurrent (a state per sequence instead of a KV cache), and LFM2's
    # short convolution's kernel length (0: none)
    recurrent_layers: tuple[bool, ...] = ()
    conv_kernel: int = 0
    # a gated DeltaNet's (Qwen3.5, Qwen3-Next): its convolution's kernel length (0: no such layers),
    # the key heads' size and count (state_size, group_count), the value heads' count
    # (time_step_rank) and their total width (inner_size); a Mamba2 layer's: the same kernel, its
    # state size per head row, B and C's groups, its heads and their total width (d_inner)
    ssm_conv_kernel: int = 0
    ssm_state: int = 0
    ssm_groups: int = 0
    ssm_heads: int = 0
    ssm_inner: int = 0
    rope_finetuned: bool = True  # False: the attention layers apply no RoPE (Granite hybrids' switch)
    # each layer attends and runs its recurrent mixer beside the attention (Falcon-H1): its recurrent
    # layers keep their KV heads
    parallel_mixers: bool = False

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        """Layer i's KV heads: none in a recurrent layer, which keeps a state instead (but beside
        its attention: parallel_mixers)."""
        if self.recurrent(i) and not self.parallel_mixers:
            return 0
        return self.kv_heads_by_layer[i] if self.kv_heads_by_layer else self.n_head_kv

    @property
    def ssm_conv_width(self) -> int:
        """The channels a DeltaNet or Mamba2 layer convolves: x (or V) and two groups' B and C (or Q and K)."""
        return self.ssm_inner + 2 * self.ssm_groups * self.ssm_state

    def layer_head_dim(self, i: int) -> int:
        """Layer i's key (and value) size per head."""
        return self.head_dim_swa if self.head_dim_swa and self.layer_windows[i] else self.head_dim

    def layer_value_dim(self, i: int) -> int:
        return self.head_dim_swa if self.head_dim_swa and self.layer_windows[i] else self.value_dim  # (= keys')

    def layer_rope_dim(self, i: int) -> int:
        return self.rope_dim_swa if self.rope_dim_swa and self.layer_windows[i] else self.rope_dim

    def recurrent(self, i: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[i]

    def attends(self, i: int) -> bool:
        """Whether layer i is an attention layer: neither recurrent (but with its attention beside:
        parallel_mixers) nor without KV heads (Nemotron-H's feed-forward blocks)."""
        return (self.parallel_mixers or not self.recurrent(i)) and self.layer_kv_heads(i) > 0

    def cache_layer(self, i: int) -> int:
        """The KV cache layer that attention layer i attends over: caches are kept for the layers
        with K and V of their own, in order, and not for recurrent layers."""
        source = self.kv_source(i)
        return sum(1 for j in range(source) if self.attends(j) and self.kv_source(j) == j)

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

# Bounds of the sizes a file may declare: llama.cpp's own limits on layers and experts, and widths
# far beyond any model's that still keep every size computed from them small.
MAX_LAYERS = 512
MAX_EXPERTS = 1024
MAX_WIDTH = 1 << 20
MAX_HEADS = 1 << 12

_BLOCK = re.compile(r"blk\.(\d+)\.")


def _block_count(f: GGUFFile, key: str) -> int:
    """The block count, which must name the blocks the file holds tensors of (blk.0 to blk.N-1)."""
    n_layer = f.get_int(key, lo=1, hi=MAX_LAYERS)
    blocks = {int(m[1]) for m in map(_BLOCK.match, f.tensors) if m}
    if blocks and blocks != set(range(n_layer)):
        f.refuse(key, n_layer, f"does not match the file's tensors, of {len(blocks)} blocks "
                               f"(blk.{min(blocks)} to blk.{max(blocks)})")
    return n_layer


def _per_layer(f: GGUFFile, key: str, n_layer: int, default=_REQUIRED, uniform: bool = False,
               hi: int = MAX_WIDTH, lo: int = 1) -> tuple[int, ...]:
    """A count given once or per layer (Gemma 4's KV heads and feed-forward widths): one value per
    layer, each lo..hi; uniform: ggrun needs the same value in every layer."""
    value = f.get(key, default)
    if isinstance(value, np.ndarray):
        values = tuple(int(v) for v in f.get_numbers(key, size=n_layer, integer=True))
    else:
        values = (f.get_int(key, default, lo=min(lo, 1), hi=hi),) * n_layer
    if not all(lo <= v <= hi for v in values):
        f.refuse(key, value, f"must be {lo}..{hi} in every layer")
    if uniform and len(set(values)) > 1:
        f.refuse(key, value, "differs by layer, which ggrun does not support")
    return values


def _sliding_layers(f: GGUFFile, key: str, default: int, n_layer: int) -> tuple[bool, ...]:
    """Which layers slide, from a sliding_window_pattern value as llama.cpp reads it: one flag
    per layer, or a period n (every n-th layer global, the others sliding; 0: all sliding)."""
    if isinstance(f.get(key), np.ndarray):
        return tuple(bool(v) for v in f.get_numbers(key, size=n_layer))
    n = f.get_int(key, default, hi=MAX_LAYERS)
    return tuple(n == 0 or i % n < n - 1 for i in range(n_layer))


def _recurrent_layers(f: GGUFFile, key, n_layer: int, ssm: dict, kv_heads: tuple[int, ...],
                      ff_lengths: tuple[int, ...], parallel: bool) -> tuple[bool, ...]:
    """Which layers of a hybrid with ssm sizes are recurrent: every one where each runs its mixer
    beside its attention (parallel: Falcon-H1), else those of 0 KV heads and no feed-forward width of
    their own (Mamba2 hybrids and plain Mamba2, as llama.cpp reads them; ff_lengths empty: any
    width), else one flag per layer, else every layer but each full_attention_interval-th
    (llama.cpp's default 4: gated-DeltaNet hybrids); with the state's sizes checked."""
    if not (ssm["ssm_state"] and ssm["ssm_groups"] and ssm["ssm_heads"] and ssm["ssm_heads"] % ssm["ssm_groups"] == 0
            and ssm["ssm_inner"] % ssm["ssm_heads"] == 0 and 1 < ssm["ssm_conv_kernel"] <= 64):
        f.refuse(key(Keys.SSM.TIME_STEP_RANK), ssm["ssm_heads"],
                 f"does not fit the other ssm sizes ({', '.join(f'{k} {v}' for k, v in ssm.items())})")
    if parallel:
        return (True,) * n_layer
    if 0 in kv_heads:
        return tuple(k == 0 and not (ff_lengths and ff_lengths[i]) for i, k in enumerate(kv_heads))
    flags = key("{arch}.attention.recurrent_layers")
    if isinstance(f.get(flags), np.ndarray):
        return tuple(bool(v) for v in f.get_numbers(flags, size=n_layer))
    interval = f.get_int(key(Keys.LLM.FULL_ATTENTION_INTERVAL), 4, lo=1, hi=MAX_LAYERS)
    return tuple((i + 1) % interval != 0 for i in range(n_layer))


def _rope_dims(f: GGUFFile, key: str, default: int, head_dim: int, arch) -> int:
    """The dimensions of each head RoPE rotates: even, at most the head size, and all of it unless
    the architecture's graph rotates part of a head (as llama.cpp's graphs assert)."""
    n = f.get_int(key, default)
    if n % 2 or n > head_dim:
        f.refuse(key, n, f"must be even and at most the head size {head_dim}")
    if arch is not None and not arch.partial_rope and n != head_dim:
        f.refuse(key, n, f"must be the head size {head_dim}: {arch.name} rotates whole heads")
    return n


def _check_widths(f: GGUFFile, p: ModelParams, key) -> None:
    """The widths the file declares against its embedding's and first block's tensors (those it
    has), naming the keys whose values do not fit; before the KV cache is sized by them."""
    i, A = 0, Keys.Attention
    widths = (("token_embd.weight", 0, p.n_embd, {Keys.LLM.EMBEDDING_LENGTH: p.n_embd}),
              ("token_embd.weight", 1, p.vocab_size, {Keys.LLM.VOCAB_SIZE: p.vocab_size}),
              (f"blk.{i}.attn_q.weight", 1, p.n_head * p.layer_head_dim(i),
               {A.HEAD_COUNT: p.n_head, A.KEY_LENGTH: p.layer_head_dim(i)}),
              (f"blk.{i}.attn_k.weight", 1, p.layer_kv_heads(i) * p.layer_head_dim(i),
               {A.HEAD_COUNT_KV: p.layer_kv_heads(i), A.KEY_LENGTH: p.layer_head_dim(i)}),
              (f"blk.{i}.attn_v.weight", 1, p.layer_kv_heads(i) * p.layer_value_dim(i),
               {A.HEAD_COUNT_KV: p.layer_kv_heads(i), A.VALUE_LENGTH: p.layer_value_dim(i)}),
              (f"blk.{i}.ffn_down.weight", 0, p.layer_ff(i), {Keys.LLM.FEED_FORWARD_LENGTH: p.layer_ff(i)}))
    for name, axis, want, keys in widths:
        t = f.tensors.get(name)
        if t is not None and len(t.shape) > axis and t.shape[axis] != want:
            values = ", ".join(f"{key(k)} = {v}" for k, v in keys.items())
            verb = "does" if len(keys) == 1 else "do"
            raise GGUFError(f"{f.path.name}: {values} {verb} not fit the tensor {name} of shape {list(t.shape)}")


def _yarn_mscale(factor: float, mul: float = 1.0) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mul * math.log(factor) + 1.0


def read_params(f: GGUFFile) -> ModelParams:
    """The hyperparameters of any architecture's file (info and quantize read those ggrun does not
    run), with the defaults of the options its declaration sets, where ggrun knows it. Each value
    is checked for type and range, and against the tensors' count and the other values, before
    any kernel computes with it: a bad one is a GGUFError that names the key and the value."""
    arch_name = f.architecture
    arch = ARCHITECTURES.get(arch_name)

    def key(k):
        return k.format(arch=arch_name)

    def get_int(k, default=_REQUIRED, lo=0, hi=MAX_WIDTH):
        return f.get_int(key(k), default, lo, hi)

    def get_float(k, default, lo=-math.inf, hi=math.inf, positive=False):
        return f.get_float(key(k), default, lo, hi, positive)

    n_layer = _block_count(f, key(Keys.LLM.BLOCK_COUNT))
    n_embd = get_int(Keys.LLM.EMBEDDING_LENGTH, lo=1)
    # a hybrid's recurrent layers have no KV heads (LFM2's convolutions)
    conv_kernel = get_int(Keys.ShortConv.L_CACHE, 0, hi=64)
    if conv_kernel == 1:
        f.refuse(key(Keys.ShortConv.L_CACHE), conv_kernel, "must be at least 2 (a kernel that sees earlier tokens)")
    ssm = {name: get_int(k, 0) for name, k in (("ssm_conv_kernel", Keys.SSM.CONV_KERNEL),
                                              ("ssm_state", Keys.SSM.STATE_SIZE), ("ssm_groups", Keys.SSM.GROUP_COUNT),
                                              ("ssm_heads", Keys.SSM.TIME_STEP_RANK), ("ssm_inner", Keys.SSM.INNER_SIZE))}
    # (no attention heads at all in a model of Mamba2 layers alone, as llama.cpp's converter writes plain Mamba2)
    n_head = _per_layer(f, key(Keys.Attention.HEAD_COUNT), n_layer, uniform=True, hi=MAX_HEADS,
                        lo=0 if ssm["ssm_conv_kernel"] else 1)[0]
    kv_heads = _per_layer(f, key(Keys.Attention.HEAD_COUNT_KV), n_layer, n_head,
                          lo=0 if conv_kernel or ssm["ssm_conv_kernel"] else 1)
    # (a mixture whose every layer has experts may have no dense width: Qwen3.5-MoE's files; layers
    # that are one block each have none but in their feed-forward blocks: Nemotron-H's)
    separate = bool(arch and arch.separate_blocks)
    if f.get(key(Keys.LLM.FEED_FORWARD_LENGTH)) is None and get_int(Keys.LLM.EXPERT_COUNT, 0, hi=MAX_EXPERTS):
        ff_lengths = (0,) * n_layer
    else:
        ff_lengths = _per_layer(f, key(Keys.LLM.FEED_FORWARD_LENGTH), n_layer, lo=0 if separate else 1)
    parallel = bool(arch and arch.parallel_mixers)
    recurrent_layers = (tuple(k == 0 for k in kv_heads) if conv_kernel else
                        _recurrent_layers(f, key, n_layer, ssm, kv_heads, ff_lengths if separate else (), parallel)
                        if ssm["ssm_conv_kernel"] else ())
    if n_head == 0 and not all(recurrent_layers):
        f.refuse(key(Keys.Attention.HEAD_COUNT), n_head, "leaves the attention layers without heads")
    bad_kv = next((k for k in kv_heads if k and n_head % k), None)
    if bad_kv is not None:
        f.refuse(key(Keys.Attention.HEAD_COUNT_KV), f.get(key(Keys.Attention.HEAD_COUNT_KV)),
                 f"does not divide the {n_head} query heads")
    # (layer 0's where they differ by layer, as llama.cpp's quantizer reads them; an attention
    # layer's in a hybrid)
    n_head_kv, n_ff = next((k for k in kv_heads if k), n_head), ff_lengths[0]
    kv_heads_by_layer = kv_heads if len(set(kv_heads)) > 1 else ()
    ff_by_layer = ff_lengths if len(set(ff_lengths)) > 1 else ()
    if n_head > n_embd and f.get(key(Keys.Attention.KEY_LENGTH)) is None:
        f.refuse(key(Keys.Attention.HEAD_COUNT), n_head, f"is above the embedding length {n_embd}")
    # (none in a model without attention)
    head_dim = get_int(Keys.Attention.KEY_LENGTH, n_embd // n_head, lo=1) if n_head else 0
    value_dim = get_int(Keys.Attention.VALUE_LENGTH, head_dim, lo=1) if n_head else 0
    scaling = f.get_str(key(Keys.Rope.SCALING_TYPE), "none")
    if scaling not in ("none", "linear", "yarn"):
        raise GGUFError(f"{f.path.name}: RoPE scaling {scaling!r} is not supported")
    factor = get_float(Keys.Rope.SCALING_FACTOR, 1.0, lo=0.0) or 1.0
    rope_scale = factor if scaling == "linear" else 1.0
    yarn_factor = factor if scaling == "yarn" else 0.0
    rope_base = get_float(Keys.Rope.FREQ_BASE, 10000.0, positive=True)
    context_length = get_int(Keys.LLM.CONTEXT_LENGTH, 2048, lo=1, hi=U32_MAX)
    rope_orig_context = get_int(Keys.Rope.SCALING_ORIG_CTX_LEN, 0, hi=U32_MAX) or context_length
    if yarn_factor and rope_base <= 1.0:
        f.refuse(key(Keys.Rope.FREQ_BASE), rope_base, "must be above 1 under YaRN scaling")
    # the magnitude RoPE gives the rotated dimensions, as llama.cpp's context derives it
    magnitude = get_float(Keys.Rope.SCALING_ATTN_FACTOR, 1.0, positive=True)
    ext_factor = get_float(Keys.Rope.SCALING_YARN_EXT_FACTOR, -1.0)  # (negative: unset, 1 under YaRN)
    ext_factor = (1.0 if ext_factor < 0 else ext_factor) if yarn_factor else 0.0
    if yarn_factor:
        log_mul = get_float(Keys.Rope.SCALING_YARN_LOG_MUL, 0.0)
        magnitude *= _yarn_mscale(yarn_factor) / (_yarn_mscale(yarn_factor, log_mul) if log_mul else 1.0)
    else:
        magnitude *= get_float(Keys.Rope.SCALING_YARN_ATTN_FACTOR, 1.0, positive=True)
    n_expert = get_int(Keys.LLM.EXPERT_COUNT, 0, hi=MAX_EXPERTS)
    n_expert_used = get_int(Keys.LLM.EXPERT_USED_COUNT, 0, hi=MAX_EXPERTS) if n_expert else 0
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise GGUFError(f"{f.path.name}: {n_expert_used} experts used of {n_expert}")
    n_ff_exp = (get_int(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, 0) or n_ff) if n_expert else 0
    if n_expert and not n_ff_exp:
        raise GGUFError(f"{f.path.name}: neither {key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} nor "
                        f"{key(Keys.LLM.FEED_FORWARD_LENGTH)} gives the experts' width")
    if n_expert and get_int(Keys.LLM.EXPERT_GROUP_COUNT, 0, hi=MAX_EXPERTS) > 1:
        f.refuse(key(Keys.LLM.EXPERT_GROUP_COUNT), f.get(key(Keys.LLM.EXPERT_GROUP_COUNT)),
                 "asks for grouped expert routing, which ggrun does not support")
    gating = get_int(Keys.LLM.EXPERT_GATING_FUNC, arch.expert_gating if arch else 1)
    if gating not in _GATING:
        raise GGUFError(f"{f.path.name}: expert gating function {gating} is not supported")
    n_shared_kv = get_int(Keys.Attention.SHARED_KV_LAYERS, 0, hi=n_layer - 1)
    head_dim_swa = get_int(Keys.Attention.KEY_LENGTH_SWA, 0)
    if get_int(Keys.Attention.VALUE_LENGTH_SWA, head_dim_swa) != head_dim_swa:
        raise GGUFError(f"{f.path.name}: sliding layers whose keys and values differ in size are not supported")
    n_tokens = len(f.get_strings(Keys.Tokenizer.LIST)) if f.get(Keys.Tokenizer.LIST) is not None else None
    vocab = get_int(Keys.LLM.VOCAB_SIZE, n_tokens if n_tokens is not None else 0, hi=U32_MAX)
    if n_tokens is not None and vocab != n_tokens:
        f.refuse(key(Keys.LLM.VOCAB_SIZE), vocab, f"does not match the tokenizer's {n_tokens} tokens")
    # (only where the architecture's graph has sliding layers: llama.cpp ignores the key elsewhere)
    slides = arch is not None and arch.swa_pattern is not None
    params = ModelParams(
        arch=arch_name, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim,
        value_dim=value_dim,
        rope_dim=_rope_dims(f, key(Keys.Rope.DIMENSION_COUNT), head_dim, head_dim, arch),
        rope_base=rope_base,
        rope_scale=rope_scale,
        rope_attn_factor=magnitude,
        rope_orig_context=rope_orig_context,
        # (Nemotron-H's files give it as the LayerNorm epsilon, which llama.cpp falls back on)
        rms_eps=get_float(Keys.Attention.LAYERNORM_RMS_EPS,
                          get_float(Keys.Attention.LAYERNORM_EPS, 1e-5, lo=0.0, hi=1.0), lo=0.0, hi=1.0),
        context_length=context_length,
        vocab_size=vocab,
        sliding_window=get_int(Keys.Attention.SLIDING_WINDOW, 0, hi=U32_MAX) if slides else 0,
        swa_layers=_sliding_layers(f, key(Keys.Attention.SLIDING_WINDOW_PATTERN), arch and arch.swa_pattern or 0,
                                   n_layer),
        rope_base_swa=get_float(Keys.Rope.FREQ_BASE_SWA, arch and arch.rope_base_swa or rope_base, positive=True),
        logit_softcap=get_float(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, arch.softcap_defaults[0] if arch else 0.0, lo=0.0),
        attn_softcap=get_float(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, arch.softcap_defaults[1] if arch else 0.0, lo=0.0),
        n_expert=n_expert, n_expert_used=n_expert_used, n_ff_exp=n_ff_exp,
        n_ff_shexp=get_int(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, n_ff_exp),
        n_layer_dense_lead=get_int(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0, hi=n_layer),
        moe_latent_size=get_int(Keys.LLM.MOE_LATENT_SIZE, 0) if n_expert else 0,
        expert_gating=_GATING[gating],
        expert_weights_norm=f.get_bool(key(Keys.LLM.EXPERT_WEIGHTS_NORM), arch.expert_weights_norm if arch else False),
        expert_weights_scale=get_float(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0) or 1.0,
        embedding_scale=get_float(Keys.LLM.EMBEDDING_SCALE, 0.0),
        residual_scale=get_float(Keys.LLM.RESIDUAL_SCALE, 0.0),
        yarn_factor=yarn_factor,
        yarn_beta_fast=get_float(Keys.Rope.SCALING_YARN_BETA_FAST, 32.0, positive=True),
        yarn_beta_slow=get_float(Keys.Rope.SCALING_YARN_BETA_SLOW, 1.0, positive=True),
        yarn_ext_factor=ext_factor,
        attn_temp_scale=get_float(Keys.Attention.TEMPERATURE_SCALE, 0.0, lo=0.0),
        attention_scale=get_float(Keys.Attention.SCALE, 0.0) or (
            1.0 / math.sqrt(n_embd // n_head) if arch and n_layer == arch.wide_query_scale_layers else 0.0),
        logit_scale=get_float(Keys.LLM.LOGIT_SCALE, 0.0),
        head_dim_swa=head_dim_swa,
        rope_dim_swa=_rope_dims(f, key(Keys.Rope.DIMENSION_COUNT_SWA), 0, head_dim_swa or head_dim, None),
        kv_heads_by_layer=kv_heads_by_layer,
        ff_by_layer=ff_by_layer,
        n_layer_kv=n_layer - n_shared_kv if n_shared_kv else 0,
        n_embd_per_layer=get_int(Keys.LLM.EMBD_LENGTH_PER_LAYER_INP, 0),
        recurrent_layers=recurrent_layers,
        conv_kernel=conv_kernel,
        rope_finetuned=f.get_bool(key(Keys.Rope.SCALING_FINETUNED), True),
        parallel_mixers=parallel,
        **ssm,
    )
    _check_widths(f, params, key)
    orphan = next((i for i in range(n_layer) if params.kv_source(i) < 0), None)
    if orphan is not None:
        f.refuse(key(Keys.Attention.SHARED_KV_LAYERS), n_shared_kv,
                 f"leaves layer {orphan} no earlier layer of its kind to share a cache with")
    return params
