"""OpenAI's API: /v1/models, /v1/chat/completions and /v1/completions, whole or streamed as
server-sent events, with llama-server's extensions (top_k, min_p, repeat_penalty,
chat_template_kwargs, `timings`); structured output through response_format (chat), and
llama-server's grammar and json_schema (both endpoints), as structured.py reads them."""
from __future__ import annotations

import json
import secrets
import time

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from ..engine.constraint import reply_grammar
from ..text.reasoning import REASONING
from .fields import (
    SAMPLING_FIELDS,
    ApiError,
    Fields,
    bad,
    chat_messages,
    read_json,
    sampling,
)
from .replies import ClientLeft, Streamed, events, gather, submit
from .scheduler import Text, TokenLogprob, Usage
from .structured import openai_grammar
from .tools import CallStream, read_tools

# fields that change nothing here (OpenAI's bookkeeping)
_IGNORED = ("user", "metadata", "store", "service_tier", "reasoning_effort")
_COMMON = ("model", "stream", "stream_options", "max_tokens", "stop", "n", "logit_bias", "cache_prompt",
           "ignore_eos", "grammar", "json_schema", *SAMPLING_FIELDS, *_IGNORED)
CHAT_FIELDS = (*_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs",
               "response_format", "tools", "tool_choice", "parallel_tool_calls")
COMPLETION_FIELDS = (*_COMMON, "prompt", "logprobs", "echo", "suffix", "best_of")
MESSAGE_FIELDS = ("role", "content", "name", "reasoning_content", "tool_calls", "tool_call_id")
MAX_TOP_LOGPROBS = 20


class Params:
    """What the two endpoints read alike from a request body."""

    def __init__(self, state, body: dict, known):
        self.state, self.f = state, Fields(body, known)
        f = self.f
        state.card.check(f.get("model", "string"))
        self.sampling = sampling(state.sampling, f)
        self.stops = f.strings("stop")
        self.stream = f.get("stream", "boolean", False)
        options = Fields(f.get("stream_options", "object", {}), ("include_usage", "continuous_usage_stats"),
                         "stream_options.")
        if f.data.get("stream_options") is not None and not self.stream:
            raise bad("stream_options is only allowed with stream: true")
        self.include_usage = options.get("include_usage", "boolean", False)
        self.cache_prompt = f.get("cache_prompt", "boolean", True)  # (llama-server's: reuse the cached prefix)
        self.ignore_eos = f.get("ignore_eos", "boolean", False)  # (llama-server's: run to max_tokens)
        f.count("n", 1, 1)
        f.count("best_of", 1, 1)
        if f.get("logit_bias", "object"):
            raise bad("logit_bias is not supported yet")
        self.id = f"{secrets.token_hex(12)}"
        self.created = int(time.time())

    def envelope(self, kind: str, choices: list, **more) -> dict:
        prefix = "chatcmpl-" if kind.startswith("chat") else "cmpl-"
        return {"id": prefix + self.id, "object": kind, "created": self.created, "model": self.state.card.name,
                "system_fingerprint": self.state.fingerprint, "choices": choices, **more}


