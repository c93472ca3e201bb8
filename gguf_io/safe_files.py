"""Files a command writes for the user (converted models, saved conversations, logits, plots): never
over one of the files it reads, and never half-written. Each goes to a temporary file beside its
target, is flushed to disk and renamed into place only once complete, so a failure, a full disk,
Ctrl-C or SIGTERM leaves the previous file as it was and no partial one behind."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputError(Exception):
    """An output file cannot be written, or would replace a file the command reads."""


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (the same device and inode, whatever links lead there)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def check_output(path: Path, inputs: Iterable[Path] = ()) -> None:
    """Refuse, before anything is written, an output that is one of the inputs or cannot be made."""
    path = Path(path)
    clash = next((p for p in inputs if p is not None and same_file(path, p)), None)
    if clash is not None:
        raise OutputError(f"{path} is the same file as {clash}, which this command reads: write the output elsewhere")
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {path}: " + ("it is a folder" if path.is_dir() else
                                                       f"{folder} is not a folder it can write in"))


def _mode(path: Path) -> int:
    """The permissions the new file gets: the replaced file's, else the umask's default."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextmanager
def atomic_output(path, inputs: Iterable[Path] = ()) -> Iterator[Path]:
    """The path of a temporary file to write `path`'s content into; when the block ends, it is
    synced and renamed over `path`. On any error or interruption it is removed and `path` is left
    as it was; an OSError comes out as an OutputError that names `path`."""
    path = Path(path)
    check_output(path, inputs)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _mode(path))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_outputs(path, inputs: Iterable[Path] = ()) -> Iterator[Path]:
    """atomic_output for a writer that may make several files named after `path` (a split model's
    parts): a temporary folder beside `path` to write `path` into; when the block ends every file
    in it is synced and renamed into `path`'s folder. On any error or interruption the folder is
    removed and nothing in `path`'s folder has changed."""
    path, inputs = Path(path), list(inputs)
    check_output(path, inputs)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial"))
    try:
        yield tmp / path.name
        made = sorted(tmp.iterdir())
        clash = next((p for p in inputs if p is not None for m in made if same_file(path.parent / m.name, p)), None)
        if clash is not None:
            raise OutputError(f"{clash} would be replaced by a part of the output: write the output elsewhere")
        for m in made:
            with open(m, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(m, _mode(path.parent / m.name))
        for m in made:
            os.replace(m, path.parent / m.name)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
