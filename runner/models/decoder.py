"""What every decoder-only architecture shares: embedding, blocks of attention over the KV cache
and a gated feed-forward (dense or a mixture of experts), each branch normalized before, after or
on both sides, output.

An architecture subclasses Decoder and declares how it differs, as class attributes here and in
its gguf_io.architectures entry (hyperparameter defaults, tensor names, conversion); a block
that these declarations cannot describe would override `block`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np
from gguf import MODEL_TENSOR as T

from gguf_io import ModelParams
from runner.engine.kv_cache import Batch, KVCache
from runner.engine.kv_pool import KVPool, SequenceCache, lanes_memory
from runner.engine.recurrent_state import RecurrentState
from runner.engine.weights import WeightLoader

# Tokens per forward pass: longer prompts are run in slices of this size (llama.cpp's ubatch).
MAX_BATCH = 512


@dataclass
class Attention:
    wq: object             # (None where the file holds Q, K and V as one matrix: wqkv)
    wk: object
    wv: object
    wo: object
    wqkv: object = None
    q_norm: object = None  # per-head RMSNorm of queries and keys (Gemma 3, Qwen 3)
    k_norm: object = None
    bq: object = None      # projection biases (Qwen 2: Q, K, V; gpt-oss: all four)
    bk: object = None
    bv: object = None
    bo: object = None
    sinks: object = None   # a logit per head that joins its softmax without a value (gpt-oss)
    value_norm: object = None  # a weightless RMSNorm of each value head, as ones (Gemma 4)
    rope_base: float = 10000.0
    rope_scale: float = 1.0
    rotates: bool = True   # False: the layer attends without RoPE (NoPE layers)
    window: int = 0        # sliding window in positions; 0 attends to the whole context
    # the layer's heads, which may differ by layer (Gemma 4), and its rotation
    n_kv_head: int = 0
    head_dim: int = 0      # of queries and keys
    value_dim: int = 0
    rope_dim: int = 0
    rope_factors: tuple = (None, None)  # RoPE frequency divisors within and past the trained context
    kv_layer: int = 0      # the cache layer it attends over: its own, or an earlier layer's (Gemma 4)


@dataclass
class FeedForward:
    """A dense gated feed-forward: down(act(gate x) * up x); where gate is None, up holds both,
    gate rows first (Phi-3, GLM-4), or, in a model whose feed-forwards have no gate, up alone:
    down(act(up x)) (Nemotron-H)."""
    gate: object
    up: object
    down: object


@dataclass
class MixtureOfExperts:
    """A feed-forward of experts: a router picks each token's n_expert_used experts, whose
    outputs are summed by their routing weights; plus, where the file has one, a shared expert
    every token goes through (scaled by a sigmoid gate where it has one: Qwen2-MoE)."""
    router: object            # n_embd -> n_expert logits
    gate: object              # the experts' stacked matrices (backend.load_experts)
    up: object
    down: object
    shared: FeedForward | None = None
    shared_gate: object = None  # n_embd -> 1
    # biases (gpt-oss): the router's (n_expert,), and each expert's rows of the others' (n_expert, n)
    router_bias: object = None
    gate_bias: object = None
    up_bias: object = None
    down_bias: object = None
    expert_scales: object = None  # (n_expert, 1): each expert's output scaled by its own factor (Gemma 4)
    selection_bias: object = None  # (n_expert,): added to the probabilities to choose experts by, not to weigh them
    # the experts' input projected to their width and their sum back (Nemotron 3's latent projections)
    latent_down: object = None  # n_embd -> moe_latent_size
    latent_up: object = None    # moe_latent_size -> n_embd


@dataclass
class Layer:
    """One block's weights. Its branches' norms (RMSNorm; None where the architecture has none):
    before attention and the feed-forward (the Llama family), on their outputs before these join
    the residual stream (OLMo 2, EXAONE 4), or both (Gemma 2 and 3, GLM-4). A hybrid's recurrent
    layer has its model's recurrent block where the others have attention, or beside it (mixer:
    Falcon-H1's, on the same normed input)."""
    attn: Attention | object
    ffn: FeedForward | MixtureOfExperts | None
    attn_norm: object = None
    ffn_norm: object = None
    post_attn_norm: object = None
    post_ffn_norm: object = None
    mixer: object = None