async def chat_completions(request):
    state = request.app.state.serve
    r = Params(state, await read_json(request), CHAT_FIELDS)
    f = r.f
    messages = chat_messages(f.require("messages", "array"), MESSAGE_FIELDS)
    if not messages:
        raise bad("messages must not be empty")
    model = state.loaded()
    tools = read_tools(f, model)
    grammar = reply_grammar(openai_grammar(f), model.tokenizer.vocab, model.reasoning)
    if tools is not None and grammar is not None:
        raise bad("tools and a grammar (response_format, grammar or json_schema) cannot both constrain a reply: "
                  "set tool_choice to \"none\", or drop one")
    logprobs = f.get("logprobs", "boolean", False)
    top = f.count("top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("top_logprobs needs logprobs: true")
    max_tokens = f.count("max_completion_tokens", 0)
    max_tokens = f.count("max_tokens", 0) if max_tokens is None else max_tokens
    variables = f.get("chat_template_kwargs", "object", {})
    ticket = await submit(state, lambda model: model.chat_ids(messages, variables, tools), r.sampling, max_tokens,
                          r.stops, (top or 0) if logprobs else None, reasoning=True, cache_prompt=r.cache_prompt,
                          ignore_eos=r.ignore_eos, grammar=tools.grammar if tools else grammar,
                          shown=tools.shown if tools else None)
    tok = state.loaded().tokenizer
    if r.stream:
        lines = _stream(request, r, ticket, "chat.completion.chunk", _chat_choices(tok, logprobs, tools),
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        return Streamed(lines, state.scheduler, ticket, "text/event-stream")
    try:
        reply = await gather(request, state.scheduler, ticket)
    except ClientLeft:
        return Response(status_code=499)
    content, calls = tools.format.parse(reply.answer, tools.tools) if tools else (reply.answer, [])
    message = {"role": "assistant", "content": content or (None if calls else "")}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if calls:
        message["tool_calls"] = [c.as_openai() for c in calls]
    choice = {"index": 0, "message": message, "finish_reason": _finish(reply.finish_reason, calls),
              "logprobs": {"content": [_chat_logprob(tok, t) for t in reply.tokens]} if logprobs else None}
    return JSONResponse(r.envelope("chat.completion", [choice], usage=usage(reply.usage),
                                   timings=timings(reply.usage)))


async def apply_template(request):
    """llama-server's /apply-template: the prompt a chat request's messages, tools and
    chat_template_kwargs make through the chat template."""
    state = request.app.state.serve
    f = Fields(await read_json(request), ("messages", "tools", "tool_choice", "parallel_tool_calls",
                                          "chat_template_kwargs"))
    messages = chat_messages(f.require("messages", "array"), MESSAGE_FIELDS)
    model = state.loaded()
    tools = read_tools(f, model)
    prompt = await run_in_threadpool(model.chat_prompt, messages, f.get("chat_template_kwargs", "object", {}), tools)
    return JSONResponse({"prompt": prompt})


def _finish(reason: str, calls: list) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


def _chat_choices(tok, logprobs: bool, tools):
    """A streamed chunk's choices for a Text event, and for the end (the tool calls, as deltas,
    before the finish reason). With tools, the answer goes out up to where a call may begin."""
    calls = CallStream(tools) if tools else None

    def delta(d: dict, tokens=(), finish_reason=None) -> dict:
        return {"index": 0, "delta": d, "finish_reason": finish_reason,
                "logprobs": {"content": [_chat_logprob(tok, t) for t in tokens]} if logprobs and tokens else None}

    def choices(event: Text | None = None, finish_reason: str | None = None) -> list[dict]:
        if event is None:
            content, found = calls.finish() if calls else ("", [])
            out = [delta({"content": content})] if content else []
            for i, call in enumerate(found):
                out.append(delta({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                                  "function": {"name": call.name, "arguments": ""}}]}))
                out.append(delta({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]}))
            return out + [delta({}, finish_reason=_finish(finish_reason, found))]
        text = event.text
        if calls is not None and event.part != REASONING:
            text = calls.push(text)
        if not text and not (logprobs and event.tokens):
            return []
        key = "reasoning_content" if event.part == REASONING else "content"
        return [delta({key: text} if text else {}, event.tokens)]
    return choices


async def _stream(request, r: Params, ticket, kind: str, choices, first: dict | None):
    """The events as server-sent chunks of `kind`: `first` (a choice), one per choice a Text event
    makes, the end's (the last with the finish reason and llama-server's timings), the usage where
    asked for, then [DONE]; an error after the response began is an event of its own."""
    if first:
        yield sse(r.envelope(kind, [first]))
    try:
        async for event in events(request, ticket):
            if isinstance(event, Text):
                for c in choices(event):
                    yield sse(r.envelope(kind, [c]))
                continue
            *before, last = choices(finish_reason=event.finish_reason)
            for c in before:
                yield sse(r.envelope(kind, [c]))
            yield sse(r.envelope(kind, [last], timings=timings(event.usage)))
            if r.include_usage:
                yield sse(r.envelope(kind, [], usage=usage(event.usage)))
    except ApiError as e:
        yield sse(e.body())
    yield "data: [DONE]\n\n"


