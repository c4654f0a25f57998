"""The tiers below the engine's own caches: host memory, local disk, the pool's object store (the archive).

Each is bounded in bytes and keeps counters; none is thread-safe on its own (the store serialises access).
Host holds CPU tensors (no encoding); disk and archive hold encoded blobs (format.py), checked on every read.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vlmq import keys
from vlmq.storage import Storage

log = logging.getLogger(__name__)
ItemKey = tuple[str, str]  # (kind, key)


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    bad_objects: int = 0  # found but refused (format.BadObject): counted as misses too
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    evictions: int = 0


class HostTier:
    """A byte-bounded LRU of CPU tensors."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.items: OrderedDict[ItemKey, torch.Tensor] = OrderedDict()
        self.stats = TierStats()

    def get(self, item: ItemKey) -> torch.Tensor | None:
        t = self.items.get(item)
        if t is None:
            self.stats.misses += 1
            return None
        self.items.move_to_end(item)
        self.stats.hits += 1
        self.stats.bytes_read += t.nbytes
        return t

    def put(self, item: ItemKey, t: torch.Tensor) -> list[tuple[ItemKey, torch.Tensor]]:
        """Insert (most recent); returns what was evicted to make room, oldest first."""
        if t.nbytes > self.capacity_bytes:
            return [(item, t)]
        if item in self.items:
            self.items.move_to_end(item)
            return []
        evicted = []
        while self.used_bytes + t.nbytes > self.capacity_bytes:
            old, ot = self.items.popitem(last=False)
            self.used_bytes -= ot.nbytes
            self.stats.evictions += 1
            evicted.append((old, ot))
        self.items[item] = t
        self.used_bytes += t.nbytes
        self.stats.puts += 1
        self.stats.bytes_written += t.nbytes
        return evicted


class DiskTier:
    """Encoded blobs as files under a local folder, byte-bounded, least recently used deleted first.

    The folder is this worker's own scratch space: it is emptied on start."""

    def __init__(self, root: str | Path, capacity_bytes: int) -> None:
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.sizes: OrderedDict[ItemKey, int] = OrderedDict()
        self.stats = TierStats()
        self.root.mkdir(parents=True, exist_ok=True)
        for old in self.root.glob("*/*.kv"):
            old.unlink(missing_ok=True)

    def _path(self, item: ItemKey) -> Path:
        return self.root / item[0] / f"{item[1]}.kv"

    def get(self, item: ItemKey) -> bytes | None:
        if item not in self.sizes:
            self.stats.misses += 1
            return None
        try:
            blob = self._path(item).read_bytes()
        except OSError:
            self._forget(item)
            self.stats.misses += 1
            return None
        self.sizes.move_to_end(item)
        self.stats.bytes_read += len(blob)
        return blob

    def put(self, item: ItemKey, blob: bytes) -> list[ItemKey]:
        """Write (most recent); returns the items deleted to make room."""
        if len(blob) > self.capacity_bytes or item in self.sizes:
            return []
        deleted = []
        while self.used_bytes + len(blob) > self.capacity_bytes:
            old = next(iter(self.sizes))
            self._forget(old)
            self.stats.evictions += 1
            deleted.append(old)
        path = self._path(item)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
        self.sizes[item] = len(blob)
        self.used_bytes += len(blob)
        self.stats.puts += 1
        self.stats.bytes_written += len(blob)
        return deleted

    def _forget(self, item: ItemKey) -> None:
        self.used_bytes -= self.sizes.pop(item)
        self._path(item).unlink(missing_ok=True)


class ArchiveTier:
    """The pool's object store under ``kv/<model-hash>/``: objects written once, read by every worker.

    Total bound: before this worker's writes since it last looked would pass a tenth of `capacity_bytes`, it lists
    ``kv/`` (every model) and deletes the oldest objects until the total is at most 90% of the bound, so one
    worker alone never takes the archive past it (N workers writing at once: at most (0.9 + N/10) x the bound
    until the next trim). Plain S3 suffices (no lifecycle rules); two workers trimming at once only delete more.
    An object over a tenth of the bound is not archived.
    """

    def __init__(self, storage: Storage, model_hash: str, capacity_bytes: int) -> None:
        self.storage = storage
        self.model_hash = model_hash
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self.num_trims = 0
        self.num_deleted = 0
        self._written_since_trim = capacity_bytes  # look once at the first write
        self._trim_lock = threading.Lock()

    def object_key(self, item: ItemKey) -> str:
        return keys.kv_object(self.model_hash, *item)

    def get(self, item: ItemKey) -> bytes | None:
        try:
            blob = self.storage.get(self.object_key(item))
        except KeyError:
            self.stats.misses += 1
            return None
        self.stats.bytes_read += len(blob)
        return blob

    def put(self, item: ItemKey, blob: bytes) -> bool:
        if len(blob) * 10 > self.capacity_bytes:
            return False
        if (self._written_since_trim + len(blob)) * 10 > self.capacity_bytes:
            self.trim()  # under 90% after it, and at most 10% written before the next: the bound holds
        wrote = self.storage.put_if_absent(self.object_key(item), blob)
        if wrote:
            self.stats.puts += 1
            self.stats.bytes_written += len(blob)
            self._written_since_trim += len(blob)
        return wrote

    def trim(self, on_delete: Callable[[str], None] | None = None) -> int:
        """Delete the oldest archive objects until the archive holds under 90% of its bound; returns bytes left."""
        with self._trim_lock:
            self._written_since_trim = 0
            self.num_trims += 1
            objects = sorted(self.storage.list_objects(keys.KV_ROOT), key=lambda o: (o.modified, o.key))
            total = sum(o.size for o in objects)
            target = self.capacity_bytes * 9 // 10
            for obj in objects:
                if total <= target:
                    break
                self.storage.delete(obj.key)
                total -= obj.size
                self.num_deleted += 1
                self.stats.evictions += 1
            return total
