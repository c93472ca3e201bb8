"""Mixtures of experts on the CPU: routing, products over a set of expert ids, the weighted sum.

An expert tensor (GGML [k, n, experts]) is one WeightMatrix of experts * n rows: expert e is rows
e*n..(e+1)*n, in the file's layout or in interleaved groups (which never straddle two experts).
So a product over chosen experts is the dense products' row kernel (matmul.rows_product) over row
ranges that the expert ids pick at run time, in compiled code: a decode step reads the chosen
experts' bytes and no others, and a recorded step replays with the ids it computes.

Many tokens (prefill) go expert by expert instead: each expert's tokens gathered, multiplied by
its rows in one product (matmul.matmuls, tiled), so its weights are read once per chunk.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange
from numba.extending import overload

from .activations import quantize_activations
from .matmul import TASK_ROWS, _formats, _table, matmuls, matrix_arrays, rows_product, streamed_task

SOFTMAX, SIGMOID, SOFTMAX_WEIGHT = 0, 1, 2
GATING = {"softmax": SOFTMAX, "sigmoid": SIGMOID, "softmax_weight": SOFTMAX_WEIGHT}
# the smallest sum renormalized weights divide by (llama.cpp clamps to float16's smallest normal)
MIN_WEIGHT_SUM = np.float32(6.103515625e-5)


@njit(cache=True, fastmath=False, error_model="numpy")
def route(logits, gating, norm, scale, bias, ids, weights):
    """Each token's top experts: ids[t] (k,) the k experts of logits[t] whose probabilities plus
    `bias` (n_expert,) are highest (probabilities by `gating`: SOFTMAX over the experts, or SIGMOID
    each; SOFTMAX_WEIGHT picks by the logits and takes the softmax over the chosen ones: gpt-oss),
    best first, ties to the lower id; weights[t] their probabilities without the bias (DeepSeek-V3's
    selection bias steers the choice only), renormalized to sum to 1 if `norm`, times `scale`.
    A NaN logit still yields k distinct valid ids. The caller checks bias's size."""
    n_tokens, n_expert = logits.shape
    k = ids.shape[1]
    probs = np.empty(n_expert, np.float32)
    scores = np.empty(n_expert, np.float32)
    taken = np.empty(n_expert, np.bool_)
    for t in range(n_tokens):
        if gating == SIGMOID:
            for e in range(n_expert):
                probs[e] = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-logits[t, e])))
        elif gating == SOFTMAX_WEIGHT:
            probs[:] = logits[t]
        else:
            top = logits[t, 0]
            for e in range(1, n_expert):
                top = max(top, logits[t, e])
            total = np.float32(0.0)
            for e in range(n_expert):
                probs[e] = np.float32(math.exp(logits[t, e] - top))
                total += probs[e]
            for e in range(n_expert):
                probs[e] /= total
        for e in range(n_expert):
            scores[e] = probs[e] + bias[e]
        taken[:] = False
        for j in range(k):
            best = -1
            for e in range(n_expert):
                if not taken[e] and (best < 0 or scores[e] > scores[best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
            weights[t, j] = probs[best]
        if gating == SOFTMAX_WEIGHT:
            _softmax(weights[t])
        if norm:
            total = np.float32(0.0)
            for j in range(k):
                total += weights[t, j]
            total = max(total, MIN_WEIGHT_SUM)
            for j in range(k):
                weights[t, j] /= total
        for j in range(k):
            weights[t, j] *= scale


@njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _softmax(x):
    top = x[0]
    for v in x[1:]:
        top = max(top, v)
    total = np.float32(0.0)
    for j in range(x.shape[0]):
        x[j] = np.float32(math.exp(x[j] - top))
        total += x[j]
    for j in range(x.shape[0]):
        x[j] /= total


@njit(cache=True)
def expert_rows(table, ids, out):
    """out[s] = table[ids[s]]: each slot's row of a per-expert table (gpt-oss's expert biases).
    The caller checks every id against the experts."""
    for s in range(ids.shape[0]):
        out[s] = table[ids[s]]


def token_acts(acts, t):
    """Token t's activations of quantize_activations's tuple (either format)."""


@overload(token_acts)
def _token_acts(acts, t):
    if len(acts) == 3:
        return lambda acts, t: (acts[0][t:t + 1], acts[1][t:t + 1], acts[2][t:t + 1])
    return lambda acts, t: (acts[0][t:t + 1], acts[1][t:t + 1], acts[2][t:t + 1], acts[3][t:t + 1],
                            acts[4][t:t + 1], acts[5][t:t + 1], acts[6][t:t + 1])


@njit(cache=True, parallel=True)
def expert_products(mats, ids, x, out, formats, rounding, streams):
    """out[m, s] = x's row for slot s @ (expert ids[s] of matrix m).T, for every matrix m of the
    products table mats (each expert out.shape[2] rows) and slot s (token s // k's j-th choice):
    its token's row where x has one per token, its own where x has one per slot (the down
    products). The caller checks every id against the experts.

    matmul.products' loop, over tasks of TASK_ROWS rows of one slot's expert that the ids pick
    here; apart from it, so that only mixtures compile it."""
    acts = quantize_activations(rounding, x, formats, mats)
    n_mats, n_slots, n_rows = out.shape
    per_row = n_slots // x.shape[0]
    chunks = (n_rows + TASK_ROWS - 1) // TASK_ROWS
    n_tasks = n_mats * n_slots * chunks
    stride = (n_tasks + streams - 1) // streams
    for c in prange(stride):
        for s in range(streams):
            j = streamed_task(c, s, stride, n_tasks)
            if j < 0:
                break
            m, slot, chunk = j // (n_slots * chunks), (j // chunks) % n_slots, j % chunks
            first = ids[slot] * n_rows + chunk * TASK_ROWS
            token = slot // per_row
            raw, mins = matrix_arrays(mats, m)
            rows_product(mats, m, raw, mins, first, min(first + TASK_ROWS, (ids[slot] + 1) * n_rows),
                         x[token:token + 1], token_acts(acts, token), out[m, slot:slot + 1], chunk * TASK_ROWS)


@njit(cache=True, fastmath=True)
def combine(y, weights, out):
    """out[t] = sum over j of weights[t, j] * y[t * k + j]: the tokens' chosen experts' outputs
    weighted by their routing weights."""
    n_tokens, k = weights.shape
    for t in range(n_tokens):
        for i in range(out.shape[1]):
            out[t, i] = np.float32(0.0)
        for j in range(k):
            w = weights[t, j]
            for i in range(out.shape[1]):
                out[t, i] += w * y[t * k + j, i]


@njit(cache=True, fastmath=True)
def sigmoid_gate(x, g):
    """x[t] *= sigmoid(g[t, 0]) (Qwen2-MoE's gate on its shared expert)."""
    for t in range(x.shape[0]):
        s = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-g[t, 0])))
        for i in range(x.shape[1]):
            x[t, i] *= s


