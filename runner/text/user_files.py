"""Text a user names on the command line or in chat (a prompt, a system prompt, a text to score, a
saved conversation): read from regular files or standard input only, and at most MAX_TEXT_BYTES, so
that /dev/zero, a FIFO nobody writes or an endless pipe is an error, not a hang."""
from __future__ import annotations

import os
import stat
import sys

MAX_TEXT_BYTES = 64 << 20


class InputError(ValueError):
    """A file or value the user gave is unusable (not a usage mistake: click's usage text would not help)."""


def user_message(e: Exception) -> str:
    """An error as one line for the user: an OSError as its file and reason, not Python's [Errno n]."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


def _bounded(read, name: str) -> bytes:
    data = read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES:
        raise InputError(f"{name} is longer than {MAX_TEXT_BYTES >> 20} MiB")
    return data


def read_text(path: str) -> str:
    """The text of a file ('-': standard input); bytes that are not UTF-8 become U+FFFD."""
    from .tokenizer import valid_utf8
    if path == "-":
        return valid_utf8(_bounded(sys.stdin.buffer.read, "the standard input").decode("utf-8", "surrogateescape"))
    try:
        # (O_NONBLOCK: opening a FIFO that no one writes would wait for a writer forever)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(f"cannot read {path}: it is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = _bounded(f.read, path)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    return valid_utf8(data.decode("utf-8", "surrogateescape"))
