"""The models ggrun has fetched: registry models in ggrun's cache and Hub models in huggingface_hub's
cache, listed and removed by the names that fetch them."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .hub import file_tag, is_first_part, is_model_file, parse_hub_name, split_siblings
from .registry import MODELS, RegistryError, model_path


@dataclass(frozen=True)
class CachedModel:
    name: str           # as `ggrun rm` and every command take it
    paths: tuple[Path, ...]  # its files: one, or a split model's parts
    origin: str

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.paths)

    def describe(self) -> tuple[str, str]:
        """(architecture, quant type) from the file's header; '?' where it cannot be read."""
        from gguf_io import GGUFError, GGUFFile
        try:
            f = GGUFFile(self.paths[0])
            return f.architecture, f.file_type_name()
        except GGUFError:
            return "?", "?"


def cached_models() -> list[CachedModel]:
    return _registry_models() + _hub_models()


def _registry_models() -> list[CachedModel]:
    return [CachedModel(name, (model_path(name),), "PyPI " + " ".join(req for req, _ in entry.parts[:1])
                        + (f" (+{len(entry.parts) - 1} parts)" if len(entry.parts) > 1 else ""))
            for name, entry in MODELS.items() if model_path(name).is_file()]


def _hub_models() -> list[CachedModel]:
    """Every GGUF model in huggingface_hub's cache, newest revision first where a name repeats."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound
    try:
        repos = scan_cache_dir().repos
    except CacheNotFound:
        return []
    models, seen = [], set()
    for repo in sorted(repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: (not r.refs, -r.last_modified)):
            files = {str(f.file_path.relative_to(rev.snapshot_path)): f.file_path for f in rev.files}
            for rel in sorted(files):
                if not is_model_file(rel) or not is_first_part(rel):
                    continue
                name = f"hf.co/{repo.repo_id}:{file_tag(rel) or rel}"
                try:
                    parts = split_siblings(rel, list(files))
                except RegistryError:
                    continue  # (a split model whose parts are not all cached)
                if name in seen:
                    continue
                seen.add(name)
                models.append(CachedModel(name, tuple(files[p] for p in parts),
                                          f"hf.co/{repo.repo_id} @ {rev.commit_hash[:8]}"))
    return models


def find_cached(name: str) -> list[CachedModel]:
    """The cached models a name means: a registry name, hf.co/USER/REPO:TAG (the tag in any case),
    or hf.co/USER/REPO for all of that repository's."""
    models = cached_models()
    if name in MODELS:
        return [m for m in models if m.name == name]
    hub = parse_hub_name(name)
    if hub is None:
        return []
    prefix = f"hf.co/{hub.repo}:".lower()
    return [m for m in models if m.name.lower() == f"{prefix}{hub.tag}".lower()
            or (hub.tag is None and m.name.lower().startswith(prefix))]


def remove(name: str) -> list[tuple[str, int]]:
    """Delete the cached models of a name; returns their names and sizes. A Hub model's blobs go with it where no
    other cached file shares them, and its repository's folder once nothing is left in it."""
    found = find_cached(name)
    if not found:
        raise RegistryError(f"no cached model is called {name!r}: `ggrun list` shows the cached ones")
    removed = [(model.name, model.size) for model in found]
    for model in found:
        for path in model.paths:
            blob = path.resolve() if _repo_folder(path) else path  # (a registry file is itself, linked or not)
            path.unlink(missing_ok=True)
            if blob != path and not _linked_from(blob):
                blob.unlink(missing_ok=True)
            _remove_empty_folders(path.parent)
    return removed


def _repo_folder(path: Path) -> Path | None:
    """The huggingface_hub cache folder (models--USER--REPO) that holds a snapshot path."""
    return next((p for p in path.parents if p.name.startswith("models--")), None)


def _linked_from(blob: Path) -> bool:
    """Whether a snapshot file of the blob's repository still links to it."""
    repo = _repo_folder(blob)
    return any(p.is_symlink() and p.resolve() == blob for p in (repo / "snapshots").rglob("*")) if repo else False


def _remove_empty_folders(folder: Path) -> None:
    """Empty snapshot folders up to the repository's; the repository's folder once it has no
    snapshot left (its refs would name one that is gone), with huggingface_hub's lock files for it."""
    repo = _repo_folder(folder)
    if repo is None:
        return
    while folder != repo and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent
    snapshots = repo / "snapshots"
    if not snapshots.is_dir() or not any(snapshots.iterdir()):
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(repo.parent / ".locks" / repo.name, ignore_errors=True)
