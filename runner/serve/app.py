"""The Starlette application: the routes of OpenAI's API (openai_api.py), Ollama's (ollama_api.py)
and llama-server's own (/completion in llama_api.py; /health, /props, /metrics, /tokenize,
/detokenize, /apply-template); the chat page at / (page.py); the API key; client mistakes as 4xx
answers in OpenAI's error shape (Ollama's on /api/); one log line per request."""
from __future__ import annotations

import hmac
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from ..engine.sampler import SamplingOptions
from . import llama_api, ollama_api, openai_api, page
from .fields import ApiError, Fields, read_json
from .model import ModelCard, ServedModel
from .options import ServeOptions
from .replies import LEFT, USAGE
from .scheduler import Scheduler

OPEN_PATHS = ("/health", "/v1/health")  # answered without the API key (as llama-server's)


@dataclass
class ServeState:
    """What the handlers share: the scheduler, the model (its card at once, the rest once loaded),
    the server's sampling defaults and API key."""
    scheduler: Scheduler
    card: ModelCard
    sampling: SamplingOptions
    api_key: str | None = None
    webui: bool = ServeOptions.webui
    model: ServedModel | None = None
    fingerprint: str = f"ggrun-{version('ggrun')}"

    @property
    def n_ctx(self) -> int | None:
        return self.scheduler.n_ctx

    def loaded(self) -> ServedModel:
        if self.model is None:
            raise ApiError(503, "Loading model")
        return self.model


def error_response(path: str, e: ApiError) -> JSONResponse:
    """OpenAI's shape, or Ollama's {"error": message} on its routes (its client reads that)."""
    return JSONResponse({"error": e.message} if path.startswith("/api/") else e.body(), e.status)


async def _api_error(request, e: ApiError):
    return error_response(request.url.path, e)


async def _http_error(request, e: HTTPException):
    message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else e.detail
    return error_response(request.url.path, ApiError(e.status_code, message))


async def _server_error(request, e: Exception):
    return error_response(request.url.path, ApiError(500, f"internal error: {type(e).__name__}: {e}"))


async def health(request):
    if not request.app.state.serve.scheduler.ready:
        raise ApiError(503, "Loading model")
    return JSONResponse({"status": "ok"})


async def props(request):
    state = request.app.state.serve
    model = state.loaded()
    vocab = model.tokenizer.vocab
    seed = state.sampling.seed
    params = {**asdict(state.sampling), "n_predict": -1, "seed": -1 if seed is None else seed}
    return JSONResponse({
        "default_generation_settings": {"n_ctx": state.n_ctx, "params": params},
        "total_slots": state.scheduler.slots, "model_alias": state.card.name, "model_path": str(state.card.path),
        "chat_template": model.template_source, "bos_token": vocab.tokens[vocab.bos_id] if vocab.bos_id >= 0 else "",
        "eos_token": vocab.tokens[vocab.eos_id] if vocab.eos_id >= 0 else "", "build_info": state.fingerprint,
        "modalities": {"vision": False, "audio": False}, "is_sleeping": False})


async def metrics(request):
    """Prometheus' text format, with llama-server's names where it has the measure."""
    s = request.app.state.serve.scheduler
    c = s.counters
    counters = [("requests_total", "Requests run", c.requests),
                ("requests_cancelled_total", "Requests stopped because their client left", c.cancelled),
                ("requests_rejected_total", "Requests turned away with the queue full (503)", c.rejected),
                ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", c.prompt_tokens),
                ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", c.cached_tokens),
                ("prompt_seconds_total", "Total time spent processing prompts", c.prompt_s),
                ("tokens_predicted_total", "Number of generation tokens processed", c.generated_tokens),
                ("tokens_predicted_seconds_total", "Total time spent generating tokens", c.decode_s)]
    gauges = [("requests_processing", "Number of requests processing", s.processing),
              ("requests_deferred", "Number of requests waiting in the queue", s.queued),
              ("slots_total", "Sequences that run together (--parallel)", s.slots),
              ("n_ctx", "Context of each sequence", s.n_ctx or 0)]
    pool = s.batcher.pool if s.batcher is not None else None
    if pool is not None:
        gauges += [("kv_blocks_total", "Blocks of the KV pool", pool.n_blocks),
                   ("kv_blocks_used", "Blocks held by running requests", pool.blocks_used),
                   ("kv_blocks_cached", "Blocks held by none, kept for prefix reuse", len(pool.cached)),
                   ("kv_block_tokens", "Tokens a block holds", pool.block),
                   ("kv_bytes_per_token", "Bytes of keys and values a token takes, all layers", pool.bytes_per_token),
                   ("kv_bytes_used", "Bytes of the blocks held by running requests",
                    pool.blocks_used * pool.block * pool.bytes_per_token)]
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, description, value in items:
            lines += [f"# HELP ggrun:{name} {description}", f"# TYPE ggrun:{name} {kind}", f"ggrun:{name} {value}"]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


