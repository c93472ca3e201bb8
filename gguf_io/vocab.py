"""The tokenizer vocabulary stored in a GGUF file's `tokenizer.*` metadata."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf import TokenType

from .errors import GGUFError
from .file import GGUFFile

# Texts that end a turn in common chat formats. llama.cpp adds tokens with these texts to its
# end-of-generation set even when the file names no EOT id; so do we (its list).
END_OF_TURN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~["})
# tokenizer.ggml.model values: byte-level BPE, SentencePiece, and Gemma 4's BPE over UTF-8 text
# whose spaces are written as ▁ (SentencePiece-style, with merges)
TOKENIZER_MODELS = ("gpt2", "llama", "gemma4")


@dataclass
class Vocab:
    model: str                      # one of TOKENIZER_MODELS
    pre: str                        # pre-tokenizer name, gpt2 model only
    tokens: list[str]
    token_types: np.ndarray         # gguf.TokenType per token
    scores: np.ndarray | None       # SentencePiece piece scores
    merges: list[str]               # BPE merges "left right", in priority order
    bos_id: int
    eos_id: int
    unk_id: int
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    end_of_generation: frozenset[int] = field(default_factory=frozenset)
    chat_template: str | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def special_ids(self) -> np.ndarray:
        """Control and user-defined tokens: matched as whole strings in prompt text."""
        return np.flatnonzero((self.token_types == TokenType.CONTROL) | (self.token_types == TokenType.USER_DEFINED))


def read_vocab(f: GGUFFile) -> Vocab:
    """The vocabulary, each key checked for its type and the ids for the vocabulary's range."""
    if f.get("tokenizer.ggml.model") is None or f.get("tokenizer.ggml.tokens") is None:
        raise GGUFError(f"{f.path.name}: the file has no tokenizer (tokenizer.ggml.model / tokens missing)")
    model, tokens = f.get_str("tokenizer.ggml.model"), f.get_strings("tokenizer.ggml.tokens")
    if model not in TOKENIZER_MODELS:
        raise GGUFError(f"{f.path.name}: tokenizer model {model!r} is not supported "
                        f"({', '.join(TOKENIZER_MODELS)} are)")
    n = len(tokens)
    if n == 0:
        raise GGUFError(f"{f.path.name}: the tokenizer has no tokens")
    types = f.get_numbers("tokenizer.ggml.token_type", np.full(n, TokenType.NORMAL, np.int32), size=n, integer=True)
    scores = f.get("tokenizer.ggml.scores")
    if scores is not None:
        scores = f.get_numbers("tokenizer.ggml.scores", size=n).astype(np.float32)
        if not np.isfinite(scores).all():
            f.refuse("tokenizer.ggml.scores", scores, "holds values that are not finite")

    def token_id(key):
        """The id stored under key, -1 when absent; an id outside the vocabulary is an error."""
        return f.get_int(key, -1, lo=-1, hi=n - 1) if f.get(key) is not None else -1

    bos = token_id("tokenizer.ggml.bos_token_id")
    eos = token_id("tokenizer.ggml.eos_token_id")
    eog = {i for i in (eos, token_id("tokenizer.ggml.eot_token_id"),
                       token_id("tokenizer.ggml.eom_token_id")) if i >= 0}
    eog.update(i for i, t in enumerate(tokens) if t in END_OF_TURN_TEXTS)
    # (gpt-oss's harmony format ends a message with <|end|> and a reply with <|return|> or <|call|>:
    # llama.cpp drops <|end|> where both of those are there, and so where <|calls|> and <|flush|> are)
    texts = {tokens[i] for i in eog}
    if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
        eog.discard(tokens.index("<|end|>"))
    return Vocab(
        model=model,
        pre=f.get_str("tokenizer.ggml.pre", "default"),
        tokens=tokens,
        token_types=types.astype(np.int32),
        scores=scores,
        merges=f.get_strings("tokenizer.ggml.merges", []),
        bos_id=bos,
        eos_id=eos,
        unk_id=token_id("tokenizer.ggml.unknown_token_id"),
        # (llama.cpp always adds BOS for Gemma 4, whatever the file says)
        add_bos=f.get_bool("tokenizer.ggml.add_bos_token", model == "llama") or model == "gemma4",
        add_eos=f.get_bool("tokenizer.ggml.add_eos_token", False),
        add_space_prefix=f.get_bool("tokenizer.ggml.add_space_prefix", model == "llama"),
        end_of_generation=frozenset(eog),
        chat_template=f.get_str("tokenizer.chat_template", None),
    )
