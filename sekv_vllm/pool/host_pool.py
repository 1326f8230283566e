"""Host-memory pool for span bases, with a byte capacity and per-request accounting.

`store` refuses (returns False) instead of exceeding the capacity, so the caller can keep
the request at full KV rather than fail it.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Generic, TypeVar

Entry = TypeVar("Entry")


class HostPool(Generic[Entry]):
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: dict[str, dict[str, tuple[Entry, int]]] = defaultdict(dict)

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes

    def store(self, owner: str, key: str, entry: Entry, nbytes: int) -> bool:
        """Keep `entry` for `owner` under `key`; False (nothing stored) when it would not fit."""
        old = self._entries[owner].get(key)
        freed = old[1] if old else 0
        if self.used_bytes - freed + nbytes > self.capacity_bytes:
            return False
        self._entries[owner][key] = (entry, nbytes)
        self.used_bytes += nbytes - freed
        return True

    def load(self, owner: str, key: str) -> Entry:
        return self._entries[owner][key][0]

    def owner_bytes(self, owner: str) -> int:
        return sum(n for _, n in self._entries.get(owner, {}).values())

    def release(self, owner: str) -> int:
        """Drop everything `owner` holds; returns the bytes freed."""
        freed = sum(n for _, n in self._entries.pop(owner, {}).values())
        self.used_bytes -= freed
        return freed

    def owners(self) -> list[str]:
        return list(self._entries)
