"""A Hugging Face tokenizer (tokenizer.json, or SentencePiece's tokenizer.model) as GGUF
`tokenizer.*` metadata, with llama.cpp's conventions for token types and special ids."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import TokenType


from .errors import ConversionError
from .hf_model import load_json


@dataclass
class TokenizerData:
    model: str                 # "gpt2" or "llama"
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    add_space_prefix: bool | None = None


# tokenizer.json pre-tokenizer regexes -> the llama.cpp pre-tokenizer name that applies it
_SPLIT_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    # (Qwen 3.5's: letters with their combining marks)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen35",
}


def _detect_pre(pre_tokenizer: dict | None) -> str:
    """llama.cpp identifies a BPE pre-tokenizer by hashing sample output; the tokenizer.json
    structure says the same for the families supported here."""
    if not pre_tokenizer:
        raise ConversionError("tokenizer.json has no pre-tokenizer; cannot tell which splitting rules apply")
    kind = pre_tokenizer.get("type")
    steps = pre_tokenizer.get("pretokenizers", []) if kind == "Sequence" else [pre_tokenizer]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds and kinds[0] == "Split":
        pattern = steps[0].get("pattern", {}).get("Regex")
        if pattern in _SPLIT_REGEXES:
            return _SPLIT_REGEXES[pattern]
    raise ConversionError(f"unsupported pre-tokenizer {json.dumps(pre_tokenizer)[:200]}")


def _merges(model: dict) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def _bpe_from_json(data: dict, vocab_size: int, byte_fallback_model: str | None, folder: Path) -> TokenizerData:
    model = data.get("model", {})
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ConversionError(f"tokenizer.json model {model.get('type')!r} is not supported (BPE is)")
    if model.get("byte_fallback"):
        if byte_fallback_model is None:
            raise ConversionError("byte-fallback BPE tokenizer.json is not supported; provide tokenizer.model")
        return _byte_fallback_bpe(data, byte_fallback_model, folder)
    merges = _merges(model)
    id_to_token = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in data.get("added_tokens", [])}
    for i, a in added.items():
        id_to_token[i] = a["content"]
    n = max(vocab_size, max(id_to_token) + 1)
    tokens, types = [], []
    for i in range(n):
        if i not in id_to_token:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            tokens.append(id_to_token[i])
            types.append(TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
        else:
            tokens.append(id_to_token[i])
            types.append(TokenType.NORMAL)
    return TokenizerData("gpt2", tokens, types, merges=merges, pre=_detect_pre(data.get("pre_tokenizer")))


# Gemma 4's tokens that llama.cpp's converter makes user-defined, so that they are always rendered
# (its chat parser reads them)
_VISIBLE_TOKENS = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
                   '<|"|>'}
_NAMED_SPECIALS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


def _byte_fallback_bpe(data: dict, model_name: str, folder: Path) -> TokenizerData:
    """A byte-fallback BPE tokenizer.json as llama.cpp's LlamaHfVocab reads it (through
    transformers): the model's vocabulary in id order, then the added tokens past it; every
    score -1000; <0xNN> pieces bytes, the tokenizer's special tokens (tokenizer_config.json's
    named ones and its extra ones) control, other added tokens past the vocabulary user-defined;
    and Gemma 4's visible tokens user-defined."""
    model = data["model"]
    if (data.get("decoder") or {}).get("type") != "Sequence":
        raise ConversionError("a byte-fallback tokenizer.json needs a Sequence decoder (as Llama's has)")
    by_id = {i: t for t, i in model["vocab"].items()}
    n_base = len(by_id)
    if sorted(by_id) != list(range(n_base)):
        raise ConversionError("tokenizer.json's vocabulary ids are not 0..n-1")
    added = sorted((a["id"], a["content"]) for a in data.get("added_tokens", []) if a.get("id", -1) >= n_base)
    tokens = [by_id[i] for i in range(n_base)] + [text for _, text in added]
    cfg = load_json(folder / "tokenizer_config.json", required=False)
    named = [_token_text(cfg.get(f"{name}_token")) for name in _NAMED_SPECIALS]
    extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
    extra = extra.values() if isinstance(extra, dict) else extra
    ids = {t: i for i, t in enumerate(tokens)}
    special = {ids[t] for t in [*named, *map(_token_text, extra)] if isinstance(t, str) and t in ids}
    types = []
    for i, text in enumerate(tokens):
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            types.append(TokenType.BYTE)
        elif i in special:
            types.append(TokenType.CONTROL)
        elif i >= n_base or text in _VISIBLE_TOKENS:
            types.append(TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
    return TokenizerData(model_name, tokens, types, scores=[-1000.0] * len(tokens), merges=_merges(model))


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ConversionError("tokenizer.model is not a valid SentencePiece model")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def _protobuf_fields(buf: bytes):
    """(field number, wire type, value) of a protobuf message: just enough for SentencePiece."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ConversionError("tokenizer.model is not a valid SentencePiece model")
        if pos > len(buf):
            raise ConversionError("tokenizer.model is truncated")
        yield number, wire, value


# SentencePiece piece types as llama.cpp's converter reads them (through SentencePieceProcessor's
# IsUnknown, IsControl, IsUnused, IsByte): a user-defined piece is a normal one, unless the folder's
# added tokens say more
_SP_TYPES = {1: TokenType.NORMAL, 2: TokenType.UNKNOWN, 3: TokenType.CONTROL,
             4: TokenType.NORMAL, 5: TokenType.UNUSED, 6: TokenType.BYTE}


def _spm_from_model(path: Path, vocab_size: int, added_as_marked: bool = False) -> TokenizerData:
    """tokenizer.model's pieces; then, as llama.cpp's converter writes a SentencePiece vocabulary,
    the folder's added tokens over them (added_tokens.json, tokenizer_config.json's
    added_tokens_decoder) and [PADn] up to the config's vocab_size."""
    tokens, scores, types = [], [], []
    add_dummy_prefix = True
    for number, _, value in _protobuf_fields(path.read_bytes()):
        if number == 1:  # ModelProto.pieces
            piece, score, kind = "", 0.0, 1
            for n, _, v in _protobuf_fields(value):
                if n == 1:
                    piece = v.decode("utf-8", errors="replace")
                elif n == 2:
                    score = struct.unpack("<f", v)[0]
                elif n == 3:
                    kind = v
            tokens.append(piece)
            scores.append(score)
            types.append(_SP_TYPES.get(kind, TokenType.NORMAL))
        elif number == 3:  # NormalizerSpec
            for n, _, v in _protobuf_fields(value):
                if n == 3:
                    add_dummy_prefix = bool(v)
    if not tokens:
        raise ConversionError("tokenizer.model holds no pieces")
    n = vocab_size or len(tokens)
    tokens, scores, types = tokens[:n], scores[:n], types[:n]
    for i in range(len(tokens), n):
        tokens.append(f"[PAD{i}]")
        scores.append(-10000.0)
        types.append(TokenType.UNUSED)
    _add_tokens(path.parent, tokens, scores, types, added_as_marked)
    return TokenizerData("llama", tokens, types, scores=scores, pre="default", add_space_prefix=add_dummy_prefix)


