"""Running the server: the socket bound first (a port in use is an error before anything loads),
uvicorn serving at once (/health answers 503 while the model loads on the scheduler's worker),
and a clean stop on Ctrl-C or SIGTERM: what runs and what waits is cancelled, uvicorn closes its
connections, and the signal then ends the command as it ends the others (status 130 or 143)."""
from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import threading
from collections.abc import Callable

import uvicorn

from ..engine.sampler import SamplingOptions
from .app import ServeState, create_app
from .model import ModelCard, ServedModel
from .options import ServeOptions
from .scheduler import Scheduler


class _Server(uvicorn.Server):
    """uvicorn's server, which also cancels the scheduler's work on the first signal and leaves
    what the signal means to the command (uvicorn would raise it again, which does nothing
    where it was ignored, as in a background job)."""

    def __init__(self, config, scheduler: Scheduler):
        super().__init__(config)
        self.scheduler = scheduler
        self.signal: int | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # (signals reach the main thread alone)
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        self.scheduler.stopping = True  # (in a signal handler: a plain assignment, no lock)
        self.signal = self.signal or sig
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        return await super().on_tick(counter) or self.scheduler.load_error is not None


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (OSError where the address is in use or not ours)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=2048)


def serving_state(load: Callable, card: ModelCard, sampling: SamplingOptions, options: ServeOptions,
                  log: Callable[[str], None] = print) -> ServeState:
    """The handlers' state, with a scheduler (not started) whose worker will load() the model."""
    def ready(lm):
        state.model = ServedModel(lm, scheduler.n_ctx)
        if state.model.template_warning:
            log(f"warning: {state.model.template_warning}")
        pool, n = scheduler.batcher.pool, options.parallel
        log(f"ready: {card.name} ({card.architecture} {card.quant}), a context of {scheduler.n_ctx} tokens per "
            f"sequence, {n} sequence{'s' * (n > 1)} at once, a KV pool of {pool.n_slots} tokens "
            f"({pool.n_slots * pool.bytes_per_token / 2**20:.0f} MiB at most)")

    scheduler = Scheduler(load, options, on_ready=ready)
    state = ServeState(scheduler, card, sampling, options.api_key, options.webui)  # (ready() sets its model)
    return state


def serve(load: Callable, card: ModelCard, sampling: SamplingOptions, sock: socket.socket, options: ServeOptions,
          log: Callable[[str], None]) -> int | None:
    """Serve until a signal, and return it; load() (on the worker thread) gives the model. A model
    that fails to load ends the server, and its error is raised here."""
    state = serving_state(load, card, sampling, options, log)
    scheduler = state.scheduler
    config = uvicorn.Config(create_app(state, log), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=10)
    server = _Server(config, scheduler)
    host, port = sock.getsockname()[:2]
    log(f"listening on http://{f'[{host}]' if ':' in host else host}:{port} (loading {card.name})")
    if not options.api_key and not ipaddress.ip_address(host).is_loopback:
        log("warning: without --api-key, anyone who reaches this address can use the model")
    scheduler.start()
    try:
        server.run(sockets=[sock])
    finally:
        scheduler.stop()
        sock.close()
    if scheduler.load_error is not None:
        raise scheduler.load_error
    return server.signal
