"""Which quantization to pick: size, bits per weight, perplexity, KL divergence and top-1
agreement against the full-precision model, and decode speed, for each type."""
from __future__ import annotations

import tempfile
from pathlib import Path

from gguf_io.safe_files import atomic_output

from ..engine.load import LoadOptions, load_model
from .bench import time_decode
from .perplexity import compare_to_base, load_base, perplexity, save_logits

DEFAULT_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")


def quant_report(source: Path, text: str, types, n_ctx: int, threads: int | None = None,
                 progress: bool = True, imatrix: Path | None = None) -> list[dict]:
    """source: a Hugging Face folder (converted to F32 first) or an F32/F16/BF16 GGUF. With an
    importance matrix, each type whose quantizer reads one is made again with it."""
    from convert.convert import convert_hf, requantize
    from convert.mixes import MixOptions
    variants = _variants(types, imatrix)
    if imatrix is not None:  # (a file that is not an importance matrix: refused before any work)
        from convert.importance import load_importance
        load_importance(str(imatrix))
    if not source.is_dir():
        _check_unquantized(source)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ggrun-report-") as tmp:
        tmp = Path(tmp)
        if source.is_dir():
            base_path = tmp / "F32.gguf"
            convert_hf(source, base_path, "F32", progress=progress)
            make = lambda t, out, mix: convert_hf(source, out, t, progress=progress, mix=mix)  # noqa: E731
        else:
            base_path = source
            make = lambda t, out, mix: requantize(source, out, t, progress=progress, mix=mix)  # noqa: E731
        for type_name, weighted in (("base", False), *variants):
            label = "F32 (base)" if type_name == "base" else type_name + ("+imatrix" if weighted else "")
            path = base_path if type_name == "base" else tmp / f"{label}.gguf"
            if type_name != "base":
                make(type_name, path, MixOptions(imatrix=str(imatrix) if weighted else None))
            lm = load_model(path, LoadOptions(kv_type="f32", threads=threads))
            if type_name == "base":
                result = perplexity(lm, text, n_ctx, progress=progress)
                save_logits(result, tmp / "base.npz", len(lm.tokenizer.vocab))
                base = load_base(tmp / "base.npz", len(result.target_logprobs))
                kl = compare_to_base(perplexity(lm, text, n_ctx, base=base, progress=False), base)
            else:
                result = perplexity(lm, text, n_ctx, base=base, progress=progress)
                kl = compare_to_base(result, base)
            time_decode(lm, 4)  # warm-up outside the measurement
            rows.append({"type": label, "imatrix": weighted,
                         "size_mib": lm.file.size / 2**20, "bits_per_weight": lm.file.bits_per_weight(),
                         "ppl": result.ppl, "ppl_stderr": result.ppl_stderr, "kld_mean": kl["kld_mean"],
                         "top1_agreement": kl["top1_agreement"], "decode_tok_s": time_decode(lm, 32)})
            lm.file = lm.model = None
    return rows


def _variants(types, imatrix: Path | None) -> list[tuple[str, bool]]:
    """(type, made with the importance matrix) for each row: every type as it is (but the ones
    that need a matrix), then again with the matrix where it changes the type's quantization.
    ValueError, before any work, for a type that needs a matrix when none is given."""
    from convert.importance import HOW_TO_MAKE_ONE, needs_importance
    from convert.mixes import FILE_TYPES
    from convert.quants import reads_importance
    needing = [t for t in types if needs_importance(FILE_TYPES[t][0])]
    if needing and imatrix is None:
        raise ValueError(f"{', '.join(needing)} need{'s' if len(needing) == 1 else ''} an importance matrix: "
                         f"{HOW_TO_MAKE_ONE}")
    variants = []
    for t in types:
        if t not in needing:
            variants.append((t, False))
        if imatrix is not None and reads_importance(FILE_TYPES[t][0]):
            variants.append((t, True))
    return variants


def _check_unquantized(path: Path) -> None:
    """Refuse, before any work, a GGUF source whose weights are already quantized: the report
    measures each type against the full-precision weights."""
    from gguf_io import GGUFFile
    from gguf_io.quant_types import FLOAT_TYPES
    f = GGUFFile(path)
    quantized = next((t for t in f.tensors.values() if t.type not in FLOAT_TYPES), None)
    if quantized is not None:
        raise ValueError(f"{path.name} is already quantized ({quantized.name} is {quantized.type.name}): "
                         f"quant-report needs an F32, F16 or BF16 file, or a Hugging Face folder")


def format_table(rows: list[dict]) -> str:
    head = f"{'type':<15} {'size MiB':>9} {'bpw':>6} {'PPL':>16} {'KLD mean':>9} {'top-1':>7} {'decode tok/s':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['type']:<15} {r['size_mib']:>9.1f} {r['bits_per_weight']:>6.2f} "
                     f"{r['ppl']:>8.3f} ± {r['ppl_stderr']:<5.3f} {r['kld_mean']:>9.4f} "
                     f"{100 * r['top1_agreement']:>6.1f}% {r['decode_tok_s']:>13.1f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'ggrun[plot]'") from None
    quantized = [r for r in rows if not r["type"].endswith("(base)")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([r["bits_per_weight"] for r in quantized], [r["kld_mean"] for r in quantized], "o-")
    for r in quantized:
        ax.annotate(r["type"], (r["bits_per_weight"], r["kld_mean"]), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel("bits per weight")
    ax.set_ylabel("mean KL divergence from the F32 model")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
