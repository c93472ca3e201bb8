"""Loading a model and generating from it: backends, weights, KV caches, sampling, speculative
decoding, batching, sessions and conversations."""
