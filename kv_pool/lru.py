"""The eviction order of the pool: sized keys, least recently used first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class LruSet:
    """Keys with their sizes in bytes, oldest first; tracks the total for O(1) room checks."""

    def __init__(self) -> None:
        self._sizes: OrderedDict[Hashable, int] = OrderedDict()
        self.total_bytes = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def add(self, key: Hashable, size_bytes: int) -> None:
        """Inserts ``key`` as most recently used (moves it there if present). Mutates: order, total."""
        self.discard(key)
        self._sizes[key] = size_bytes
        self.total_bytes += size_bytes

    def discard(self, key: Hashable) -> None:
        """Removes ``key`` if present. Mutates: order, total."""
        size_bytes = self._sizes.pop(key, None)
        if size_bytes is not None:
            self.total_bytes -= size_bytes

    def touch(self, key: Hashable) -> None:
        """Makes a present ``key`` most recently used; ignores absent keys. Mutates: order."""
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def pop_oldest(self) -> Hashable:
        """Removes and returns the least recently used key. Mutates: order, total.

        Raises:
            KeyError: the set is empty.
        """
        return self.pop_oldest_with_size()[0]

    def pop_oldest_with_size(self) -> tuple[Hashable, int]:
        """As ``pop_oldest``, with the key's size in bytes. Raises KeyError when empty."""
        if not self._sizes:
            raise KeyError("pop_oldest from an empty LruSet")
        key, size_bytes = self._sizes.popitem(last=False)
        self.total_bytes -= size_bytes
        return key, size_bytes