@dataclass(frozen=True)
class Lanes:
    """Several sequences in one forward pass, each with its own cache: lane j's tokens are rows
    starts[j]:starts[j + 1] of the pass, run against caches[j] with the batch that cache reserved.
    Every row but attention's goes through the weights together; attention is each lane's own."""
    caches: tuple
    batches: tuple
    starts: tuple
    shared: bool  # whether the caches share their buffers (a pool's sequences: attention in one call)

    def rows(self):
        """(rows, batch, cache) of each lane."""
        return [(slice(a, b), batch, cache)
                for a, b, batch, cache in zip(self.starts, self.starts[1:], self.batches, self.caches)]


# Attention's optional tensors: field -> (tensor, suffix)
_ATTENTION_EXTRAS = {"bq": (T.ATTN_Q, "bias"), "bk": (T.ATTN_K, "bias"), "bv": (T.ATTN_V, "bias"),
                     "bo": (T.ATTN_OUT, "bias"), "q_norm": (T.ATTN_Q_NORM, "weight"),
                     "k_norm": (T.ATTN_K_NORM, "weight"), "sinks": (T.ATTN_SINKS, "weight")}
_KEY_VALUE_EXTRAS = ("bk", "bv", "k_norm")


def yarn_frequency_factors(p: ModelParams) -> np.ndarray:
    """YaRN as divisors of RoPE's frequencies (one per rotated pair), as ggml's rope computes it:
    interpolated (divided by the factor) below the dimensions that turn beta_slow times over the
    original context, extrapolated (unchanged) above those that turn beta_fast times, ramped between."""
    def dimension(rotations):
        return p.rope_dim * math.log(p.rope_orig_context / (rotations * 2 * math.pi)) / (2 * math.log(p.rope_base))
    low = max(0.0, math.floor(dimension(p.yarn_beta_fast)))
    high = min(p.rope_dim - 1.0, math.ceil(dimension(p.yarn_beta_slow)))
    ramp = 1 - np.clip((np.arange(p.rope_dim // 2) - low) / max(0.001, high - low), 0, 1)
    mix = ramp * p.yarn_ext_factor
    return (1 / ((1 - mix) / p.yarn_factor + mix)).astype(np.float32)


def _no_rotation(x, positions) -> None:
    """The rotation of a layer without positional encoding."""


class Decoder:
    pre_norms = True        # RMSNorm before attention and before the feed-forward
    post_norms = False      # RMSNorm on each branch's output, before it joins the residual stream
    ffn_norm_tensor = T.FFN_NORM  # the pre-feed-forward norm (gguf names it differently by architecture)
    output_norm_tensor = T.OUTPUT_NORM  # the final norm (LFM2's is token_embd_norm)
    rope_neox = False       # rotary pairing: (i, i + d/2) when True, (2i, 2i + 1) when False
    embed_scale = False     # multiply embeddings by sqrt(hidden size)
    extra_attention_tensors: tuple[str, ...] = ()  # required, of _ATTENTION_EXTRAS' ("bq", "q_norm", ...)
    qk_norm_per_head = True  # the Q/K norms normalize each head; else the whole projection (OLMoE, OLMo 2)
    nope_interval = 0       # every nope_interval-th layer attends without RoPE (SmolLM3's NoPE layers); 0: none
    nope_global_layers = False  # where some layers slide, the global ones attend without RoPE (EXAONE 4)
    # of the feed-forward's gate: "silu" (SwiGLU), "gelu" (GeGLU) or "clamped_swiglu" (gpt-oss's,
    # with swiglu_clamp's (alpha, limit))
    gated_activation = "silu"
    swiglu_clamp = (1.702, 7.0)
    # the feed-forwards (experts and shared expert too) have no gate: down(act(up x)), act this
    # backend.unary kind (Nemotron-H's "relu_sqr"); None: they are gated
    ungated_activation: str | None = None
    fused_gate_up = False   # the dense feed-forward's gate and up are one matrix, ffn_up (Phi-3, GLM-4)
    kv_type: str            # KV cache precision of new caches (load.LoadOptions sets it)
    value_norm = False      # RMSNorm (without weight) on each value head (Gemma 4)
    values_from_keys = False  # a layer without V attends over its K projection as values too (Gemma 4)
    query_scale = 0.0       # the scores' scale whatever the file says (Gemma 4's 1; 0: the file's, or 1/sqrt(head))
    # each query head comes with a gate of its output, sigmoid(gate) * out, projected beside it
    # (Qwen3.5, Qwen3-Next: per head, the query's head_dim rows, then the gate's)
    output_gate = False
    # every mixture layer has an expert selection bias, exp_probs_b (else used where the file has one)
    expert_selection_bias = False

    def __init__(self, params: ModelParams, weights: WeightLoader, backend):
        self.params, self.backend = params, backend
        p = params
        # (an embedding that is not also the output is only looked up: a table, read in place)
        untied = weights.has(T.OUTPUT)
        self.tok_embd = (weights.table if untied else weights.matrix)(T.TOKEN_EMBD, p.n_embd, p.vocab_size)
        self.output_norm = weights.vector(self.output_norm_tensor, p.n_embd)
        self.output = weights.matrix(T.OUTPUT, p.n_embd, p.vocab_size) if untied else self.tok_embd
        # RoPE frequency factors, by whether the context is longer than the trained one: one table
        # for both (Llama 3's), or LongRoPE's short and long tables (Phi-3), or none
        freqs = weights.optional_vector(T.ROPE_FREQS, p.rope_dim // 2)
        short, long = (weights.optional_vector(t, p.rope_dim // 2) for t in (T.ROPE_FACTORS_SHORT, T.ROPE_FACTORS_LONG))
        self.rope_factors = (freqs, freqs) if freqs is not None or long is None else (short, long)
        if p.yarn_factor:  # (YaRN's interpolation is a factor per frequency too)
            yarn = backend.asarray(yarn_frequency_factors(p))
            self.rope_factors = tuple(yarn if f is None else f * yarn for f in self.rope_factors)
        self._ones = {}  # (the weight of weightless norms, by width)
        self.layers = [self.load_layer(weights, i) for i in range(p.n_layer)]
        # the attention layers with K and V of their own, in the order of their cache layers
        self.cache_owners = [layer.attn for i, layer in enumerate(self.layers)
                             if p.attends(i) and p.kv_source(i) == i]

    def load_layer(self, weights: WeightLoader, i: int) -> Layer:
        n = self.params.n_embd

        def norm(tensor, present: bool):
            return weights.vector(tensor, n, i) if present else None
        mixer = self.load_recurrent(weights, i) if self.params.recurrent(i) else self.load_attention(weights, i)
        return Layer(mixer, self.load_feed_forward(weights, i),
                     attn_norm=norm(T.ATTN_NORM, self.pre_norms), ffn_norm=norm(self.ffn_norm_tensor, self.pre_norms),
                     post_attn_norm=norm(T.ATTN_POST_NORM, self.post_norms),
                     post_ffn_norm=norm(T.FFN_POST_NORM, self.post_norms))

    def load_recurrent(self, weights: WeightLoader, i: int):
        """A hybrid's recurrent layer i's block (its model file says what it is)."""
        raise NotImplementedError(f"{self.params.arch} has no recurrent layers")

    def block(self, layer: Layer, x, batch: Batch, cache: KVCache, i: int):
        h = self.norm(x, layer.attn_norm)
        if self.params.recurrent(i):
            a = self.recurrent(layer.attn, h, cache, i)
        else:
            a = self.attention(layer.attn, h, batch, cache, i)
        x = x + self.branch(a, layer.post_attn_norm)
        return x + self.branch(self.feed_forward_branch(layer, x), layer.post_ffn_norm)

    def feed_forward_branch(self, layer: Layer, x):
        """The feed-forward of the residual stream x, before its post-norm."""
        return self.feed_forward(layer.ffn, self.norm(x, layer.ffn_norm))

    def norm(self, x, weight):
        return x if weight is None else self.backend.rms_norm(x, weight, self.params.rms_eps)

    def branch(self, y, post_norm):
        """A branch's output as it joins the residual stream: normalized where the block has
        post-norms, scaled where the file gives a residual multiplier (Granite)."""
        y = self.norm(y, post_norm)
        return y * np.float32(self.params.residual_scale) if self.params.residual_scale else y

    def query_temperature(self, positions):
        """Llama 4's attention temperature (Ministral 3): each query scaled by
        1 + scale * ln(1 + floor(position / original context)); None where that is 1 for all."""
        p = self.params
        if not p.attn_temp_scale or positions.max() < p.rope_orig_context:
            return None
        return (1 + p.attn_temp_scale * np.log1p(np.floor(positions / p.rope_orig_context))).astype(np.float32)

    def rotates(self, i: int) -> bool:
        """Whether layer i applies RoPE (not on NoPE layers); read once, into its Attention."""
        if self.nope_interval and (i + 1) % self.nope_interval == 0:
            return False
        return not (self.nope_global_layers and self.params.layer_windows[i] == 0 and any(self.params.layer_windows))

    def load_attention(self, weights: WeightLoader, i: int) -> Attention:
        """Layer i's attention, with the extras the architecture declares, at its sliding window
        (and the sliding layers' RoPE base) where it has one."""
        p = self.params
        n_kv, head_dim, value_dim = p.layer_kv_heads(i), p.layer_head_dim(i), p.layer_value_dim(i)
        q_dim, kv_dim, v_dim = p.n_head * head_dim, n_kv * head_dim, n_kv * value_dim
        sizes = {"bq": q_dim, "bk": kv_dim, "bv": v_dim, "bo": p.n_embd,
                 "q_norm": head_dim if self.qk_norm_per_head else q_dim,
                 "k_norm": head_dim if self.qk_norm_per_head else kv_dim, "sinks": p.n_head}
        owns_kv = p.kv_source(i) == i  # (a layer over an earlier one's cache has no K or V of its own)
        required = [key for key in self.extra_attention_tensors if owns_kv or key not in _KEY_VALUE_EXTRAS]
        # the declared extras are required; the others are used where the file has them, as llama.cpp does
        extras = {key: (weights.vector if key in required else weights.optional_vector)(
                      tensor, sizes[key], layer=i, suffix=suffix)
                  for key, (tensor, suffix) in _ATTENTION_EXTRAS.items()}
        window = p.layer_windows[i]
        # Q, K and V as one matrix where the file has them so (as llama.cpp takes either)
        if weights.has(T.ATTN_QKV, i):
            projections = (None, None, None, weights.matrix(T.ATTN_QKV, p.n_embd, q_dim + kv_dim + v_dim, i))
        elif not owns_kv:
            projections = (weights.matrix(T.ATTN_Q, p.n_embd, q_dim, i), None, None, None)
        else:
            wv = (weights.matrix(T.ATTN_V, p.n_embd, v_dim, i)
                  if weights.has(T.ATTN_V, i) or not self.values_from_keys else None)
            projections = (weights.matrix(T.ATTN_Q, p.n_embd, q_dim * (2 if self.output_gate else 1), i),
                           weights.matrix(T.ATTN_K, p.n_embd, kv_dim, i), wv, None)
        wq, wk, wv, wqkv = projections
        return Attention(wq, wk, wv, weights.matrix(T.ATTN_OUT, p.n_head * value_dim, p.n_embd, i), wqkv,
                         value_norm=self.ones(value_dim) if self.value_norm and owns_kv else None,
                         # position scaling applies to the global layers only
                         rope_base=p.rope_base_swa if window else p.rope_base,
                         rope_scale=1.0 if window else p.rope_scale, rotates=self.rotates(i), window=window,
                         n_kv_head=n_kv, head_dim=head_dim, value_dim=value_dim, rope_dim=p.layer_rope_dim(i),
                         rope_factors=self.layer_rope_factors(i), kv_layer=p.cache_layer(i), **extras)

    def layer_rope_factors(self, i: int) -> tuple:
        """Layer i's RoPE frequency divisors within and past the trained context."""
        return self.rope_factors

    def ones(self, n: int):
        if n not in self._ones:
            self._ones[n] = self.backend.load_vector(np.ones(n, dtype=np.float32))
        return self._ones[n]

    def load_feed_forward(self, weights: WeightLoader, i: int) -> FeedForward | MixtureOfExperts:
        """Layer i's feed-forward: a mixture of experts where the layer has a router (past the
        leading dense layers), else dense."""
        p = self.params
        if p.n_expert and i >= p.n_layer_dense_lead and weights.has(T.FFN_GATE_INP, i):
            return self.load_experts(weights, i)
        return self.load_dense(weights, i)

    def load_dense(self, weights: WeightLoader, i: int) -> FeedForward:
        p = self.params
        n_ff = p.layer_ff(i)
        if self.ungated_activation:
            gate, up = None, weights.matrix(T.FFN_UP, p.n_embd, n_ff, i)
        elif self.fused_gate_up:
            gate, up = None, weights.matrix(T.FFN_UP, p.n_embd, 2 * n_ff, i)
        else:
            gate, up = (weights.matrix(t, p.n_embd, n_ff, i) for t in (T.FFN_GATE, T.FFN_UP))
        return FeedForward(gate, up, weights.matrix(T.FFN_DOWN, n_ff, p.n_embd, i))

    def load_experts(self, weights: WeightLoader, i: int) -> MixtureOfExperts:
        p = self.params
        n, e, ungated = p.n_ff_exp, p.n_expert, self.ungated_activation
        width = p.moe_latent_size or p.n_embd  # (the experts' input and output)
        if ungated:
            gate, up = None, weights.experts(T.FFN_UP_EXP, width, n, e, i)
        elif weights.has(T.FFN_GATE_UP_EXP, i):  # (one tensor, each expert's gate rows then its up rows)
            gate, up = weights.expert_halves(T.FFN_GATE_UP_EXP, width, n, e, i)
        else:
            gate, up = (weights.experts(t, width, n, e, i) for t in (T.FFN_GATE_EXP, T.FFN_UP_EXP))
        latent = {}
        if p.moe_latent_size:
            latent = {"latent_down": weights.matrix(T.MOE_LATENT_DOWN, p.n_embd, width, i),
                      "latent_up": weights.matrix(T.MOE_LATENT_UP, width, p.n_embd, i)}
        shared = shared_gate = None
        if weights.has(T.FFN_UP_SHEXP, i):
            shared = FeedForward(None if ungated else weights.matrix(T.FFN_GATE_SHEXP, p.n_embd, p.n_ff_shexp, i),
                                 weights.matrix(T.FFN_UP_SHEXP, p.n_embd, p.n_ff_shexp, i),
                                 weights.matrix(T.FFN_DOWN_SHEXP, p.n_ff_shexp, p.n_embd, i))
            if weights.has(T.FFN_GATE_INP_SHEXP, i):
                shared_gate = weights.matrix(T.FFN_GATE_INP_SHEXP, p.n_embd, 1, i)
        selection_bias = weights.vector if self.expert_selection_bias else weights.optional_vector
        biases = {f"{key}_bias": weights.optional_table(t, n_out, e, i, "bias") for key, t, n_out in
                  (("gate", T.FFN_GATE_EXP, n), ("up", T.FFN_UP_EXP, n), ("down", T.FFN_DOWN_EXP, width))}
        return MixtureOfExperts(weights.matrix(T.FFN_GATE_INP, p.n_embd, e, i), gate, up,
                                weights.experts(T.FFN_DOWN_EXP, n, width, e, i), shared, shared_gate,
                                router_bias=weights.optional_vector(T.FFN_GATE_INP, e, i, "bias"), **biases,
                                expert_scales=weights.optional_per_expert(T.FFN_DOWN_EXP, e, i, "scale"),
                                selection_bias=selection_bias(T.FFN_EXP_PROBS_B, e, i, "bias"), **latent)

    def new_cache(self, n_ctx: int, ring: bool = False) -> KVCache:
        """A cache of every layer with K and V of its own, and a hybrid's recurrent state."""
        own = self.cache_owners
        shapes = [(a.n_kv_head, a.head_dim, a.value_dim) for a in own]
        return KVCache(self.backend, n_ctx, [a.window for a in own], shapes, MAX_BATCH, ring=ring, kv_type=self.kv_type,
                       recurrent=self.new_recurrent_state())

    @staticmethod
    def state_shapes(p: ModelParams) -> dict[str, tuple[int, ...]]:
        """What each recurrent layer of the architecture carries: RecurrentState's kinds and shapes."""
        return {}

    def new_recurrent_state(self) -> RecurrentState | None:
        """A sequence's state of the recurrent layers (None: the model has none)."""
        p = self.params
        layers = [i for i in range(p.n_layer) if p.recurrent(i)]
        return RecurrentState(self.backend, dict.fromkeys(layers, self.state_shapes(p))) if layers else None

    def new_kv_pool(self, n_tokens: int) -> KVPool:
        """A paged cache for at least n_tokens tokens, which sequences share (runner/engine/kv_pool.py)."""
        shapes = [(a.n_kv_head, a.head_dim, a.value_dim) for a in self.cache_owners]
        return KVPool(self.backend, n_tokens, shapes, self.kv_type)

    def sequence_cache(self, pool: KVPool, n_ctx: int) -> SequenceCache:
        """A sequence's view of the pool, with a context of n_ctx tokens."""
        return SequenceCache(pool, n_ctx, MAX_BATCH, recurrent=self.new_recurrent_state())

    def forward(self, tokens, cache: KVCache, all_logits: bool = False):
        """Run tokens at the cache's next positions; logits of the last token (vocab,) or of all (T, vocab)."""
        outputs, start = [], 0
        while start < len(tokens):
            chunk = tokens[start:start + cache.batch_limit(len(tokens) - start)]
            start += len(chunk)
            logits = self._forward_batch(chunk, cache, all_logits)
            if all_logits:
                outputs.append(logits)
        return np.concatenate(outputs) if all_logits else logits[-1]

    def _forward_batch(self, tokens, cache: KVCache, all_logits: bool):
        batch = cache.reserve(tokens)
        # (the ring's pinned keys move outside the pass, so that the pass may replay)
        cache.move_pinned(lambda i: self.key_rotation(self.cache_owners[i], cache))
        # A decode step, or a pass of a few tokens that returns the logits of each (a verified
        # draft), is the same computation every time, up to the batch's values, so a backend may
        # record it once and replay it (a short prompt's pass, which comes once, is not worth
        # recording); not where queries get a temperature other than 1 (a recorded step has none).
        # A hybrid's pass replays where the backend binds its states, and not where the states keep
        # what each pass fed them (undo: a replay runs no Python).
        recurrent = cache.recurrent
        replayable = ((len(tokens) == 1 or all_logits and len(tokens) <= self.backend.few_tokens)
                      and self.query_temperature(batch.positions) is None
                      and (recurrent is None or self.backend.replays_states and not recurrent.undo))
        compute = partial(self._compute, cache=cache, all_logits=all_logits)
        memory = cache.memory if replayable else None
        return self.backend.to_numpy(self.backend.run(compute, batch, memory, self, all_logits))

    def forward_lanes(self, tokens: list[list[int]], caches: list[KVCache]):
        """Each sequence's tokens (a few, or one: a decode step) at its own cache's next positions,
        all in one pass over the weights: the logits of every token, lane after lane (sum of
        the lanes' tokens, vocab). Each row is computed as forward(tokens, cache, all_logits=True)
        of its lane alone computes it, bit for bit, on a backend whose products of a few rows
        compute each row as one row's (both do, within few_tokens rows)."""
        if sum(map(len, tokens)) > self.backend.few_tokens:
            raise ValueError(f"a pass of lanes takes at most {self.backend.few_tokens} token(s) on this backend")
        if len({c.n_ctx for c in caches}) > 1:  # (RoPE's frequencies may depend on the context)
            raise ValueError("the lanes of a pass need caches of one context size")
        batches = []
        for lane, cache in zip(tokens, caches):
            batches.append(cache.reserve(lane))
            cache.move_pinned(lambda i, c=cache: self.key_rotation(self.cache_owners[i], c))
        starts = tuple(np.cumsum([0, *map(len, tokens)]).tolist())
        joint = batches[0].replace(ids=np.concatenate([b.ids for b in batches]),
                                   positions=np.concatenate([b.positions for b in batches]), lanes=tuple(batches))
        # (a pass of lanes replays as a step does, where the backend binds each lane's batch)
        replayable = (self.backend.replays_lanes and self.query_temperature(joint.positions) is None
                      and all(c.recurrent is None or self.backend.replays_states and not c.recurrent.undo
                              for c in caches))
        shared = lanes_memory(caches)
        memory = shared if replayable else None

        def compute(batch):
            lanes = Lanes(tuple(caches), tuple(self.backend.upload(b) for b in batch.lanes), starts, shared is not None)
            return self._compute(batch, lanes, all_logits=True)
        return self.backend.to_numpy(self.backend.run(compute, joint, memory, self, all_logits=True))

    def _compute(self, batch: Batch, cache: KVCache | Lanes, all_logits: bool):
        be, p = self.backend, self.params
        x = be.embed(self.tok_embd, batch.ids)
        if self.embed_scale:
            x = x * np.float32(math.sqrt(p.n_embd))
        if p.embedding_scale:  # (Granite's multiplier, from the file)
            x = x * np.float32(p.embedding_scale)
        x = self.blocks(x, batch, cache)
        if not all_logits:
            x = x[-1:]
        logits = be.matmul(self.output, be.rms_norm(x, self.output_norm, p.rms_eps))
        if p.logit_scale:  # (Granite's divisor)
            logits = logits * np.float32(1.0 / p.logit_scale)
        return be.softcap(logits, p.logit_softcap) if p.logit_softcap > 0 else logits

    def blocks(self, x, batch: Batch, cache: KVCache):
        for i, layer in enumerate(self.layers):
            x = self.block(layer, x, batch, cache, i)
        return x

    def each_sequence(self, cache: KVCache | Lanes, n: int, compute):
        """compute(rows, cache) of each sequence's rows of a pass of n: the lanes' one by one,
        concatenated (what a recurrent layer's state computes: each sequence's own), or all rows
        with the cache."""
        if not isinstance(cache, Lanes):
            return compute(slice(0, n), cache)
        return self.backend.concat([compute(rows, lane_cache) for rows, _, lane_cache in cache.rows()])

    def attention(self, a: Attention, h, batch: Batch, cache: KVCache, i: int):
        """Self-attention of h (T, n_embd) through layer i's cache (or the earlier layer's it
        shares), output projection included."""
        be, p = self.backend, self.params
        n, heads = h.shape[0], p.n_head
        q_dim, k_dim = heads * a.head_dim, a.n_kv_head * a.head_dim
        if a.wqkv is not None:
            qkv = be.matmul(a.wqkv, h)
            q, k, v = be.split(qkv, [q_dim, k_dim, qkv.shape[1] - q_dim - k_dim])
        elif a.wk is None:  # (attends over another layer's keys and values)
            q, k, v = be.matmul(a.wq, h), None, None
        elif a.wv is None:  # (values from the keys' projection, before the keys' norm)
            q, k = be.matmuls([a.wq, a.wk], h)
            v = k
        else:
            q, k, v = be.matmuls([a.wq, a.wk, a.wv], h)
        q = q if a.bq is None else q + a.bq
        gate = None
        if self.output_gate:  # (each head's query, then its gate)
            q, gate = (x.reshape(n, heads * a.head_dim)
                       for x in be.split(q.reshape(n * heads, 2 * a.head_dim), [a.head_dim, a.head_dim]))
            gate = be.unary(gate, "sigmoid")
        norm_width = a.head_dim if self.qk_norm_per_head else None  # (None: a row's whole projection)
        if a.q_norm is not None:
            q = be.rms_norm(q.reshape(-1, norm_width or q.shape[1]), a.q_norm, p.rms_eps)
        q = q.reshape(n, heads, a.head_dim)
        lanes = cache.rows() if isinstance(cache, Lanes) else None
        # (every row is rotated at its own position: the lanes' rows together)
        rotate = self.key_rotation(a, cache.caches[0] if lanes else cache)
        if a.rotates:
            # (the magnitude scales the rotated dimensions once: not again where the ring moves keys)
            rotate(q, batch.positions, magnitude=p.rope_attn_factor)
        if k is not None:
            k, v = self.keys_values(a, k, v, batch, rotate)
        attend = self.attend if lanes is None else self.attend_lanes
        out = attend(a, q, k, v, batch, cache, i)
        out = out.reshape(n, heads * a.value_dim)
        out = be.matmul(a.wo, out if gate is None else out * gate)
        return out if a.bo is None else out + a.bo

    def attend(self, a: Attention, q, k, v, batch: Batch, cache: KVCache, i: int):
        """One sequence's rotated queries (T, heads, size) over layer i's cache, after storing its
        keys and values (k None: over the earlier layer's that it shares), before the output
        projection."""
        be, p, n = self.backend, self.params, q.shape[0]
        # (the batch's positions from the cache's count: the host's, where the batch's may be a device's)
        temperature = self.query_temperature(np.arange(cache.used - n, cache.used)) if p.attn_temp_scale else None
        if temperature is not None:
            q = q * be.asarray(temperature[:, None, None])
        keys, values, key_pos = cache.read(a.kv_layer, batch) if k is None else cache.store(a.kv_layer, k, v, batch)
        return be.attention(q, keys, values, batch.positions, key_pos, self.attention_scale(a), a.window,
                            p.attn_softcap, a.sinks)

    def attend_lanes(self, a: Attention, q, k, v, batch: Batch, lanes: Lanes, i: int):
        """attend for the lanes of a pass: in one call where their caches share their buffers (a
        pool's sequences), else lane by lane."""
        be, p = self.backend, self.params
        rows = lanes.rows()
        if not lanes.shared or p.attn_temp_scale:  # (temperature: each lane's queries scaled at its own positions)
            return be.concat([self.attend(a, q[r], None if k is None else k[r], None if v is None else v[r], b, c, i)
                              for r, b, c in rows])
        held = [c.read(a.kv_layer, b) if k is None else c.store(a.kv_layer, k[r], v[r], b) for r, b, c in rows]
        keys, values, _ = held[0]
        return be.attention_lanes(q, keys, values, batch.positions, [h[2] for h in held], list(lanes.starts),
                                  self.attention_scale(a), a.window, p.attn_softcap, a.sinks)

    def attention_scale(self, a: Attention) -> float:
        return self.query_scale or self.params.attention_scale or 1.0 / math.sqrt(a.head_dim)

    def key_rotation(self, a: Attention, cache: KVCache):
        """The layer's RoPE, rotate(x, positions, magnitude=1.0) in place, at the cache's context."""
        if not a.rotates:
            return _no_rotation  # (a NoPE layer's pinned keys stay as they are in the ring too)
        return partial(self.backend.rope, n_rot=a.rope_dim, base=a.rope_base, pos_scale=a.rope_scale,
                       neox=self.rope_neox, freq_factors=a.rope_factors[cache.n_ctx > self.params.rope_orig_context])

    def keys_values(self, a: Attention, k, v, batch: Batch, rotate) -> tuple:
        """A batch's keys and values (T, KV heads, size) from their projections: biased, normed,
        keys rotated."""
        be, p, n = self.backend, self.params, k.shape[0]
        k, v = (x if bias is None else x + bias for x, bias in ((k, a.bk), (v, a.bv)))
        if a.k_norm is not None:
            k = be.rms_norm(k.reshape(-1, a.head_dim if self.qk_norm_per_head else k.shape[1]), a.k_norm, p.rms_eps)
        if a.value_norm is not None:
            v = be.rms_norm(v.reshape(-1, a.value_dim), a.value_norm, p.rms_eps)
        k = k.reshape(n, a.n_kv_head, a.head_dim)
        if a.rotates:
            rotate(k, batch.positions, magnitude=p.rope_attn_factor)
        return k, v.reshape(n, a.n_kv_head, a.value_dim)

    def feed_forward(self, ffn: FeedForward | MixtureOfExperts, h):
        be = self.backend
        if isinstance(ffn, MixtureOfExperts):
            return self.mixture_of_experts(ffn, h)
        if self.ungated_activation:
            return be.matmul(ffn.down, be.unary(be.matmul(ffn.up, h), self.ungated_activation))
        if ffn.gate is None:
            gate_up = be.matmul(ffn.up, h)
            n_ff = gate_up.shape[1] // 2
            gate, up = be.split(gate_up, [n_ff, n_ff])
        else:
            gate, up = be.matmuls([ffn.gate, ffn.up], h)
        return be.matmul(ffn.down, self.activation(gate, up))

    def activation(self, gate, up):
        be = self.backend
        if self.gated_activation == "clamped_swiglu":
            return be.clamped_swiglu(gate, up, *self.swiglu_clamp)
        return be.silu_mul(gate, up) if self.gated_activation == "silu" else be.gelu_mul(gate, up)

    def mixture_of_experts(self, moe: MixtureOfExperts, h, router_input=None):
        """The mixture's output for h, routed by router_input (h where None)."""
        be, p = self.backend, self.params

        def expert_biased(y, bias, ids):
            return y if bias is None else y + be.expert_rows(bias, ids)
        logits = be.matmul(moe.router, h if router_input is None else router_input)
        if moe.router_bias is not None:
            logits = logits + moe.router_bias
        ids, weights = be.route(logits, p.n_expert_used, p.expert_gating, p.expert_weights_norm, p.expert_weights_scale,
                                moe.selection_bias)
        if moe.expert_scales is not None:
            weights = weights * be.expert_rows(moe.expert_scales, ids).reshape(weights.shape)
        x = h if moe.latent_down is None else be.matmul(moe.latent_down, h)
        if moe.gate is None:  # (ungated experts)
            (up,) = be.expert_matmuls([moe.up], x, ids)
            act = be.unary(expert_biased(up, moe.up_bias, ids), self.ungated_activation)
        else:
            gate, up = be.expert_matmuls([moe.gate, moe.up], x, ids)
            act = self.activation(expert_biased(gate, moe.gate_bias, ids), expert_biased(up, moe.up_bias, ids))
        (down,) = be.expert_matmuls([moe.down], act, ids)
        out = be.expert_combine(expert_biased(down, moe.down_bias, ids), weights)
        if moe.latent_up is not None:
            out = be.matmul(moe.latent_up, out)
        if moe.shared is not None:
            shared = self.feed_forward(moe.shared, h)
            if moe.shared_gate is not None:
                shared = be.sigmoid_gate(shared, be.matmul(moe.shared_gate, h))
            out = out + shared
        return out
