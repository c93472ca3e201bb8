"""Continuous batching: several sequences generated together, one pass over the weights a step.

A decode step is bound by reading the weights, so one pass that takes the next token of every
running sequence (Decoder.forward_lanes: each sequence its own cache, attention each its own)
costs little more than one sequence's step, and each row comes out as it would alone. Sequences
join and leave at any step. A prompt is prefilled in chunks of at most `prefill_chunk` tokens,
one chunk a step between decode passes, so the running streams keep flowing while it comes in.

Each of the `slots` sequences that may run at once has a KV cache of `n_ctx` tokens, kept with
the tokens it holds after its sequence ends: a new prompt goes to the free slot holding the
longest prefix of it and prefills only the rest (a repeated system prompt, the next turn of a
conversation). Given a drafter, a sequence that runs alone decodes speculatively
(runner/speculative.py's drafts and verification); several batch instead, which spends the same
spare compute.

    batcher = Batcher(lm, slots=4, n_ctx=2048)
    seq = batcher.add(ids, Sampler(options), max_tokens=128)   # then, from the same thread:
    while batcher.step(): ...                                  # seq.tokens grows; seq.finish_reason
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .generate import checked
from .kv_cache import ContextFullError
from .load import LoadedModel
from .sampler import Choice, Sampler
from .speculative import verify

PREFILL_CHUNK = 128  # prompt tokens a step, between decode passes


@dataclass(eq=False)
class Sequence:
    """One request's generation: its prompt, how to sample, and what came of it so far."""
    ids: list[int]
    sampler: Sampler
    max_tokens: int
    stop_ids: frozenset
    on_token: Callable[[Choice], None] | None = None  # each generated token, as it comes (worker's thread)
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0          # of the prompt, reused from its slot's cache
    finish_reason: str | None = None  # "eos", "length", "context", "cancelled" or "failed" once finished
    cancelled: bool = False         # set from anywhere: the sequence leaves at the next step
    reuse: bool = True              # whether it may start from a prefix its slot's cache holds
    slot: _Slot | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    next_token: int | None = None   # sampled, not yet run through the model

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class _Slot:
    cache: object
    held: list[int] = field(default_factory=list)  # the tokens its cache holds, in order
    sequence: Sequence | None = None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Batcher:
    def __init__(self, lm: LoadedModel, slots: int, n_ctx: int, prefill_chunk: int = PREFILL_CHUNK, drafter=None,
                 draft_max: int = 16, draft_min: int = 0):
        """drafter (speculative.make_drafter's): speculative decoding while one sequence runs
        alone, drafts of draft_min to draft_max tokens; several sequences batch instead."""
        self.lm, self.n_ctx, self.prefill_chunk = lm, n_ctx, prefill_chunk
        self.drafter, self.draft_max, self.draft_min = drafter, draft_max, draft_min
        self.slots = [_Slot(lm.model.new_cache(n_ctx)) for _ in range(slots)]
        self.waiting: deque[Sequence] = deque()
        self.lanes = lm.backend.few_tokens  # sequences a decode pass takes

    @property
    def running(self) -> list[Sequence]:
        return [s.sequence for s in self.slots if s.sequence is not None]

    def add(self, ids: list[int], sampler: Sampler, max_tokens: int, stop_ids=None,
            on_token: Callable[[Choice], None] | None = None, reuse: bool = True) -> Sequence:
        """Queue a prompt; it joins at a step where a slot is free (reuse: prefilling only what
        follows the longest prefix of it a free slot holds). A prompt that could never fit a
        slot's context raises ContextFullError."""
        if not ids:
            raise ValueError("a sequence needs at least one prompt token")
        if len(ids) >= self.n_ctx:
            raise ContextFullError(f"the prompt has {len(ids)} tokens; a sequence's context holds {self.n_ctx}")
        stop = self.lm.tokenizer.vocab.end_of_generation if stop_ids is None else stop_ids
        seq = Sequence(list(ids), sampler, max_tokens, frozenset(stop), on_token, reuse=reuse)
        self.waiting.append(seq)
        return seq

    def step(self) -> bool:
        """One step: admit waiting sequences to free slots, prefill one chunk of one prompt, run
        one decode pass over the sequences with a token to run; whether anything is left to do."""
        self._leave_cancelled()
        self._admit()
        prefilling = next((s for s in self.running if s.pending), None)
        if prefilling is not None:
            self._prefill_chunk(prefilling)
        decoding = [s for s in self.running if s.next_token is not None][:self.lanes]
        if len(decoding) == 1 and len(self.running) == 1 and self.drafter is not None:
            self._speculate(decoding[0])
        elif decoding:
            self._decode(decoding)
        return bool(self.waiting or self.running)

    def _leave_cancelled(self) -> None:
        for seq in self.running:
            if seq.cancelled:
                self._finish(seq, "cancelled")
        kept = [s for s in self.waiting if not s.cancelled]
        for seq in self.waiting:
            if seq.cancelled:
                seq.finish_reason = "cancelled"
        self.waiting = deque(kept)

    def _admit(self) -> None:
        while self.waiting:
            free = [s for s in self.slots if s.sequence is None]
            if not free:
                return
            seq = self.waiting.popleft()
            slot = max(free, key=lambda s: common_prefix(s.held, seq.ids))
            # (at least the last prompt token runs again: its logits give the first token)
            reuse = min(common_prefix(slot.held, seq.ids), len(seq.ids) - 1) if seq.reuse else 0
            if not slot.cache.truncation_keeps(reuse):
                reuse = 0
            slot.cache.truncate(reuse)
            del slot.held[reuse:]
            seq.slot, seq.cached_tokens, seq.pending = slot, reuse, seq.ids[reuse:]
            slot.sequence = seq

    def _prefill_chunk(self, seq: Sequence) -> None:
        chunk, seq.pending = seq.pending[:self.prefill_chunk], seq.pending[self.prefill_chunk:]
        logits = checked(self.lm.model.forward(chunk, seq.slot.cache))
        seq.slot.held.extend(chunk)
        if not seq.pending:
            self._sample(seq, logits)

    def _speculate(self, seq: Sequence) -> None:
        """A lone sequence's step through a drafted chunk (runner/speculative.py): the drafted
        tokens the target's pass accepts, and one more, each handed out as a step's would be."""
        cache, history = seq.slot.cache, seq.ids + seq.tokens
        room = min(seq.max_tokens - len(seq.tokens), self.n_ctx - cache.used - 2, self.lanes - 1, self.draft_max)
        draft = self.drafter.propose(history, room, min(self.draft_min, room)) if room > 0 else []
        if not draft:
            return self._decode([seq])
        last = seq.next_token
        rows = checked(self.lm.model.forward([last] + draft, cache, all_logits=True))
        ready = verify(seq.sampler, rows, draft, history)
        rejected = len(draft) - (len(ready) - 1)
        if rejected:
            cache.truncate(cache.used - rejected)
        seq.slot.held.extend([last] + draft[:len(ready) - 1])
        for j, (_, choice) in enumerate(ready):
            if seq.cancelled or seq.finished:
                break
            self._take(seq, choice)
            if j < len(ready) - 1:  # (an accepted draft token: in the cache already)
                seq.next_token = None
        if seq.cancelled and not seq.finished:
            self._finish(seq, "cancelled")

    def _decode(self, seqs: list[Sequence]) -> None:
        tokens = [s.next_token for s in seqs]
        if len(seqs) == 1:  # (a plain step, which a backend replays from its recording)
            logits = checked(self.lm.model.forward(tokens, seqs[0].slot.cache))[None]
        else:
            logits = checked(self.lm.model.forward_lanes([[t] for t in tokens], [s.slot.cache for s in seqs]))
        for seq, token, row in zip(seqs, tokens, logits):
            seq.slot.held.append(token)
            seq.next_token = None
            self._sample(seq, row)

    def _sample(self, seq: Sequence, logits) -> None:
        """The sequence's next token from logits, or its end."""
        if seq.cancelled:
            return self._finish(seq, "cancelled")
        if len(seq.tokens) >= seq.max_tokens:
            return self._finish(seq, "length")
        self._take(seq, seq.sampler.choose(logits, seq.ids + seq.tokens))

    def _take(self, seq: Sequence, choice: Choice) -> None:
        """Hand out a chosen token (it runs through the model next), or end the sequence."""
        if choice.token in seq.stop_ids:
            return self._finish(seq, "eos")
        if seq.slot.cache.used >= self.n_ctx:
            return self._finish(seq, "context")
        seq.tokens.append(choice.token)
        if seq.on_token is not None:
            seq.on_token(choice)
        if len(seq.tokens) >= seq.max_tokens:
            return self._finish(seq, "length")
        seq.next_token = choice.token

    def fail_running(self) -> None:
        """End every running sequence ("failed") and empty its slot's cache: a pass that raised
        may have left it half written."""
        for seq in self.running:
            seq.slot.cache.truncate(0)
            seq.slot.held.clear()
            self._finish(seq, "failed")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason, seq.next_token, seq.pending = reason, None, []
        seq.slot.sequence = None
        seq.slot = None
