"""Constrained decoding: a Grammar (llama.cpp's GBNF, or a JSON schema) that the generated text
must follow, and a Matcher per sequence that says which tokens may come next. llguidance does the
parsing (an Earley parser over a lexer, its masks in tens of microseconds); its tokenizer is built
from the GGUF vocabulary's token bytes, as llama.cpp's common/llguidance.cpp builds it: control
tokens' text behind a 0xff byte (so that no grammar text matches them), ggrun's own tokenizer as its
tokenize callback, the end-of-generation tokens as its EOS.

A grammar is checked when it is made: an invalid one, and a schema asking for what llguidance
cannot enforce (its errors and its warnings alike), raise a GrammarError naming the problem; the
schema's features are never dropped silently (llguidance's `lenient` and `coerce_one_of` are
forced off)."""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import numpy as np

from ..text.lark import TEXT_RULE, WS, Literals, control_tokens
from ..text.reasoning import REASONING_MARKUP, answer_opening, reasoning_head

# JSON whitespace between tokens, as llama.cpp's json-schema-to-grammar bounds it (a space, or up to
# two newlines and an indentation of 20): unbounded, a small model can fill max_tokens with it.
JSON_WHITESPACE = r" |\n{1,2}[ \t]{0,20}"
# llguidance's settings for a schema inside a Lark grammar (%json): that whitespace, no feature dropped
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE, "lenient": False, "coerce_one_of": False}


class GrammarError(ValueError):
    """A grammar or JSON schema that is invalid, or that asks for what cannot be enforced."""


@dataclass(frozen=True)
class Grammar:
    """What a constrained generation must follow; made by gbnf() or json_schema(), which check it."""
    kind: str       # "grammar" (GBNF) or "JSON schema", as messages name it
    compiled: str   # llguidance's grammar

    @classmethod
    def gbnf(cls, text: str) -> Grammar:
        """llama.cpp's GBNF (a `root` rule and the rules it uses; llguidance's Lark syntax also works)."""
        import llguidance
        try:
            compiled = llguidance.grammar_from("gbnf", text)
        except ValueError as e:
            problem = _one_line(str(e)).removeprefix("Failed to convert the grammar from GBNF to Lark: ")
            raise GrammarError(f"invalid grammar: {problem}") from None
        return cls._checked("grammar", compiled)

    @classmethod
    def json_schema(cls, schema: str | dict | bool) -> Grammar:
        """A JSON schema (its text, or parsed): the output is one JSON value it validates. Refused:
        keywords llguidance does not implement (not, if/then, uniqueItems, contains ...), a oneOf
        whose branches may overlap (llguidance enforces it as anyOf only where that is the same),
        unsatisfiable bounds, and minProperties above 1 (llguidance does not keep the extra keys
        of an object distinct, so two of the same name could make up the count)."""
        import llguidance
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not JSON: {e}") from None
            except RecursionError:
                raise GrammarError("the JSON schema is nested too deeply") from None
        if schema is False:
            raise GrammarError("invalid JSON schema: false allows no value")
        if schema is True:
            schema = {}  # (any value)
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema is an object (or true or false), not {type(schema).__name__}")
        counted = _min_properties(schema)
        if counted is not None:
            raise GrammarError(f"the JSON schema cannot be enforced: minProperties {counted} (llguidance does not keep "
                               "an object's additional keys distinct, so a repeated key could make up the count)")
        # (a schema's own "x-guidance" settings, llguidance's extension, may set its whitespace)
        own = isinstance(schema, dict) and isinstance(schema.get("x-guidance"), dict)
        try:
            compiled = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults=None if own else {"whitespace_pattern": JSON_WHITESPACE},
                overrides={"lenient": False, "coerce_one_of": False})
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {_one_line(str(e))}") from None
        return cls._checked("JSON schema", compiled)

    @classmethod
    def lark(cls, text: str, kind: str = "tool-call grammar") -> Grammar:
        """llguidance's own Lark grammar, as ggrun writes them (text/tool_calls.py); its control
        tokens named by id (`<[id]>`) are checked against the vocabulary by the Matcher."""
        return cls._checked(kind, text)

    @classmethod
    def tool_calls(cls, fmt, tools: list, choice: str, parallel: bool, control: dict[str, int],
                   reasoning: str | None) -> Grammar:
        """A reply in a tool-call format (text/tool_calls.py's ToolFormat.grammar), the arguments'
        schemas with ggrun's JSON settings; GrammarError where an argument cannot be held to its
        schema."""
        try:
            return cls.lark(fmt.grammar(tools, choice, parallel, control, reasoning, JSON_OPTIONS))
        except ValueError as e:  # (a GrammarError, or a schema feature the format's syntax cannot hold to)
            raise GrammarError(str(e)) from None

    def after_reasoning(self, fmt: str | None, control: dict[str, int]) -> Grammar:
        """This grammar after a reasoning model's thinking (text/reasoning.py's formats, None:
        none): the reasoning comes first, free, then what this grammar allows (in harmony, as the
        final message). control: the vocabulary's control tokens of the reasoning markup, by text."""
        if fmt is None:
            return self
        lit = Literals(control)
        head = f"{reasoning_head(fmt, lit)} {'' if answer_opening(fmt) else WS} {lit(answer_opening(fmt))}"
        parts = json.loads(self.compiled)["grammars"] if self.compiled.startswith("{") else \
            [{"lark_grammar": self.compiled}]
        top = "\n".join(["%llguidance {}", f"start: {head} @answer", *lit.rules, TEXT_RULE])
        grammars = [{"name": "reply", "lark_grammar": top}, {**parts[0], "name": "answer"}, *parts[1:]]
        return Grammar(self.kind, json.dumps({"grammars": grammars}))

    @classmethod
    def _checked(cls, kind: str, compiled: str) -> Grammar:
        """The grammar, once llguidance validates it with neither errors nor warnings (a warning
        says what it would not enforce)."""
        import llguidance
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled)
        messages = [m for m in messages if _NO_TOKENIZER not in m]
        if messages:
            problem = "; ".join(_explained(m) for m in messages)
            if not is_error or any(words in m for m in messages for words in _UNENFORCEABLE):
                raise GrammarError(f"the {kind} cannot be enforced: {problem}")
            raise GrammarError(f"invalid {kind}: {problem}")
        return cls(kind, compiled)


