"""Progress bars on a terminal only: redrawn with carriage returns, they would litter a log file."""
from __future__ import annotations

import sys


def progress_bar(iterable=None, disable: bool = False, **options):
    """tqdm over iterable on stderr, where stderr is a terminal and the caller does not disable it."""
    from tqdm import tqdm  # (here: importing it cost every command ~20 ms)
    return tqdm(iterable, disable=disable or not sys.stderr.isatty(), **options)
