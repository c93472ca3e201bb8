"""Gemma 3: scaled embeddings, norms before and after attention and MLP, per-head Q/K norms,
GELU-gated MLP, and sliding-window layers interleaved with global ones."""
from __future__ import annotations

from dataclasses import dataclass

from .decoder import Attention, Decoder


@dataclass
class Gemma3Layer:
    attn_norm: object
    attn: Attention
    post_attn_norm: object
    ffn_norm: object
    w_gate: object
    w_up: object
    w_down: object
    post_ffn_norm: object


class Gemma3(Decoder):
    rope_neox = True
    embed_scale = True
    extra_attention_tensors = ("q_norm", "k_norm")
    # Declared by the architecture (llama.cpp hard-codes the same), unless the file says otherwise:
    swa_pattern = 6             # every 6th layer is global, the other five slide
    local_rope_base = 10000.0   # RoPE base of the sliding layers

    @classmethod
    def layer_windows(cls, params):
        pattern = params.swa_pattern or cls.swa_pattern
        return [params.sliding_window if params.sliding_window > 0 and i % pattern < pattern - 1 else 0
                for i in range(params.n_layer)]

    def load_layer(self, weights, i):
        p = self.params
        vec = lambda name, n: weights.vector(f"blk.{i}.{name}.weight", n)  # noqa: E731
        mat = lambda name, n_in, n_out: weights.matrix(f"blk.{i}.{name}.weight", n_in, n_out)  # noqa: E731
        attn = self.load_attention(weights, i)
        attn.window = self.layer_windows(p)[i]
        if attn.window:
            attn.rope_base = p.rope_base_swa or self.local_rope_base
            attn.rope_scale = 1.0  # position scaling applies to the global layers only
        return Gemma3Layer(
            attn_norm=vec("attn_norm", p.n_embd), attn=attn, post_attn_norm=vec("post_attention_norm", p.n_embd),
            ffn_norm=vec("ffn_norm", p.n_embd), w_gate=mat("ffn_gate", p.n_embd, p.n_ff),
            w_up=mat("ffn_up", p.n_embd, p.n_ff), w_down=mat("ffn_down", p.n_ff, p.n_embd),
            post_ffn_norm=vec("post_ffw_norm", p.n_embd))

    def block(self, layer, x, batch, cache, i):
        be, eps = self.backend, self.params.rms_eps
        a = self.attention(layer.attn, be.rms_norm(x, layer.attn_norm, eps), batch, cache, i)
        x = x + be.rms_norm(a, layer.post_attn_norm, eps)
        h = be.rms_norm(x, layer.ffn_norm, eps)
        gate, up = be.matmuls([layer.w_gate, layer.w_up], h)
        f = be.matmul(layer.w_down, be.gelu_mul(gate, up))
        return x + be.rms_norm(f, layer.post_ffn_norm, eps)
