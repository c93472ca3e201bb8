"""Ollama's API: /api/chat and /api/generate (streamed as NDJSON unless stream is false), /api/tags,
/api/show and /api/version, as the `ollama` client and the tools built on it call them; `format`
("json" or a JSON schema) constrains the reply (structured.py). Errors
here take Ollama's shape, {"error": "message"}, which its client reads (app.py)."""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from importlib.metadata import version

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
from .replies import ClientLeft, Reply, Streamed, events, gather, submit
from .scheduler import Text
from .structured import ollama_grammar
from .tools import CallStream, read_tools

# Ollama's runtime options, which ggrun's own settings decide (the context is the server's -c per
# sequence), and the sampling options it does not implement: accepted and left alone
_RUNTIME = ("numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
            "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "penalize_newline", "tfs_z",
            "typical_p", "mirostat", "mirostat_tau", "mirostat_eta")
OPTIONS = (*SAMPLING_FIELDS, "num_predict", "stop", *_RUNTIME)
_COMMON = ("model", "stream", "format", "options", "keep_alive", "think", "logprobs", "top_logprobs")
CHAT_FIELDS = (*_COMMON, "messages", "tools")
GENERATE_FIELDS = (*_COMMON, "prompt", "suffix", "system", "template", "context", "raw", "images")
MESSAGE_FIELDS = ("role", "content", "thinking", "images", "tool_calls", "tool_name")


class Params:
    """What /api/chat and /api/generate read alike."""

    def __init__(self, state, body: dict, known):
        self.state, self.f = state, Fields(body, known)
        f = self.f
        self.model = f.require("model", "string")
        state.card.check(self.model)
        options = Fields(f.get("options", "object", {}), OPTIONS, "options.")
        self.sampling = sampling(state.sampling, options)
        self.stops = options.strings("stop")
        predict = options.count("num_predict", -2, None, -1)
        self.max_tokens = None if predict < 0 else predict  # (-1: until the end of generation, -2: of the context)
        self.stream = f.get("stream", "boolean", True)
        self.grammar = ollama_grammar(f.data.get("format"))
        think = f.data.get("think")
        if think is not None and not isinstance(think, (bool, str)):
            raise bad(f"think must be a boolean or high, medium or low, not {json.dumps(think)}")
        # (a template's switch for reasoning, as Qwen 3's and gpt-oss's read it)
        self.variables = {} if think is None else {"enable_thinking": think} if isinstance(think, bool) \
            else {"reasoning_effort": think}
        self.logprobs = f.get("logprobs", "boolean", False)
        top = f.count("top_logprobs", 0, 20)
        self.top_logprobs = (top or 0) if self.logprobs else None
        self.start = time.perf_counter()

    def line(self, **fields) -> dict:
        return {"model": self.model, "created_at": _now(), **fields}

    def final(self, reply_or_event, **fields) -> dict:
        u = reply_or_event.usage
        return self.line(**fields, done=True, done_reason=reply_or_event.finish_reason,
                         total_duration=_ns(time.perf_counter() - self.start), load_duration=0,
                         prompt_eval_count=u.prompt_tokens, prompt_eval_duration=_ns(u.prompt_s),
                         eval_count=u.completion_tokens, eval_duration=_ns(u.decode_s))

    def logprobs_of(self, tokens) -> dict:
        if not self.logprobs:
            return {}
        tok = self.state.loaded().tokenizer
        return {"logprobs": [{"token": tok.piece(t.id), "logprob": t.logprob,
                              "top_logprobs": [{"token": tok.piece(i), "logprob": lp} for i, lp in t.top]}
                             for t in tokens]}


async def chat(request):
    state = request.app.state.serve
    r = Params(state, await read_json(request), CHAT_FIELDS)
    messages = chat_messages(r.f.get("messages", "array", []), MESSAGE_FIELDS)
    if not messages:  # (Ollama's way to load a model)
        return JSONResponse(r.line(message={"role": "assistant", "content": ""}, done=True, done_reason="load"))
    model = state.loaded()
    tools = read_tools(r.f, model)
    if tools is not None and r.grammar is not None:
        raise bad("tools and format cannot both constrain a reply: drop one")
    grammar = tools.grammar if tools else reply_grammar(r.grammar, model.tokenizer.vocab, model.reasoning)
    ticket = await submit(state, lambda model: model.chat_ids(messages, r.variables, tools), r.sampling, r.max_tokens,
                          r.stops, r.top_logprobs, reasoning=True, grammar=grammar,
                          shown=tools.shown if tools else None)

    def message(answer: str, thinking: str, calls=()) -> dict:
        return {"message": {"role": "assistant", "content": answer, **({"thinking": thinking} if thinking else {}),
                            **({"tool_calls": [_call(c) for c in calls]} if calls else {})}}
    return await _respond(request, r, ticket, message, tools)