class ExpertStack:
    """Expert matrices that take one input (the gate and up experts; the down ones), prepared
    once for expert_products."""

    def __init__(self, matrices):
        self.matrices = tuple(matrices)
        first = matrices[0]
        self.n_expert, self.n_rows, self.k = first.experts, first.shape[0] // first.experts, first.shape[1]
        if any((m.experts, m.shape[0] // m.experts, m.shape[1]) != (self.n_expert, self.n_rows, self.k)
               for m in matrices):
            raise ValueError("expert matrices of one product must have the same shapes")
        self.mats = _table(matrices)
        self.formats = _formats(matrices)


def check_expert_ids(ids: np.ndarray, n_expert: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise IndexError(f"expert ids outside 0..{n_expert - 1}")


def grouped_products(matrices, x: np.ndarray, ids: np.ndarray, precise: bool) -> list:
    """The outputs expert_products gives, for many tokens: expert by expert, each expert's slots
    gathered into one product with its rows (matmul.matmuls), so its weights are read once."""
    n_slots = ids.size
    flat = ids.reshape(-1)
    per_row = n_slots // x.shape[0]
    outs = [np.empty((n_slots, m.shape[0] // m.experts), dtype=np.float32) for m in matrices]
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.arange(matrices[0].experts + 1))
    for e in range(matrices[0].experts):
        slots = order[bounds[e]:bounds[e + 1]]
        if len(slots):
            products = matmuls([m.expert(e) for m in matrices], x[slots // per_row], precise)
            for out, product in zip(outs, products):
                out[slots] = product
    return outs
