"""Stop strings: end generation before the first occurrence, and never send any part of one."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Filters streamed text so that no part of a stop string ever reaches the client.

    Text that could be the beginning of a stop string (a suffix of the text so far that is a
    proper prefix of some stop string) is held back until the next delta decides it.
    """

    def __init__(self, stop: Sequence[str]):
        if any(not s for s in stop):
            raise ValueError(f"stop strings must not be empty, got {list(stop)!r}")
        self.stop = tuple(stop)
        self._held = ""  # text received but not yet released
        self.stopped = False

    def feed(self, text: str) -> str:
        """Adds ``text`` and returns what is safe to send.

        After a match the returned text ends right before the stop string, ``stopped`` is set
        and every later call returns "". Mutates the held-back text.
        """
        if self.stopped:
            return ""
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            self.stopped = True
            self._held = ""
            return buffer[:match]
        keep = self._partial_match_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Releases the held-back text at the end of generation (no stop string followed)."""
        text, self._held = ("" if self.stopped else self._held), ""
        return text

    def _first_match(self, buffer: str) -> int | None:
        positions = [i for i in (buffer.find(s) for s in self.stop) if i >= 0]
        return min(positions) if positions else None

    def _partial_match_len(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that a stop string starts with."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buffer)), longest, -1):
                if buffer.endswith(s[:n]):
                    longest = n
                    break
        return longest
