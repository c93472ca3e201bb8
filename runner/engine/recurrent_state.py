"""What a hybrid model's recurrent layers carry from token to token, per sequence, beside the KV
cache of its attention layers: a fixed-size state per layer, float32 on the backend. Three kinds:
a convolution's history (its last K - 1 inputs: LFM2's short convolution, and the one before a
gated DeltaNet or a Mamba2 scan), a gated DeltaNet's state (value heads, d_k, d_v) and a Mamba2
layer's (heads, head_dim, d_state).

A state cannot be cut back to an earlier position as a KV cache can: it holds no per-token rows.
So, where asked (`undo`: speculative decoding sets it), it keeps what the last pass needs to go
back into it (a verify pass's rejected draft tokens): each state as it was before the pass and
what the pass fed it, from which the state after any of the pass's tokens follows. Going back
further is only to a position marked before (a copy of the state there: a draft model marks
where its drafts begin) or to the start (an empty state); callers ask `can_return_to` and
prefill again from there otherwise.
"""
from __future__ import annotations

import numpy as np

CONV, DELTA, SSM = "conv", "delta", "ssm"
# the backend operation that carries each kind but CONV from token to token, as a pass fed it
_SCANS = {DELTA: "delta_rule", SSM: "ssm_scan"}


class RecurrentState:
    def __init__(self, backend, shapes: dict[int, dict[str, tuple[int, ...]]]):
        """shapes: recurrent layer -> {CONV: (K - 1, channels), DELTA: (value heads, d_k, d_v),
        SSM: (heads, head_dim, d_state)} (the kinds it has)."""
        self.backend = backend
        self.shapes = {(int(i), kind): tuple(map(int, shape)) for i, kinds in shapes.items()
                       for kind, shape in kinds.items()}
        self.arrays = {key: backend.new_state(shape) for key, shape in self.shapes.items()}
        self.undo = False    # keep what each pass needs for going back into it
        self.pass_start = 0  # the position of the last pass's first token
        self.pass_end = 0
        self._before: dict[tuple, np.ndarray] = {}  # (layer, kind) -> the state before the last pass (host)
        # (layer, kind) -> what the last pass fed it: its per-token inputs, the weights that go with them,
        # and the operation's options
        self._fed: dict[tuple, tuple] = {}
        self.marked, self._marked = -1, {}          # a position mark() kept the state of (-1: none), that state

    def begin(self, start: int, n_tokens: int) -> None:
        """A pass of n_tokens from position start is about to run."""
        self.pass_start, self.pass_end = start, start + n_tokens
        self._before, self._fed = {}, {}

    def _feed(self, key: tuple, *inputs, weights: tuple = (), **options):
        if self.undo:
            self._before[key] = self.backend.read_state(self.arrays[key])
            self._fed[key] = inputs, weights, options
        return self.arrays[key]

    def conv_history(self, layer: int, x):
        """The layer's convolution history, which the pass's convolution of x (tokens, channels)
        reads and updates in place."""
        return self._feed((layer, CONV), x)

    def delta_state(self, layer: int, q, k, v, decay, beta, grouped: bool = False):
        """The layer's DeltaNet state, which the pass's delta rule over these (backend.delta_rule's
        arguments) updates in place."""
        return self._feed((layer, DELTA), q, k, v, decay, beta, grouped=grouped)

    def ssm_state(self, layer: int, x, dt, b, c, a, d):
        """The layer's Mamba2 state, which the pass's scan over these (a and d its weights) updates in place."""
        return self._feed((layer, SSM), x, dt, b, c, weights=(a, d))

    def mark(self) -> None:
        """Keep a copy of the state as it is now, to come back to (one mark at a time)."""
        self.marked, self._marked = self.pass_end, self.export()

    def can_return_to(self, n: int) -> bool:
        """Whether the state can be made what it was after position n - 1 (n tokens in)."""
        return n in (0, self.pass_end, self.marked) or (self.pass_start <= n < self.pass_end
                                                         and len(self._fed) == len(self.arrays))

    def return_to(self, n: int) -> None:
        """The state as it was n tokens in (can_return_to(n), else ValueError, and nothing changes)."""
        if not self.can_return_to(n):
            raise ValueError(f"a recurrent state cannot go back to position {n}: it holds positions "
                             f"{self.pass_start}..{self.pass_end - 1} of its last pass only")
        if n == self.pass_end:
            return
        if n == self.marked:
            return self.load(self._marked, n)
        m = n - self.pass_start  # (the pass's tokens kept)
        for (layer, kind), state in self.arrays.items():
            if n == 0:
                self.backend.write_state(state, np.zeros(self.shapes[layer, kind], dtype=np.float32))
            elif kind == CONV:
                fed = np.concatenate([self._before[layer, kind], self.backend.to_numpy(self._fed[layer, kind][0][0])])
                self.backend.write_state(state, fed[m:m + self.shapes[layer, kind][0]])
            else:
                self.backend.write_state(state, self._before[layer, kind])
                if m:
                    inputs, weights, options = self._fed[layer, kind]
                    getattr(self.backend, _SCANS[kind])(*(x[:m] for x in inputs), *weights, state, **options)
        self._left_at(n)

    def _left_at(self, n: int) -> None:
        self.pass_start = self.pass_end = n
        self._before, self._fed = {}, {}
        if self.marked > n:
            self.marked, self._marked = -1, {}

    def shape(self) -> dict:
        return {f"{kind}_{layer}": list(shape) for (layer, kind), shape in self.shapes.items()}

    def export(self) -> dict[str, np.ndarray]:
        """Every state array, copied to the host, by name."""
        return {f"{kind}_{layer}": self.backend.read_state(a) for (layer, kind), a in self.arrays.items()}

    def expected(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        return {f"{kind}_{layer}": (np.dtype(np.float32), shape) for (layer, kind), shape in self.shapes.items()}

    def load(self, arrays: dict[str, np.ndarray], used: int) -> None:
        """export's arrays back in (checked by the caller against expected()), the state of `used`
        tokens, which it cannot go back from but to the start."""
        for (layer, kind), a in self.arrays.items():
            self.backend.write_state(a, arrays[f"{kind}_{layer}"])
        self._left_at(used)
