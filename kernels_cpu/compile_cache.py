"""Keeping Numba's on-disk cache of this package's kernels consistent with their sources.

Numba checks a cached function only against its own file, but kernels here inline functions from
other files (matmul.py inlines rowdot.py's IR); a change to rowdot.py alone would leave matmul.py's
cached machine code stale. So the whole package's cache is dropped when any source changes.
"""
import hashlib
from pathlib import Path

_PACKAGE = Path(__file__).parent
_CACHE = _PACKAGE / "__pycache__"
_STAMP = _CACHE / "ggrun-kernels.sha256"


def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def drop_stale_cache() -> None:
    digest = _sources_digest()
    try:
        if _STAMP.read_text() == digest:
            return
    except OSError:
        pass
    for path in list(_CACHE.glob("*.nbi")) + list(_CACHE.glob("*.nbc")) + list(_CACHE.glob("ggrun-compiled-*")):
        path.unlink(missing_ok=True)
    try:
        _CACHE.mkdir(exist_ok=True)
        _STAMP.write_text(digest)
    except OSError:
        pass  # a read-only install: Numba then caches elsewhere or not at all


def kernels_compiled(kv_type: str) -> bool:
    """True once mark_compiled(kv_type) has run since the sources last changed: the kernels that
    touch the KV cache are compiled once per element type, so each type has its first run."""
    return (_CACHE / f"ggrun-compiled-{kv_type}").exists()


def mark_compiled(kv_type: str) -> None:
    try:
        (_CACHE / f"ggrun-compiled-{kv_type}").touch()
    except OSError:
        pass  # (a read-only install: see drop_stale_cache)