async def completions(request):
    state = request.app.state.serve
    r = Params(state, await read_json(request), COMPLETION_FIELDS)
    f = r.f
    prompt = prompt_value(f.data.get("prompt"))
    if f.get("suffix", "string"):
        raise bad("suffix (fill-in-the-middle) is not supported yet")
    top = f.count("logprobs", 0, MAX_TOP_LOGPROBS)
    echo = f.get("echo", "boolean", False)
    grammar = openai_grammar(f, response_format=False)  # (llama-server reads no response_format here)
    ticket = await submit(state, lambda model: model.text_ids(prompt), r.sampling, f.count("max_tokens", 0, None, 16),
                          r.stops, top, cache_prompt=r.cache_prompt, ignore_eos=r.ignore_eos, grammar=grammar)
    tok = state.loaded().tokenizer
    echoed = (prompt if isinstance(prompt, str) else tok.decode(prompt)) if echo else ""
    if r.stream:
        first = {"index": 0, "text": echoed, "logprobs": None, "finish_reason": None} if echoed else None
        lines = _stream(request, r, ticket, "text_completion", _completion_choices(tok, top is not None), first)
        return Streamed(lines, state.scheduler, ticket, "text/event-stream")
    try:
        reply = await gather(request, state.scheduler, ticket)
    except ClientLeft:
        return Response(status_code=499)
    choice = {"index": 0, "text": echoed + reply.answer, "finish_reason": reply.finish_reason,
              "logprobs": _completion_logprobs(tok, reply.tokens, len(echoed)) if top is not None else None}
    return JSONResponse(r.envelope("text_completion", [choice], usage=usage(reply.usage),
                                   timings=timings(reply.usage)))


def _completion_choices(tok, logprobs: bool):
    def choices(event: Text | None = None, finish_reason: str | None = None) -> list[dict]:
        if event is None:
            return [{"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}]
        if not event.text and not (logprobs and event.tokens):
            return []
        return [{"index": 0, "text": event.text, "finish_reason": None,
                 "logprobs": _completion_logprobs(tok, event.tokens, 0) if logprobs else None}]
    return choices


def prompt_value(prompt) -> str | list[int]:
    """A completion's prompt: a string or token ids, alone or as a list of one."""
    if prompt is None:
        raise bad("prompt is required")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(i, int) for i in prompt)):
        return prompt
    raise bad("prompt must be a string or an array of token ids (one prompt per request)")


async def models(request):
    return JSONResponse({"object": "list", "data": [_model(request.app.state.serve)]})


async def model(request):
    state = request.app.state.serve
    state.card.check(request.path_params["model"])
    return JSONResponse(_model(state))


def _model(state) -> dict:
    card = state.card
    return {"id": card.name, "object": "model", "created": card.created, "owned_by": "ggrun",
            "meta": {"architecture": card.architecture, "quant": card.quant, "n_params": card.parameters,
                     "size": card.size, "n_ctx": state.n_ctx}}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def timings(u: Usage) -> dict:
    """llama-server's `timings`: prompt_n counts the tokens prefilled, cache_n those reused."""
    prompt_n = u.prompt_tokens - u.cached_tokens
    return {"cache_n": u.cached_tokens, "prompt_n": prompt_n, "prompt_ms": 1e3 * u.prompt_s,
            "prompt_per_second": prompt_n / u.prompt_s if u.prompt_s else 0.0,
            "predicted_n": u.completion_tokens, "predicted_ms": 1e3 * u.decode_s,
            "predicted_per_second": u.completion_tokens / u.decode_s if u.decode_s else 0.0}


def _token(tok, token_id: int) -> tuple[str, list[int]]:
    data = tok.token_bytes(token_id, render_special=True)
    return data.decode("utf-8", errors="replace"), list(data)


def _chat_logprob(tok, t: TokenLogprob) -> dict:
    def entry(token_id, logprob):
        text, data = _token(tok, token_id)
        return {"token": text, "logprob": logprob, "bytes": data}
    return {**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}


def _completion_logprobs(tok, tokens: list[TokenLogprob], offset: int) -> dict:
    texts = [_token(tok, t.id)[0] for t in tokens]
    offsets = [offset + sum(map(len, texts[:i])) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{_token(tok, i)[0]: lp for i, lp in t.top} for t in tokens], "text_offset": offsets}
