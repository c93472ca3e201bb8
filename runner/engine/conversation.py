"""A conversation with a model: the chat template, the KV cache carried across turns (each turn
prefills only its own tokens), a ring-style context that never runs out, tool calls and their
results (chat_tools.py); the REPL around it is terminal/chat_repl.py."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from gguf_io.safe_files import atomic_output, check_output

from ..text.chat_template import (
    ChatTemplateError,
    builtin_template,
    choose_template,
    render_with_content_spans,
)
from ..text.reasoning import ReplyDecoder, SplitReply, reasoning_format
from ..text.tool_calls import Tool
from ..text.user_files import read_text
from .chat_tools import ChatTools
from .constraint import Grammar, reply_grammar
from .generate import GenerationStats
from .kv_cache import ContextFullError
from .kv_state import KVState, KVStateError
from .sampler import Sampler, SamplingOptions
from .session import Session
from .speculative import SpeculationStats


class ChatSession:
    def __init__(self, lm, n_ctx: int, options: SamplingOptions, system: str | None = None,
                 template_name: str | None = None, max_reply: int = 4096, save_kv: bool = False,
                 drafter=None, draft_max: int = 16, draft_min: int = 0, grammar: Grammar | None = None,
                 tools: list[Tool] | None = None):
        self.lm, self.n_ctx, self.options, self.max_reply = lm, n_ctx, options, max_reply
        # speculative decoding (speculative.py), its statistics over the conversation
        self.drafter, self.draft_max, self.draft_min = drafter, draft_max, draft_min
        self.speculation = SpeculationStats()
        self.save_kv = save_kv  # /save keeps the KV cache beside the messages
        self.template, self.warning = choose_template(lm.tokenizer.vocab, template_name)
        self.tools = ChatTools(tools or [], self.template, lm.tokenizer)
        self.reasoning = reasoning_format(lm.tokenizer.vocab)  # how replies mark their reasoning (text/reasoning.py)
        # what every reply follows (constraint.py), after its reasoning, or None
        self.grammar = self.tools.grammar or reply_grammar(grammar, lm.tokenizer.vocab, self.reasoning)
        self.system = system
        self.last = GenerationStats()
        self.interrupted = False
        self.notices: list[str] = []  # one-line messages for the user, shown by the REPL
        self._ring_noticed = False
        self.reset()

    # -- the conversation and the cache -------------------------------------------------------

    def reset(self) -> None:
        """A new conversation: empty cache, then the pinned prefix (BOS and the system prompt). A
        system prompt too long for the context raises ContextFullError and changes nothing."""
        prefix, ids = self._prefix(self.system)
        if len(ids) > self.max_prefix:
            what = "the system prompt and the tools take" if self.tools.tools else "the system prompt takes"
            raise ContextFullError(f"{what} {len(ids)} tokens; a context of {self.n_ctx} (-c) "
                                   f"keeps at most {self.max_prefix} of them pinned")
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.cache = self.lm.model.new_cache(self.n_ctx, ring=True)
        self.fed_text = ""     # the rendered conversation as far as it is in the cache
        self.fed_tokens = 0
        self.tokens = list(ids)  # those tokens, for a draft and the penalties (after a KV resume: the new ones)
        if ids:
            self.lm.model.forward(ids, self.cache)
            self.fed_text, self.fed_tokens = prefix, len(ids)
            self.cache.pin()

    @property
    def max_prefix(self) -> int:
        """The most tokens BOS and the system prompt may pin: half the context stays for the turns."""
        return self.n_ctx // 2

    def _prefix(self, system: str | None) -> tuple[str, list[int]]:
        """The text and tokens of BOS and `system`, pinned at the start of the context."""
        messages = [{"role": "system", "content": system}] if system else []
        shown = messages or self.tools.makes_system
        text, spans = self._render(messages, add_generation_prompt=False) if shown else ("", [])
        return text, self._tokens(text, spans, first=True)

    def set_system(self, system: str | None) -> None:
        """A new system prompt and a new conversation; a prompt too long for the context is
        refused (ContextFullError) and the conversation goes on as it was."""
        previous, self.system = self.system, system
        try:
            self.reset()
        except ContextFullError:
            self.system = previous
            raise

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list]:
        """The rendered conversation and its contents' spans. When the model's template fails on
        this conversation, the built-in one takes over (with a notice) and the chat goes on."""
        try:
            return self._rendered(messages, add_generation_prompt)
        except ChatTemplateError as e:
            if self.template.builtin:
                raise
            self.template = builtin_template(self.lm.tokenizer.vocab)
            self.notices.append(f"{e}; switched to the built-in {self.template.name} template")
            # (the built-in template has no tool format: the tools are described to the model instead)
            self.tools = ChatTools(self.tools.tools, self.template, self.lm.tokenizer)
            self.grammar = self.tools.grammar or self.grammar
            return self._rendered(messages, add_generation_prompt)

    def _rendered(self, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list]:
        shown, variables = self.tools.template_input(messages)
        return render_with_content_spans(self.template, shown, add_generation_prompt, **variables)

    def _tokens(self, text: str, spans, first: bool, offset: int = 0) -> list[int]:
        """Tokens of text (rendered[offset:]); the contents' spans are tokenized as plain text."""
        literal = [(max(start - offset, 0), end - offset) for start, end in spans if end > offset]
        return self.lm.tokenizer.encode_rendered(text, literal, first)

    def _catch_up(self, rendered: str, spans) -> list[int]:
        """Tokens that bring the cache from fed_text to `rendered`. Where a template renders the
        history otherwise than the cache holds it (a reply's reasoning dropped from later turns,
        as gpt-oss's and Qwen 3's templates do), the cache keeps the tokens both share and goes
        on from there, or starts again from its pinned prefix."""
        if not rendered.startswith(self.fed_text):
            ids = self._tokens(rendered, spans, first=True)
            keep = self._shared_tokens(ids)
            if keep is not None:
                self.cache.truncate(keep)
                self.tokens, self.fed_tokens = self.tokens[:keep], keep
                return ids[keep:]
            messages = self.messages
            self.reset()
            self.messages = messages
        first = self.fed_tokens == 0
        return self._tokens(rendered[len(self.fed_text):], spans, first=first, offset=len(self.fed_text))

    def _shared_tokens(self, ids: list[int]) -> int | None:
        """How many of ids, from the start, the cache holds already (at least its pinned prefix);
        None where it does not hold that prefix or no longer knows its tokens (the ring evicted
        some, or a KV resume brought them without their ids)."""
        pinned = self.cache.pinned
        if self.cache.evicted or len(self.tokens) != self.cache.used or ids[:pinned] != self.tokens[:pinned]:
            return None
        keep = pinned
        while keep < min(len(ids) - 1, len(self.tokens)) and ids[keep] == self.tokens[keep]:
            keep += 1
        return keep if self.cache.truncation_keeps(keep) else None  # (a recurrent state may not go back)

    def send(self, user_text: str, on_text=None) -> str:
        """One turn: returns the reply's answer (also the partial one, when interrupted); the text
        streams to on_text(piece, part), part reasoning.REASONING or ANSWER. A reply's tool calls
        do not stream: they are `pending_calls` once it is whole."""
        self.messages.append({"role": "user", "content": user_text})
        return self._reply(on_text)

    @property
    def pending_calls(self) -> list[dict]:
        """The last reply's tool calls (OpenAI's shape), which wait for their results."""
        last = self.messages[-1] if self.messages else {}
        return last.get("tool_calls", []) if last.get("role") == "assistant" else []

    def send_results(self, results: list[str], on_text=None) -> str:
        """The results of the pending calls, in their order, and the model's reply to them (as send)."""
        for call, result in zip(self.pending_calls, results, strict=True):
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                                  "content": result})
        return self._reply(on_text)

    def _reply(self, on_text) -> str:
        """The model's reply to the conversation so far, added to it."""
        rendered, spans = self._render(self.messages, add_generation_prompt=True)
        prompt = self._catch_up(rendered, spans)
        session = Session(self.lm, self.cache, self.drafter, self.draft_max, self.draft_min)
        session.speculation = self.speculation
        self.interrupted = False
        decoder, reply = ReplyDecoder(self.lm.tokenizer, self.reasoning, self.tools.shown), SplitReply()
        stream = self.tools.stream(on_text)
        for piece in session.complete(prompt, Sampler(self.options), self.max_reply, should_stop=lambda: self.interrupted,
                                      history=self.tokens, decoder=decoder, grammar=self.grammar):
            reply.add(decoder.part, piece)
            if piece:
                stream(piece, decoder.part)
        content, calls = self.tools.read(reply.answer)
        stream.finish(bool(calls))
        self.last = session.stats
        # (the cache's text with its markup: what the template's rendering of it is checked against)
        markup = self.reasoning is not None or bool(self.tools.shown)
        self.fed_text = rendered + self.lm.tokenizer.decode(self.last.tokens, render_special=markup)
        self.fed_tokens += len(prompt) + len(self.last.tokens)
        self.tokens += prompt + self.last.tokens
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        if reply.reasoning:  # (templates take it as reasoning_content / thinking)
            message["reasoning_content"] = reply.reasoning
        self.messages.append(message)
        if self.cache.evicted and not self._ring_noticed:
            self._ring_noticed = True
            self.notices.append(f"the context of {self.n_ctx} tokens is full: the oldest tokens now give way "
                                f"to new ones ({self.cache.pinned} pinned at the start stay)")
        return message["content"]

    def stats(self) -> dict:
        s = self.last
        return {"context_used": min(self.cache.used, self.n_ctx), "context_size": self.n_ctx,
                "pinned": self.cache.pinned, "tokens_evicted": self.cache.evicted,
                "tokens_total": self.cache.used, "last_prompt_tokens": s.prompt_tokens,
                "last_generated_tokens": s.generated_tokens, "time_to_first_token_s": s.time_to_first_token_s,
                "prefill_tok_s": s.prefill_tok_s, "decode_tok_s": s.decode_tok_s,
                **(self.speculation.as_dict() if self.drafter else {})}

    # -- saving and loading --------------------------------------------------------------------

    def save(self, path: Path, with_kv: bool = False) -> None:
        """The messages as JSON; with_kv: the KV cache beside them (kv_path), which load resumes
        from without prefilling the conversation again. Neither may be the model's file, and each
        replaces an earlier save only once it is wholly written."""
        targets = [path, kv_path(path)] if with_kv else [path]
        for target in targets:
            check_output(target, [self.lm.file.path])
        with atomic_output(path) as tmp:
            tmp.write_text(json.dumps({"format": "ggrun-chat/1", "system": self.system, "messages": self.messages,
                                       "sampling": asdict(self.options)}, indent=1, ensure_ascii=False),
                           encoding="utf-8")
        if with_kv:
            note = {"model": self.lm.identity(), "text": self.fed_text, "tokens": self.fed_tokens}
            self.cache.snapshot(note).save(kv_path(path))

    def load(self, path: Path) -> bool:
        """A conversation from save: from its KV state when one lies beside it and fits this model
        and context (True; a notice says when one does not), else by prefilling its messages. A file
        that is not a conversation, one the template cannot render, or Ctrl-C during the prefill
        leaves the conversation as it was."""
        system, messages = read_conversation(path)
        try:
            self._rendered(messages, add_generation_prompt=False)
        except ChatTemplateError as e:
            raise ValueError(f"{path}: {e}") from None
        kept = {name: getattr(self, name) for name in _CONVERSATION}
        try:
            if kv_path(path).exists() and self._resume(system, messages, kv_path(path)):
                return True
            self.set_system(system)
            self.messages = messages
            rendered, spans = self._render(messages, add_generation_prompt=False)
            ids = self._catch_up(rendered, spans)
            if ids:
                self.lm.model.forward(ids, self.cache)
            self.fed_text, self.fed_tokens = rendered, self.fed_tokens + len(ids)
            self.tokens += ids
            return False
        except BaseException:
            self.__dict__.update(kept)
            raise

    def _resume(self, system: str | None, messages: list[dict], state_path: Path) -> bool:
        """The conversation from its saved KV state, when that fits; False (and a notice) when not."""
        try:
            cache = self.lm.model.new_cache(self.n_ctx, ring=True)
            state = KVState.load(state_path, cache)
            note = state.note
            if note.get("model") != self.lm.identity():
                raise KVStateError("it was saved with another model file")
            if not isinstance(note.get("text"), str) or note.get("tokens") != state.used:
                raise KVStateError("it does not say what text it holds")
            cache.restore(state)
        except KVStateError as e:
            self.notices.append(f"{state_path.name} not used ({e}); prefilling the conversation instead")
            return False
        self.system, self.messages, self.cache = system, messages, cache
        self.fed_text, self.fed_tokens, self.tokens = note["text"], note["tokens"], []
        return True


