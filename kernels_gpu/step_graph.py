"""Decode steps replayed from CUDA graphs.

A small model's decode step is hundreds of tiny kernels, and launching them one by one from
Python costs more than running them. A step is therefore recorded once as a CUDA graph and
replayed: the host only copies the step's few integers (token id, position, cache slots, the
positions the slots hold) into the graph's static input tensors.

Shapes must not change between replays, so the positions attention reads are padded with -1
(empty slots, which attention masks) to a bucket: the next power of two of the filled slots, at
least MIN_SLOTS, at most the cache. A graph is recorded per bucket as the context grows.

Replaying a step is safe to repeat: it writes its token's keys and values into the same slots
and reads the same cache, so the warm-up run and the replay after recording agree.
"""
from __future__ import annotations

import numpy as np
import torch

MIN_SLOTS = 256


def padded_length(filled: int, capacity: int) -> int:
    bucket = MIN_SLOTS
    while bucket < filled:
        bucket *= 2
    return min(bucket, capacity)


def pad_key_positions(batch):
    """The batch with every kind's key positions padded to their bucket with empty slots (-1)."""
    padded = []
    for key_pos, capacity in zip(batch.key_positions, batch.capacities):
        full = np.full(padded_length(len(key_pos), capacity), -1, dtype=np.int32)
        full[:len(key_pos)] = key_pos
        padded.append(full)
    return batch.replace(key_positions=tuple(padded))


class StepGraph:
    """One recorded step: static inputs, the graph, its output. Without CUDA (tests on the CPU)
    the same bookkeeping runs and `replay` calls the step eagerly on the static inputs. It keeps
    no reference to compute, which holds the cache that the backend keeps the graph for weakly."""

    def __init__(self, compute, static_batch, pool):
        self.static = static_batch
        self.graph = None
        if static_batch.ids.is_cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: compiles kernels, settles the allocator
                compute(static_batch)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.output = compute(static_batch)

    def replay(self, host_batch, compute):
        for static, host in zip(self.static.arrays(), host_batch.arrays()):
            static.copy_(torch.from_numpy(host), non_blocking=True)
        if self.graph is None:
            return compute(self.static)
        self.graph.replay()
        return self.output


def replay_step(compute, batch, graphs: dict, upload):
    """Run a one-token step through its recorded graph, recording it first when its shapes are new.
    graphs: the pass's by slot bucket, which TorchBackend keeps per cache memory (a graph replays
    over the buffers it was recorded on), so a graph never outlives its cache.

    A cache's graphs share one memory pool, the first graph's, and so the pool dies with them.
    (One pool handle for the whole backend broke on an H200: once every graph recorded into it
    was freed with its cache, torch released the pool, and recording into the same handle again
    failed an assertion in CUDA's caching allocator.)"""
    batch = pad_key_positions(batch)
    key = tuple(len(k) for k in batch.key_positions)
    graph = graphs.get(key)
    if graph is None:
        pool = next((g.graph.pool() for g in graphs.values() if g.graph is not None), None)
        graph = graphs[key] = StepGraph(compute, upload(batch), pool)
    return graph.replay(batch, compute)
