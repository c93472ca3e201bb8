"""A Hugging Face model folder's config.json, read into GGUF hyperparameters.

What differs between architectures (the GGUF name, tensor names, the few ways a checkpoint differs
from what llama.cpp's graph reads) is declared in gguf_io.architectures; the conversion is shared.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import MODEL_TENSOR, TENSOR_NAMES

from gguf_io.architectures import ARCHITECTURES, HF_MODEL_TYPES, Architecture

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
    extra_tensors: dict = field(default_factory=dict)  # GGUF name -> values the config holds (LongRoPE factors)
    # tensor -> the multipliers folded into it, in turn: (rows, factor), rows None for all (Falcon-H1's)
    folded: dict = field(default_factory=dict)

    def __post_init__(self):
        self._names = self.arch.hf_names(self.n_layer)

    def left_out(self, hf_name: str) -> str | None:
        """What part of the model a checkpoint tensor the converter leaves out belongs to (the
        architecture's left_out); None for the others."""
        return next((part for prefix, part in self.arch.left_out if hf_name.startswith(prefix)), None)

    def gguf_name(self, hf_name: str) -> str | None:
        """GGUF tensor name for a checkpoint tensor; None for tensors llama.cpp drops."""
        name = self._gguf_name(hf_name)
        return self._dense(name) if name else name

    def _dense(self, gguf_name: str) -> str:
        """A shared expert's tensor as the dense MLP's where the architecture has it so (shared_mlp_dense)."""
        return gguf_name.replace("_shexp.", ".") if self.arch.shared_mlp_dense and not self.n_expert else gguf_name

    def _gguf_name(self, hf_name: str) -> str | None:
        hf_name = hf_name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
        if (hf_name == "lm_head.weight" and self.tied) or hf_name.endswith("rotary_emb.inv_freq"):
            return None
        layer = re.search(r"layers\.(\d+)\.", hf_name)
        for suffix, tensor, gguf_suffix in self.arch.renamed:
            if hf_name.endswith(suffix) and layer:
                return self.arch.tensor_name(tensor, int(layer[1]), gguf_suffix)
        # (parameters named x_bias are x's bias; bare parameters, such as gpt-oss's experts and
        # sinks, are weights: as llama.cpp's converter renames them)
        name = self._names.get_name(re.sub(r"_bias$", ".bias", hf_name), try_suffixes=(".weight", ".bias"))
        if name is None and re.search(r"vision|audio|multi_modal_projector", hf_name):
            raise ConversionError(f"tensor {hf_name!r} belongs to a vision or audio part, which ggrun does not "
                                  f"support: it converts and runs the text decoder alone")
        if name is None:
            raise ConversionError(f"tensor {hf_name!r} is not part of a supported {self.arch.name} checkpoint")
        return name if name.endswith((".weight", ".bias")) else name + ".weight"

    def fused_parts(self, hf_name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The GGUF names and (oriented) shapes of the tensors a checkpoint tensor of this (oriented)
        shape holds together, where the architecture declares such a tensor: gate and up (halves of
        its rows, or of a bias's values), or Qwen3-Next's Q, K, V and z; else none."""
        layer = re.search(r"layers\.(\d+)\.", hf_name)
        if layer is None:
            return []
        if self.arch.delta_net_heads_grouped and hf_name.endswith(_FUSED_QKVZ):
            value_dim = self.metadata["ssm.inner_size"]
            return [(self.arch.tensor_name(t, int(layer[1])), (rows, *shape[1:])) for t, rows in
                    ((MODEL_TENSOR.ATTN_QKV, shape[0] - value_dim), (MODEL_TENSOR.ATTN_GATE, value_dim))]
        for suffix, gate, up, gguf_suffix in self.arch.fused_gate_up:
            if hf_name.endswith(suffix):
                half = list(shape)
                half[-1 if gguf_suffix == "bias" else -2] //= 2
                return [(self._dense(self.arch.tensor_name(t, int(layer[1]), gguf_suffix)), tuple(half))
                        for t in (gate, up)]
        return []

    def split_fused(self, hf_name: str, w: np.ndarray) -> list[np.ndarray]:
        """A checkpoint tensor (oriented) that fused_parts names the parts of, as those parts."""
        if self.arch.delta_net_heads_grouped and hf_name.endswith(_FUSED_QKVZ):
            return self._qkv_z(w)
        return self.gate_up_halves(w, -1 if self.fused_parts(hf_name, w.shape)[0][0].endswith(".bias") else -2)

    def _qkv_z(self, w: np.ndarray) -> list[np.ndarray]:
        """Qwen3-Next's fused projection, per key head its q, k, v and z rows, as every head's q,
        then k, then v (attn_qkv), and z (attn_gate)."""
        md = self.metadata
        n_k, d_k = md["ssm.group_count"], md["ssm.state_size"]
        v_rows = md["ssm.inner_size"] // n_k  # (a key head's value heads)
        per_head = w.reshape(n_k, -1, w.shape[-1])
        q, k, v, z = np.split(per_head, np.cumsum([d_k, d_k, v_rows]), axis=1)
        return [np.concatenate([x.reshape(-1, w.shape[-1]) for x in (q, k, v)]), z.reshape(-1, w.shape[-1])]

    def _in_out(self, hf_name: str, shape: tuple[int, ...]) -> bool:
        """Whether a checkpoint tensor is stacked experts held as [experts, in, out]."""
        return self.arch.experts_in_out and len(shape) == 3 and ".experts." in hf_name

    def _squeezed(self, hf_name: str, shape: tuple[int, ...]) -> bool:
        """Whether a checkpoint tensor is held [rows, 1, n] and written [rows, n]."""
        return len(shape) == 3 and shape[1] == 1 and hf_name.endswith(self.arch.squeezed)

    def _mamba2_shape(self, hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The shape llama.cpp's converter gives a Mamba2 layer's A and D ([heads, 1]) and its norm's
        weights ([groups, d_inner / groups]); None for other tensors."""
        module = self.arch.mamba2
        if module is None or len(shape) != 1:
            return None
        if hf_name.endswith((f"{module}.A_log", f"{module}.D")):
            return shape[0], 1
        groups = self.metadata["ssm.group_count"]
        return (groups, shape[0] // groups) if hf_name.endswith(f"{module}.norm.weight") else None

    def oriented_shape(self, hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A checkpoint tensor's shape as GGUF takes it (numpy order): [experts, out, in]."""
        if self._squeezed(hf_name, shape):
            return shape[0], shape[2]
        if self._mamba2_shape(hf_name, shape):
            return self._mamba2_shape(hf_name, shape)
        return (*shape[:-2], shape[-1], shape[-2]) if self._in_out(hf_name, shape) else shape

    def orient(self, hf_name: str, w: np.ndarray) -> np.ndarray:
        if self._squeezed(hf_name, w.shape):
            return w[:, 0]
        if self._mamba2_shape(hf_name, w.shape):
            return w.reshape(self._mamba2_shape(hf_name, w.shape))
        return w.swapaxes(-1, -2) if self._in_out(hf_name, w.shape) else w

    def gate_up_halves(self, w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
        """Gate and up of a fused tensor (oriented), along its rows (axis -2) or a bias's values
        (axis -1): the first half and the second, or alternating ones (gate_up_interleaved)."""
        n = w.shape[axis]
        if self.arch.gate_up_interleaved:
            return tuple(np.take(w, np.arange(j, n, 2), axis=axis) for j in (0, 1))
        return tuple(np.split(w, 2, axis=axis))

    def transform(self, gguf_name: str, w: np.ndarray) -> np.ndarray:
        tensor = self._tensor(gguf_name)
        if self.arch.norm_plus_one and gguf_name.endswith("norm.weight") and tensor not in self.arch.plain_norms:
            w = w + np.float32(1.0)
        if self.arch.gated_delta_net and not self.arch.delta_net_heads_grouped and tensor in _V_HEADS:
            w = self._tiled_v_heads(tensor, w)
        if tensor == MODEL_TENSOR.SSM_A:  # (held as A_log by every checkpoint)
            # (rounded from float64: torch's float32 exp, which llama.cpp's converter takes, is within
            # one unit in the last place of it and mostly equal; numpy's float32 exp is further off)
            w = (-np.exp(w.astype(np.float64))).astype(np.float32)
        if tensor in self.folded:  # (one float32 product after another, as llama.cpp's converter takes them)
            w = w.copy()
            for rows, factor in self.folded[tensor]:
                w[slice(None) if rows is None else rows] *= np.float32(factor)
        if self.arch.permute_qk and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.n_head if "attn_q" in gguf_name else self.n_head_kv
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        return w

    def _tensor(self, gguf_name: str) -> MODEL_TENSOR | None:
        """The tensor a GGUF name is one of (blk.3.ssm_a: SSM_A)."""
        base = re.sub(r"\.(weight|bias)$", "", gguf_name)
        layer = re.match(r"blk\.(\d+)\.", base)
        bid = layer[1] if layer else None
        return next((t for t in self.arch.tensors if TENSOR_NAMES[t].format(bid=bid) == base), None)

    def _tiled_v_heads(self, tensor: MODEL_TENSOR, w: np.ndarray) -> np.ndarray:
        """A gated DeltaNet tensor (oriented) with its value heads, grouped by key head in the
        checkpoint (key head 0's, then 1's...), tiled (each key head's first value head, then each
        one's second...); in the fused QKV projection and the convolution, only the V part."""
        axis, per_head, after_qk = _V_HEADS[tensor]
        n_k, n_v = self.metadata["ssm.group_count"], self.metadata["ssm.time_step_rank"]
        size = self.metadata["ssm.inner_size"] // n_v if per_head else 1
        start = 2 * n_k * self.metadata["ssm.state_size"] if after_qk else 0
        w = np.moveaxis(w, axis, 0)
        v = w[start:].reshape(n_k, n_v // n_k, size, *w.shape[1:]).swapaxes(0, 1).reshape(-1, *w.shape[1:])
        return np.moveaxis(np.concatenate([w[:start], v]), 0, axis)


_FUSED_QKVZ = "linear_attn.in_proj_qkvz.weight"  # (Qwen3-Next's)
# a gated DeltaNet's tensors that hold its value heads: tensor -> (the axis they lie along, whether a
# head has head-size many entries there (else one), whether Q's and K's heads come first there)
_V_HEADS = {MODEL_TENSOR.ATTN_QKV: (0, True, True), MODEL_TENSOR.SSM_CONV1D: (0, True, True),
            MODEL_TENSOR.ATTN_GATE: (0, True, False), MODEL_TENSOR.SSM_OUT: (1, True, False),
            MODEL_TENSOR.SSM_ALPHA: (0, False, False), MODEL_TENSOR.SSM_BETA: (0, False, False),
            MODEL_TENSOR.SSM_A: (0, False, False), MODEL_TENSOR.SSM_DT: (0, False, False)}


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
    if arch.mixture_variant and "moe" in _mamba2_layer_kinds(cfg):
        arch = ARCHITECTURES[arch.mixture_variant]
    cfg.update({usual: cfg[alias] for alias, usual in arch.config_aliases if alias in cfg})
    for name, value in arch.config_fixed:
        if cfg.get(name, value) != value:
            raise ConversionError(f"{name} = {cfg[name]!r} is not supported: llama.cpp's {arch.name} graph "
                                  f"computes {name} = {value!r}")
    if arch.separate_blocks and "num_hidden_layers" not in cfg:  # (transformers 5 saves it as the layer types)
        cfg["num_hidden_layers"] = len(_mamba2_layer_kinds(cfg))
    # (a mixture with no dense MLP may give no intermediate_size, as Qwen3.5's does: then llama.cpp's
    # converter writes no feed_forward_length)
    dense_ff = "intermediate_size" in cfg or not (cfg.get("num_local_experts") or cfg.get("num_experts"))
    try:
        n_layer, n_embd = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
        n_head, n_ff = (0, 0) if arch.attention_free else (  # (plain Mamba2: neither)
            int(cfg["num_attention_heads"]), int(cfg["intermediate_size"]) if dense_ff else 0)
        vocab_size = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"config.json lacks a usable {e}") from None
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    # (where the config leaves them out, transformers' defaults, which llama.cpp's converter reads)
    if arch.ff_auto_adjust and cfg.get("block_auto_adjust_ff_dim", True):
        n_ff = _adjusted_ff(n_ff, cfg.get("block_ffn_dim_multiplier", 1.0), int(cfg.get("block_multiple_of", 256)))
    head_dim = 0 if arch.attention_free else int(cfg.get("head_dim") or n_embd // n_head)
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope, dict) and "full_attention" in rope:  # per-layer-type parameters (Gemma 3)
        local = rope.get("sliding_attention", {})
        rope = rope["full_attention"]
    else:
        local = {}
    scaling = cfg.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    llama3 = rope_type == "llama3" and MODEL_TENSOR.ROPE_FREQS in arch.tensors
    known = ("default", "linear", "yarn") + (("longrope", "su") if arch.long_rope else ()) + (
        ("proportional",) if arch.global_layers_apart else ())
    if rope_type not in known and not llama3:
        raise ConversionError(f"RoPE scaling {rope_type!r} is not supported")
    md = {
        "context_length": int(cfg.get("max_position_embeddings", 2048)),
        "embedding_length": n_embd,
        "block_count": n_layer,
        **({"feed_forward_length": n_ff} if dense_ff else {}),
        "attention.head_count": n_head,
        **({} if arch.attention_free else {"attention.head_count_kv": n_head_kv}),
        "attention.layer_norm_epsilon" if arch.rms_eps_as_layer_norm else "attention.layer_norm_rms_epsilon":
            float(cfg.get(arch.rms_eps_key, 1e-6)),
    }
    theta = rope.get("rope_theta", cfg.get("rope_theta", arch.rope_theta_default))
    if theta is not None:
        md["rope.freq_base"] = float(theta)
    if arch.conv_layer_type:
        md["attention.head_count_kv"] = [0 if t == arch.conv_layer_type else n_head_kv
                                         for t in _conv_layer_types(cfg, n_layer)]
        md["shortconv.l_cache"] = int(cfg.get("conv_L_cache", 3))
    if arch.gated_delta_net:
        md.update(_delta_net(cfg, n_layer))
    if arch.mamba2:
        md.update(_mamba2(cfg, n_layer, n_head_kv, n_embd, n_ff, arch))
    sections = scaling.get("mrope_section") or arch.rope_sections_default
    if sections:  # (M-RoPE's: time, height, width and a fourth, 0 where not given)
        md["rope.dimension_sections"] = [int(s) for s in [*sections, 0, 0, 0][:4]]
    if rope_type == "linear":
        md["rope.scaling.type"] = "linear"
        md["rope.scaling.factor"] = float(scaling["factor"])
    if rope_type == "yarn" and scaling.get("factor") is not None:
        md.update(_yarn(scaling, arch))
    if arch.writes_vocab_size:
        md["vocab_size"] = vocab_size
    # a rotary share of each head below 1 (Phi-4-mini, GLM-4)
    rotary = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", arch.rotary_share)))
    if arch.writes_rope_dims or rotary != 1.0:
        md["rope.dimension_count"] = int(head_dim * rotary)
    if not arch.attention_free and (arch.writes_head_dims or "head_dim" in cfg or head_dim != n_embd // n_head):
        md["attention.key_length"] = head_dim
        md["attention.value_length"] = head_dim
    extra_tensors = _long_rope(cfg, rope, md, rope_type) if arch.long_rope else {}
    if llama3:
        extra_tensors["rope_freqs.weight"] = _llama3_rope_factors(scaling, head_dim, md["rope.freq_base"])
    if arch.swa_pattern is not None:
        md["attention.sliding_window"] = int(cfg.get("sliding_window") or 0)
    if arch.swa_pattern:  # interleaved sliding and global layers (Gemma)
        local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq"))
        if local_theta is not None:
            md["rope.freq_base_swa"] = float(local_theta)
        pattern = _sliding_window_pattern(cfg, n_layer, arch.swa_pattern, arch.writes_swa_layers)
        if arch.writes_swa_layers:
            md["attention.sliding_window_pattern"] = pattern
        elif pattern != arch.swa_pattern:
            md["attention.sliding_window_pattern"] = pattern
    md.update({key: float(cfg[key]) for key in ("attn_logit_softcapping", "final_logit_softcapping") if cfg.get(key)})
    # Gemma's query scale, where llama.cpp's rule for the architecture (which files rely on) would miss it
    query_scalar = cfg.get("query_pre_attn_scalar")
    if query_scalar and query_scalar != (n_embd // n_head if n_layer == arch.wide_query_scale_layers else head_dim):
        md["attention.scale"] = float(query_scalar) ** -0.5
    rope_layers = cfg.get("no_rope_layers")  # (SmolLM3: 1 where a layer rotates)
    if rope_layers is not None and list(rope_layers) != [int((i + 1) % 4 != 0) for i in range(n_layer)]:
        raise ConversionError("no_rope_layers other than every fourth layer without RoPE are not supported "
                              "(llama.cpp fixes that interval)")
    if arch.global_layers_apart:
        extra_tensors.update(_global_layers(cfg, md, local, rope, n_layer))
    n_expert = _experts(cfg, md, arch)
    tied = bool(cfg.get("tie_word_embeddings", arch.tied_by_default))
    if arch.folded_multipliers:
        folded = _falcon_h1_multipliers(cfg, md, tied)
    else:
        folded = {}
        md.update({key: float(cfg[name]) for name, key in _MULTIPLIERS.items() if cfg.get(name)})
    # (the tokens written: the vocabulary rounded up as llama.cpp's converter rounds it; the embedding stays)
    multiple = int(cfg.get(arch.vocab_multiple_key) or arch.vocab_multiple) if arch.vocab_multiple_key \
        else arch.vocab_multiple
    return HFModel(arch, n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, -(-vocab_size // multiple) * multiple,
                   tied, md, n_expert, extra_tensors, folded)


def _yarn(rope: dict, arch: Architecture) -> dict:
    """YaRN's keys, as llama.cpp's converter writes them (and, for Ministral 3, its log multiplier
    and Llama 4's query temperature)."""
    md = {"rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
          "rope.scaling.original_context_length": int(rope["original_max_position_embeddings"])}
    for name, key in (("extrapolation_factor", "yarn_ext_factor"), ("attention_factor", "yarn_attn_factor"),
                      ("attn_factor", "yarn_attn_factor"), ("beta_fast", "yarn_beta_fast"),
                      ("beta_slow", "yarn_beta_slow")):
        if rope.get(name) is not None and f"rope.scaling.{key}" not in md:
            md[f"rope.scaling.{key}"] = float(rope[name])
    if arch.llama4_temperature:
        md["rope.scaling.yarn_log_multiplier"] = float(rope["mscale_all_dim"])
        md["attention.temperature_scale"] = float(rope["llama_4_scaling_beta"])
    return md


def _llama3_rope_factors(rope: dict, dim: int, base: float) -> np.ndarray:
    """Llama 3.1's RoPE scaling as the frequency divisors llama.cpp stores (rope_freqs): 1 for
    wavelengths under the original context / high_freq_factor, the factor above the original
    context / low_freq_factor, smoothly between; in float32 step by step as the reference
    computes it (powers rounded from float64, wavelengths as reciprocals times 2 pi), so that the
    bytes are llama.cpp's."""
    factor = np.float32(rope.get("factor", 8.0))
    low, high = np.float32(rope.get("low_freq_factor", 1.0)), np.float32(rope.get("high_freq_factor", 4.0))
    context = np.float32(rope.get("original_max_position_embeddings", 8192))
    one = np.float32(1)
    freqs = one / (np.float64(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
    wavelengths = (one / freqs) * np.float32(2 * math.pi)
    smooth = (context / wavelengths - low) / (high - low)
    between = one / ((one - smooth) / factor + smooth)
    return np.where(wavelengths < context / high, one,
                    np.where(wavelengths > context / low, factor, between)).astype(np.float32)


def _long_rope(cfg: dict, rope: dict, md: dict, rope_type: str) -> dict:
    """Phi-3's LongRoPE into md (its original context, the attention factor the long context
    needs) and its per-dimension frequency factors, as the two tensors llama.cpp writes: GGUF
    name -> values."""
    original = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if original is None:
        raise ConversionError("config.json lacks original_max_position_embeddings")
    md["rope.scaling.original_context_length"] = int(original)
    long, short = rope.get("long_factor"), rope.get("short_factor")
    if not long:
        return {}
    if not short or len(long) != len(short) or 2 * len(long) != md.get("rope.dimension_count", 0):
        raise ConversionError("rope long_factor and short_factor must each have one value per rotated pair")
    scale = md["context_length"] / int(original)
    md["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1.0 else 1.0
    return {"rope_factors_long.weight": np.asarray(long, np.float32),
            "rope_factors_short.weight": np.asarray(short, np.float32)}


def _experts(cfg: dict, md: dict, arch: Architecture) -> int:
    """A mixture's hyperparameters into md (as llama.cpp's converter names them); its expert count."""
    n_expert = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not n_expert:
        if arch.shared_mlp_dense:  # (as llama.cpp's converter writes them, whether or not there are experts)
            md.update({key: int(cfg[name]) for name, key in _DENSE_EXPERT_KEYS if cfg.get(name) is not None})
        return 0
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise ConversionError("mixtures with dense layers among the expert ones (mlp_only_layers, "
                              "decoder_sparse_step) are not supported")
    if int(cfg.get("n_group") or 1) > 1:
        raise ConversionError(f"grouped expert routing (n_group = {cfg['n_group']}) is not supported")
    md["expert_count"] = n_expert
    md["expert_used_count"] = int(cfg.get("num_experts_per_tok") or cfg["top_k_experts"])
    if arch.writes_expert_gating:
        md["expert_gating_func"] = arch.expert_gating
    if arch.leading_dense_key:
        if arch.leading_dense_key not in cfg:
            raise ConversionError(f"config.json lacks {arch.leading_dense_key}")
        md["leading_dense_block_count"] = int(cfg[arch.leading_dense_key])
    if cfg.get("moe_intermediate_size") or arch.writes_expert_ff_length:
        md["expert_feed_forward_length"] = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    shared = (cfg.get("shared_expert_intermediate_size") or cfg.get("shared_intermediate_size")
              or cfg.get("moe_shared_expert_intermediate_size"))
    if shared:
        md["expert_shared_feed_forward_length"] = int(shared)
    for name, key, default in arch.expert_config_keys:
        value = cfg.get(name, default)
        if value is not None:
            md[key] = type(default)(value) if default is not None else int(value)
    return n_expert


# a model without experts' expert keys that llama.cpp's converter writes where the config has them (Granite 4.0-H)
_DENSE_EXPERT_KEYS = (("num_local_experts", "expert_count"), ("num_experts_per_tok", "expert_used_count"),
                      ("shared_intermediate_size", "expert_shared_feed_forward_length"))


def _adjusted_ff(n_ff: int, multiplier: float | None, multiple_of: int) -> int:
    """LFM2's MLP width from its intermediate_size: 2/3 of it, times the multiplier (truncated
    each time), rounded up to a multiple of multiple_of (as llama.cpp's converter rounds it also
    without a multiplier)."""
    n_ff = int(2 * n_ff / 3)
    if multiplier is not None:
        n_ff = int(multiplier * n_ff)
    return multiple_of * ((n_ff + multiple_of - 1) // multiple_of)


def _delta_net(cfg: dict, n_layer: int) -> dict:
    """A gated-DeltaNet hybrid's keys, as llama.cpp's converter writes them: the recurrent layers'
    sizes, which layers are recurrent (where layer_types says), and the attention layers' interval."""
    try:
        n_k, n_v = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        md = {"ssm.conv_kernel": int(cfg["linear_conv_kernel_dim"]), "ssm.state_size": int(cfg["linear_key_head_dim"]),
              "ssm.group_count": n_k, "ssm.time_step_rank": n_v,
              "ssm.inner_size": int(cfg["linear_value_head_dim"]) * n_v}
    except (KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"config.json lacks a usable {e}") from None
    if n_k <= 0 or n_v % n_k:
        raise ConversionError(f"linear_num_value_heads ({n_v}) is not a multiple of linear_num_key_heads ({n_k})")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n_layer:
            raise ConversionError(f"layer_types has {len(types)} entries for {n_layer} layers")
        md["attention.recurrent_layers"] = [t == "linear_attention" for t in types]
    md["full_attention_interval"] = int(cfg.get("full_attention_interval", 4))
    return md


# a Mamba2 model's sizes: GGUF key -> the config names that give it, first found (Nemotron-H's, Granite's
# and Falcon-H1's mamba_*, plain Mamba2's)
_MAMBA2_SIZES = {"ssm.conv_kernel": ("conv_kernel", "mamba_d_conv"),
                 "ssm.state_size": ("ssm_state_size", "mamba_d_state", "state_size"),
                 "ssm.group_count": ("n_groups", "mamba_n_groups"),
                 "ssm.time_step_rank": ("mamba_num_heads", "mamba_n_heads", "num_heads")}


def _mamba2(cfg: dict, n_layer: int, n_head_kv: int, n_embd: int, n_ff: int, arch: Architecture) -> dict:
    """A Mamba2 model's keys, as llama.cpp's converter writes them: the Mamba2 layers' sizes (d_inner
    Falcon-H1's mamba_d_ssm, the heads' width, or the expansion of the hidden size); in a hybrid of
    Mamba2 and attention layers, 0 KV heads but in attention layers (and where each layer is one
    block, 0 feed-forward width but in feed-forward ones) and whether the attention layers rotate;
    without attention (plain Mamba2), a context of 2^20; where every layer has both (Falcon-H1), no more."""
    try:
        md = {key: int(next(cfg[n] for n in names if n in cfg)) for key, names in _MAMBA2_SIZES.items()}
    except StopIteration:
        raise ConversionError(f"config.json lacks the Mamba2 layers' sizes ({', '.join(_MAMBA2_SIZES)})") from None
    heads_width = md["ssm.time_step_rank"] * int(cfg.get("mamba_head_dim", 0))
    md["ssm.inner_size"] = int(cfg.get("mamba_d_ssm") or heads_width
                               or int(cfg.get("mamba_expand", cfg.get("expand", 2))) * n_embd)
    if arch.attention_free:
        return {**md, "context_length": 2 ** 20}
    if arch.parallel_mixers:
        return md
    separate = arch.separate_blocks
    kinds = _mamba2_layer_kinds(cfg)
    # (where each layer is one block, its feed-forward blocks are MLPs or, in a mixture, experts: never
    # both, as llama.cpp's converter reads them)
    ff_kind = "moe" if "moe" in kinds else "mlp"
    blocks = {"mamba", "attention", ff_kind} if separate else {"mamba", "attention"}
    if len(kinds) != n_layer or not set(kinds) <= blocks or separate and ff_kind not in kinds:
        raise ConversionError(f"the layer types ({', '.join(kinds)}) are not {n_layer} Mamba2 and attention layers"
                              f"{' and MLPs, or mixtures' if separate else ''} (MLPs beside mixtures, or mixtures "
                              f"in a layer beside its mixer, are not supported)")
    if ff_kind == "moe" and "moe_intermediate_size" not in cfg:
        raise ConversionError("config.json lacks moe_intermediate_size, the experts' width")
    ff_width = int(cfg["moe_intermediate_size"]) if ff_kind == "moe" else n_ff
    md["attention.head_count_kv"] = [n_head_kv if k == "attention" else 0 for k in kinds]
    if separate:
        md["feed_forward_length"] = [ff_width if k == ff_kind else 0 for k in kinds]
    md["rope.scaling.finetuned"] = rotates = cfg.get("position_embedding_type") == "rope"
    if not rotates:
        md["context_length"] = 2 ** 20
    return md


def _falcon_h1_multipliers(cfg: dict, md: dict, tied: bool) -> dict:
    """Falcon-H1's multipliers as llama.cpp's converter folds them into the weights they scale: tensor
    -> (rows, factor) in turn (rows None: all). Refused: a tied embedding whose two multipliers differ
    (the one matrix would carry the embedding's), and a mixer normed before its gate (llama.cpp's
    graph norms after it)."""
    def get(name):
        value = cfg.get(name)
        return 1.0 if value is None else float(value)
    if tied and get("embedding_multiplier") != get("lm_head_multiplier"):
        raise ConversionError("a tied embedding with embedding_multiplier and lm_head_multiplier apart is not "
                              "supported: llama.cpp's converter folds the embedding's into the one shared matrix")
    if cfg.get("mamba_rms_norm") and cfg.get("mamba_norm_before_gate", True):
        raise ConversionError("mamba_norm_before_gate is not supported: llama.cpp's graph norms the mixer's "
                              "output after its gate")
    gate, down = cfg.get("mlp_multipliers") or (1.0, 1.0)
    z, x, b, c, dt = cfg.get("ssm_multipliers") or (1.0,) * 5
    inner, groups = md["ssm.inner_size"], md["ssm.group_count"] * md["ssm.state_size"]
    # (in_proj's rows: z, x, B, C, dt)
    bounds = np.cumsum([0, inner, inner, groups, groups])
    ssm_in = [(None, get("ssm_in_multiplier"))] + [
        (slice(lo, hi), m) for lo, hi, m in zip(bounds, [*bounds[1:], None], (z, x, b, c, dt))]
    attention_in = get("attention_in_multiplier")
    return {MODEL_TENSOR.TOKEN_EMBD: [(None, get("embedding_multiplier"))],
            MODEL_TENSOR.OUTPUT: [(None, get("lm_head_multiplier"))],
            MODEL_TENSOR.ATTN_Q: [(None, attention_in)], MODEL_TENSOR.ATTN_V: [(None, attention_in)],
            MODEL_TENSOR.ATTN_K: [(None, get("key_multiplier")), (None, attention_in)],
            MODEL_TENSOR.ATTN_OUT: [(None, get("attention_out_multiplier"))],
            MODEL_TENSOR.SSM_IN: ssm_in, MODEL_TENSOR.SSM_OUT: [(None, get("ssm_out_multiplier"))],
            MODEL_TENSOR.FFN_GATE: [(None, float(gate))], MODEL_TENSOR.FFN_DOWN: [(None, float(down))]}


def _mamba2_layer_kinds(cfg: dict) -> list[str]:
    """Each layer's kind ("mamba", "attention", "mlp", "moe"; what a layer is called otherwise is
    itself) from layer_types, or Nemotron-H's hybrid_override_pattern (M, *, -, E) or layers_block_type."""
    types = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type") or cfg.get("layer_types") or []
    return [_MAMBA2_LAYER_KINDS.get(t, t) for t in types]


# a Mamba2 hybrid's layer types, as published and as transformers 5 renames them, by kind
_MAMBA2_LAYER_KINDS = {"M": "mamba", "linear_attention": "mamba", "*": "attention", "full_attention": "attention",
                       "-": "mlp", "E": "moe"}


def _conv_layer_types(cfg: dict, n_layer: int) -> list[str]:
    """A hybrid's layer types: layer_types, else (older LFM2 configs) "full_attention" at
    full_attn_idxs and "conv" elsewhere, as transformers reads them."""
    types = cfg.get("layer_types")
    if types is None:
        full = cfg.get("full_attn_idxs")
        types = ["full_attention" if full is None or i in full else "conv" for i in range(n_layer)]
    if len(types) != n_layer:
        raise ConversionError(f"layer_types has {len(types)} entries for {n_layer} layers")
    return list(types)


# Granite's multipliers: config.json name -> GGUF key (as llama.cpp's converter renames them)
_MULTIPLIERS = {"attention_multiplier": "attention.scale", "embedding_multiplier": "embedding_scale",
                "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"}


def _global_layers(cfg: dict, md: dict, local: dict, full: dict, n_layer: int) -> dict:
    """Gemma 4's layers into md, as llama.cpp's converter writes them: the global layers' head size
    (key_length; the sliding ones' as key_length_swa) and KV heads (head_count_kv per layer where
    they differ), double-wide MLPs in the layers that share KV, how many do, the per-layer
    embeddings' width; and its proportional RoPE as the frequency divisors of the global layers
    (1 on the rotated pairs, 1e30 on the others: GGUF name -> values)."""
    types = cfg.get("layer_types") or []
    overrides = {int(i): c for i, c in (cfg.get("per_layer_config") or {}).items()}

    def global_value(key: str, own: str):
        found = [c[own] for i, c in sorted(overrides.items()) if i < len(types) and types[i] == "full_attention"
                 and own in c]
        return cfg.get(key) if cfg.get(key) is not None else (found[0] if found else None)
    head_dim_full, head_dim_swa = global_value("global_head_dim", "head_dim"), int(cfg["head_dim"])
    if head_dim_full is None:
        raise ConversionError("config.json gives no head size of the global layers (global_head_dim)")
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    md["attention.shared_kv_layers"] = shared
    md["embedding_length_per_layer_input"] = int(cfg.get("hidden_size_per_layer_input") or 0)
    md.update({"attention.key_length": int(head_dim_full), "attention.value_length": int(head_dim_full),
               "attention.key_length_swa": head_dim_swa, "attention.value_length_swa": head_dim_swa})
    if cfg.get("use_double_wide_mlp"):
        n_ff = int(cfg["intermediate_size"])
        md["feed_forward_length"] = [n_ff * (2 if i >= n_layer - shared else 1) for i in range(n_layer)]
    kv_full = global_value("num_global_key_value_heads", "num_key_value_heads")
    if kv_full is not None and cfg.get("num_key_value_heads") is not None:
        md["attention.head_count_kv"] = [int(cfg["num_key_value_heads"]) if slides else int(kv_full)
                                         for slides in md["attention.sliding_window_pattern"]]
    md["rope.dimension_count"] = int(head_dim_full)
    md["rope.dimension_count_swa"] = int(head_dim_swa * local.get("partial_rotary_factor", 1.0))
    rotated = int(head_dim_full * full.get("partial_rotary_factor", 1.0) / 2)
    return {"rope_freqs.weight": np.array([1.0] * rotated + [1e30] * (int(head_dim_full) // 2 - rotated), np.float32)}


def _sliding_window_pattern(cfg: dict, n_layer: int, default: int, as_flags: bool = False) -> int | list[bool]:
    """Every how many layers one is global; as_flags: whether each layer slides."""
    types = cfg.get("layer_types")
    if types and as_flags:
        return [t == "sliding_attention" for t in types]
    if as_flags:
        pattern = cfg.get("sliding_window_pattern") or default
        if isinstance(pattern, str):  # (EXAONE's "LLLG": L slides)
            return [pattern[i % len(pattern)] == "L" for i in range(n_layer)]
        return [i % int(pattern) < int(pattern) - 1 for i in range(n_layer)]
    if types:  # e.g. five "sliding_attention" then one "full_attention", repeated
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        pattern = full[0] + 1 if full else n_layer + 1
        expected = ["full_attention" if i % pattern == pattern - 1 else "sliding_attention" for i in range(len(types))]
        if types != expected:
            raise ConversionError("this layer_types arrangement is not a repeating sliding-window pattern")
        return pattern
    return int(cfg.get("sliding_window_pattern") or default)
