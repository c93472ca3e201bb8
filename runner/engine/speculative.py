"""Speculative decoding: a drafter guesses the next tokens, the target checks them all in one
forward pass over the chunk, and keeps the prefix it agrees with (llama.cpp's -md and
--spec-type ngram-*, mlx-lm's --draft-model). A step reads the target's weights once for up to
draft-max + 1 tokens.

Exactness: every drafted token d is a proposal with certainty (q = 1 at d), accepted with
probability min(1, p(d) / q(d)) = p(d) under the target's sampling distribution p (its
penalties, filters and temperature applied); a rejection draws from the normalized max(0, p - q),
p without d. So the output follows the target's own distribution, and at temperature 0
(p = 1 at the argmax) it is token for token the target's greedy text.

Drafters: another model with the same vocabulary on its own KV cache (DraftModel; a quantized
copy of the target itself is one: self_draft), or the continuation of the last n-gram's earlier
occurrence in the prompt and output (PromptLookup).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .generate import GenerationStats, checked, choose, prefill
from .kv_cache import ContextFullError
from .kv_pool import common_prefix
from .sampler import Choice, Sampler


# Where a draft model's top probability falls below this it stops drafting (--draft-p-min;
# llama.cpp's default is 0.75). A pass of up to 8 tokens costs little more than one step, so long
# drafts pay, and a low floor makes them long for the same draft steps all told
# (docs/benchmarks.md). A random-weight draft's top probability is ~1e-4, so it still stops at
# once (no cost of drafting).
DRAFT_P_MIN = 0.1


class DraftError(ValueError):
    """A draft that cannot serve the target (another vocabulary)."""


@dataclass
class SpeculationStats:
    proposed: int = 0      # drafted tokens the target checked
    accepted: int = 0      # of them, those it kept
    passes: int = 0        # the target's forward passes over a chunk
    generated: int = 0     # tokens those passes produced (accepted drafts, plus one each)
    draft_max: int = 0     # the longest draft asked for (gamma)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.generated / self.passes if self.passes else 0.0

    def expected_tokens_per_pass(self) -> float:
        """(1 - a^(g + 1)) / (1 - a), for acceptance a and draft length g: what drafting at that
        rate would give with every draft as long as draft_max."""
        a, g = self.acceptance, self.draft_max
        return g + 1.0 if a >= 1.0 else (1 - a ** (g + 1)) / (1 - a)

    def as_dict(self) -> dict:
        return {"draft_proposed": self.proposed, "draft_accepted": self.accepted,
                "acceptance": round(self.acceptance, 4), "target_passes": self.passes,
                "tokens_per_pass": round(self.tokens_per_pass, 3),
                "expected_tokens_per_pass": round(self.expected_tokens_per_pass(), 3), "draft_max": self.draft_max}


def describe_speculation(s: dict) -> str:
    """One line of SpeculationStats.as_dict(), as run --timings, chat's /stats and bench print it."""
    return (f"drafts: {s['draft_accepted']} of {s['draft_proposed']} accepted (acceptance {s['acceptance']:.3f}), "
            f"{s['tokens_per_pass']:.2f} tokens per target pass over {s['target_passes']} passes (expected at "
            f"draft length {s['draft_max']}: {s['expected_tokens_per_pass']:.2f})")


def check_vocabularies(target, draft) -> None:
    """As llama.cpp's speculative compatibility check: the same tokenizer kind, BOS/EOS, sizes
    within 128 tokens, and the same token texts from id 5 on."""
    a, b = target.tokenizer.vocab, draft.tokenizer.vocab
    if (a.model, a.bos_id, a.eos_id, a.add_bos) != (b.model, b.bos_id, b.eos_id, b.add_bos):
        raise DraftError(f"the draft's tokenizer ({b.model}, BOS {b.bos_id}, EOS {b.eos_id}) is not the target's "
                         f"({a.model}, BOS {a.bos_id}, EOS {a.eos_id})")
    if abs(len(a) - len(b)) > 128:
        raise DraftError(f"the draft's vocabulary has {len(b)} tokens, the target's {len(a)}")
    for i in range(5, min(len(a), len(b))):
        if a.tokens[i] != b.tokens[i]:
            raise DraftError(f"the draft's token {i} is {b.tokens[i]!r}, the target's {a.tokens[i]!r}: "
                             "another vocabulary")


