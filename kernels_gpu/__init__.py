"""torch kernels over quantized GGUF weights for NVIDIA GPUs: the subject of the GPU-backend issue.

Nothing is implemented here yet; runner.backend.make_backend offers only the CPU.
"""
