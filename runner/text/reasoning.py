"""A reply's reasoning apart from its answer, as the model's tokens mark them.

Three formats, recognised by the vocabulary:
- harmony (gpt-oss): messages `<|channel|>NAME<|message|>TEXT<|end|>`, each after
  `<|start|>ROLE`; the analysis channel is the reasoning, final (and commentary, a tool
  preamble) the answer; the header tokens between are markup.
- think tags (Qwen 3, DeepSeek R1 and their kin): the text between `<think>` and `</think>`.
- a thought channel (Gemma 4): `<|channel>thought\nTEXT<channel|>`, its first line the
  channel's name.

ReplyDecoder turns the generated ids into text as StreamDecoder does, and says which part each
piece belongs to; the chat shows reasoning apart (or hides it) and keeps it beside the answer.
"""
from __future__ import annotations

import re

from .tokenizer import StreamDecoder

REASONING, ANSWER = "reasoning", "answer"
_HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
_THINK = ("<think>", "</think>")
_CHANNEL = ("<|channel>", "<channel|>")


def reasoning_format(vocab) -> str | None:
    """"harmony", "think", "channel" or None: how the model's replies mark their reasoning."""
    tokens = set(vocab.tokens[:300_000])
    if all(t in tokens for t in _HARMONY):
        return "harmony"
    if all(t in tokens for t in _THINK):
        return "think"
    if all(t in tokens for t in _CHANNEL):
        return "channel"
    return None


def reasoning_head(fmt: str, lit) -> str:
    """Lark (lark.Literals writes it) for a reply's optional reasoning before what a grammar
    constrains: think tags (the opening may be in the prompt already), or harmony's analysis
    message and the header of the next."""
    if fmt == "harmony":
        body = lit.until("<|end|>", "analysis_body")
        return f"({lit('<|channel|>analysis<|message|>')} {body} {lit('<|start|>assistant')})?"
    if fmt == "channel":
        return f"({lit('<|channel>')} {lit.until('<channel|>', 'thought_body')})?"
    return f"({lit('<think>')}? {lit.until('</think>', 'think_body')})?"


def answer_opening(fmt: str | None) -> str:
    """What comes before a reply's answer, after its reasoning: harmony's final-channel header."""
    return "<|channel|>final<|message|>" if fmt == "harmony" else ""


REASONING_MARKUP = "".join(_HARMONY) + "".join(_THINK) + "".join(_CHANNEL)  # (the control tokens reasoning_head may write)


class ReplyDecoder(StreamDecoder):
    """StreamDecoder that follows a reply's structure: after each push, `part` is REASONING or
    ANSWER for the text it returned (markup returns no text).

    shown: control tokens (by id) to give as text, a tool-call format's markup, which its parser
    reads; with them (tool calls are read), a harmony message addressed to a recipient (a tool call) begins with
    `to=RECIPIENT<|message|>` in the answer."""

    def __init__(self, tokenizer, fmt: str | None, shown: dict[int, str] | None = None):
        super().__init__(tokenizer)
        self.format = fmt
        self._markers = {}
        for text in {"harmony": _HARMONY, "think": _THINK, "channel": _CHANNEL}.get(fmt, ()):
            self._markers[tokenizer.vocab.tokens.index(text)] = text
        self._shown = shown or {}
        self._calls = shown is not None
        # a harmony reply starts after its generation prompt's <|start|>assistant: a header
        self._state = "header" if fmt == "harmony" else "content"
        self._header = self._channel = ""
        self.part = ANSWER

    def push(self, token_id: int) -> str:
        marker = self._markers.get(token_id)
        if marker is None:
            text = self._shown.get(token_id) or super().push(token_id)
            if self._state == "name":  # (a thought channel's first line names it)
                if "\n" not in text:
                    return ""
                self._state, text = "content", text.split("\n", 1)[1]
            if self._state == "content":
                return text
            self._header += text
            if self._state == "channel":
                self._channel += text
            return ""
        if marker == "<think>":
            self.part = REASONING
        elif marker in ("</think>", "<channel|>"):
            self.part, self._state = ANSWER, "content"
        elif marker == "<|channel>":
            self.part, self._state = REASONING, "name"
        elif marker == "<|channel|>":
            self._state, self._channel = "channel", ""
        elif marker == "<|message|>":
            self._state = "content"
            self.part = REASONING if (self._channel.split() or [""])[0] == "analysis" else ANSWER
            recipient = re.search(r"to=(\S+)", self._header)
            if recipient and self._calls:
                self.part = ANSWER
                return f"to={recipient.group(1)}<|message|>"
        else:  # <|start|> opens a header, <|end|> closes a message
            self._state, self._header = "header", ""
        return ""  # (markup)


class SplitReply:
    """A reply's pieces gathered by part."""

    def __init__(self):
        self.parts = {REASONING: [], ANSWER: []}

    def add(self, part: str, text: str) -> None:
        self.parts[part].append(text)

    @property
    def reasoning(self) -> str:
        return "".join(self.parts[REASONING]).strip()

    @property
    def answer(self) -> str:
        return "".join(self.parts[ANSWER])