class DraftModel:
    """Greedy drafts from a smaller model on its own cache, which follows the target's tokens:
    a draft stops early where the model's top probability falls below p_min (llama.cpp's
    --draft-p-min), so drafting shortens itself where it would be rejected."""

    def __init__(self, lm, n_ctx: int, ring: bool, p_min: float = DRAFT_P_MIN):
        self.lm, self.p_min = lm, p_min
        self.cache = lm.model.new_cache(n_ctx, ring=ring)
        self.tokens: list[int] = []  # what its cache holds

    def propose(self, sequence: list[int], n: int, n_min: int) -> list[int]:
        common = min(common_prefix(self.tokens, sequence), len(sequence) - 1)  # (the last token runs again: its logits start the draft)
        recurrent = self.cache.recurrent
        if recurrent is not None and not self.cache.truncation_keeps(common):
            # (a recurrent state goes back only to where it was marked, before the last drafts)
            common = recurrent.marked if 0 <= recurrent.marked <= common else 0
        self.cache.truncate(common)
        self.tokens = self.tokens[:common]
        draft = []
        logits = self._forward(sequence[common:])
        if recurrent is not None:
            recurrent.mark()
        while len(draft) < n:
            token = int(np.argmax(logits))
            if len(draft) >= n_min and self.p_min > 0 and 1 / np.exp(logits - logits[token]).sum() < self.p_min:
                break  # (the top token's probability is below p_min)
            draft.append(token)
            if len(draft) < n:
                logits = self._forward([token])
        return draft

    def _forward(self, tokens):
        if not self.cache.ring and self.cache.used + len(tokens) > self.cache.n_ctx:
            raise ContextFullError("the draft's context is full")
        self.tokens += tokens
        return self.lm.model.forward(tokens, self.cache)


class PromptLookup:
    """Drafts from the text itself: where the last n tokens occurred before (the latest such
    place), the tokens that followed them there."""

    def __init__(self, n: int):
        self.n = n

    def propose(self, sequence: list[int], n: int, n_min: int) -> list[int]:
        k = self.n
        if len(sequence) <= k:
            return []
        seq = np.asarray(sequence)
        tail = seq[-k:]
        starts = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(seq[:-1], k) == tail, axis=1))
        if not len(starts):
            return []
        follow = seq[starts[-1] + k:][:n].tolist()
        return follow if len(follow) >= n_min else []


def verify(sampler: Sampler, rows: np.ndarray, draft: list[int], history: list[int],
           matcher=None) -> list[tuple[int, Choice]]:
    """The tokens a target pass yields: rows[i] are the logits after the chunk's i-th token, the
    chunk being the last decided token and then the draft. Accepted drafted tokens, then one more
    (the correction at the first rejection, or the next token after a wholly accepted draft);
    each with the Choice (the sampling distribution) it came from; with a grammar's matcher, each
    row sampled under its mask, and none after the grammar is complete. (history and the matcher
    are moved on by the accepted tokens while they are checked, and given back as they came.)"""
    out: list[tuple[int, Choice]] = []
    n_history = len(history)
    try:
        for i, row in enumerate(rows):
            complete = matcher is not None and matcher.finished
            choice = choose(sampler, checked(row), history, matcher)
            token = _verify_one(sampler, choice, draft[i] if i < len(draft) else None)
            out.append((token, dataclasses.replace(choice, token=token)))
            if complete or i == len(draft) or token != draft[i]:
                return out
            if matcher is not None:
                matcher.accept(token)
            history.append(token)
    finally:
        if matcher is not None:
            matcher.rollback(len(history) - n_history)
        del history[n_history:]
    return out


def _verify_one(sampler: Sampler, choice: Choice, d: int | None) -> int:
    """The token a row yields: the draft's d where accepted (with probability p(d)), else one
    drawn from p without d; with no draft, the sampled one."""
    if d is None:
        return choice.token
    probs = np.exp(choice.logprobs)
    p_d = float(probs[choice.ids == d].sum())
    if p_d >= 1.0 or (p_d > 0.0 and sampler.rng.random() < p_d):
        return d
    residual = np.where(choice.ids == d, 0.0, probs)  # p - q, q all on d: p without d
    if residual.sum() <= 0:
        return choice.token
    return int(choice.ids[sampler.rng.choice(len(residual), p=residual / residual.sum())])


