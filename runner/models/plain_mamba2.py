"""Plain Mamba2 (mamba2): every layer one Mamba2 block (runner/models/mamba2.py), RMS-normed before it
and added to the residual stream; no attention, no feed-forward: Nemotron-H's blocks, all of one
kind. A sequence's whole memory is its recurrent state."""
from __future__ import annotations

from .nemotron_h import NemotronH


class PlainMamba2(NemotronH):
    pass
