"""GGUF models from the Hugging Face Hub, named as llama.cpp's -hf names them: USER/REPO[:TAG].

Downloads go through huggingface_hub, so its cache, HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE,
resumable downloads and progress bars are the user's as in every other Hugging Face tool. The TAG
(a quant type: Q4_K_M, q8_0 ...) picks a file as llama.cpp picks it: the first model file whose
path holds the tag followed by '.' or '-', case-insensitively; without a tag Q4_K_M, then Q8_0,
then the first model file. A split model comes with all its parts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gguf_io.split import parse_part_name, part_name

from .registry import RegistryError, sha256_of

HUB_PREFIXES = ("https://huggingface.co/", "huggingface.co/", "hf.co/")
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # side files a repo may hold


class HubError(RegistryError):
    """A Hub model cannot be found, chosen or downloaded."""


@dataclass(frozen=True)
class HubModel:
    """USER/REPO and an optional quant tag."""

    repo: str
    tag: str | None = None

    @property
    def name(self) -> str:
        return f"hf.co/{self.repo}" + (f":{self.tag}" if self.tag else "")


def parse_hub_name(text: str, bare: bool = True) -> HubModel | None:
    """hf.co/USER/REPO[:TAG] (also huggingface.co/...), or with bare a plain USER/REPO[:TAG];
    None for anything else."""
    for prefix in HUB_PREFIXES:
        if text.startswith(prefix):
            text, bare = text[len(prefix):], True
            break
    if not bare or text.endswith(".gguf"):
        return None
    repo, _, tag = text.partition(":")
    if not _REPO.match(repo) or (tag and not re.fullmatch(r"[\w.-]+", tag)):
        return None
    return HubModel(repo, tag or None)


def file_tag(path: str) -> str:
    """The quant tag of a GGUF file name (model-Q4_K_M.gguf -> Q4_K_M), upper-cased; '' if none."""
    stem = PurePosixPath(path).name.removesuffix(".gguf")
    parsed = parse_part_name(PurePosixPath(path).name)
    m = _TAG.search(parsed[0] if parsed else stem)
    return m[1].upper() if m else ""


def is_model_file(path: str) -> bool:
    name = PurePosixPath(path).name
    return name.endswith(".gguf") and not any(word in name for word in _NOT_MODELS)


def is_first_part(path: str) -> bool:
    """Whether a GGUF file is a whole model or the first part of a split one."""
    parsed = parse_part_name(PurePosixPath(path).name)
    return parsed is None or parsed[1] == 0


def choose_files(model: HubModel, files: list[str]) -> list[str]:
    """The repository files (paths) of model's tag: the chosen file, or all parts of a split one."""
    candidates = [f for f in sorted(files) if is_model_file(f) and is_first_part(f)]
    for tag in (model.tag,) if model.tag else DEFAULT_TAGS:
        pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
        chosen = next((f for f in candidates if pattern.search(f)), None)
        if chosen:
            return split_siblings(chosen, files)
    if not model.tag and candidates:
        return split_siblings(candidates[0], files)
    if not candidates:
        raise HubError(f"{model.name}: the repository has no GGUF model files")
    tags = sorted({file_tag(f) for f in candidates} - {""})
    raise HubError(f"{model.name}: no GGUF file of the tag {model.tag!r}; the repository has "
                   + (", ".join(tags) if tags else ", ".join(candidates)))


def split_siblings(path: str, files: list[str]) -> list[str]:
    """path, or all parts of the split model whose first part it is, in order."""
    parsed = parse_part_name(PurePosixPath(path).name)
    if parsed is None:
        return [path]
    folder = PurePosixPath(path).parent
    parts = [str(folder / part_name(parsed[0], i, parsed[2])) for i in range(parsed[2])]
    missing = [p for p in parts if p.removeprefix("./") not in files]
    if missing:
        raise HubError(f"{path} is part 1 of {parsed[2]}, but the repository lacks {missing[0]}")
    return [p.removeprefix("./") for p in parts]


