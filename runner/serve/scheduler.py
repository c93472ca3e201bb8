"""The engine side of the server: one worker thread owns the model and its KV cache, and runs the
requests' sequences; HTTP handlers talk to it through submit and cancel alone.

    ticket = scheduler.submit(job)       # on the event loop; QueueFull when the queue is full
    async for event in ticket.events():  # Text ... then Done or Failed
        ...
    scheduler.cancel(ticket)             # a client that left: its sequence stops within a token

For now the worker runs one sequence at a time, in arrival order (`slots` is reported, not yet
used): continuous batching (runner/batching.py's Batcher: add, step, a sequence's on_token and
cancelled) replaces `_next` and `_run`, several tickets stepping together and joining and leaving
at any step, behind the same Job, Ticket, events, submit and cancel.

Prefix reuse: the cache is kept between requests with the tokens it holds (`held`); a prompt that
starts with some of them truncates the cache to that common prefix and prefills only the rest, so
a repeated system prompt, or the next turn of a conversation, costs only its new tokens (a job's
cache_prompt False prefills it all: see _reuse).
"""
from __future__ import annotations

import asyncio
import threading
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import closing
from dataclasses import dataclass, field

import numpy as np

from ..engine import Session
from ..generate import ModelOutputError
from ..reasoning import ReplyDecoder, reasoning_format
from ..sampler import Sampler, SamplingOptions
from .text import StopText


@dataclass
class Job:
    """One sequence to generate: a prompt's token ids and how to continue them."""
    ids: list[int]
    sampling: SamplingOptions
    max_tokens: int
    stops: tuple[str, ...] = ()
    top_logprobs: int | None = None  # None: no log-probabilities; N: the chosen token's and the N likeliest
    reasoning: bool = False          # tell a reasoning model's thinking apart from its answer (a chat reply)
    cache_prompt: bool = True        # reuse what the cache holds of the prompt (llama-server's option)


@dataclass
class TokenLogprob:
    id: int
    logprob: float | None                                 # under the model (None without top_logprobs)
    top: list[tuple[int, float]] = field(default_factory=list)  # the likeliest ids and their log-probabilities


@dataclass
class Text:
    """Generated text (empty while it may begin a stop string) and the tokens it came from."""
    text: str
    part: str  # reasoning.REASONING or ANSWER
    tokens: list[TokenLogprob]


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0      # of the prompt, reused from the cache (not prefilled)
    completion_tokens: int = 0
    prompt_s: float = 0.0
    decode_s: float = 0.0


@dataclass
class Done:
    finish_reason: str  # "stop" (end of generation or a stop string), "length" (max_tokens or the context)
    usage: Usage


@dataclass
class Failed:
    status: int  # the HTTP status that fits
    message: str


class QueueFull(Exception):
    """Every place in the queue is taken."""


