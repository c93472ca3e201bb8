"""A Hugging Face model folder's config.json, read into GGUF hyperparameters.

What differs between architectures (the GGUF name, tensor names, the few ways a checkpoint differs
from what llama.cpp's graph reads) is declared in gguf_io.architectures; the conversion is shared.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gguf_io.architectures import HF_MODEL_TYPES, Architecture

from .errors import ConversionError


@dataclass
class HFModel:
    arch: Architecture
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab_size: int
    tied: bool
    metadata: dict  # GGUF key (without the architecture prefix) -> value
    n_expert: int = 0  # a mixture's experts per layer (0: dense)

    def __post_init__(self):
        self._names = self.arch.hf_names(self.n_layer)

    def gguf_name(self, hf_name: str) -> str | None:
        """GGUF tensor name for a checkpoint tensor; None for tensors llama.cpp drops."""
        hf_name = hf_name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
        if (hf_name == "lm_head.weight" and self.tied) or hf_name.endswith("rotary_emb.inv_freq"):
            return None
        name = self._names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConversionError(f"tensor {hf_name!r} is not part of a supported {self.arch.name} checkpoint")
        return name

    def fused_halves(self, hf_name: str) -> tuple[str, str] | None:
        """The GGUF names of the gate and up halves of a checkpoint tensor holding both (in that
        order along its rows), where the architecture declares one; else None."""
        layer = re.search(r"layers\.(\d+)\.", hf_name)
        for suffix, gate, up in self.arch.fused_gate_up:
            if hf_name.endswith(suffix) and layer:
                return self.arch.tensor_name(gate, int(layer[1])), self.arch.tensor_name(up, int(layer[1]))
        return None

    def transform(self, gguf_name: str, w: np.ndarray) -> np.ndarray:
        if self.arch.norm_plus_one and gguf_name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        if self.arch.permute_qk and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.n_head if "attn_q" in gguf_name else self.n_head_kv
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        return w


def load_json(path: Path, required: bool = True) -> dict:
    if not path.exists():
        if required:
            raise ConversionError(f"{path.name} is missing from {path.parent}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path.name} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path.name} is not a JSON object")
    return data


def read_hf_model(folder: Path) -> HFModel:
    return model_from_config(load_json(folder / "config.json"))


def model_from_config(cfg: dict) -> HFModel:
    """The model a Hugging Face config.json describes: architecture, sizes, GGUF metadata."""
    cfg = {**cfg, **cfg.get("text_config", {})}  # multimodal wrappers keep the decoder's config inside
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ConversionError(f"model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(sorted(HF_MODEL_TYPES))})")
    arch = HF_MODEL_TYPES[model_type]
    try:
        n_layer, n_embd = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
        n_head, n_ff = int(cfg["num_attention_heads"]), int(cfg["intermediate_size"])
        vocab_size = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"config.json lacks a usable {e}") from None
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = int(cfg.get("head_dim") or n_embd // n_head)
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope, dict) and "full_attention" in rope:  # per-layer-type parameters (Gemma 3)
        local = rope.get("sliding_attention", {})
        rope = rope["full_attention"]
    else:
        local = {}
    scaling = cfg.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in ("default", "linear"):
        raise ConversionError(f"RoPE scaling {rope_type!r} is not supported")
    md = {
        "context_length": int(cfg.get("max_position_embeddings", 2048)),
        "embedding_length": n_embd,
        "block_count": n_layer,
        "feed_forward_length": n_ff,
        "attention.head_count": n_head,
        "attention.head_count_kv": n_head_kv,
        "rope.freq_base": float(rope.get("rope_theta", cfg.get("rope_theta", arch.rope_theta_default))),
        "attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
    }
    if rope_type == "linear":
        md["rope.scaling.type"] = "linear"
        md["rope.scaling.factor"] = float(scaling["factor"])
    if arch.writes_vocab_and_rope_dims:
        md["vocab_size"] = vocab_size
        md["rope.dimension_count"] = head_dim
    if arch.writes_head_dims or head_dim != n_embd // n_head:
        md["attention.key_length"] = head_dim
        md["attention.value_length"] = head_dim
    if arch.swa_pattern:
        md["attention.sliding_window"] = int(cfg.get("sliding_window") or 0)
        local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
        if local_theta != 10_000.0:
            md["rope.freq_base_swa"] = local_theta
        pattern = _sliding_window_pattern(cfg, n_layer, arch.swa_pattern)
        if pattern != arch.swa_pattern:
            md["attention.sliding_window_pattern"] = pattern
        if cfg.get("final_logit_softcapping"):
            md["final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
    rope_layers = cfg.get("no_rope_layers")  # (SmolLM3: 1 where a layer rotates)
    if rope_layers is not None and list(rope_layers) != [int((i + 1) % 4 != 0) for i in range(n_layer)]:
        raise ConversionError("no_rope_layers other than every fourth layer without RoPE are not supported "
                              "(llama.cpp fixes that interval)")
    n_expert = _experts(cfg, md)
    md.update({key: float(cfg[name]) for name, key in _MULTIPLIERS.items() if cfg.get(name)})
    tied = bool(cfg.get("tie_word_embeddings", arch.tied_by_default))
    return HFModel(arch, n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, vocab_size, tied, md, n_expert)


def _experts(cfg: dict, md: dict) -> int:
    """A mixture's hyperparameters into md (as llama.cpp's converter names them); its expert count."""
    n_expert = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not n_expert:
        return 0
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise ConversionError("mixtures with dense layers among the expert ones (mlp_only_layers, "
                              "decoder_sparse_step) are not supported")
    md["expert_count"] = n_expert
    md["expert_used_count"] = int(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        md["expert_feed_forward_length"] = int(cfg["moe_intermediate_size"])
    shared = cfg.get("shared_expert_intermediate_size") or cfg.get("shared_intermediate_size")
    if shared:
        md["expert_shared_feed_forward_length"] = int(shared)
    return n_expert


# Granite's multipliers: config.json name -> GGUF key (as llama.cpp's converter renames them)
_MULTIPLIERS = {"attention_multiplier": "attention.scale", "embedding_multiplier": "embedding_scale",
                "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"}


def _sliding_window_pattern(cfg: dict, n_layer: int, default: int) -> int:
    types = cfg.get("layer_types")
    if types:  # e.g. five "sliding_attention" then one "full_attention", repeated
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        pattern = full[0] + 1 if full else n_layer + 1
        expected = ["full_attention" if i % pattern == pattern - 1 else "sliding_attention" for i in range(len(types))]
        if types != expected:
            raise ConversionError("this layer_types arrangement is not a repeating sliding-window pattern")
        return pattern
    return int(cfg.get("sliding_window_pattern") or default)