def reply_grammar(grammar: Grammar | None, vocab, fmt: str | None) -> Grammar | None:
    """The grammar of a chat reply by a model whose replies mark their reasoning in format fmt
    (text/reasoning.py's; None: they do not): it applies after the reasoning, which is free."""
    if grammar is None or fmt is None:
        return grammar
    return grammar.after_reasoning(fmt, control_tokens(vocab, REASONING_MARKUP))


# what llguidance's errors say of a feature it does not implement (not of a mistake in the schema)
_UNENFORCEABLE = ("Unimplemented", "not supported", "Unknown format")
_NO_TOKENIZER = "no tokenizer - can't validate <[...]>"  # (a token by id: the Matcher checks it)
_ONE_OF = "oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate oneOf with anyOf"


def _explained(message: str) -> str:
    message = _one_line(message)
    if _ONE_OF in message:  # (ggrun keeps coerce_one_of off: say what the user can do instead)
        return message.replace(_ONE_OF, "a oneOf whose branches may overlap (llguidance enforces oneOf only where "
                                        "no value can match two branches; anyOf allows that)")
    return message


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _min_properties(schema) -> int | None:
    """A minProperties above 1 anywhere in a schema (the keyword's own value is a number, which
    tells it from a property of that name), or None; walked with a stack, since a hostile schema
    may nest deeper than Python's recursion."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            value = node.get("minProperties")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1:
                return value
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> its llguidance tokenizer


def guidance_tokenizer(tokenizer):
    """llguidance's tokenizer for a ggrun Tokenizer, built once per tokenizer (~1 s for a 256k
    vocabulary)."""
    built = _TOKENIZERS.get(tokenizer)
    if built is None:
        import llguidance
        ends = sorted(tokenizer.vocab.end_of_generation)
        wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, ends))
        built = llguidance.LLTokenizer(wrapper, eos_token=ends or None)
        _TOKENIZERS[tokenizer] = built
    return built


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads of a tokenizer, as llama.cpp's common/llguidance.cpp
    gives it: each token's bytes as the model prints them, a control token's text behind 0xff (so
    that only a grammar naming it allows it); the end-of-generation tokens as EOS. Its tokenize
    callback (which makes the tokens of text a grammar forces) gives plain text's tokens, never a
    control token for text that spells one (whose bytes the grammar's text does not have), and, as
    the text continues a reply, no SentencePiece space prefix."""

    def __init__(self, tokenizer, ends: list[int]):
        self.tokenizer = weakref.ref(tokenizer)  # (the cache holds what holds this: no strong reference back)
        self.tokens = [tokenizer.token_bytes(i) or _special(tokenizer.token_bytes(i, render_special=True))
                       for i in range(len(tokenizer.vocab.tokens))]
        self.eos_token_id = ends[0] if ends else None
        self.bos_token_id = tokenizer.vocab.bos_id if tokenizer.vocab.bos_id >= 0 else None

    def __call__(self, text: bytes) -> list[int]:
        return self.tokenizer().encode(text.decode("utf-8", "replace"), add_special=False, parse_special=False,
                                       continuation=True)


def _special(text: bytes) -> bytes:
    return b"\xff" + text if text else b""