async def tokenize(request):
    """llama-server's: content's tokens, with their pieces (text, or bytes that are not UTF-8) if asked."""
    model = request.app.state.serve.loaded()
    f = Fields(await read_json(request), ("content", "add_special", "parse_special", "with_pieces"))
    content = f.get("content", "string", "")
    tok = model.tokenizer
    ids = await run_in_threadpool(tok.encode, content, f.get("add_special", "boolean", False),
                                  f.get("parse_special", "boolean", True))
    if not f.get("with_pieces", "boolean", False):
        return JSONResponse({"tokens": ids})
    pieces = []
    for i in ids:
        data = tok.token_bytes(i, render_special=True)
        try:
            pieces.append({"id": i, "piece": data.decode("utf-8")})
        except UnicodeDecodeError:
            pieces.append({"id": i, "piece": list(data)})
    return JSONResponse({"tokens": pieces})


async def detokenize(request):
    model = request.app.state.serve.loaded()
    ids = Fields(await read_json(request), ("tokens",)).get("tokens", "array", [])
    model.check_ids(ids)
    return JSONResponse({"content": model.tokenizer.decode(ids, render_special=True)})


async def root(request):
    if request.app.state.serve.webui and page.wants_page(request):
        return page.answer(request, page.INDEX)
    return PlainTextResponse("ggrun is running")  # (as Ollama answers it: tools check for it)


ROUTES = [
    Route("/", root, methods=["GET", "HEAD"]),
    Route("/health", health), Route("/v1/health", health),
    Route("/v1/models", openai_api.models), Route("/models", openai_api.models),
    Route("/v1/models/{model:path}", openai_api.model),
    Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
    Route("/chat/completions", openai_api.chat_completions, methods=["POST"]),
    Route("/v1/completions", openai_api.completions, methods=["POST"]),
    Route("/completions", openai_api.completions, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
    Route("/apply-template", openai_api.apply_template, methods=["POST"]),
    Route("/completion", llama_api.completion, methods=["POST"]),
    Route("/props", props), Route("/metrics", metrics),
    Route("/api/chat", ollama_api.chat, methods=["POST"]),
    Route("/api/generate", ollama_api.generate, methods=["POST"]),
    Route("/api/tags", ollama_api.tags), Route("/api/show", ollama_api.show, methods=["POST"]),
    Route("/api/version", ollama_api.version_info),
]


class Gate:
    """Around every HTTP request: the API key (where one is set; not on OPEN_PATHS nor the page), and
    one log line once it is answered: method, path, status, tokens, time."""

    def __init__(self, app, state: ServeState, log):
        self.app, self.state, self.log = app, state, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), []

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)
        try:
            if self.state.api_key and not self._open(scope["path"]) and not self._authorized(scope):
                message = "invalid API key" if _header(scope, b"authorization") else "an API key is required"
                await error_response(scope["path"], ApiError(401, message))(scope, receive, sending)
            else:
                await self.app(scope, receive, sending)
        finally:
            u = scope.get(USAGE)
            tokens = (f" {u.prompt_tokens} prompt ({u.cached_tokens} cached) + {u.completion_tokens} tokens"
                      if u else "")
            answered = "client left" if scope.get(LEFT) or not status else status[0]
            self.log(f"{scope['method']} {scope['path']} {answered}{tokens} {time.perf_counter() - start:.3f} s")

    def _open(self, path: str) -> bool:
        return path in OPEN_PATHS or (self.state.webui and page.is_page(path))  # (the page asks for the key)

    def _authorized(self, scope) -> bool:
        given = _header(scope, b"authorization").removeprefix("Bearer ").strip() or _header(scope, b"x-api-key")
        return hmac.compare_digest(given.encode(), self.state.api_key.encode())


def _header(scope, name: bytes) -> str:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == name), "")


def create_app(state: ServeState, log) -> Gate:
    app = Starlette(routes=ROUTES + (page.ROUTES if state.webui else []),
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error})
    app.state.serve = state
    return Gate(app, state, log)
