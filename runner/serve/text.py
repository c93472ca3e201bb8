"""A reply's text as it streams, cut before the first stop string (which, as in OpenAI's API, the
reply does not include): text that might begin a stop string is held back until the next pieces
say whether it does."""
from __future__ import annotations


class StopText:
    def __init__(self, stops=()):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held, self._part = "", None

    def push(self, piece: str, part: str) -> list[tuple[str, str]]:
        """The (part, text) that can be released now that `piece` (of `part`) follows; after a stop
        string, `stopped` is set and nothing more is released."""
        if self.stopped:
            return []
        out = self.flush() if part != self._part else []
        self._part = part
        text = self._held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return out + ([(part, text[:cut])] if cut else [])
        keep = self._prefix_held(text)
        self._held = text[len(text) - keep:]
        released = text[:len(text) - keep]
        return out + ([(part, released)] if released else [])

    def flush(self) -> list[tuple[str, str]]:
        """What is held back, once no more text comes."""
        held, self._held = self._held, ""
        return [(self._part, held)] if held and not self.stopped else []

    def _prefix_held(self, text: str) -> int:
        """The length of the longest end of text that begins a stop string."""
        for n in range(min(len(text), max(map(len, self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stops):
                return n
        return 0
