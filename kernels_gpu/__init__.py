"""torch kernels for ggrun's Backend: quantized weights stay in their GGUF blocks on the device."""
