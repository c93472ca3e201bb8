"""The generation loop: prefill the prompt, then sample one token at a time until a stop."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .kv_cache import ContextFullError
from .sampler import Sampler


class ModelOutputError(Exception):
    """The model computed something unusable (NaN or infinite logits)."""


class PromptError(ValueError):
    """A prompt that cannot be run (empty, with no BOS to start from)."""


def checked(logits):
    """logits, when they are all finite; a corrupt tensor shows up here first."""
    if not np.isfinite(logits).all():
        raise ModelOutputError("the model produced NaN or infinite logits; the file may be corrupt")
    return logits


def truncate_prompt(ids: list[int], n_ctx: int, keep: int, n_predict: int) -> tuple[list[int], str | None]:
    """A prompt that fits the context: past it, the first `keep` tokens (pinned) and the last
    ones, leaving room for min(n_predict, half the rest) generated tokens before the ring wraps,
    as llama.cpp keeps n_keep and the end; and a notice saying what was dropped."""
    if len(ids) <= n_ctx:
        return ids, None
    tail = n_ctx - keep - min(n_predict, (n_ctx - keep) // 2)
    kept = ids[:keep] + ids[len(ids) - tail:]
    return kept, (f"the prompt has {len(ids)} tokens, more than the context of {n_ctx}: kept the first {keep} "
                  f"and the last {tail} ({len(ids) - len(kept)} dropped)")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0        # prompt processing, ends with the first token's logits
    time_to_first_token_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = ""         # "eos", "length", "context", "interrupted" or "reverse_prompt"
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # each token's log-probability (generate's logprobs)

    def hand_out(self, token: int, choice, logprobs: bool) -> None:
        """Count a generated token (with its log-probability under the model, with logprobs)."""
        self.generated_tokens += 1
        self.tokens.append(token)
        if logprobs:
            self.logprobs.append(choice.model_logprob())

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first generated token comes from the prefill's logits; each one then costs a decode step
        return self.generated_tokens / self.decode_s if self.generated_tokens and self.decode_s else 0.0


def choose(sampler: Sampler, logits, history: list[int], matcher=None):
    """The sampler's choice, under a grammar's mask where there is a matcher (constraint.Matcher)."""
    return sampler.choose(logits, history) if matcher is None else sampler.choose(logits, history, matcher)


def prefill(model, cache, prompt: list[int], stats: GenerationStats, pin: int = 0):
    """The prompt into the cache (its first `pin` tokens pinned), timed into stats: the logits
    after it. Without a ring, ContextFullError up front when it does not fit."""
    if not cache.ring and len(prompt) > cache.n_ctx - cache.used:
        raise ContextFullError(f"the prompt has {len(prompt)} tokens but the context holds "
                               f"{cache.n_ctx - cache.used}; use a larger -c, a shorter prompt or --ring")
    stats.prompt_tokens = len(prompt)
    start = time.perf_counter()
    if pin:
        model.forward(prompt[:pin], cache)
        cache.pin()
    logits = checked(model.forward(prompt[pin:], cache))
    stats.prefill_s = time.perf_counter() - start
    return logits


def generate(model, cache, prompt: list[int], sampler: Sampler, max_tokens: int, stop_ids,
             stats: GenerationStats | None = None, history: list[int] | None = None, pin: int = 0,
             should_stop=None, logprobs: bool = False, matcher=None):
    """Yield generated token ids; fills `stats` as it goes (each token's log-probability under
    the model too, with logprobs). Without a ring, raises ContextFullError up front when the prompt
    does not fit, and stops at the context end; always stops at a stop id or at max_tokens.
    `history` (tokens already in the cache) feeds the repetition penalty; the first `pin` prompt
    tokens are pinned in the cache, never overwritten by its ring. `should_stop` is polled between
    tokens (Ctrl-C sets it), so a forward pass is never cut in half. `matcher`: a grammar's
    (constraint.Matcher), which allows each token and ends the generation where it is complete,
    as an end-of-generation token would."""
    stats = stats if stats is not None else GenerationStats()
    start = time.perf_counter()
    logits = prefill(model, cache, prompt, stats, pin)
    history = list(history or []) + list(prompt)
    decode_start = None
    stats.stop_reason = "length"
    while True:
        if matcher is not None and matcher.finished:
            stats.stop_reason = "eos"
            break
        if stats.generated_tokens >= max_tokens:
            break
        if should_stop is not None and should_stop():
            stats.stop_reason = "interrupted"
            break
        choice = choose(sampler, logits, history, matcher)
        token = choice.token
        if stats.generated_tokens == 0:
            stats.time_to_first_token_s = time.perf_counter() - start
            decode_start = time.perf_counter()
        if token in stop_ids:
            stats.stop_reason = "eos"
            break
        if not cache.ring and cache.used >= cache.n_ctx:
            stats.stop_reason = "context"
            break
        if matcher is not None:
            matcher.accept(token)
        stats.hand_out(token, choice, logprobs)
        history.append(token)
        yield token
        # every token handed out is also in the cache, so a caller can continue from it
        logits = checked(model.forward([token], cache))
        stats.decode_s = time.perf_counter() - decode_start
