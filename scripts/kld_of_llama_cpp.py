"""KL divergence of llama.cpp's logits against a ggrun base (--save-logits), measured exactly as
`ggrun perplexity --kl-base` measures ggrun's own: over the base's top-32 tokens plus one bucket
for the rest, with top-1 agreement and the perplexity ratio. The logits are those
llama-perplexity saves with --kl-divergence-base FILE (b11434's format: "_logits_", n_ctx,
n_vocab, n_chunk, the tokens, then per scored position a float scale and minimum and the
log-probabilities as 16-bit steps above it).

usage: python scripts/kld_of_llama_cpp.py BASE.npz LLAMA_LOGITS"""
import json
import sys

import numpy as np

from runner.measure.perplexity import PerplexityResult, compare_to_base, load_base

ROWS_AT_ONCE = 1024


def main(base_path, logits_path):
    raw = np.memmap(logits_path, dtype=np.uint8, mode="r")
    if bytes(raw[:8]) != b"_logits_":
        sys.exit(f"{logits_path} is not a logits file of llama-perplexity")
    n_ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(raw[8:20], dtype=np.int32))
    tokens = np.frombuffer(raw[20:20 + 4 * n_chunk * n_ctx], dtype=np.int32).reshape(n_chunk, n_ctx)
    row = 2 * ((n_vocab + 1) // 2) + 4  # uint16s a position: two floats, then the steps
    first = n_ctx // 2  # the first half of each chunk is context only, as ggrun scores it
    rows = np.frombuffer(raw[20 + tokens.nbytes:], dtype=np.uint16).reshape(-1, row)
    base = load_base(base_path, len(rows))
    if n_ctx != base["n_ctx"] or n_vocab != base["vocab_size"] or len(rows) != len(base["top_ids"]):
        sys.exit("the logits come from a different context size, vocabulary or text than the base")
    targets = tokens[:, first + 1:].reshape(-1)
    at_base, top1, target = [], [], []
    for lo in range(0, len(rows), ROWS_AT_ONCE):
        part = rows[lo:lo + ROWS_AT_ONCE]
        scale_min = np.ascontiguousarray(part[:, :4]).view(np.float32).astype(np.float64)
        steps = part[:, 4:4 + n_vocab]
        ids = base["top_ids"][lo:lo + ROWS_AT_ONCE]
        at_base.append(scale_min[:, :1] * np.take_along_axis(steps, ids, axis=1) + scale_min[:, 1:])
        top1.append(steps.argmax(axis=1))
        t = targets[lo:lo + ROWS_AT_ONCE]
        target.append(scale_min[:, 0] * steps[np.arange(len(t)), t] + scale_min[:, 1])
    target = np.concatenate(target)
    ppl = float(np.exp(-target.mean()))
    result = PerplexityResult(ppl, 0.0, len(target), n_chunk, n_ctx, 0.0, np.concatenate(top1)[:, None],
                              np.zeros((len(target), 1)), target, np.concatenate(at_base))
    print(json.dumps({"ppl": ppl, **compare_to_base(result, base)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
