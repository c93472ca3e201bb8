"""The engine side of the server: one worker thread owns the model and steps a Batcher
(runner/engine/batching.py) over every running request; HTTP handlers talk to it through submit and
cancel alone.

    ticket = scheduler.submit(job)       # on the event loop; QueueFull when the queue is full
    async for event in ticket.events():  # Text ... then Done or Failed
        ...
    scheduler.cancel(ticket)             # a client that left: its sequence stops within a step

Up to `slots` requests run together, one decode pass over the weights a step for all of them
(continuous batching: they join and leave at any step, and a long prompt comes in by chunks
between the passes); the others wait in the queue. They share one paged KV pool, which keeps
what finished requests held: a prompt that starts with cached tokens prefills only the rest, so a
repeated system prompt, or the next turn of a conversation, costs only its new tokens.
"""
from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np

from ..engine.batching import Batcher
from ..engine.constraint import Grammar, GrammarError
from ..engine.generate import ModelOutputError
from ..engine.sampler import Sampler, SamplingOptions
from ..text.reasoning import ReplyDecoder, reasoning_format
from .options import ServeOptions
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
    ignore_eos: bool = False         # go on past the end-of-generation tokens (llama-server's option)
    grammar: Grammar | None = None   # what the text must follow (structured output), checked already
    shown: dict[int, str] | None = None  # with tools: the control tokens of their markup, given as text


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
    # "stop" (end of generation, a stop string, a complete grammar), "length" (max_tokens or the context)
    finish_reason: str
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
        self.sequence = None  # its batching.Sequence, once the worker has it
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

    def __init__(self, load: Callable, options: ServeOptions, on_ready: Callable = lambda lm: None):
        self._load, self._on_ready, self.options = load, on_ready, options
        self.n_ctx, self.slots, self.max_queue = options.n_ctx, options.parallel, options.max_queue
        self.lm = self.batcher = None
        self.reasoning: str | None = None  # how the model's replies mark their reasoning (text/reasoning.py)
        self.ready = False
        self.load_error: BaseException | None = None
        self.stopping = False          # (set from a signal handler: a plain assignment, no lock)
        self.counters = Counters()
        self._waiting: deque[Ticket] = deque()  # submitted, not yet given to the batcher
        self._active: list[_Active] = []         # given to the batcher: waiting for a slot, or running
        self._lock = threading.Condition()       # over _waiting
        self._thread = threading.Thread(target=self._work, name="ggrun-scheduler", daemon=True)

    # -- the handlers' side (the event loop) ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> Ticket:
        """Queue a job (on the event loop, where its ticket's events arrive); QueueFull when
        max_queue jobs wait for a slot already."""
        ticket = Ticket(job)
        with self._lock:
            if self.queued >= self.max_queue:
                self.counters.rejected += 1
                raise QueueFull(f"the server is busy: {self.queued} requests are waiting (--max-queue)")
            self._waiting.append(ticket)
            self._lock.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop a ticket's sequence (within a step), or take it out of the queue."""
        ticket.cancelled = True
        with self._lock:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
        if ticket.sequence is not None:
            ticket.sequence.cancelled = True

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiting) + (len(self.batcher.waiting) if self.batcher is not None else 0)

    @property
    def processing(self) -> int:
        return len(self.batcher.running) if self.batcher is not None else 0


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
            o = self.options
            drafter = o.drafter(self.lm, self.n_ctx) if o.drafter else None
            self.batcher = Batcher(self.lm, self.slots, self.n_ctx, o.kv_size, drafter=drafter, draft_max=o.draft_max,
                                   draft_min=o.draft_min)
            self.reasoning = reasoning_format(self.lm.tokenizer.vocab)
            self._on_ready(self.lm)
        except BaseException as e:  # (the server reports it and exits)
            self.load_error = e
            return
        self.ready = True
        while self._take_new():
            try:
                self.batcher.step()
            except Exception as e:  # (the model's NaN logits, or a bug: its requests fail, the server goes on)
                if not isinstance(e, ModelOutputError):
                    traceback.print_exc()
                message = str(e) if isinstance(e, ModelOutputError) else f"internal error: {type(e).__name__}: {e}"
                for active in self._active:
                    active.ticket.put(Failed(500, message))
                self.batcher.fail_running()
                self._active = []
            self._report_finished()
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for ticket in waiting + [a.ticket for a in self._active]:
            ticket.put(Failed(503, "the server is shutting down"))

    def _take_new(self) -> bool:
        """Give the submitted tickets to the batcher, waiting while there is nothing to do; False
        once the server stops."""
        with self._lock:
            while not self.stopping:
                while self._waiting:
                    self._start(self._waiting.popleft())
                if self._active:
                    return True
                self._lock.wait(0.1)  # (stop() sets `stopping` from a signal handler, without a notify)
        return False

    def _start(self, ticket: Ticket) -> None:
        job = ticket.job
        if ticket.cancelled:  # (its client left as it came out of the queue)
            ticket.put(Done("cancelled", Usage(len(job.ids))))
            return
        active = _Active(ticket, _RecordingSampler(job.sampling, job.top_logprobs),
                         ReplyDecoder(self.lm.tokenizer, self.reasoning if job.reasoning else None, job.shown),
                         StopText(job.stops))
        try:
            ticket.sequence = self.batcher.add(job.ids, active.sampler, job.max_tokens, on_token=active.on_token,
                                               reuse=job.cache_prompt, stop_ids=() if job.ignore_eos else None,
                                               grammar=job.grammar)
        except GrammarError as e:  # (llguidance refusing the grammar with this model's tokenizer)
            ticket.put(Failed(400, str(e)))
            return
        self._active.append(active)
        self.counters.requests += 1

    def _report_finished(self) -> None:
        """Done for each ticket whose sequence ended this step, with its usage counted."""
        counters, still = self.counters, []
        for active in self._active:
            seq = active.ticket.sequence
            if not seq.finished:
                still.append(active)
                continue
            usage = active.finish()
            counters.prompt_tokens += usage.prompt_tokens - usage.cached_tokens
            counters.cached_tokens += usage.cached_tokens
            counters.generated_tokens += usage.completion_tokens
            counters.prompt_s += usage.prompt_s
            counters.decode_s += usage.decode_s
            counters.cancelled += seq.finish_reason == "cancelled" and not active.text.stopped
        self._active = still


