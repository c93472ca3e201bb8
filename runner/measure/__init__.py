"""Measuring a model: throughput (bench), perplexity and KL divergence, and the quantization report."""
