"""Split GGUF files as llama-gguf-split writes them: NAME-00001-of-00003.gguf and its siblings.
The first part holds all metadata; every part holds split.no (its index from 0), split.count and
split.tensors.count (the tensors of all parts together), and a share of the tensors."""
from __future__ import annotations

import re
from pathlib import Path

from gguf import Keys

from .errors import GGUFError

KEY_NO, KEY_COUNT, KEY_TENSORS = Keys.Split.LLM_KV_SPLIT_NO, Keys.Split.LLM_KV_SPLIT_COUNT, \
    Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
MAX_PARTS = 99999  # the name's five digits
_PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def part_name(prefix: str, no: int, count: int) -> str:
    """The file name of part `no` (from 0) of `count`, as llama.cpp's llama_split_path spells it."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def parse_part_name(name: str) -> tuple[str, int, int] | None:
    """(prefix, no from 0, count) of a split part's file name; None for any other name."""
    m = _PART_NAME.match(name)
    if not m or not 1 <= int(m["no"]) <= int(m["count"]):
        return None
    return m["prefix"], int(m["no"]) - 1, int(m["count"])


def part_paths(path: Path, no: int, count: int) -> list[Path]:
    """All parts' paths, from one part's path and the split.no and split.count it holds."""
    parsed = parse_part_name(path.name)
    if parsed is None or parsed[1:] != (no, count):
        raise GGUFError(f"{path.name} is part {no + 1} of {count} of a split model, but its name does not say so "
                        f"(llama-gguf-split names it NAME-{no + 1:05d}-of-{count:05d}.gguf): rename it to find "
                        f"the other parts")
    return [path.with_name(part_name(parsed[0], i, count)) for i in range(count)]
