"""`ggrun convert` (Hugging Face folder -> GGUF) and `ggrun quantize` (F32/F16/BF16 GGUF -> type)."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType

from gguf_io import GGUFError, GGUFFile, read_params
from gguf_io.quant_types import FLOAT_TYPES
from gguf_io.safe_files import check_output

from .errors import ConversionError
from .gguf_out import PlannedTensor, Summary, typed_value, write_gguf
from .hf_metadata import general_metadata
from .hf_model import HFModel, read_hf_model
from .hf_tokenizer import read_tokenizer
from .importance import Importance, check_importance, load_importance
from .mixes import COPY, FILE_TYPES, MixOptions, llama_quantize_order, mix_types

QUANTIZATION_VERSION = 2


def _mix_types(*args) -> dict:
    """mix_types, its refusal of a type given by name as a ConversionError."""
    try:
        return mix_types(*args)
    except ValueError as e:
        raise ConversionError(str(e)) from None


def _importance(mix: MixOptions) -> Importance | None:
    return load_importance(mix.imatrix, mix.include_weights, mix.exclude_weights)


def _imatrix_keys(importance: Importance | None) -> list:
    return importance.metadata() if importance else []


def _file_type(name: str) -> str:
    key = name.upper()
    if key not in FILE_TYPES:
        raise ConversionError(f"unknown type {name!r}; choose one of {', '.join(FILE_TYPES)}")
    return key


def convert_hf(folder: Path, out: Path, type_name: str, progress: bool = True, split_max_size: int = 0,
               mix: MixOptions = MixOptions()) -> Summary:
    folder = Path(folder)
    if not folder.is_dir():
        raise ConversionError(f"{folder} is not a folder")
    check_output(out, folder.iterdir())  # (before the work: the checkpoint is read as it is written)
    file_type = _file_type(type_name)
    importance = _importance(mix)
    hf = read_hf_model(folder)
    tok, special = read_tokenizer(folder, hf.vocab_size, hf.arch)
    if hf.vocab_size == hf.arch.no_bos_vocab_size:
        special["add_bos"] = False
    from .safetensors_io import Checkpoint
    ckpt = Checkpoint(folder)

    # (GGUF name, GGML shape, its float32 values): from one checkpoint tensor, several (a mixture's
    # experts, stacked), or half of one (gate and up held as one); first those the config holds
    planned: list[tuple[str, tuple[int, ...], object]] = [
        (name, values.shape, lambda v=values: v) for name, values in hf.extra_tensors.items()]
    carried = _mxfp4_tensors(ckpt, hf)  # (and MXFP4 experts as the checkpoint holds them)
    left_out = Counter(hf.left_out(n) for n in ckpt.names())  # (by part: None, the tensors converted)
    names = [n for n in ckpt.names() if hf.left_out(n) is None
             and (not n.endswith(("_blocks", "_scales")) or n.rsplit("_", 1)[0] not in carried)]
    for hf_name, parts in _stacked_experts(names, hf.n_expert).items():
        shape = hf.oriented_shape(hf_name, ckpt.shape(parts[0]) if parts[0] == hf_name
                                  else (len(parts), *ckpt.shape(parts[0])))
        fused = hf.fused_parts(hf_name, shape)
        if fused:
            planned += [(name, tuple(reversed(part)), lambda h=parts, n=hf_name, j=j:
                         hf.split_fused(n, hf.orient(n, _read(ckpt, h)))[j]) for j, (name, part) in enumerate(fused)]
            continue
        name = hf.gguf_name(hf_name)
        if name is not None:
            planned.append((name, tuple(reversed(shape)),
                            lambda n=name, h=parts, hn=hf_name: hf.transform(n, hf.orient(hn, _read(ckpt, h)))))
    embedding = next((shape for name, shape, _ in planned if name == "token_embd.weight"), None)
    if embedding is None:
        raise ConversionError("the checkpoint has no token embedding (model.embed_tokens.weight)")
    if embedding[-1] != hf.vocab_size:  # (llama.cpp's converter would write a file its loader refuses)
        raise ConversionError(f"the vocabulary of {hf.vocab_size} tokens (config.json's vocab_size, rounded up as "
                              f"llama.cpp's converter rounds a {hf.arch.name} vocabulary) does not fit the "
                              f"embedding's {embedding[-1]} rows")
    kv_heads = hf.metadata.get("attention.head_count_kv", 0)  # (layer 0's, where given per layer; none: no attention)
    types = _mix_types(file_type, {name: shape for name, shape, _ in planned}, hf.n_layer, hf.n_head,
                       kv_heads[0] if isinstance(kv_heads, list) else kv_heads, hf.n_expert, mix, importance is not None)
    # (with an importance matrix for those llama-quantize quantizes: of another type than F32)
    tensors = [PlannedTensor(name, shape, types[name], load, imatrix=importance.for_tensor(name, shape)
                             if importance and types[name] != T.F32 else None) for name, shape, load in planned]
    check_importance(tensors, importance)
    tensors += [t for ts in carried.values() for t in ts]

    # (a float conversion that carries MXFP4 experts is an MXFP4_MOE file, as llama.cpp names it)
    written_type = "MXFP4_MOE" if carried and FILE_TYPES[file_type][0] in FLOAT_TYPES else file_type
    general = general_metadata(folder.resolve(), tensors)  # (resolved: "." is named as the folder it is)
    metadata = model_metadata(folder.resolve().name, hf, written_type, tok, special, general) + _imatrix_keys(importance)
    summary = write_gguf(out, hf.arch.name, metadata, tensors, progress, split_max_size, list(folder.iterdir()))
    summary.left_out = [f"{n} tensors of {part}" for part, n in left_out.items() if part]
    return summary


def _mxfp4_tensors(ckpt, hf: HFModel) -> dict[str, list[PlannedTensor]]:
    """An MXFP4 checkpoint's expert tensors (gpt-oss: x_blocks and x_scales), carried through as
    llama.cpp's MXFP4 blocks: checkpoint name x -> its GGUF tensors (gate and up apart)."""
    carried = {}
    for blocks_name in (n for n in ckpt.names() if n.endswith("_blocks")):
        base = blocks_name[:-len("_blocks")]
        shape = ckpt.shape(blocks_name)
        scales_shape = ckpt.shape(base + "_scales") if base + "_scales" in ckpt.location else None
        if len(shape) != 4 or shape[-1] != 16 or scales_shape != shape[:-1]:
            raise ConversionError(f"{blocks_name}: MXFP4 blocks must be [experts, rows, blocks, 16] with "
                                  f"[experts, rows, blocks] scales beside them")
        names = [name for name, _ in hf.fused_parts(base, shape)] or [hf.gguf_name(base)]
        n_rows = shape[1] // len(names)
        carried[base] = [PlannedTensor(name, (shape[2] * 32, n_rows, shape[0]), T.MXFP4,
                                       lambda b=base, j=j, n=len(names): _ggml_mxfp4(ckpt, b)[:, j::n], quantized=True)
                         for j, name in enumerate(names)]
    return carried


