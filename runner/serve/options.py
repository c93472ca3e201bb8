"""How `ggrun serve` runs: one dataclass, built by keyword, whose defaults the command line shows."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ServeOptions:
    n_ctx: int | None = None        # context of each sequence: its prompt and reply (None: the model's default)
    parallel: int = 1               # sequences that run together (llama-server's -np)
    kv_size: int | None = None      # tokens of the KV pool they share (None: every sequence may fill its context)
    max_queue: int = 64             # requests that may wait for a sequence; more get 503
    api_key: str | None = None      # required on every route but /health and the chat page
    webui: bool = True              # the chat page at / (page.py)
    drafter: Callable | None = None  # drafter(lm, n_ctx): speculative decoding while one request runs alone
    draft_max: int = 16
    draft_min: int = 0
