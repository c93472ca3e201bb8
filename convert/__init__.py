"""Hugging Face checkpoints to GGUF, and llama.cpp's quantization formats and mixes."""