def _call(call) -> dict:
    """A tool call as Ollama gives it: its arguments an object."""
    return {"function": {"name": call.name, "arguments": json.loads(call.arguments)}}


async def generate(request):
    state = request.app.state.serve
    r = Params(state, await read_json(request), GENERATE_FIELDS)
    f = r.f
    prompt, system = f.get("prompt", "string", ""), f.get("system", "string")
    if any(f.get(name, kind) for name, kind in (("suffix", "string"), ("template", "string"), ("context", "array"),
                                                ("images", "array"))):
        raise bad("suffix, template, context and images are not supported yet (/api/chat takes a conversation)")
    if not prompt and system is None:
        return JSONResponse(r.line(response="", done=True, done_reason="load"))
    raw = f.get("raw", "boolean", False)
    if raw:
        def prompt_ids(model):
            return model.text_ids(prompt)
    else:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": prompt}]

        def prompt_ids(model):
            return model.chat_ids(messages, r.variables)
    model = state.loaded()
    grammar = r.grammar if raw else reply_grammar(r.grammar, model.tokenizer.vocab, model.reasoning)
    ticket = await submit(state, prompt_ids, r.sampling, r.max_tokens, r.stops, r.top_logprobs, reasoning=not raw,
                          grammar=grammar)

    def response(answer: str, thinking: str) -> dict:
        return {"response": answer, **({"thinking": thinking} if thinking else {})}
    return await _respond(request, r, ticket, response)


async def _respond(request, r: Params, ticket, shape, tools=None):
    """The reply, whole or as NDJSON lines; shape(answer, thinking[, calls]) puts its text (and a
    chat's tool calls) where the endpoint does."""
    scheduler = r.state.scheduler
    if r.stream:
        return Streamed(_lines(request, r, ticket, shape, tools), scheduler, ticket, "application/x-ndjson")
    try:
        reply: Reply = await gather(request, scheduler, ticket)
    except ClientLeft:
        return Response(status_code=499)
    answer, calls = tools.format.parse(reply.answer, tools.tools) if tools else (reply.answer, [])
    return JSONResponse(r.final(reply, **shape(answer, reply.reasoning, *([calls] if calls else [])),
                                **r.logprobs_of(reply.tokens)))


async def _lines(request, r: Params, ticket, shape, tools):
    calls = CallStream(tools) if tools else None
    try:
        async for event in events(request, ticket):
            if isinstance(event, Text):
                text = event.text
                if calls is not None and event.part != REASONING:
                    text = calls.push(text)
                if text or (r.logprobs and event.tokens):
                    text = (text, "") if event.part != REASONING else ("", text)
                    yield _json(r.line(**shape(*text), done=False, **r.logprobs_of(event.tokens)))
                continue
            content, found = calls.finish() if calls else ("", [])
            if content or found:  # (the calls in a line of their own, as Ollama sends them)
                yield _json(r.line(**shape(content, "", *([found] if found else [])), done=False))
            yield _json(r.final(event, **shape("", "")))
    except ApiError as e:
        yield _json({"error": e.message})


async def tags(request):
    return JSONResponse({"models": [_entry(request.app.state.serve)]})


async def show(request):
    state = request.app.state.serve
    f = Fields(await read_json(request), ("model", "name", "verbose"))
    name = f.get("model", "string") or f.get("name", "string")
    if name is None:
        raise bad("model is required")
    state.card.check(name)
    card = state.card
    # (tools: every template, those without a tool format of their own described them in a system message)
    capabilities = ["completion", "tools"] + (["thinking"] if state.model and state.model.reasoning else [])
    return JSONResponse({"license": card.metadata.get("general.license", ""), "modelfile": "", "parameters": "",
                         "template": state.model.template_source if state.model else "",
                         "details": _details(card), "capabilities": capabilities,
                         "model_info": {**card.metadata, "general.parameter_count": card.parameters},
                         "modified_at": _iso(card.created)})


async def version_info(request):
    return JSONResponse({"version": version("ggrun")})


def _entry(state) -> dict:
    card = state.card
    return {"name": card.name, "model": card.name, "modified_at": _iso(card.created), "size": card.size,
            "digest": "", "details": _details(card)}


def _details(card) -> dict:
    return {"parent_model": "", "format": "gguf", "family": card.architecture, "families": [card.architecture],
            "parameter_size": card.parameter_size, "quantization_level": card.quant}


def _json(data: dict) -> str:
    return json.dumps(data, ensure_ascii=False) + "\n"


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _iso(timestamp: int) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat().replace("+00:00", "Z")