class _Active:
    """A ticket's sequence in the batcher, and what turns its tokens into the ticket's events."""

    def __init__(self, ticket: Ticket, sampler, decoder: ReplyDecoder, text: StopText):
        self.ticket, self.sampler, self.decoder, self.text = ticket, sampler, decoder, text
        self.started = time.perf_counter()
        self.first_token: float | None = None

    def on_token(self, choice) -> None:
        """A generated token (on the worker, during the batcher's step): its text, less any stop
        string, to the ticket; a stop string ends the sequence."""
        self.first_token = self.first_token or time.perf_counter()
        self._put(self.decoder.push(choice.token), [self.sampler.info(choice.token)])
        if self.text.stopped:
            self.ticket.sequence.cancelled = True

    def _put(self, piece: str, tokens: list[TokenLogprob]) -> None:
        segments = self.text.push(piece, self.decoder.part)
        for i, (part, released) in enumerate(segments):
            self.ticket.put(Text(released, part, tokens if i == 0 else []))
        if tokens and not segments:
            self.ticket.put(Text("", self.decoder.part, tokens))

    def finish(self) -> Usage:
        """The rest of the text and Done, once the sequence has ended; its usage."""
        seq, now = self.ticket.sequence, time.perf_counter()
        self._put(self.decoder.flush(), [])
        for part, released in self.text.flush():
            self.ticket.put(Text(released, part, []))
        first = self.first_token or now
        usage = Usage(len(seq.ids), seq.cached_tokens, len(seq.tokens), first - self.started, now - first)
        if seq.finish_reason == "failed":  # (its grammar failed: it alone)
            self.ticket.put(Failed(500, f"internal error: {seq.error}"))
        elif self.text.stopped or seq.finish_reason == "eos":
            self.ticket.put(Done("stop", usage))
        elif seq.finish_reason == "cancelled":
            self.ticket.put(Done("cancelled", usage))
        else:  # ("length": max_tokens; "context": the sequence's context is full)
            self.ticket.put(Done("length", usage))
        return usage


class _RecordingSampler(Sampler):
    """A Sampler that keeps what a response reports of each token it chose: its log-probability
    under the model and the top_logprobs likeliest alternatives (when asked for)."""

    def __init__(self, options: SamplingOptions, top_logprobs: int | None):
        super().__init__(options)
        self.top_logprobs = top_logprobs
        self.chosen: dict[int, TokenLogprob] = {}  # the last choice's, by token (the one handed out next)

    def choose(self, logits, history, allowed=None):
        choice = super().choose(logits, history, allowed)
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
