"""The Llama family (Llama 2/3, Mistral, TinyLlama, SmolLM2): pre-norm decoder, RoPE, GQA, SwiGLU."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gguf_io import ModelParams
from runner.kv_cache import KVCache
from runner.weights import WeightLoader


@dataclass
class LlamaLayer:
    attn_norm: object
    wq: object
    wk: object
    wv: object
    wo: object
    ffn_norm: object
    w_gate: object
    w_up: object
    w_down: object


class Llama:
    rope_neox = False  # GGUF stores Llama's Q/K rows permuted for the interleaved rotary pairing

    def __init__(self, params: ModelParams, weights: WeightLoader, backend):
        self.params, self.backend = params, backend
        p = params
        q_dim, kv_dim = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
        self.tok_embd = weights.matrix("token_embd.weight", p.n_embd, p.vocab_size)
        self.output_norm = weights.vector("output_norm.weight", p.n_embd)
        self.output = (weights.matrix("output.weight", p.n_embd, p.vocab_size)
                       if weights.has("output.weight") else self.tok_embd)
        self.rope_factors = (weights.vector("rope_freqs.weight", p.rope_dim // 2)
                             if weights.has("rope_freqs.weight") else None)
        self.layers = []
        for i in range(p.n_layer):
            def blk(name, n_in, n_out, i=i):
                return weights.matrix(f"blk.{i}.{name}.weight", n_in, n_out)
            self.layers.append(LlamaLayer(
                attn_norm=weights.vector(f"blk.{i}.attn_norm.weight", p.n_embd),
                wq=blk("attn_q", p.n_embd, q_dim), wk=blk("attn_k", p.n_embd, kv_dim),
                wv=blk("attn_v", p.n_embd, kv_dim), wo=blk("attn_output", q_dim, p.n_embd),
                ffn_norm=weights.vector(f"blk.{i}.ffn_norm.weight", p.n_embd),
                w_gate=blk("ffn_gate", p.n_embd, p.n_ff), w_up=blk("ffn_up", p.n_embd, p.n_ff),
                w_down=blk("ffn_down", p.n_ff, p.n_embd)))

    def new_cache(self, n_ctx: int) -> KVCache:
        p = self.params
        return KVCache(self.backend, p.n_layer, p.n_head_kv, n_ctx, p.head_dim, p.value_dim)

    def forward(self, tokens, cache: KVCache, all_logits: bool = False):
        """Run tokens (ints) through the model at the cache's next positions.

        Returns logits for the last token (vocab,), or for every token (T, vocab).
        """
        be, p = self.backend, self.params
        n = len(tokens)
        slots, positions = cache.reserve(n)
        positions = be.asarray(positions)
        x = be.embed(self.tok_embd, np.asarray(tokens))
        for i, layer in enumerate(self.layers):
            h = be.rms_norm(x, layer.attn_norm, p.rms_eps)
            q = be.matmul(layer.wq, h).reshape(n, p.n_head, p.head_dim)
            k = be.matmul(layer.wk, h).reshape(n, p.n_head_kv, p.head_dim)
            v = be.matmul(layer.wv, h).reshape(n, p.n_head_kv, p.value_dim)
            for t in (q, k):
                be.rope(t, positions, p.rope_dim, p.rope_base, p.rope_scale, self.rope_neox, self.rope_factors)
            keys, values, key_pos = cache.store(i, slots, k, v)
            a = be.attention(q, keys, values, positions, be.asarray(key_pos),
                             1.0 / math.sqrt(p.head_dim), 0, 0.0)
            x = x + be.matmul(layer.wo, a.reshape(n, p.n_head * p.value_dim))
            h = be.rms_norm(x, layer.ffn_norm, p.rms_eps)
            g = be.silu_mul(be.matmul(layer.w_gate, h), be.matmul(layer.w_up, h))
            x = x + be.matmul(layer.w_down, g)
        if not all_logits:
            x = x[-1:]
        logits = be.matmul(self.output, be.rms_norm(x, self.output_norm, p.rms_eps))
        return logits if all_logits else logits[0]