class Ticket:
    """A submitted job: its events reach the handler on the event loop through a thread-safe channel."""

    def __init__(self, job: Job):
        self.job = job
        self.cancelled = False
        self.finished = False
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()

    def put(self, event) -> None:
        """From the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is listening
            pass

    async def events(self) -> AsyncIterator[Text | Done | Failed]:
        while not self.finished:
            event = await self._events.get()
            self.finished = isinstance(event, (Done, Failed))
            yield event


@dataclass
class Counters:
    """What /metrics reports of the worker (written by it alone)."""
    requests: int = 0           # jobs run
    cancelled: int = 0          # of those, stopped because their client left
    rejected: int = 0           # turned away with the queue full
    prompt_tokens: int = 0      # prefilled (not counting reused ones)
    cached_tokens: int = 0      # reused from the cache instead of prefilled
    generated_tokens: int = 0
    prompt_s: float = 0.0
    decode_s: float = 0.0


class Scheduler:
    """The worker thread and its queue. load() runs on the worker (the server answers /health
    with 503 meanwhile); on_ready(lm) is called once it has."""

    def __init__(self, load: Callable, n_ctx: int | None, slots: int = 1, max_queue: int = 64,
                 on_ready: Callable = lambda lm: None):
        self._load, self._on_ready = load, on_ready
        self.n_ctx, self.slots, self.max_queue = n_ctx, slots, max_queue
        self.lm = self.cache = None
        self.reasoning: str | None = None  # how the model's replies mark their reasoning (reasoning.py)
        self.held: list[int] = []      # the tokens the cache holds, in order
        self.ready = False
        self.load_error: BaseException | None = None
        self.stopping = False          # (set from a signal handler: a plain assignment, no lock)
        self.counters = Counters()
        self.running: Ticket | None = None
        self._waiting: deque[Ticket] = deque()
        self._lock = threading.Condition()  # over _waiting
        self._thread = threading.Thread(target=self._work, name="ggrun-scheduler", daemon=True)

    # -- the handlers' side (the event loop) ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> Ticket:
        """Queue a job (on the event loop, where its ticket's events arrive); QueueFull when
        max_queue jobs wait already."""
        ticket = Ticket(job)
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                self.counters.rejected += 1
                raise QueueFull(f"the server is busy: {len(self._waiting)} requests are waiting (--max-queue)")
            self._waiting.append(ticket)
            self._lock.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop a ticket's sequence (within a token), or take it out of the queue."""
        ticket.cancelled = True
        with self._lock:
            if ticket in self._waiting:
                self._waiting.remove(ticket)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def kv_tokens(self) -> int:
        return self.cache.used if self.cache is not None else 0

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what runs and what waits, and end the worker."""
        self.stopping = True
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker ----------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            self.lm = self._load()
            self.n_ctx = self.n_ctx or self.lm.default_context()
            self.cache = self.lm.model.new_cache(self.n_ctx, ring=False)
            self.reasoning = reasoning_format(self.lm.tokenizer.vocab)
            self._on_ready(self.lm)
        except BaseException as e:  # (the server reports it and exits)
            self.load_error = e
            return
        self.ready = True
        while (ticket := self._next()) is not None:
            try:
                self._run(ticket)
            except Exception as e:  # (the model's NaN logits, or a bug: the request fails, the server goes on)
                if not isinstance(e, ModelOutputError):
                    traceback.print_exc()
                self.cache.truncate(0)
                self.held = []
                message = str(e) if isinstance(e, ModelOutputError) else f"internal error: {type(e).__name__}: {e}"
                ticket.put(Failed(500, message))
            finally:
                self.running = None
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for ticket in waiting:
            ticket.put(Failed(503, "the server is shutting down"))

    def _next(self) -> Ticket | None:
        """The next ticket in arrival order (None once the server stops)."""
        with self._lock:
            while not self.stopping:
                if self._waiting:
                    self.running = self._waiting.popleft()
                    return self.running
                self._lock.wait(0.1)  # (stop() sets `stopping` from a signal handler, without a notify)
        return None

    def _run(self, ticket: Ticket) -> None:
        job, counters = ticket.job, self.counters
        if ticket.cancelled:  # (its client left as it came out of the queue)
            ticket.put(Done("cancelled", Usage(len(job.ids))))
            return
        reused = self._reuse(job.ids, job.cache_prompt)
        session = Session(self.lm, self.cache)
        sampler = _RecordingSampler(job.sampling, job.top_logprobs)
        decoder = ReplyDecoder(self.lm.tokenizer, self.reasoning if job.reasoning else None)
        text = StopText(job.stops)
        counters.requests += 1
        handed = 0  # tokens handed out so far
        pieces = session.complete(job.ids[reused:], sampler, job.max_tokens, history=job.ids[:reused],
                                  should_stop=lambda: ticket.cancelled or self.stopping, decoder=decoder)
        with closing(pieces):
            for piece in pieces:  # (one per token handed out, and a last one, the decoder's remainder)
                new = [sampler.info(t) for t in session.stats.tokens[handed:]]
                handed += len(new)
                segments = text.push(piece, decoder.part)
                for i, (part, released) in enumerate(segments):
                    ticket.put(Text(released, part, new if i == 0 else []))
                if new and not segments:
                    ticket.put(Text("", decoder.part, new))
                if text.stopped:
                    break
        for part, released in text.flush():
            ticket.put(Text(released, part, []))
        stats = session.stats
        # (the cache holds the prompt and the tokens handed out, but for the last one where it stopped early)
        self.held = (job.ids + stats.tokens)[:self.cache.used]
        usage = Usage(len(job.ids), reused, stats.generated_tokens, stats.prefill_s, stats.decode_s)
        counters.prompt_tokens += len(job.ids) - reused
        counters.cached_tokens += reused
        counters.generated_tokens += stats.generated_tokens
        counters.prompt_s += stats.prefill_s
        counters.decode_s += stats.decode_s
        if stats.stop_reason == "interrupted":
            counters.cancelled += ticket.cancelled
            ticket.put(Done("cancelled", usage) if ticket.cancelled else Failed(503, "the server is shutting down"))
        else:
            ticket.put(Done("stop" if text.stopped or stats.stop_reason == "eos" else "length", usage))

    def _reuse(self, ids: list[int], cache_prompt: bool) -> int:
        """Truncate the cache to the longest prefix of ids it holds (leaving at least one token of
        ids to prefill, whose logits start the reply) and say how long that is; none where
        cache_prompt is False. As with llama-server's cache_prompt, a reused prefix was computed
        in passes of other sizes (a reply's tokens in one-token steps) than a fresh prefill's,
        whose rounding differs, and at a near tie a greedy pick may differ too."""
        n, most = 0, min(len(self.held), len(ids) - 1) if cache_prompt else 0
        while n < most and self.held[n] == ids[n]:
            n += 1
        if n and not self.cache.truncation_keeps(n):
            n = 0
        if n < self.cache.used:
            self.cache.truncate(n)
            self.held = self.held[:n]
        return n


class _RecordingSampler(Sampler):
    """A Sampler that keeps what a response reports of each token it chose: its log-probability
    under the model and the top_logprobs likeliest alternatives (when asked for)."""

    def __init__(self, options: SamplingOptions, top_logprobs: int | None):
        super().__init__(options)
        self.top_logprobs = top_logprobs
        self.chosen: dict[int, TokenLogprob] = {}  # the last choice's, by token (the one handed out next)

    def choose(self, logits, history):
        choice = super().choose(logits, history)
        if self.top_logprobs is not None:
            x = np.asarray(choice.logits, dtype=np.float64)
            x = x - x.max()
            x -= np.log(np.exp(x).sum())
            k = min(self.top_logprobs, x.size)
            top = np.argpartition(-x, k - 1)[:k] if k else np.array([], dtype=np.int64)
            top = top[np.argsort(-x[top], kind="stable")]
            self.chosen = {choice.token: TokenLogprob(choice.token, float(x[choice.token]),
                                                      [(int(i), float(x[i])) for i in top])}
        return choice

    def info(self, token: int) -> TokenLogprob:
        return self.chosen.get(token) or TokenLogprob(token, None)
