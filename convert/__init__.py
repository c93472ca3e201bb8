"""Hugging Face checkpoint to GGUF conversion and quantization: the subject of the converter issue.

Nothing is implemented here yet.
"""
