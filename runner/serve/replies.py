"""Between a ticket's events and an HTTP response: a streamed reply that cancels its ticket when
the client leaves, and a whole reply gathered while watching for the client leaving. Either way
the usage lands in the request's scope, for the log line."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from ..text.reasoning import SplitReply
from .fields import ApiError
from .scheduler import (
    Done,
    Failed,
    Job,
    QueueFull,
    Scheduler,
    Text,
    Ticket,
    TokenLogprob,
    Usage,
)

USAGE = "ggrun.usage"  # the scope's key for a request's Usage (the log line reads it)
LEFT = "ggrun.client_left"  # set in the scope when the client disconnected before its reply was whole


class ClientLeft(Exception):
    """The client disconnected before its reply was whole."""


class Reply(SplitReply):
    """A whole reply: its text by part (answer, reasoning), its tokens, why it ended, its usage."""

    def __init__(self):
        super().__init__()
        self.tokens: list[TokenLogprob] = []
        self.finish_reason = ""
        self.usage = Usage()


async def submit(state, prompt_ids, sampling, max_tokens: int | None, stops=(), top_logprobs: int | None = None,
                 reasoning: bool = False, cache_prompt: bool = True, ignore_eos: bool = False,
                 grammar=None, shown=None) -> Ticket:
    """A request's job into the queue: prompt_ids(model) makes its tokens (off the event loop, as a
    template may take a while), which must leave room in the context for max_tokens (none: the
    rest of the context); a full queue is a 503. grammar: what the reply must follow (structured.py's);
    shown: control tokens to give as text (a tool-call format's, tools.py)."""
    model = state.loaded()
    ids = await run_in_threadpool(prompt_ids, model)
    job = Job(ids, sampling, model.budget(len(ids), max_tokens), tuple(stops), top_logprobs, reasoning, cache_prompt,
              ignore_eos, grammar, shown)
    try:
        return state.scheduler.submit(job)
    except QueueFull as e:
        raise ApiError(503, str(e)) from None


async def events(request, ticket: Ticket) -> AsyncIterator[Text | Done]:
    """The ticket's events; Failed raises its ApiError, Done's usage goes into the scope."""
    async for event in ticket.events():
        if isinstance(event, Failed):
            raise ApiError(event.status, event.message)
        if isinstance(event, Done):
            request.scope[USAGE] = event.usage
        yield event


async def gather(request, scheduler: Scheduler, ticket: Ticket) -> Reply:
    """The whole reply; ClientLeft (and the ticket cancelled) when the client disconnects first."""
    async def collect() -> Reply:
        reply = Reply()
        async for event in events(request, ticket):
            if isinstance(event, Text):
                reply.add(event.part, event.text)
                reply.tokens.extend(event.tokens)
            else:
                reply.finish_reason, reply.usage = event.finish_reason, event.usage
        return reply

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collecting, watching = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()
            scheduler.cancel(ticket)
    if collecting not in done:
        request.scope[LEFT] = True
        raise ClientLeft
    return collecting.result()


class Streamed(StreamingResponse):
    """Lines of a reply as they come (SSE or NDJSON), stopped, and the ticket cancelled, as soon
    as the client disconnects: while its request waits in the queue too, when nothing is sent."""

    def __init__(self, lines: AsyncIterator[str], scheduler: Scheduler, ticket: Ticket, media_type: str):
        super().__init__(lines, media_type=media_type, headers={"Cache-Control": "no-cache",
                                                                "X-Accel-Buffering": "no"})
        self.scheduler, self.ticket = scheduler, ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream():
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            if not self.ticket.finished:
                scope[LEFT] = True
                self.scheduler.cancel(self.ticket)