def resolve_hub(model: HubModel, quiet: bool = False) -> Path:
    """The local path of model's file (the first part of a split one), downloaded where needed.
    Offline (HF_HUB_OFFLINE, or the Hub unreachable) a cached copy is used."""
    files, sha256, commit = _repo_files(model)
    chosen = choose_files(model, files)
    paths = [_download(model, f, commit, sha256.get(f), quiet) for f in chosen]
    return paths[0]


def _repo_files(model: HubModel) -> tuple[list[str], dict[str, str], str]:
    """The repository's file paths, their sha256 (the Hub's metadata of large files) and its commit:
    from the Hub, or offline from the cache."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, OfflineModeIsEnabled, RepositoryNotFoundError
    try:
        info = HfApi().model_info(model.repo, files_metadata=True)
    except GatedRepoError:
        raise HubError(f"{model.name} is gated: accept its terms on its Hub page, then set HF_TOKEN to a token "
                       f"of that account (or run `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{model.name}: no such repository on the Hub (a private one needs HF_TOKEN set to a "
                       f"token that can read it)") from None
    except OfflineModeIsEnabled:
        return _cached_files(model, "HF_HUB_OFFLINE is set")
    except Exception as e:  # (the network: httpx's errors, or the Hub's 5xx)
        if not _network_error(e):
            raise
        return _cached_files(model, f"the Hub is unreachable ({_reason(e)})")
    files = [s.rfilename for s in info.siblings or ()]
    sha256 = {s.rfilename: s.lfs.sha256 for s in info.siblings or () if s.lfs is not None}
    return files, sha256, info.sha or "main"


def _network_error(e: Exception) -> bool:
    from huggingface_hub.errors import HfHubHTTPError
    if isinstance(e, HfHubHTTPError):
        return e.response is None or e.response.status_code >= 500
    return type(e).__module__.split(".")[0] in ("httpx2", "httpx", "httpcore2", "httpcore") or isinstance(e, OSError)


def _reason(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _snapshot(model: HubModel) -> Path | None:
    """The cached snapshot of the repository's main branch where the cache knows it, else the
    latest one (ggrun downloads by commit, which records no branch)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name
    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=model.repo, repo_type="model")
    try:
        main = storage / "snapshots" / (storage / "refs" / "main").read_text().strip()
        if main.is_dir():
            return main
    except OSError:
        pass
    snapshots = [p for p in (storage / "snapshots").glob("*") if p.is_dir()]
    return max(snapshots, key=lambda p: p.stat().st_mtime, default=None)


def _cached_files(model: HubModel, why: str) -> tuple[list[str], dict[str, str], str]:
    from huggingface_hub import constants
    snapshot = _snapshot(model)
    files = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf")) if snapshot else []
    if not files:
        raise HubError(f"{why}, and {model.name} is not in the cache ({constants.HF_HUB_CACHE}): "
                       f"download it once while online")
    return files, {}, snapshot.name


def _download(model: HubModel, filename: str, commit: str, sha256: str | None, quiet: bool) -> Path:
    """One file through huggingface_hub's cache; a fresh download is checked against the sha256
    the Hub lists for it, and removed where it differs."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    cached = try_to_load_from_cache(model.repo, filename, revision=commit)
    if quiet:
        disable_progress_bars()
    try:
        path = Path(hf_hub_download(model.repo, filename, revision=commit))
    except Exception as e:
        if not _network_error(e):
            raise
        raise HubError(f"downloading {filename} of {model.name} failed ({_reason(e)}): run the command again "
                       f"to resume it") from None
    finally:
        if quiet:
            enable_progress_bars()
    if sha256 and str(path) != cached:
        digest = sha256_of(path)
        if digest != sha256:
            blob = path.resolve()
            path.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
            raise HubError(f"{filename} of {model.name} arrived corrupted (sha256 {digest[:16]}..., the Hub lists "
                           f"{sha256[:16]}...); it was removed: run the command again")
    return path

