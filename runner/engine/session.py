"""What run, chat and bench share between a model file and text: loading the model with its kernels
warm, and a Session that takes a prompt to generated text (tokenize, template, generate, stop,
timings) over one KV cache. A server would hold one Session per conversation.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator

from ..text.tokenizer import StreamDecoder
from .constraint import Grammar, Matcher
from .generate import GenerationStats, PromptError, generate, truncate_prompt
from .kv_cache import SINK_TOKENS, ContextFullError, KVCache
from .load import LoadedModel, LoadOptions, load_model
from .sampler import Sampler
from .speculative import SpeculationStats, generate_speculative
from .startup import StartupTimes, paused_gc


def load(path, options: LoadOptions = LoadOptions(), times: StartupTimes | None = None, prefill=True,
         notify: Callable[[str], None] = lambda message: None) -> LoadedModel:
    """The model on options.device, with its kernels loaded from Numba's cache (or compiled, the
    first time: notify says so) by throw-away forward passes (warm_up), so that the prompt does not
    pay for that; prefill: also those of prompts longer than decode's kernels take (run passes
    False and warms them itself when its prompt needs them). On CUDA that step compiles and tunes
    the Triton products (Triton and torch.compile keep them in their own caches)."""
    times = times or StartupTimes()
    device = options.device
    paths = ("decode", "prefill") if prefill else ("decode",)
    compiling = compiling_paths(device, options.kv_type, paths)
    # A warm start makes ~10^5 objects that live as long as the process (Numba's registries and
    # kernels, the vocabulary) and little garbage, and the collector's passes over them would
    # lengthen it for nothing; a compile makes garbage, so the collector runs then.
    with paused_gc(not compiling):
        if device == "cpu":
            importlib.import_module("kernels_cpu.backend")  # (Numba: the bulk of the imports, timed as such)
        times.mark("imports")
        if compiling and device == "cpu":  # (its loading compiles too: it interleaves matrices' rows)
            notify(compiling_message(device))
        lm = load_model(path, options)
        times.mark("file mapping and model")
        if compiling and device != "cpu":
            notify(compiling_message(device))
        warm_up(lm, paths, compiling)
    times.mark("kernel cache load")
    return lm


def compiling_paths(device, kv_type, paths) -> list:
    """The paths of `paths` whose kernels this run compiles (the first one on the CPU, each
    marked once done; every run on CUDA, where Triton's and torch.compile's caches decide)."""
    if device == "cpu":
        from kernels_cpu.compile_cache import kernels_compiled
        return [p for p in paths if not kernels_compiled(f"{kv_type}-{p}")]
    return list(paths) if device == "cuda" else []


def compiling_message(device) -> str:
    if device == "cpu":
        return "compiling the Numba kernels (first run only, under a minute; cached for later runs)..."
    return "compiling the GPU kernels (the first run takes a few minutes; cached for later runs)..."


def warm_up(lm, paths, compiling=()):
    """Throw-away forward passes through what the first prompt and tokens run, for each path of
    `paths`: "decode", a few tokens and one-token steps, the second of which replays the first
    (whose kernel stalled the second token when it compiled then) and checks the replay against an
    eager step (step_program.run_step); "prefill", a prompt longer than decode's kernels take. Paths
    in `compiling` run them all (so that nothing compiles after the message), and are marked
    compiled; the others run one decode step, which loads what the cache holds."""
    token = max(lm.tokenizer.vocab.bos_id, 0)
    if "prefill" in compiling:
        lm.model.forward([token] * (lm.backend.few_tokens + 1), lm.model.new_cache(16))
    if "decode" in compiling and lm.backend.few_tokens > 1:
        lm.model.forward([token] * 2, lm.model.new_cache(16))
    cache = lm.model.new_cache(16)
    for _ in range(2 if "decode" in compiling else 1):
        lm.model.forward([token], cache)
    if lm.backend.name == "cpu":
        from kernels_cpu.compile_cache import mark_compiled
        for path in compiling:
            mark_compiled(f"{lm.model.kv_type}-{path}")


def warm_prefill(lm, device, kv_type, notify: Callable[[str], None] = lambda message: None) -> bool:
    """Prefill's kernels, before a prompt longer than decode's kernels take (run's: it loads
    without them); whether they compiled."""
    compiling = compiling_paths(device, kv_type, ("prefill",))
    if compiling:
        notify(compiling_message(device))
        warm_up(lm, ("prefill",), compiling)
    return bool(compiling)


def ring_pin(n_prompt: int, cache: KVCache) -> int:
    """The leading prompt tokens a ring pins for good when nothing is pinned yet (no BOS, no
    system prompt): the first token, the attention sink (kv_cache.SINK_TOKENS); at least one
    prompt token is left to run."""
    return min(SINK_TOKENS, n_prompt - 1) if cache.ring and cache.pinned == 0 else 0


class Session:
    """A model and one KV cache, taking prompts to generated text; with a drafter (speculative.py),
    through drafted chunks of up to draft_max tokens (at least draft_min where one is drafted)."""

    def __init__(self, lm: LoadedModel, cache: KVCache, drafter=None, draft_max: int = 16, draft_min: int = 0):
        self.lm, self.cache = lm, cache
        self.drafter, self.draft_max, self.draft_min = drafter, draft_max, draft_min
        self.speculation = SpeculationStats()  # (over the session's completions)
        self.stats = GenerationStats()
        self.notices: list[str] = []  # one-line messages for the user (what a prompt lost, a template's failure)

    @classmethod
    def new(cls, lm: LoadedModel, n_ctx: int | None = None, ring: bool = True) -> Session:
        return cls(lm, lm.model.new_cache(n_ctx or lm.default_context(), ring=ring))

    def prompt_ids(self, prompt: str, system: str | None = None, special: bool = False) -> list[int]:
        """The prompt's tokens: plain text (special-token text parsed only with special); with a
        system prompt, the chat template's rendering of system and user turns, whose markup alone
        yields control tokens. An empty prompt starts from BOS, as llama.cpp does."""
        tok = self.lm.tokenizer
        if system is not None:
            from ..text.chat_template import choose_template, render_with_content_spans
            template, warning = choose_template(tok.vocab)
            if warning:
                self.notices.append(warning)
            messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
            text, spans = render_with_content_spans(template, messages, add_generation_prompt=True)
            ids = tok.encode_rendered(text, literal=() if special else spans)
        else:
            ids = tok.encode(prompt, parse_special=special)
        if not ids:
            if tok.vocab.bos_id < 0:
                raise PromptError("the prompt is empty and the model has no BOS token to start from")
            ids = [tok.vocab.bos_id]
        return ids

    def fit(self, ids: list[int], n_predict: int) -> list[int]:
        """A prompt that fits the ring: past the context, the pinned start and the end (a notice
        says what was dropped). Without a ring, a prompt and n_predict tokens that exceed the
        context raise ContextFullError."""
        free = self.cache.n_ctx - self.cache.used
        if not self.cache.ring:
            if len(ids) + n_predict > free:
                raise ContextFullError(f"the prompt ({len(ids)} tokens) plus -n {n_predict} exceed the context of "
                                       f"{free}; use a larger -c, a smaller -n, or --ring")
            return ids
        ids, notice = truncate_prompt(ids, free, ring_pin(len(ids), self.cache), n_predict)
        if notice:
            self.notices.append(notice)
        return ids

    def complete(self, ids: list[int], sampler: Sampler, max_tokens: int, stop_ids=None, stops=(),
                 should_stop=None, logprobs: bool = False, history: list[int] | None = None,
                 decoder: StreamDecoder | None = None, grammar: Grammar | None = None) -> Iterator[str]:
        """Text pieces of the completion of ids, streamed; self.stats fills as it goes (tokens,
        their log-probabilities with logprobs, timings, why it stopped). Stops at the model's end of
        generation (stop_ids: those ids instead; () never), at max_tokens, at any of the `stops`
        strings, when should_stop(), or at Ctrl-C (what was generated stays, in the cache too).
        decoder: the ids' text (a StreamDecoder, or a reasoning.ReplyDecoder that tells the parts
        of a reply apart). grammar: what the text must follow (constraint.py); it also ends where
        the grammar is complete."""
        self.stats = stats = GenerationStats()
        stop_ids = self.lm.tokenizer.vocab.end_of_generation if stop_ids is None else stop_ids
        stream = decoder or StreamDecoder(self.lm.tokenizer)
        tail = ""  # the end of the text, as long as the longest stop string needs
        matcher = None if grammar is None else Matcher(grammar, self.lm.tokenizer, self.lm.params.vocab_size, stop_ids)
        # (history: the tokens already in the cache, for the penalties and a draft)
        common = dict(pin=ring_pin(len(ids), self.cache), should_stop=should_stop, logprobs=logprobs, history=history,
                      matcher=matcher)
        if self.drafter is None:
            tokens = generate(self.lm.model, self.cache, ids, sampler, max_tokens, stop_ids, stats, **common)
        else:
            tokens = generate_speculative(self.lm.model, self.cache, ids, sampler, max_tokens, stop_ids, self.drafter,
                                          self.draft_max, self.draft_min, stats, self.speculation, **common)
        try:
            for token in tokens:
                piece = stream.push(token)
                yield piece
                if stops:
                    tail = (tail + piece)[-max(map(len, stops)) - len(piece):]
                    if any(stop in tail for stop in stops):
                        stats.stop_reason = "reverse_prompt"
                        break
        except KeyboardInterrupt:
            stats.stop_reason = "interrupted"
        yield stream.flush()