def _ggml_mxfp4(ckpt, base: str) -> np.ndarray:
    """MXFP4 blocks as a checkpoint holds them (two E2M1 codes a byte, element 2i in the low
    nibble; the E8M0 scales apart) as ggml's blocks: the scale byte, then 16 bytes whose byte j
    holds element j (low nibble) and j + 16 (high). The codes and the scale byte are the same
    numbers in both; (experts, rows, blocks, 17)."""
    blocks, scales = ckpt.bytes(base + "_blocks"), ckpt.bytes(base + "_scales")
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    return np.concatenate([scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(.*)")


def _stacked_experts(names, n_expert: int) -> dict[str, list[str]]:
    """Checkpoint tensor name -> the tensors it is made of: itself, or for a mixture's expert
    tensors (layers.3.mlp.experts.5.up_proj.weight) the merged name (layers.3.mlp.experts.up_proj.weight)
    -> every expert's, in expert order (stacked into one 3-D tensor, as llama.cpp writes them)."""
    out, experts = {}, {}
    for name in names:
        m = _EXPERT.fullmatch(name)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = name
        else:
            out[name] = [name]
    for merged, parts in experts.items():
        if sorted(parts) != list(range(n_expert)):
            raise ConversionError(f"{merged}: the checkpoint has experts {sorted(parts)}, expected 0..{n_expert - 1}")
        out[merged] = [parts[e] for e in range(n_expert)]
    return out


def _read(ckpt, parts: list[str]) -> np.ndarray:
    return ckpt.float32(parts[0]) if len(parts) == 1 else np.stack([ckpt.float32(p) for p in parts])


def model_metadata(name: str, hf: HFModel, file_type: str, tok, special: dict, general: list | None = None) -> list:
    """The GGUF key/value section of a converted model: general keys, the architecture's
    hyperparameters, the file type and the tokenizer. general: the typed general keys a Hugging
    Face folder gives (hf_metadata.general_metadata, general.name among them); without them,
    general.name is name."""
    arch = hf.arch
    if general is None:
        general = [("general.name", *typed_value(name))]
    md = [(f"{arch.name}.{k}", v) for k, v in hf.metadata.items()]
    md += [("general.file_type", int(FILE_TYPES[file_type][1])),
           ("general.quantization_version", QUANTIZATION_VERSION)]
    return ([("general.type", *typed_value("model"))] + general + [(k, *typed_value(v)) for k, v in md]
            + _tokenizer_metadata(tok, special, arch))


def _tokenizer_metadata(tok, special: dict, arch) -> list:
    arr = GGUFValueType.ARRAY
    md = [("tokenizer.ggml.model", tok.model, GGUFValueType.STRING, None)]
    if tok.pre:
        md.append(("tokenizer.ggml.pre", tok.pre, GGUFValueType.STRING, None))
    md.append(("tokenizer.ggml.tokens", tok.tokens, arr, GGUFValueType.STRING))
    if tok.scores is not None:
        md.append(("tokenizer.ggml.scores", tok.scores, arr, GGUFValueType.FLOAT32))
    md.append(("tokenizer.ggml.token_type", [int(t) for t in tok.token_types], arr, GGUFValueType.INT32))
    if tok.merges is not None:
        md.append(("tokenizer.ggml.merges", tok.merges, arr, GGUFValueType.STRING))
    for name in ("bos", "eos", "eot", "unk", "sep", "pad", "mask"):  # (GGUF has no key for a CLS token)
        if name in special:
            key = {"unk": "unknown", "sep": "seperator", "pad": "padding"}.get(name, name)
            md.append((f"tokenizer.ggml.{key}_token_id", special[name], GGUFValueType.UINT32, None))
    for name in ("add_bos", "add_eos"):
        if name in special:
            md.append((f"tokenizer.ggml.{name}_token", special[name], GGUFValueType.BOOL, None))
    space_prefix = tok.add_space_prefix if arch.space_prefix is None else arch.space_prefix
    if space_prefix is not None:
        md.append(("tokenizer.ggml.add_space_prefix", space_prefix, GGUFValueType.BOOL, None))
    if "chat_template" in special:
        md.append(("tokenizer.chat_template", special["chat_template"], GGUFValueType.STRING, None))
    return md


def requantize(src: Path, out: Path, type_name: str, progress: bool = True, allow_requantize: bool = False,
               split_max_size: int = 0, mix: MixOptions = MixOptions()) -> Summary:
    """src's weights as type_name (COPY: as they are). A tensor already of its new type is copied;
    a quantized tensor is widened back to a float type, or, with allow_requantize (llama-quantize's
    --allow-requantize), quantized again from its values (a loss on top of the first: a
    self-draft's weights, not a file to publish)."""
    from gguf.quants import dequantize
    copy = type_name.upper() == COPY
    file_type = None if copy else _file_type(type_name)
    f = GGUFFile(src)
    check_output(out, f.parts)  # (before the work: also through another path or a link)
    params = read_params(f)
    importance = None if copy else _importance(mix)
    types = {name: t.type for name, t in f.tensors.items()} if copy else _mix_types(
        file_type, {name: t.shape for name, t in f.tensors.items()},
        params.n_layer, params.n_head, params.layer_kv_heads(0), params.n_expert, mix, importance is not None)
    tensors = []
    for name in llama_quantize_order(f.tensors):  # written in that order too, as llama-quantize writes
        t, new_type = f.tensors[name], types[name]
        if t.type == new_type:
            tensors.append(PlannedTensor(name, t.shape, t.type, lambda n=name: f.tensor_bytes(n), quantized=True))
            continue
        # (a quantized tensor may be widened back to a float type, not quantized again)
        if (t.type.name not in ("F32", "F16", "BF16") and new_type.name not in ("F32", "F16", "BF16")
                and not allow_requantize):
            raise GGUFError(f"tensor {name} is already quantized ({t.type.name}); requantize from F32, F16 or BF16")
        load = (lambda n=name, tt=t: dequantize(f.tensor_bytes(n).reshape(-1), tt.type)
                .astype(np.float32).reshape(tuple(reversed(tt.shape))))
        tensors.append(PlannedTensor(name, t.shape, new_type, load,
                                     imatrix=importance.for_tensor(name, t.shape) if importance else None))
    check_importance(tensors, importance)
    metadata = []
    imatrix_keys = _imatrix_keys(importance)
    for key, mv in f.metadata.items():
        if key == "general.architecture" or key.startswith("split."):  # (the writer adds its own)
            continue
        if any(key == k[0] for k in imatrix_keys):  # (given anew, last, as llama-quantize sets them)
            continue
        value = int(FILE_TYPES[file_type][1]) if key == "general.file_type" and not copy else mv.value
        if isinstance(value, np.ndarray):
            value = value.tolist()
        metadata.append((key, value, mv.type, mv.item_type))
    if "general.file_type" not in f.metadata and not copy:
        metadata.append(("general.file_type", int(FILE_TYPES[file_type][1]), GGUFValueType.UINT32, None))
    metadata += imatrix_keys
    return write_gguf(out, f.architecture, metadata, tensors, progress, split_max_size, f.parts)
