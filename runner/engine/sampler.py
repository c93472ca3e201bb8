"""Next-token sampling: repetition, frequency and presence penalties, then top-k, top-p, min-p and
temperature, as llama.cpp chains them."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class OptionError(ValueError):
    """A sampling option's value is unusable; `option` names it (as SamplingOptions does)."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"{option} {problem}")
        self.option, self.problem = option, problem


@dataclass
class SamplingOptions:
    """Checked when made, by keyword or by dataclasses.replace, for the command line, chat's /set and
    a server alike: llama.cpp's meanings where it has them, and an OptionError for the rest."""
    temperature: float = 0.8      # <= 0: greedy
    top_k: int = 40               # <= 0: off
    top_p: float = 0.95           # 1: off
    min_p: float = 0.05           # 0: off
    repeat_penalty: float = 1.0   # 1: off
    repeat_last_n: int = 64       # window of recent tokens the penalties look at (-1: all of them; 0: off)
    seed: int | None = None       # None or -1: a random seed
    presence_penalty: float = 0.0   # subtracted once from a token seen in the window (0: off)
    frequency_penalty: float = 0.0  # subtracted per occurrence in the window (0: off)

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise OptionError(name, f"must be a finite number, not {value!r}")
        for name in ("top_k", "repeat_last_n"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise OptionError(name, f"must be an integer, not {getattr(self, name)!r}")
        for name in ("top_p", "min_p"):
            if not 0 <= getattr(self, name) <= 1:
                raise OptionError(name, f"must be between 0 and 1, not {getattr(self, name)!r}")
        if self.repeat_penalty <= 0:
            raise OptionError("repeat_penalty", f"must be above 0 (1 is off), not {self.repeat_penalty!r}")
        if self.repeat_last_n < -1:
            raise OptionError("repeat_last_n", f"must be -1 (all), 0 (off) or a token count, not {self.repeat_last_n}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -1 <= self.seed < 2**64):
            raise OptionError("seed", f"must be -1 (random) or an integer from 0 to 2^64 - 1, not {self.seed!r}")
        if self.seed == -1:
            self.seed = None


@dataclass
class Choice:
    """A sampled token, and what it was drawn from."""
    token: int
    ids: np.ndarray         # the candidates the sampling distribution covers (one, when greedy)
    logprobs: np.ndarray    # their log-probabilities in it (penalties, filters and temperature applied)
    logits: np.ndarray      # the model's logits it was drawn from (not copied)

    def model_logprob(self) -> float:
        """The token's log-probability under the model (log-softmax of its logits); computed on
        request, as it reads the whole vocabulary."""
        top = float(self.logits.max())
        return float(self.logits[self.token]) - top - float(np.log(np.exp(self.logits.astype(np.float64) - top).sum()))


class Sampler:
    def __init__(self, options: SamplingOptions):
        self.options = options
        self.rng = np.random.default_rng(options.seed)

    def sample(self, logits: np.ndarray, history: list[int]) -> int:
        return self.choose(logits, history).token

    def _penalized(self, history: list[int]) -> bool:
        o = self.options
        return (o.repeat_penalty != 1.0 or o.presence_penalty != 0.0 or o.frequency_penalty != 0.0) and \
            bool(history) and o.repeat_last_n != 0

    def choose(self, logits: np.ndarray, history: list[int], allowed=None) -> Choice:
        """The next token. `allowed`: where a grammar constrains it, the tokens it may be (a boolean
        mask over logits, or what answers as constraint.TokenMask does: a Matcher); the others are
        out before any filter, greedy included, and a single allowed token is taken as it is,
        without sampling. Greedy, the best token's own bit is read first: only where the grammar
        refuses it is the whole mask needed."""
        o = self.options
        logits = np.asarray(logits, dtype=np.float32)
        model_logits = logits
        n = logits.size
        packed = allowed is not None and not isinstance(allowed, np.ndarray)
        penalized = self._penalized(history)
        if packed and o.temperature <= 0 and not penalized:
            best = int(np.argmax(logits))
            if best in allowed:  # (the best token allowed: the rest need not be masked)
                return Choice(best, np.array([best]), np.zeros(1), model_logits)
        if allowed is not None:
            n = allowed.count if packed else int(np.count_nonzero(allowed))
            if n == 0:
                raise ValueError("the grammar allows no token here")
            if n == 1:
                token = allowed.only() if packed else int(np.argmax(allowed))
                return Choice(token, np.array([token]), np.zeros(1), model_logits)
        if penalized:  # llama.cpp's penalties sampler
            window = np.asarray(history[-o.repeat_last_n:] if o.repeat_last_n > 0 else history)
            recent, counts = np.unique(window, return_counts=True)
            logits = logits.astype(np.float64)  # (so that no penalty overflows to an infinity)
            vals = logits[recent]
            vals = np.where(vals > 0, vals / o.repeat_penalty, vals * o.repeat_penalty)
            logits[recent] = np.clip(vals - counts * o.frequency_penalty - o.presence_penalty, -_LIMIT, _LIMIT)
        if allowed is not None:
            logits = np.where(allowed.array() if packed else allowed, logits, -np.inf)
        if o.temperature <= 0:
            token = int(np.argmax(logits))
            return Choice(token, np.array([token]), np.zeros(1), model_logits)

        # Candidates sorted by logit, best first; each filter keeps a prefix of them (all allowed ones).
        k = min(o.top_k, n) if o.top_k > 0 else n
        ids = np.argpartition(-logits, k - 1)[:k] if k < logits.size else np.arange(logits.size)
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        probs = _softmax(logits[ids])
        if o.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), o.top_p)) + 1
            ids, probs = ids[:keep], probs[:keep]
        if o.min_p > 0.0:
            keep = max(1, int(np.sum(probs >= o.min_p * probs[0])))
            ids = ids[:keep]
        logprobs = _log_softmax(logits[ids], o.temperature)
        token = int(ids[self.rng.choice(len(ids), p=np.exp(logprobs))])
        return Choice(token, ids, logprobs, model_logits)


_LIMIT = 1e30  # penalized logits stay within it: finite, and far apart from one another


def _log_softmax(x: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """log softmax(x / temperature), in float64; at a vanishing temperature, all the mass on the
    largest logits (no overflow: x is shifted to its maximum before it is divided)."""
    with np.errstate(over="ignore"):
        x = (x.astype(np.float64) - x.max()) / temperature
    return x - np.log(np.exp(x).sum())


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()
