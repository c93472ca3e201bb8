"""Granite 4.0-H (granitehybrid): Mamba2 layers (runner/models/mamba2.py) among GQA attention
layers, with Granite's multipliers from the file, a dense MLP or experts with a shared expert. Its
attention layers apply RoPE only where the file's rope.scaling.finetuned says so (the published
hybrids apply none)."""
from __future__ import annotations

from .llama import Llama
from .mamba2 import Mamba2Layers


class GraniteHybrid(Mamba2Layers, Llama):
    def rotates(self, i: int) -> bool:
        return self.params.rope_finetuned and super().rotates(i)