def _looks_special(text: str) -> bool:
    """Added tokens llama.cpp's converter makes control tokens even where a folder does not mark
    them special (<|...|>, <unused...>, Gemma's and DeepSeek's few)."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _add_tokens(folder: Path, tokens: list, scores: list, types: list, as_marked: bool) -> None:
    """A SentencePiece vocabulary's added tokens, in place, as llama.cpp's converter sets them:
    added_tokens.json's user-defined, then tokenizer_config.json's added_tokens_decoder (control
    where special or special-looking, else user-defined with its \u2581 as spaces); score -1000;
    ids past the vocabulary are left out. as_marked (Phi-3's converter): control where marked
    special alone, the text as written, and tokenizer.json's added tokens last."""
    added = load_json(folder / "added_tokens.json", required=False)
    decoder = load_json(folder / "tokenizer_config.json", required=False).get("added_tokens_decoder", {})
    entries = [(i, text, TokenType.USER_DEFINED) for text, i in added.items()]
    marked = [(key, data) for key, data in (decoder.items() if isinstance(decoder, dict) else ())]
    if as_marked:
        marked += [(data.get("id"), data) for data in load_json(folder / "tokenizer.json", required=False).get(
            "added_tokens", []) if isinstance(data, dict)]
    for key, data in marked:
        text = data.get("content") if isinstance(data, dict) else None
        if isinstance(text, str) and str(key).isdigit():
            special = data.get("special") or (not as_marked and _looks_special(text))
            entries.append((int(key), text if special or as_marked else text.replace("\u2581", " "),
                            TokenType.CONTROL if special else TokenType.USER_DEFINED))
    for i, text, kind in entries:
        if isinstance(i, int) and 0 <= i < len(tokens):
            tokens[i], scores[i], types[i] = text, -1000.0, kind


def read_tokenizer(folder: Path, vocab_size: int, arch) -> tuple[TokenizerData, dict]:
    """The vocabulary and the special-token settings (ids, add_bos, chat template), as llama.cpp's
    converter for the architecture (gguf_io.Architecture) reads them."""
    spm, tj = folder / "tokenizer.model", folder / "tokenizer.json"
    if spm.exists() and (arch.sentencepiece_first or not tj.exists()) and not arch.byte_fallback_model:
        tok = _spm_from_model(spm, vocab_size, arch.added_tokens_as_marked)
    elif tj.exists():
        tok = _bpe_from_json(load_json(tj), vocab_size, arch.byte_fallback_model, folder)
    else:
        raise ConversionError("no tokenizer.json or tokenizer.model in the folder")
    special = _special_settings(folder, tok, arch.special_tokens)
    if arch.byte_fallback_model:  # (llama.cpp's Gemma 4 converter always adds BOS)
        special["add_bos"] = True
    return tok, special


def _special_settings(folder: Path, tok: TokenizerData, special_tokens: tuple) -> dict:
    cfg = load_json(folder / "tokenizer_config.json", required=False)
    gen = load_json(folder / "generation_config.json", required=False)
    tokenizer = load_json(folder / "tokenizer.json", required=False)
    ids = {t: i for i, t in enumerate(tok.tokens)}
    # (tokenizer_config.json names its special tokens by text, which llama.cpp's converter looks up
    # among tokenizer.json's added tokens alone, the first that matches)
    added = {}
    for entry in tokenizer.get("added_tokens", []):
        added.setdefault(entry.get("content"), entry.get("id"))

    def token_id(value):
        value = _token_text(value)
        return added.get(value) if isinstance(value, str) else None

    out = {}
    for name in _NAMED_SPECIALS:
        i = token_id(cfg.get(f"{name}_token"))
        if i is not None:
            out[name] = i
    # those still unset from the ids of generation_config.json, then config.json (as llama.cpp's converter)
    for source in (gen, load_json(folder / "config.json", required=False)):
        for name in ("bos", "eos", "unk", "pad"):
            value = source.get(f"{name}_token_id")
            if isinstance(value, list) and value:
                value = value[0]
            if isinstance(value, int) and 0 <= value < len(tok.tokens) and name not in out:
                out[name] = value
    for name, text in special_tokens:  # (last, as llama.cpp's converter sets them by text)
        if text in ids and name not in out:
            out[name] = ids[text]
    adds, ends_with = _post_processor_adds(tokenizer, cfg)
    out.update(adds)
    if ends_with in added:  # (a template ending in another token makes it EOS, the configured one EOT)
        if token_id(cfg.get("eos_token")) is not None:
            out["eot"] = token_id(cfg["eos_token"])
        out["eos"] = added[ends_with]
    for name in ("add_bos", "add_eos"):  # (the post-processor's word wins, as in llama.cpp's converter)
        if isinstance(cfg.get(f"{name}_token"), bool) and name not in out:
            out[name] = cfg[f"{name}_token"]
    jinja = folder / "chat_template.jinja"
    template = cfg.get("chat_template", jinja.read_text(encoding="utf-8") if jinja.exists() else None)
    if isinstance(template, str):
        out["chat_template"] = template
    return out


def _token_text(value):
    """A special token as tokenizer_config.json names it: its text, or an object with its content."""
    return value.get("content") if isinstance(value, dict) else value


def _post_processor_adds(tokenizer: dict, cfg: dict) -> tuple[dict, str | None]:
    """Whether encoding adds BOS and EOS, as llama.cpp's converter reads tokenizer.json's
    post-processor: a byte-level one adds neither, RoBERTa's both, a template what it begins and
    ends with (BOS unless the config names both a BOS and a CLS token and it begins with neither; EOS where
    it ends with a special token, which becomes EOS: returned where it is not the configured one)."""
    bos, cls, eos = (_token_text(cfg.get(f"{name}_token")) for name in ("bos", "cls", "eos"))
    adds, ends_with = {}, None
    processor = tokenizer.get("post_processor") or {}
    for step in processor.get("processors", [processor]):
        kind = step.get("type")
        if kind == "ByteLevel":
            adds.setdefault("add_bos", False)
            adds.setdefault("add_eos", False)
        elif kind == "RobertaProcessing":
            adds.update(add_bos=True, add_eos=True)
        elif kind == "TemplateProcessing" and len(single := step.get("single", [])) > 1:
            if first := single[0].get("SpecialToken", {}).get("id"):
                adds["add_bos"] = not (bos and cls) or first in (bos, cls)
            if last := single[-1].get("SpecialToken", {}).get("id"):
                adds["add_eos"] = True
                ends_with = None if last == eos else last
    return adds, ends_with
