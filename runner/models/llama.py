"""The Llama family (Llama 2/3, Mistral, TinyLlama, SmolLM2): pre-norm blocks, RoPE, GQA, SwiGLU."""
from __future__ import annotations

from dataclasses import dataclass

from .decoder import Attention, Decoder


@dataclass
class LlamaLayer:
    attn_norm: object
    attn: Attention
    ffn_norm: object
    w_gate: object
    w_up: object
    w_down: object


class Llama(Decoder):
    rope_neox = False  # GGUF stores Llama's Q/K rows permuted for the interleaved pairing

    def load_layer(self, weights, i):
        p = self.params
        return LlamaLayer(
            attn_norm=weights.vector(f"blk.{i}.attn_norm.weight", p.n_embd),
            attn=self.load_attention(weights, i),
            ffn_norm=weights.vector(f"blk.{i}.ffn_norm.weight", p.n_embd),
            w_gate=weights.matrix(f"blk.{i}.ffn_gate.weight", p.n_embd, p.n_ff),
            w_up=weights.matrix(f"blk.{i}.ffn_up.weight", p.n_embd, p.n_ff),
            w_down=weights.matrix(f"blk.{i}.ffn_down.weight", p.n_ff, p.n_embd))

    def block(self, layer, x, batch, cache, i):
        be, eps = self.backend, self.params.rms_eps
        x = x + self.attention(layer.attn, be.rms_norm(x, layer.attn_norm, eps), batch, cache, i)
        h = be.rms_norm(x, layer.ffn_norm, eps)
        gate, up = be.matmuls([layer.w_gate, layer.w_up], h)
        return x + be.matmul(layer.w_down, be.silu_mul(gate, up))
