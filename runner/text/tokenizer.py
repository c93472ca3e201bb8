"""Text to token ids and back, from a GGUF vocabulary, following llama.cpp's tokenizers.

`gpt2` vocabularies are byte-level BPE over pre-tokenized pieces; `llama` vocabularies are
SentencePiece: greedy highest-score merges over characters with byte fallback; `gemma4` is BPE
over the UTF-8 text itself, spaces written as ▁, split only at newlines, with byte fallback. In both, the
texts of control tokens (where special tokens are parsed) and of user-defined ones (always, as in
llama.cpp) are matched in the input first and become those tokens.
"""
from __future__ import annotations

import codecs
import heapq

import numpy as np
from gguf import TokenType

from gguf_io import GGUFError, Vocab

from .pretokenize import IGNORE_MERGES, PreTokenizer, canonical_name


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_TO_UNICODE = _byte_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}
SPM_SPACE = "\u2581"


def _merge_greedy(symbols: list[str], pair_priority) -> list[str]:
    """Repeatedly merge the adjacent pair with the best priority (lowest value, leftmost on ties).

    pair_priority(left, right) returns a sortable priority or None when the pair cannot merge.
    """
    n = len(symbols)
    if n < 2:
        return symbols
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    heap = []
    for i in range(n - 1):
        p = pair_priority(symbols[i], symbols[i + 1])
        if p is not None:
            heap.append((p, i, symbols[i], symbols[i + 1]))
    heapq.heapify(heap)
    while heap:
        p, left, ltext, rtext = heapq.heappop(heap)
        right = nxt[left]
        if right == -1 or symbols[left] != ltext or symbols[right] != rtext:
            continue  # stale: one side was merged since this pair was queued
        symbols[left] = ltext + rtext
        symbols[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] != -1:
            prev[nxt[right]] = left
        for a, b in ((prev[left], left), (left, nxt[left])):
            if a != -1 and b != -1:
                q = pair_priority(symbols[a], symbols[b])
                if q is not None:
                    heapq.heappush(heap, (q, a, symbols[a], symbols[b]))
    return [s for s in symbols if s]