class TokenMask:
    """The tokens a grammar allows next, packed as llguidance gives them (token i: bit i % 32 of
    word i // 32): a token's bit is read without unpacking the whole vocabulary, which a greedy
    choice whose best token is allowed never needs."""

    def __init__(self, words: np.ndarray, size: int):
        self.size = size
        self.words = np.zeros((size + 31) // 32, dtype=np.uint32)
        n = min(len(words), len(self.words))
        self.words[:n] = words[:n]
        if size % 32:  # (no bit beyond the logits)
            self.words[-1] &= np.uint32((1 << (size % 32)) - 1)
        self.count = int(np.bitwise_count(self.words).sum())
        self._array: np.ndarray | None = None

    def __contains__(self, token: int) -> bool:
        return 0 <= token < self.size and bool((int(self.words[token >> 5]) >> (token & 31)) & 1)

    def discard(self, token: int) -> None:
        if token in self:
            self.words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
            self.count -= 1
            self._array = None

    def array(self) -> np.ndarray:
        """The mask as one boolean per token."""
        if self._array is None:
            self._array = np.unpackbits(self.words.view(np.uint8), count=self.size, bitorder="little").view(bool)
        return self._array

    def only(self) -> int:
        """The first allowed token (the only one, where count is 1)."""
        word = int(np.flatnonzero(self.words)[0])
        return word * 32 + (int(self.words[word]) & -int(self.words[word])).bit_length() - 1


class Matcher:
    """One sequence's place in a grammar: the tokens allowed next (as a TokenMask does: `token in
    matcher`, count, only(), array()), fed each token handed out. `ends`: the ids that end this
    generation (its stop ids); the grammar's end-of-generation tokens outside them are never
    allowed while the grammar can go on."""

    def __init__(self, grammar: Grammar, tokenizer, size: int, ends=None):
        import llguidance
        self._llg = llguidance.LLMatcher(guidance_tokenizer(tokenizer), grammar.compiled, log_level=0)
        self._check()
        self.size = size
        eos = sorted(tokenizer.vocab.end_of_generation)
        ends = tokenizer.vocab.end_of_generation if ends is None else ends
        self._eos_ids = [t for t in eos if t < size]
        words = np.zeros((size + 31) // 32, dtype=np.uint32)
        for t in self._eos_ids:
            words[t >> 5] |= np.uint32(1 << (t & 31))
        self._eos = TokenMask(words, size)
        self._not_ends = [t for t in eos if t not in ends and t < size]
        self._eos_set = set(eos)
        self._state: tuple[TokenMask, bool] | None = None  # (the allowed tokens, finished) where they are known
        self._rolled_back = False  # (llguidance's is_stopped() is not kept up to date by a rollback)

    def _check(self) -> None:
        if self._llg.is_error():
            raise GrammarError(f"the grammar failed: {_one_line(self._llg.get_error())}")

    def _current(self) -> tuple[TokenMask, bool]:
        if self._state is None:
            mask = TokenMask(np.frombuffer(self._llg.compute_bitmask(), dtype=np.uint32), self.size)
            self._check()
            # (llguidance's own is_stopped() is not kept up to date by a rollback: the mask is)
            finished = mask.count == sum(t in mask for t in self._eos_ids)
            if finished:
                mask = self._eos  # (never chosen from: a generation stops first)
            else:
                for t in self._not_ends:
                    mask.discard(t)
            self._state = mask, finished
        return self._state

    # -- what Sampler.choose asks of the tokens allowed (TokenMask answers it too) ------------------

    def __contains__(self, token: int) -> bool:
        """Whether the grammar allows token next: asked of llguidance for that token alone (a
        fraction of a microsecond, where the whole mask takes up to hundreds) until the mask is
        known, the grammar stopped, a rollback made is_stopped() unreliable, or token ends text."""
        if self._state is None and not self._rolled_back and token not in self._eos_set:
            return 0 <= token < self.size and not self._llg.is_stopped() and self._llg.validate_tokens([token]) == 1
        return token in self._current()[0]

    @property
    def count(self) -> int:
        return self._current()[0].count

    def only(self) -> int:
        return self._current()[0].only()

    def array(self) -> np.ndarray:
        return self._current()[0].array()

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, one boolean per token (where it is finished: its
        end-of-generation tokens)."""
        return self.array()

    def forced(self) -> int | None:
        """The only token the grammar allows next, where it allows one only."""
        return self.only() if self.count == 1 else None

    @property
    def finished(self) -> bool:
        """Whether the grammar is complete: nothing but an end of generation may follow."""
        if self._state is None and not self._rolled_back:
            return self._llg.is_stopped()
        return self._current()[1]

    def accept(self, token: int) -> None:
        """A token chosen (from the allowed ones), the grammar moved past it."""
        self._state = None
        if not self._llg.consume_token(token):
            raise GrammarError(f"token {token} does not follow the grammar: {_one_line(self._llg.get_error())}")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, from the first, the grammar allows in turn (a draft is cut there)."""
        return self._llg.validate_tokens(tokens) if tokens else 0

    def rollback(self, n: int) -> None:
        """The last n tokens accepted taken back."""
        if n:
            self._state, self._rolled_back = None, True
            self._llg.rollback(n)
