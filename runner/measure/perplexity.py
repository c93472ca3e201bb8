"""Perplexity as llama.cpp's perplexity tool measures it, and KL divergence against a saved base.

The text is tokenized whole (BOS first when the model adds one) and cut into chunks of n_ctx
tokens; each chunk is evaluated from an empty cache with its first token replaced by BOS (when
the model adds BOS), and only the second half of each chunk is scored, so every scored token has
at least n_ctx/2 tokens of context.

Saved logits keep, per scored position, the top-k log-probabilities and the log-probability of
the token that came: enough for KL divergence (the tail beyond the top k is one bucket), top-1
agreement and perplexity, at a few hundred bytes per position even for a 262k vocabulary.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from gguf_io.progress import progress_bar
from gguf_io.safe_files import atomic_output

from ..engine.kv_cache import SINK_TOKENS
from ..engine.npz_files import NpzError, expect, read_npz

TOP_K = 32


@dataclass
class PerplexityResult:
    ppl: float
    ppl_stderr: float
    tokens_scored: int
    chunks: int
    n_ctx: int
    seconds: float
    top_ids: np.ndarray        # (positions, TOP_K) int32
    top_logprobs: np.ndarray   # (positions, TOP_K) float32
    target_logprobs: np.ndarray  # (positions,) float32
    base_logprobs: np.ndarray | None = None  # the model's log-probs at the base's top-k tokens

    def as_dict(self) -> dict:
        return {"ppl": self.ppl, "ppl_stderr": self.ppl_stderr, "tokens_scored": self.tokens_scored,
                "chunks": self.chunks, "n_ctx": self.n_ctx, "seconds": self.seconds}


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class _Scores:
    """Accumulates what a run keeps per scored position."""

    def __init__(self, base: dict | None):
        self.base = base
        self.nll, self.top_ids, self.top_lp, self.target_lp, self.at_base = [], [], [], [], []
        self.count = 0

    def add(self, logits: np.ndarray, targets) -> None:
        logp = _log_softmax(logits)
        targets = np.asarray(targets)
        lp = logp[np.arange(len(targets)), targets]
        self.nll.append(-lp)
        best = np.argpartition(-logp, TOP_K - 1, axis=1)[:, :TOP_K]
        order = np.argsort(-np.take_along_axis(logp, best, axis=1), axis=1, kind="stable")
        best = np.take_along_axis(best, order, axis=1)
        self.top_ids.append(best.astype(np.int32))
        self.top_lp.append(np.take_along_axis(logp, best, axis=1).astype(np.float32))
        self.target_lp.append(lp.astype(np.float32))
        if self.base is not None:
            rows = self.base["top_ids"][self.count:self.count + len(targets)]
            self.at_base.append(np.take_along_axis(logp, rows, axis=1))
        self.count += len(targets)

    def result(self, chunks: int, n_ctx: int, seconds: float) -> PerplexityResult:
        nll = np.concatenate(self.nll)
        mean = nll.mean()
        var = (nll ** 2).mean() - mean ** 2
        ppl = float(np.exp(mean))
        stderr = float(np.sqrt(var / (len(nll) - 1)) * ppl) if len(nll) > 1 and var > 0 else 0.0
        return PerplexityResult(ppl, stderr, len(nll), chunks, n_ctx, seconds, np.concatenate(self.top_ids),
                                np.concatenate(self.top_lp), np.concatenate(self.target_lp),
                                np.concatenate(self.at_base) if self.at_base else None)


def _check_base(base, vocab_size: int, n_ctx: int, n_positions: int) -> None:
    if base is not None and (base["vocab_size"] != vocab_size or base["n_ctx"] != n_ctx
                             or len(base["top_ids"]) != n_positions):
        raise ValueError("the base logits come from a different vocabulary, context size or text")


def text_tokens(lm, text: str) -> list[int]:
    """The text's tokens as llama-perplexity makes them: special-token texts (<|im_start|> in a
    document) are plain text there, not control tokens."""
    return lm.tokenizer.encode(text, parse_special=False)


def text_chunks(lm, tokens: list[int], n_ctx: int, n_chunks: int) -> list[list[int]]:
    """The first n_chunks chunks of n_ctx tokens, each with its first token replaced by BOS where
    the model adds one: what llama.cpp's perplexity and imatrix tools evaluate, each from an empty cache."""
    vocab = lm.tokenizer.vocab
    chunks = [list(tokens[c * n_ctx:(c + 1) * n_ctx]) for c in range(n_chunks)]
    for chunk in chunks if vocab.add_bos and vocab.bos_id >= 0 else ():
        chunk[0] = vocab.bos_id
    return chunks


def perplexity(lm, text: str, n_ctx: int, base: dict | None = None, progress: bool = True,
               ubatch: int | None = None) -> PerplexityResult:
    """`base` (from load_base) makes the run also record what KL divergence needs. ubatch: each
    chunk goes through the model in forward passes of that many tokens (llama.cpp's -ub); up to
    matmul.FEW_TOKENS, every product then runs on decode's kernels, whose rounding is then scored."""
    tokens = text_tokens(lm, text)
    n_chunks = len(tokens) // n_ctx
    if n_chunks == 0:
        raise ValueError(f"the text has {len(tokens)} tokens; at least {n_ctx} (one chunk of -c) are needed")
    first = n_ctx // 2
    _check_base(base, len(lm.tokenizer.vocab), n_ctx, n_chunks * (n_ctx - 1 - first))
    scores = _Scores(base)
    start = time.perf_counter()
    for chunk in progress_bar(text_chunks(lm, tokens, n_ctx, n_chunks), desc="perplexity", unit="chunk",
                              disable=not progress):
        cache, step = lm.model.new_cache(n_ctx), ubatch or n_ctx
        logits = np.concatenate([lm.model.forward(chunk[i:i + step], cache, all_logits=True)
                                 for i in range(0, n_ctx, step)])
        scores.add(logits[first:n_ctx - 1], chunk[first + 1:n_ctx])
    return scores.result(n_chunks, n_ctx, time.perf_counter() - start)