def generate_speculative(model, cache, prompt: list[int], sampler: Sampler, max_tokens: int, stop_ids, drafter,
                         draft_max: int = 16, draft_min: int = 0, stats: GenerationStats | None = None,
                         spec: SpeculationStats | None = None, history: list[int] | None = None, pin: int = 0,
                         should_stop=None, logprobs: bool = False, matcher=None):
    """generate()'s contract, with drafted chunks: yields the same tokens (at temperature 0) or
    tokens of the same distribution; every token handed out is in the cache when it stops, and
    rejected drafts are not (truncated, not recomputed). With a grammar's matcher, a draft is cut
    where the grammar rejects it, and every token is chosen under the grammar's mask (verify)."""
    stats = stats if stats is not None else GenerationStats()
    spec = spec if spec is not None else SpeculationStats()
    # On the CPU a chunk of at most few_tokens runs through decode's own kernels (8-bit
    # activations), computing each token's logits bit for bit as a plain step does (prefill's
    # float products differ by more than rounding): greedy output is then the plain one even where
    # two tokens nearly tie. (torch's chunk products differ from its one-token ones by float32
    # rounding only, and are not capped.)
    if model.backend.few_tokens > 1:
        draft_max = min(draft_max, model.backend.few_tokens - 1)
    draft_min = min(draft_min, draft_max)
    spec.draft_max = max(spec.draft_max, draft_max)
    cache.undo_overwrites = True  # (a rejected draft gives back the ring slots it took)
    if cache.recurrent is not None:  # (and the recurrent state goes back over it)
        cache.recurrent.undo = True
    start = time.perf_counter()
    logits = prefill(model, cache, prompt, stats, pin)
    sequence = list(history or []) + list(prompt)
    decode_start = time.perf_counter()
    first = choose(sampler, logits, sequence, matcher)
    ready = [(first.token, first)]  # decided tokens; all but the last are in the cache already
    # the draft length adapts: after a rejection, one more than was accepted; after a wholly
    # accepted draft, two more (so that drafts that keep failing cost one drafted token a pass)
    length = draft_max
    stats.stop_reason = "length"
    while True:
        for j, (token, choice) in enumerate(ready):
            cached = len(ready) - 1 - j  # this token and those after it that the cache holds
            stop = None
            if should_stop is not None and should_stop():
                stop = "interrupted"
            elif token in stop_ids or (matcher is not None and matcher.finished):
                stop = "eos"
            elif stats.generated_tokens >= max_tokens:
                stop = "length"
            elif not cache.ring and not cached and cache.used >= cache.n_ctx:
                stop = "context"
            if stop:  # (not handed out: out of the cache too)
                stats.stop_reason = stop
                cache.truncate(cache.used - cached)
                return
            if stats.generated_tokens == 0:
                stats.time_to_first_token_s = time.perf_counter() - start
                decode_start = time.perf_counter()
            if matcher is not None:
                matcher.accept(token)
            stats.hand_out(token, choice, logprobs)
            sequence.append(token)
            yield token
            if stats.generated_tokens >= max_tokens:  # (the last one handed out is the cache's last too)
                if cached:
                    cache.truncate(cache.used - (cached - 1))
                else:
                    model.forward([token], cache)
                stats.decode_s = time.perf_counter() - decode_start
                if matcher is not None and matcher.finished:
                    stats.stop_reason = "eos"  # (as generate() says where the grammar completes at max_tokens)
                return
        last = ready[-1][0]
        room = max_tokens - stats.generated_tokens
        if not cache.ring:
            room = min(room, cache.n_ctx - cache.used - 1)
        draft = drafter.propose(sequence, min(length, room), min(draft_min, room)) if room > 0 else []
        if matcher is not None:  # (cut where the grammar rejects it; the grammar has had `last`)
            draft = [] if matcher.finished else draft[:matcher.valid_prefix(draft)]
        # (without a draft, a plain step: one token's logits, which a backend may replay)
        rows = model.forward([last] + draft, cache, all_logits=True) if draft else model.forward([last], cache)[None]
        ready = verify(sampler, rows, draft, sequence, matcher)
        rejected = len(draft) - (len(ready) - 1)
        if rejected:
            cache.truncate(cache.used - rejected)
            length = max(draft_min, 1, len(ready))
        elif draft:
            length = min(draft_max, length + 2)
        spec.passes += 1
        spec.proposed += len(draft)
        spec.accepted += len(ready) - 1
        spec.generated += len(ready)
        stats.decode_s = time.perf_counter() - decode_start


def self_draft_path(target: Path, type_name: str) -> Path:
    """The target's weights quantized to type_name with ggrun's quantizers, once, cached under the
    cache directory by the target's name, size and time (a changed file gets a new draft)."""
    from convert.convert import requantize
    from convert.mixes import FILE_TYPES

    from ..fetch.registry import cache_dir
    type_name = type_name.upper()
    if type_name not in FILE_TYPES:
        raise DraftError(f"self:{type_name}: unknown type; choose one of {', '.join(FILE_TYPES)}")
    info = target.stat()
    out = cache_dir() / "drafts" / f"{target.stem}-{info.st_size}-{int(info.st_mtime)}.{type_name}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        requantize(target, out, type_name, progress=False, allow_requantize=True)
    return out


def make_drafter(target, draft: str | None, lookup: int, n_ctx: int, ring: bool, p_min: float, load):
    """The drafter that --draft (a model, or self:TYPE) or --lookup N asks for; None for neither.
    load(path) loads a model as the target was loaded."""
    if draft and lookup:
        raise DraftError("--draft and --lookup are two kinds of draft; choose one")
    if lookup:
        return PromptLookup(lookup)
    if not draft:
        return None
    path = self_draft_path(target.file.path, draft[len("self:"):]) if draft.startswith("self:") else draft
    lm = load(path)
    check_vocabularies(target, lm)
    return DraftModel(lm, n_ctx, ring, p_min)
