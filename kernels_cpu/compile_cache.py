"""Keeping Numba's on-disk cache of ggrun's kernels consistent with their sources.

Numba checks a cached function only against its own file, but kernels inline functions from
other files of this package (matmul.py inlines rowdot.py's IR), and convert/quants.py inlines
blocks.py's Q8_0 quantizer; a change to rowdot.py or blocks.py alone would leave the callers'
cached machine code stale, after an upgrade as after an edit. So when any source of this package
changes, the caches of every package that inlines it are dropped. (convert's own files inline
nothing of each other's, so Numba's check of each file covers them.)

Numba also names compiled functions by counters that restart in every process: a function's
compile number (`v<n>` in the symbol) and, for structured dtypes, the order the process met its
types. Code cached by two processes can then hold one symbol with two bodies, say `products`
over one model's weight types and over another's, and once a process has loaded both, calls
into the weak copies bind to whichever loaded first: wrong numbers, no error (numba issues 7654
and 10486). So every process numbers its compiles from its own random start.
"""
import hashlib
import itertools
import os
import secrets
from pathlib import Path

_PACKAGE = Path(__file__).parent
# the packages whose cached kernels inline this one's
_INLINING = (_PACKAGE, _PACKAGE.parent / "convert")
_CACHE = _PACKAGE / "__pycache__"
_STAMP = _CACHE / "ggrun-kernels.sha256"


def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _cache_dirs(package: Path) -> list[Path]:
    """Where Numba may keep a package's cache: its __pycache__ and, with NUMBA_CACHE_DIR set,
    the directory Numba names for it there."""
    dirs = [package / "__pycache__"]
    if os.environ.get("NUMBA_CACHE_DIR"):
        from numba.core.caching import _CacheLocator  # (only after a change: Numba compiles next anyway)
        subpath = _CacheLocator.get_suitable_cache_subpath(str(package / "__init__.py"))
        dirs.append(Path(os.environ["NUMBA_CACHE_DIR"]) / subpath)
    return dirs


def distinct_symbols() -> None:
    """Number this process's compiles from a random 62-bit start (see module doc): two
    processes' symbols then never meet, whatever counters they share."""
    from numba.core.bytecode import FunctionIdentity
    FunctionIdentity._unique_ids = itertools.count(secrets.randbits(62))


def drop_stale_cache() -> None:
    digest = _sources_digest()
    try:
        if _STAMP.read_text() == digest:
            return
    except OSError:
        pass
    for cache in (cache for package in _INLINING for cache in _cache_dirs(package)):
        for path in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")) + list(cache.glob("ggrun-compiled-*")):
            path.unlink(missing_ok=True)
    try:
        _CACHE.mkdir(exist_ok=True)
        _STAMP.write_text(digest)
    except OSError:
        pass  # a read-only install: Numba then caches elsewhere or not at all


def _mark(kernels: str) -> Path:
    """The file that says `kernels` compiled: beside the kernels' Numba cache, wherever
    NUMBA_CACHE_DIR puts it (a mark in __pycache__ said compiled for an empty cache, and the first
    run then compiled during decode, without its message)."""
    return _cache_dirs(_PACKAGE)[-1] / f"ggrun-compiled-{kernels}"


def kernels_compiled(kernels: str) -> bool:
    """True once mark_compiled(kernels) has run since the sources last changed. The CLI names
    what a run compiles: the kernels that touch the KV cache compile once per element type, and
    prefill's apart from decode's, so each has its first run."""
    return _mark(kernels).exists()


def mark_compiled(kernels: str) -> None:
    mark = _mark(kernels)
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
    except OSError:
        pass  # (a read-only install: see drop_stale_cache)