# what a conversation is: what load puts back as it was where it fails
_CONVERSATION = ("system", "messages", "cache", "fed_text", "fed_tokens", "tokens", "template", "tools", "grammar")
_ROLES = ("system", "user", "assistant", "tool")
_TEXT_FIELDS = ("reasoning_content", "tool_call_id", "name")  # (besides content) the text a message may have


def read_conversation(path: Path) -> tuple[str | None, list[dict]]:
    """The system prompt and messages of a file that save wrote: every field of the right type,
    each message only its role, content, reasoning and tool calls, or a tool result's call id and
    function name (ValueError otherwise)."""
    not_one = ValueError(f"{path} is not a conversation saved by /save")
    try:
        data = json.loads(read_text(str(path)))
    except ValueError as e:
        raise not_one if isinstance(e, json.JSONDecodeError) else e from None
    if not isinstance(data, dict) or data.get("format") != "ggrun-chat/1" or not isinstance(data.get("messages"), list):
        raise not_one
    system, messages = data.get("system"), []
    for m in data["messages"]:
        if (not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str)
                or not all(isinstance(m.get(k, ""), str) for k in _TEXT_FIELDS)):
            raise not_one
        message = {k: m[k] for k in ("role", "content", *_TEXT_FIELDS) if k in m}
        if "tool_calls" in m:
            message["tool_calls"] = _read_calls(m["tool_calls"], not_one)
        messages.append(message)
    if system is not None and not isinstance(system, str):
        raise not_one
    return system, messages


def _read_calls(calls, not_one: ValueError) -> list[dict]:
    """A saved reply's tool calls: each an id, a function's name and its arguments (a JSON object's text)."""
    if not isinstance(calls, list):
        raise not_one
    read = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(call.get("id"), str)
                or not isinstance(function.get("name"), str) or not _is_object_text(function.get("arguments"))):
            raise not_one
        read.append({"id": call["id"], "type": "function",
                     "function": {"name": function["name"], "arguments": function["arguments"]}})
    return read


def _is_object_text(text) -> bool:
    try:
        return isinstance(text, str) and isinstance(json.loads(text), dict)
    except (json.JSONDecodeError, RecursionError):
        return False


def kv_path(path: Path) -> Path:
    """Where save keeps a conversation's KV state: beside it."""
    return path.with_name(path.name + ".kv.npz")