def ring_perplexity(lm, text: str, n_ring: int, base: dict | None = None, progress: bool = True,
                    step: int = 256) -> PerplexityResult:
    """Stream the whole text through one ring of n_ring slots, scoring every token once
    (from the second on). The first tokens are pinned, as chat and run pin them."""
    tokens = text_tokens(lm, text)
    if len(tokens) < 2:
        raise ValueError("the text is too short to score")
    _check_base(base, len(lm.tokenizer.vocab), n_ring, len(tokens) - 1)
    cache = lm.model.new_cache(n_ring, ring=True)
    pin = min(SINK_TOKENS, len(tokens) - 1, n_ring // 2)
    scores = _Scores(base)
    start = time.perf_counter()
    bounds = [0, pin] + list(range(pin + step, len(tokens), step)) + [len(tokens)]
    for lo, hi in progress_bar(list(zip(bounds, bounds[1:])), desc="ring perplexity", unit="step", disable=not progress):
        if hi <= lo:
            continue
        logits = lm.model.forward(tokens[lo:hi], cache, all_logits=True)
        if hi == pin:
            cache.pin()
        targets = tokens[lo + 1:hi + 1]
        if targets:
            scores.add(logits[:len(targets)], targets)
    return scores.result(1, n_ring, time.perf_counter() - start)


def save_logits(result: PerplexityResult, path, vocab_size: int) -> None:
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, top_ids=result.top_ids, top_logprobs=result.top_logprobs.astype(np.float16),
                            target_logprobs=result.target_logprobs, n_ctx=result.n_ctx, vocab_size=vocab_size)


# what save_logits writes: name -> (dtype, shape), None for the positions (P)
_BASE_ARRAYS = {"top_ids": (np.int32, (None, TOP_K)), "top_logprobs": (np.float16, (None, TOP_K)),
                "target_logprobs": (np.float32, (None,)), "n_ctx": (np.int64, ()), "vocab_size": (np.int64, ())}


def load_base(path, max_positions: int) -> dict:
    """Logits that save_logits wrote, of at most max_positions positions (a text of N bytes
    scores fewer than N + 1 tokens): each array's type and shape checked before it is read, then
    its values (ids in the vocabulary, finite log-probabilities)."""
    def check(name, dtype, shape):
        want_dtype, want_shape = _BASE_ARRAYS[name]
        expect(name, dtype, shape, want_dtype, want_shape)
        if shape and shape[0] > max_positions:
            raise NpzError(f"its {name} holds {shape[0]} positions, more than the text has tokens")
    try:
        f = read_npz(path, check, names=set(_BASE_ARRAYS))
        if set(f) != set(_BASE_ARRAYS):
            raise NpzError(f"it lacks {', '.join(sorted(set(_BASE_ARRAYS) - set(f)))}")
        n = len(f["top_ids"])
        if len(f["top_logprobs"]) != n or len(f["target_logprobs"]) != n:
            raise NpzError("its arrays hold different numbers of positions")
        vocab_size = int(f["vocab_size"])
        if n and not 0 <= f["top_ids"].min() <= f["top_ids"].max() < vocab_size:
            raise NpzError(f"its top_ids are not ids of a vocabulary of {vocab_size}")
        for name in ("top_logprobs", "target_logprobs"):
            if not (np.isfinite(f[name]) & (f[name] <= 0)).all():
                raise NpzError(f"its {name} are not all finite log-probabilities")
    except NpzError as e:
        raise ValueError(f"{path} is not a logits file written by --save-logits: {e}") from None
    return {"top_ids": f["top_ids"], "top_logprobs": f["top_logprobs"].astype(np.float64),
            "target_logprobs": f["target_logprobs"].astype(np.float64), "n_ctx": int(f["n_ctx"]),
            "vocab_size": vocab_size}


def compare_to_base(result: PerplexityResult, base: dict) -> dict:
    """KL(base || model) per position over the base's top-k tokens plus one bucket for the rest,
    top-1 agreement and the perplexity ratio."""
    b_lp, m_at = base["top_logprobs"], result.base_logprobs
    p = np.exp(b_lp)
    p_rest = np.clip(1.0 - p.sum(axis=1), 1e-12, None)
    q_rest = np.clip(1.0 - np.exp(m_at).sum(axis=1), 1e-12, None)
    kl = np.maximum((p * (b_lp - m_at)).sum(axis=1) + p_rest * (np.log(p_rest) - np.log(q_rest)), 0.0)
    base_ppl = float(np.exp(-base["target_logprobs"].mean()))
    return {
        "kld_mean": float(kl.mean()), "kld_p50": float(np.percentile(kl, 50)),
        "kld_p90": float(np.percentile(kl, 90)), "kld_p99": float(np.percentile(kl, 99)),
        "kld_max": float(kl.max()),
        "top1_agreement": float((base["top_ids"][:, 0] == result.top_ids[:, 0]).mean()),
        "ppl_base": base_ppl, "ppl_ratio": result.ppl / base_ppl,
    }
