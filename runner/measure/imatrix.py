"""An importance matrix as llama.cpp's imatrix tool collects it: per weight matrix of the blocks
(blk.*; not the output or the embedding), per input column, the activations entering it squared
and summed, and summed, with the number of activation rows summed (per expert for a mixture's:
a token's input counts once for each expert it is routed to).

The text is tokenized and chunked as for perplexity (each chunk of n_ctx tokens from an empty
cache, its first token BOS where the model adds one), and every token of a chunk counts. As
llama.cpp does, a dense product of fewer than 16 rows is not counted (a mixture's always is): a
chunk goes through the model in passes of at most 512 tokens, llama.cpp's micro-batches.

Normal runs pay nothing for it: the model computes on a backend that observes its products only
while a collection runs (model.backend swapped for the observer, then restored)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from gguf_io.imatrix import Imatrix, ImatrixEntry
from gguf_io.progress import progress_bar

from .perplexity import text_chunks, text_tokens

MIN_ROWS = 16  # llama.cpp's imatrix ignores dense products of fewer rows


@dataclass(frozen=True)
class ImatrixOptions:
    """What a collection runs over, built by keyword; each default is defined here alone."""
    n_ctx: int = 512              # tokens per chunk (llama-imatrix's -c)
    chunks: int | None = None     # the most chunks to evaluate (None: all the text has)
    dataset: str = ""             # the text's name, kept in the file's imatrix.datasets
    progress: bool = True


class _Sums:
    """One weight matrix's running sums (its rows: experts), in float64 so that their rounding
    stays below that of llama.cpp's float32 sums, whatever the order."""

    def __init__(self, n_mat: int, n_cols: int):
        self.sq = np.zeros((n_mat, n_cols))
        self.act = np.zeros((n_mat, n_cols))
        self.counts = np.zeros(n_mat, dtype=np.int64)

    def add(self, row: int, totals: tuple) -> None:
        sq, act, n = totals
        self.sq[row] += sq
        self.act[row] += act
        self.counts[row] += n


def _totals(x: np.ndarray) -> tuple:
    """x's rows squared and summed, summed, and counted: what one product adds to its matrices' sums."""
    x = x.astype(np.float64)
    return np.einsum("ij,ij->j", x, x), x.sum(axis=0), len(x)


class _Observer:
    """The model's backend, whose products add their inputs to the sums of the named matrices
    they multiply; every other call goes to the backend itself."""

    def __init__(self, backend, names: dict[int, tuple[str, int]]):
        self._backend, self._names = backend, names
        self.sums: dict[str, _Sums] = {}

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def _observed(self, ws, x) -> tuple[list, np.ndarray | None]:
        """The sums of the blocks' named matrices among ws, and x on the host where there are any."""
        sums = []
        for w in ws:
            name, n_matrices = self._names.get(id(w), ("", 0))
            if name.startswith("blk."):
                sums.append(self.sums.setdefault(name, _Sums(n_matrices, x.shape[1])))
        return sums, np.asarray(self._backend.to_numpy(x), dtype=np.float32) if sums else None

    def matmul(self, w, x):
        return self.matmuls([w], x)[0]

    def matmuls(self, ws, x):
        if x.shape[0] >= MIN_ROWS:
            sums, rows = self._observed(ws, x)
            totals = _totals(rows) if sums else None
            for s in sums:
                s.add(0, totals)
        return self._backend.matmuls(ws, x)

    def expert_matmuls(self, ws, x, ids):
        sums, rows = self._observed(ws, x)
        if sums:
            slots = np.asarray(self._backend.to_numpy(ids)).reshape(-1)
            # slot t * k + j's input: x's row t (one row per token) or its row t * k + j
            inputs = rows if len(rows) == len(slots) else np.repeat(rows, len(slots) // len(rows), axis=0)
            for expert in np.unique(slots):
                totals = _totals(inputs[slots == expert])
                for s in sums:
                    s.add(int(expert), totals)
        return self._backend.expert_matmuls(ws, x, ids)


def collect_imatrix(lm, text: str, options: ImatrixOptions) -> tuple[Imatrix, float]:
    """The importance matrix of lm over the text's chunks, and the seconds it took."""
    n_ctx = options.n_ctx
    if n_ctx < MIN_ROWS:
        raise ValueError(f"a chunk of {n_ctx} tokens is too short: products of under {MIN_ROWS} rows are not counted")
    tokens = text_tokens(lm, text)
    n_chunks = min(len(tokens) // n_ctx, options.chunks or len(tokens))
    if n_chunks == 0:
        raise ValueError(f"the text has {len(tokens)} tokens; at least {n_ctx} (one chunk of -c) are needed")
    model = lm.model
    observer = _Observer(model.backend, model.weight_names)
    start = time.perf_counter()
    model.backend = observer
    try:
        for chunk in progress_bar(text_chunks(lm, tokens, n_ctx, n_chunks), desc="imatrix", unit="chunk",
                                  disable=not options.progress):
            model.forward(chunk, model.new_cache(n_ctx))
    finally:
        model.backend = observer._backend
    entries = {name: ImatrixEntry(s.sq.astype(np.float32), s.counts.copy(), s.act.astype(np.float32))
               for name, s in observer.sums.items()}
    # llama.cpp's chunk count: the most rows any matrix summed, in chunks, rounded to the nearest
    most = max((int(s.counts.max()) for s in observer.sums.values()), default=0)
    imatrix = Imatrix(entries, [options.dataset] if options.dataset else [], (most + n_ctx // 2) // n_ctx, n_ctx)
    return imatrix, time.perf_counter() - start
