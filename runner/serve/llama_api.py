"""llama-server's own completion endpoint, /completion: a prompt (text or token ids) continued
with n_predict tokens at most, whole or streamed as server-sent events of {"content", "stop"},
with the sampling fields, stop strings, and the grammar and json_schema fields (structured.py)."""
from __future__ import annotations

from starlette.responses import JSONResponse, Response

from .fields import SAMPLING_FIELDS, ApiError, Fields, bad, read_json, sampling
from .openai_api import prompt_value, sse, timings
from .replies import ClientLeft, Streamed, events, gather, submit
from .scheduler import Text
from .structured import openai_grammar

FIELDS = ("prompt", "n_predict", "stream", "stop", "grammar", "json_schema", "cache_prompt", "ignore_eos", "model",
          "n_probs", *SAMPLING_FIELDS)
STOP_TYPES = {"stop": "eos", "length": "limit"}  # (a finish reason as llama-server's stop_type says it)


async def completion(request):
    state = request.app.state.serve
    f = Fields(await read_json(request), FIELDS)
    state.card.check(f.get("model", "string"))
    prompt = prompt_value(f.data.get("prompt"))
    n_predict = f.count("n_predict", -1, None, -1)
    if f.count("n_probs", 0, None, 0):
        raise bad("n_probs is not supported yet on /completion (/v1/completions takes logprobs)")
    ticket = await submit(state, lambda model: model.text_ids(prompt), sampling(state.sampling, f),
                          None if n_predict < 0 else n_predict, f.strings("stop"),
                          cache_prompt=f.get("cache_prompt", "boolean", True),
                          ignore_eos=f.get("ignore_eos", "boolean", False),
                          grammar=openai_grammar(f, response_format=False))
    if f.get("stream", "boolean", False):
        return Streamed(_lines(request, state, ticket), state.scheduler, ticket, "text/event-stream")
    try:
        reply = await gather(request, state.scheduler, ticket)
    except ClientLeft:
        return Response(status_code=499)
    return JSONResponse({"content": reply.answer, **_end(state, reply)})


def _end(state, done) -> dict:
    """The closing fields of a reply (a whole one's, or a stream's last event's)."""
    u = done.usage
    return {"model": state.card.name, "stop": True, "stop_type": STOP_TYPES.get(done.finish_reason, "none"),
            "tokens_predicted": u.completion_tokens, "tokens_evaluated": u.prompt_tokens,
            "tokens_cached": u.cached_tokens, "truncated": False, "timings": timings(u)}


async def _lines(request, state, ticket):
    try:
        async for event in events(request, ticket):
            if isinstance(event, Text):
                if event.text:
                    yield sse({"content": event.text, "stop": False})
            else:
                yield sse({"content": "", **_end(state, event)})
    except ApiError as e:
        yield sse(e.body())
