"""Continuous batching: several sequences generated together, one pass over the weights a step.

A decode step is bound by reading the weights, so one pass that takes the next token of every
running sequence (Decoder.forward_lanes: each sequence its own cache, attention each its own)
costs little more than one sequence's step, and each row comes out as it would alone. Sequences
join and leave at any step. A prompt is prefilled in chunks of at most `prefill_chunk` tokens,
one chunk a step between decode passes, so the running streams keep flowing while it comes in.

Up to `slots` sequences run at once, each with a context of `n_ctx` tokens, over one paged KV
cache of `kv_tokens` tokens (runner/engine/kv_pool.py): a sequence holds blocks for the tokens it has,
and a new prompt starts from the cached blocks that hold its longest start and prefills only the
rest (a repeated system prompt, the next turn of a conversation). A sequence joins once the pool
can reserve blocks for its prompt and its most tokens; until then it waits. Given a drafter, a sequence that runs alone decodes speculatively
(runner/engine/speculative.py's drafts and verification); several batch instead, which spends the same
spare compute. A sequence given a grammar (runner/engine/constraint.py) has a Matcher of its own:
each of its tokens is chosen under the grammar's mask (drafts cut where the grammar rejects them),
and it ends ("eos") where the grammar is complete.

    batcher = Batcher(lm, slots=4, n_ctx=2048)                 # (a pool of 4 x 2048 tokens)
    seq = batcher.add(ids, Sampler(options), max_tokens=128)   # then, from the same thread:
    while batcher.step(): ...                                  # seq.tokens grows; seq.finish_reason
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .constraint import Grammar, GrammarError, Matcher
from .generate import checked, choose
from .kv_cache import ContextFullError
from .kv_pool import SequenceCache
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
    cached_tokens: int = 0          # of the prompt, reused from the cache
    finish_reason: str | None = None  # "eos", "length", "context", "cancelled" or "failed" once finished
    cancelled: bool = False         # set from anywhere: the sequence leaves at the next step
    reuse: bool = True              # whether it may start from a prefix the cache holds
    cache: SequenceCache | None = None  # while it runs
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    next_token: int | None = None   # sampled, not yet run through the model
    matcher: Matcher | None = None  # its grammar's, where it has one
    error: str | None = None        # why it "failed", where its grammar did (the others go on)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Batcher:
    def __init__(self, lm: LoadedModel, slots: int, n_ctx: int, kv_tokens: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, drafter=None, draft_max: int = 16, draft_min: int = 0):
        """kv_tokens: the pool's size (default: every slot may fill its context at once);
        drafter (speculative.make_drafter's): speculative decoding while one sequence runs alone,
        drafts of draft_min to draft_max tokens; several sequences batch instead."""
        self.lm, self.slots, self.n_ctx, self.prefill_chunk = lm, slots, n_ctx, prefill_chunk
        self.drafter, self.draft_max, self.draft_min = drafter, draft_max, draft_min
        block = lm.backend.kv_block
        self.pool = lm.model.new_kv_pool(kv_tokens or slots * -(-n_ctx // block) * block)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.lanes = lm.backend.few_tokens  # sequences a decode pass takes

    def add(self, ids: list[int], sampler: Sampler, max_tokens: int, stop_ids=None,
            on_token: Callable[[Choice], None] | None = None, reuse: bool = True,
            grammar: Grammar | None = None) -> Sequence:
        """Queue a prompt; it joins at a step where a slot is free and the pool has room for it
        (reuse: prefilling only what follows the longest start of it that the cache holds). A
        prompt that could never fit a sequence's context, or the pool, raises ContextFullError.
        grammar: what its text must follow (a Matcher of its own, ended by its stop ids; a
        GrammarError here where llguidance refuses it with this tokenizer)."""
        if not ids:
            raise ValueError("a sequence needs at least one prompt token")
        if len(ids) >= self.n_ctx:
            raise ContextFullError(f"the prompt has {len(ids)} tokens; a sequence's context holds {self.n_ctx}")
        if self._reservation(len(ids), max_tokens) > self.pool.n_slots:
            raise ContextFullError(f"the prompt has {len(ids)} tokens and may grow by {max_tokens}; the KV pool "
                                   f"holds {self.pool.n_slots} tokens in blocks of {self.pool.block}")
        stop = self.lm.tokenizer.vocab.end_of_generation if stop_ids is None else stop_ids
        matcher = None if grammar is None else Matcher(grammar, self.lm.tokenizer, self.lm.params.vocab_size, stop)
        seq = Sequence(list(ids), sampler, max_tokens, frozenset(stop), on_token, reuse=reuse, matcher=matcher)
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
        for seq in list(self.running):
            if seq.cancelled:
                self._finish(seq, "cancelled")
        kept = [s for s in self.waiting if not s.cancelled]
        for seq in self.waiting:
            if seq.cancelled:
                seq.finish_reason = "cancelled"
        self.waiting = deque(kept)

    def _reservation(self, n_prompt: int, max_tokens: int) -> int:
        """Tokens a sequence's blocks are reserved for: its prompt and its most tokens, within the
        context, in whole blocks."""
        tokens = min(self.n_ctx, n_prompt + max_tokens)
        return -(-tokens // self.pool.block) * self.pool.block

    def _admit(self) -> None:
        """Waiting sequences join, first come first served, while slots and the pool allow."""
        while self.waiting and len(self.running) < self.slots:
            seq = self.waiting[0]
            cache = self.lm.model.sequence_cache(self.pool, self.n_ctx)
            reused = cache.start(seq.ids, seq.reuse, self._reservation(len(seq.ids), seq.max_tokens))
            if reused is None:
                return
            self.waiting.popleft()
            seq.cache, seq.cached_tokens, seq.pending = cache, reused, seq.ids[reused:]
            self.running.append(seq)

    def _prefill_chunk(self, seq: Sequence) -> None:
        chunk, seq.pending = seq.pending[:self.prefill_chunk], seq.pending[self.prefill_chunk:]
        logits = checked(self.lm.model.forward(chunk, seq.cache))
        if not seq.pending:
            self._sample(seq, logits)

    def _speculate(self, seq: Sequence) -> None:
        """A lone sequence's step through a drafted chunk (runner/engine/speculative.py): the drafted
        tokens the target's pass accepts, and one more, each handed out as a step's would be."""
        cache, history = seq.cache, seq.ids + seq.tokens
        room = min(seq.max_tokens - len(seq.tokens), self.n_ctx - cache.used - 2, self.lanes - 1, self.draft_max)
        draft = self.drafter.propose(history, room, min(self.draft_min, room)) if room > 0 else []
        if seq.matcher is not None:  # (cut where the grammar rejects it; the grammar has had the last token)
            draft = draft[:seq.matcher.valid_prefix(draft)]
        if not draft:
            return self._decode([seq])
        last = seq.next_token
        if cache.recurrent is not None:  # (rejected drafts: the recurrent state goes back over them)
            cache.recurrent.undo = True
        rows = checked(self.lm.model.forward([last] + draft, cache, all_logits=True))
        try:
            ready = verify(seq.sampler, rows, draft, history, seq.matcher)
        except (GrammarError, ValueError) as e:  # (the sampler's "the grammar allows no token here")
            cache.truncate(cache.used - len(draft))
            return self._fail(seq, e)
        rejected = len(draft) - (len(ready) - 1)
        if rejected:
            cache.truncate(cache.used - rejected)
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
            logits = checked(self.lm.model.forward(tokens, seqs[0].cache))[None]
        else:
            logits = checked(self.lm.model.forward_lanes([[t] for t in tokens], [s.cache for s in seqs]))
        for seq, row in zip(seqs, logits):
            seq.next_token = None
            self._sample(seq, row)

    def _sample(self, seq: Sequence, logits) -> None:
        """The sequence's next token from logits, or its end."""
        if seq.cancelled:
            return self._finish(seq, "cancelled")
        if seq.matcher is not None and seq.matcher.finished:
            return self._finish(seq, "eos")
        if len(seq.tokens) >= seq.max_tokens:
            return self._finish(seq, "length")
        try:
            choice = choose(seq.sampler, logits, seq.ids + seq.tokens, seq.matcher)
        except (GrammarError, ValueError) as e:  # (the sampler's "the grammar allows no token here")
            if seq.matcher is None:
                raise
            return self._fail(seq, e)
        self._take(seq, choice)

    def _take(self, seq: Sequence, choice: Choice) -> None:
        """Hand out a chosen token (it runs through the model next), or end the sequence: at a
        stop id, or where its grammar is complete (and at max_tokens, "length", inside it)."""
        if choice.token in seq.stop_ids:
            return self._finish(seq, "eos")
        if seq.cache.used >= self.n_ctx:
            return self._finish(seq, "context")
        if seq.matcher is not None:
            try:
                seq.matcher.accept(choice.token)
            except GrammarError as e:
                return self._fail(seq, e)
        seq.tokens.append(choice.token)
        if seq.on_token is not None:
            seq.on_token(choice)
        if seq.matcher is not None and seq.matcher.finished:
            return self._finish(seq, "eos")
        if len(seq.tokens) >= seq.max_tokens:
            return self._finish(seq, "length")
        seq.next_token = choice.token

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """A sequence whose grammar failed ends alone ("failed", the error kept); the others go on."""
        seq.error = str(error)
        self._finish(seq, "failed")

    def fail_running(self) -> None:
        """End every running sequence ("failed"), forgetting the blocks it alone held: a pass that
        raised may have left them half written."""
        for seq in list(self.running):
            self._finish(seq, "failed", keep=False)

    def _finish(self, seq: Sequence, reason: str, keep: bool = True) -> None:
        seq.finish_reason, seq.next_token, seq.pending = reason, None, []
        seq.cache.release(keep)
        seq.cache = None
        self.running.remove(seq)