def valid_utf8(text: str) -> str:
    """text with what was not UTF-8 (bytes decoded as lone surrogates) as U+FFFD, as llama.cpp
    replaces invalid bytes."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        data = b"".join(bytes([ord(c) - 0xDC00]) if 0xDC80 <= ord(c) <= 0xDCFF else c.encode("utf-8", "surrogatepass")
                        for c in text)  # each undecodable byte back as itself, then decoded as llama.cpp does
        return data.decode("utf-8", "replace")


class SpecialTokens:
    """Finds the texts of special tokens in a text, left to right, the longest one at each
    position: a trie walked from the characters that can start one. (Gemma 3 has 6414 special
    tokens, most of them HTML tags; as one regex alternation they are slow to compile at
    start-up and slow to match.)"""

    def __init__(self, texts, always=()):
        """texts: the special tokens' texts; always: those matched in literal spans too (llama.cpp
        splits user-defined tokens out of any text, control tokens only when parsing special)."""
        self._trie: dict = {}
        for text, anywhere in [(t, False) for t in texts] + [(t, True) for t in always]:
            if text:
                node = self._trie
                for ch in text:
                    node = node.setdefault(ch, {})
                node[""] = anywhere or node.get("", False)  # a token ends here (no character is "")
        self._anywhere = any(always)

    def split(self, text: str, literal=()):
        """(fragment, is_special) for the pieces of text in order. `literal`: sorted, disjoint
        (start, end) spans of text whose control-token texts stay plain text (what a user typed)."""
        root, n = self._trie, len(text)
        spans = iter(literal)
        lit_start, lit_end = next(spans, (n, n))
        start = i = 0
        while i < n:
            in_literal = i >= lit_start
            if in_literal and (i >= lit_end or not self._anywhere):  # past, or nothing to find in it
                i = max(i, lit_end)
                lit_start, lit_end = next(spans, (n, n))
                continue
            # (a token may not straddle a span's boundary)
            node, end, j, limit = root, 0, i, lit_end if in_literal else lit_start
            while j < limit and (node := node.get(text[j])) is not None:
                j += 1
                if node.get("") is True or ("" in node and not in_literal):
                    end = j
            if not end:
                i += 1
                continue
            if i > start:
                yield text[start:i], False
            yield text[i:end], True
            start = i = end
        if start < n:
            yield text[start:], False


class Tokenizer:
    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.token_to_id = {t: i for i, t in enumerate(vocab.tokens)}
        types = vocab.token_types
        self._specials = SpecialTokens([vocab.tokens[i] for i in np.flatnonzero(types == TokenType.CONTROL)],
                                       [vocab.tokens[i] for i in np.flatnonzero(types == TokenType.USER_DEFINED)])
        self._cache: dict[str, list[int]] = {}
        if vocab.model in ("gpt2", "gemma4"):
            pre = "gemma4" if vocab.model == "gemma4" else canonical_name(vocab.pre)
            if pre is None:
                raise GGUFError(f"pre-tokenizer {vocab.pre!r} is not supported")
            self._pre = PreTokenizer(pre)
            self._ignore_merges = pre in IGNORE_MERGES
            self._byte_level = vocab.model == "gpt2"  # (pieces as GPT-2's byte characters, else as text)
            # keyed by the merge's own "left right" text; reversed so the first occurrence wins
            n = len(vocab.merges)
            self._ranks = dict(zip(reversed(vocab.merges), range(n - 1, -1, -1)))
        self._byte_tokens = [self.token_to_id.get(f"<0x{b:02X}>", -1) for b in range(256)]

    # -- encoding --------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True, literal=(),
               continuation: bool = False) -> list[int]:
        """Token ids of text; BOS/EOS added when add_special and the vocabulary asks for them.
        Special-token texts become their tokens when parse_special, except in the `literal` spans
        (see SpecialTokens.split); without parse_special all text is plain. A continuation (of
        text already tokenized) gets no SentencePiece space prefix at its start."""
        v = self.vocab
        text = valid_utf8(text)
        ids: list[int] = []
        if add_special and v.add_bos and v.bos_id >= 0:
            ids.append(v.bos_id)
        prev_special = not continuation
        if not parse_special:
            literal = ((0, len(text)),)
        for fragment, is_special in self._specials.split(text, literal):
            if is_special:
                ids.append(self.token_to_id[fragment])
            elif v.model in ("gpt2", "gemma4"):
                if not self._byte_level:
                    fragment = fragment.replace(" ", SPM_SPACE)
                for piece in self._pre.split(fragment):
                    ids.extend(self._bpe_piece(piece))
            else:
                ids.extend(self._spm(fragment, space_prefix=v.add_space_prefix and prev_special))
            prev_special = is_special
        if add_special and v.add_eos and v.eos_id >= 0:
            ids.append(v.eos_id)
        return ids

    def encode_rendered(self, text: str, literal=(), first: bool = True) -> list[int]:
        """Tokens of a rendered chat template: its markup parsed for special tokens, the
        `literal` spans (what users wrote) plain; when `first`, BOS leads as the vocabulary asks,
        unless the template wrote it itself."""
        ids = self.encode(text, add_special=False, literal=literal)
        bos = self.vocab.bos_id
        if first and self.vocab.add_bos and bos >= 0 and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def _bpe_piece(self, piece: str) -> list[int]:
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        word = "".join(BYTE_TO_UNICODE[b] for b in piece.encode("utf-8")) if self._byte_level else piece
        # (Gemma 4 takes a run of newlines whole where the vocabulary has it)
        if (self._ignore_merges or not word.strip("\n")) and word in self.token_to_id:
            ids = [self.token_to_id[word]]
        else:
            ranks = self._ranks
            ids = []
            for sym in _merge_greedy(list(word), lambda a, b: ranks.get(a + " " + b)):
                tid = self.token_to_id.get(sym)
                if tid is not None:
                    ids.append(tid)
                elif self._byte_level:  # llama.cpp falls back to the symbol's single characters
                    ids.extend(self.token_to_id[c] for c in sym if c in self.token_to_id)
                else:  # or its bytes' <0xXX> tokens
                    ids.extend(self._byte_tokens[b] for b in sym.encode("utf-8") if self._byte_tokens[b] >= 0)
        if len(self._cache) < 100_000:
            self._cache[piece] = ids
        return ids

    def _spm(self, text: str, space_prefix: bool) -> list[int]:
        text = ((" " if space_prefix else "") + text).replace(" ", SPM_SPACE)
        scores, vocab_ids = self.vocab.scores, self.token_to_id

        def priority(a, b):
            tid = vocab_ids.get(a + b)
            return None if tid is None else -float(scores[tid]) if scores is not None else 0.0

        ids = []
        for sym in _merge_greedy(list(text), priority):
            tid = vocab_ids.get(sym)
            if tid is not None:
                ids.append(tid)
            else:  # byte fallback: <0xXX> tokens, or unknown
                for b in sym.encode("utf-8"):
                    bt = self._byte_tokens[b]
                    ids.append(bt if bt >= 0 else self.vocab.unk_id)
        return ids

    # -- decoding --------------------------------------------------------------------------

    def token_bytes(self, token_id: int, render_special: bool = False) -> bytes:
        """The bytes a token stands for; control tokens render empty unless render_special."""
        v = self.vocab
        if not 0 <= token_id < len(v.tokens):
            return b""
        text, ttype = v.tokens[token_id], int(v.token_types[token_id])  # (an int: a NumPy scalar compares slowly)
        if ttype == TokenType.CONTROL:
            return text.encode("utf-8") if render_special else b""
        if v.model == "gpt2" or ttype == TokenType.USER_DEFINED:
            if ttype == TokenType.USER_DEFINED:
                return text.encode("utf-8")
            return bytes(UNICODE_TO_BYTE.get(c, 0x3F) for c in text)
        if ttype == TokenType.BYTE and len(text) == 6 and text.startswith("<0x"):
            return bytes([int(text[3:5], 16)])
        return text.replace(SPM_SPACE, " ").encode("utf-8")

    def decode(self, ids, render_special: bool = False) -> str:
        return b"".join(self.token_bytes(i, render_special) for i in ids).decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> str:
        return self.token_bytes(token_id, render_special=True).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns a stream of token ids into text, never splitting a UTF-8 character across tokens."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
