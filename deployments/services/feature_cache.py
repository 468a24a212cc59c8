"""The encoder and vision replicas' cache (deployments/services/encoder.py, vision.py), in a module of its
own so that neither replica's module imports the other's (their common shape: encoding.py)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict


class FeatureCache:
    """Encoder outputs by content hash, least recently used out first, bounded in bytes: a
    repeated source, clip window or image is encoded once."""

    def __init__(self, max_bytes: int = 256 * 2**20):
        self.max_bytes, self.bytes = max_bytes, 0
        self._items: OrderedDict[str, tuple] = OrderedDict()

    @staticmethod
    def key(*parts) -> str:
        digest = hashlib.sha256()
        for part in parts:
            digest.update(part if isinstance(part, bytes) else repr(part).encode())
            digest.update(b"\x00")
        return digest.hexdigest()

    def get(self, key: str):
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
            return item[0]
        return None

    def put(self, key: str, value, size: int) -> None:
        if size > self.max_bytes or key in self._items:
            return
        self._items[key] = (value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._items)
