"""Times the torch backend's quantized products alone on CUDA: the Triton kernels (with each
configuration the decode kernel's tuning tried; prefill's tiles in TF32 and, precise, in
float32), the torch.compile'd reduction they replaced in decode, and a dense half-precision
product of the same shape (what the bytes alone would allow).

One-token (decode) and many-token (prefill) products of 7B-shaped matrices, per block type, on
random blocks whose scales are set to small finite values. Prints µs per product and the GB/s
of the quantized bytes it read. Run on a machine with an NVIDIA GPU:

    python3 scripts/gpu_products_bench.py [TYPE ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels_gpu.matmul import Products, QuantMatrix  # noqa: E402

SHAPES = [(14336, 4096), (4096, 14336)]  # a 7B's FFN up and down
SCALE_FIELDS = {"Q4_0": [0], "Q8_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_matrix(qtype, n, k, device):
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (n, k // block, block_bytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[qtype.name]:  # float16 scales of about 1e-3, never NaN
        raw[..., offset:offset + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return QuantMatrix(qtype, torch.from_numpy(raw.reshape(n, -1)).to(device), k)


def time_us(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def copy_bandwidth(device):
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() / time_us(lambda: b.copy_(a), 20) / 1e3  # GB/s, read + write


def main(names):
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, f"copy {copy_bandwidth(device):.0f} GB/s")
    names = names or ["Q4_K", "Q6_K", "Q4_0", "Q8_0"]
    triton, compiled = Products(compiled=True, triton=True, tf32=True), Products(compiled=True)
    precise = Products(compiled=True, triton=True)
    for name in names:
        qtype = GGMLQuantizationType[name]
        for n, k in SHAPES:
            w = random_matrix(qtype, n, k, device)
            dense = torch.randn(n, k, dtype=torch.float16, device=device)
            for tokens in (1, 512):
                x = torch.randn(tokens, k, device=device)
                rows = [("triton", lambda: triton.matmul(w, x))]
                if tokens == 1:
                    rows.append(("torch.compile", lambda: compiled.matmul(w, x)))
                else:
                    rows.append(("triton, precise", lambda: precise.matmul(w, x)))
                rows.append(("dense f16", lambda: x.half() @ dense.T))
                for label, fn in rows:
                    us = time_us(fn)
                    gbs = w.raw.numel() / us / 1e3
                    print(f"{name} {n}x{k} t={tokens:3d} {label:18s} {us:9.1f} µs  {gbs:7.0f} GB/s of blocks",
                          flush=True)
            tuner = triton.triton._tuned.get(qtype)
            for config, timing in sorted(getattr(tuner, "configs_timings", {}).items(), key=lambda c: c[1][0]):
                print(f"    {config}: {timing[0] * 1000:.1f} µs")


if __name__ == "__main__":
    main(sys.argv[1:])
