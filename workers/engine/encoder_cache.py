"""Vision-encoder outputs shared across requests, bounded in bytes.

Entries are keyed by an exact image identity (`make_key`) and hold an opaque value
the model runner puts there (a tensor; this module never imports torch). A sequence
that needs an image holds a reference from the step its chunk first overlaps the
image until the KV of all the image's tokens is computed. Only unreferenced entries
are evicted, least recently released first, and only to make room for a new one.

Life of an entry: reserve(key, bytes, holder) at schedule time (a miss; evicts if
needed) → put(key, value) by the runner before the LM forward that reads it →
get(key) → release(key, holder); acquire(key, holder) on a later request is a hit.

With KV tiers (kv_tiers.py), `on_evict(key, value)` sees every computed entry that is evicted (it is demoted to
host memory instead of dropped) and `insert` adds an entry restored from a tier, unreferenced and ready.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


def _canonical(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)  # 1003520.0 and 1003520 configure the processor identically
    if value is None or isinstance(value, (str, int, float)):
        return value
    raise ValueError(f"processor setting {value!r} ({type(value).__name__}) is not JSON-like; "
                     "pass str, int, float, bool, None, lists or dicts")


def encoder_output_width(model: Any) -> int:
    """Floats per image token in an encoder output: the LM hidden size, wider where the family keeps more
    (DeepStack features beside the input embedding)."""
    return getattr(model, "encoder_output_width", model.config.text_config.hidden_size)


def make_key(pixel_hash: str, model_id: str, processor_settings: Mapping[str, Any], salt: str | None = None) -> str:
    """Exact encoder-cache key: canonical pixel hash + model id + processor settings (+ the request's cache salt).

    Dict order, tuples versus lists and integral floats do not change the key. A salt (a tenant's: see
    block_hash.root_hash) makes a key no unsalted or differently salted request can hit; no salt leaves the key
    as it always was.
    """
    payload = {"pixels": pixel_hash, "model": model_id, "processor": _canonical(processor_settings)}
    if salt:
        payload["salt"] = salt
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(slots=True)
class _Entry:
    num_bytes: int
    holders: set[Hashable] = field(default_factory=set)
    value: Any = None
    ready: bool = False  # the runner has put the value


class EncoderCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_used_bytes = 0
        self.entries: dict[str, _Entry] = {}
        self.freeable: OrderedDict[str, None] = OrderedDict()  # unreferenced keys, least recently released first
        self.held_keys: dict[Hashable, set[str]] = {}  # holder -> keys it references
        self.hits = 0
        self.misses = 0
        self.num_evictions = 0
        self.on_evict: Callable[[str, Any], None] | None = None

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def freeable_bytes(self) -> int:
        return sum(self.entries[k].num_bytes for k in self.freeable)

    def holds(self, key: str, holder: Hashable) -> bool:
        return key in self.held_keys.get(holder, ())

    def can_reserve(self, num_bytes: int, keep: Iterable[str] = ()) -> bool:
        """Room for `num_bytes` more, evicting unreferenced entries other than `keep`."""
        kept = sum(self.entries[k].num_bytes for k in set(keep) if k in self.freeable)
        free = self.capacity_bytes - self.num_used_bytes
        return num_bytes <= free + self.freeable_bytes - kept

    def reserve(self, key: str, num_bytes: int, holder: Hashable) -> None:
        """A miss: make room for `key` (value to come from the runner) and reference it."""
        if key in self.entries:
            raise KeyError(f"encoder cache already has {key!r}; acquire it instead")
        if not self.can_reserve(num_bytes):
            raise MemoryError(f"encoder cache cannot fit {num_bytes} bytes; check can_reserve first")
        while self.capacity_bytes - self.num_used_bytes < num_bytes:
            self._evict_one()
        self.entries[key] = _Entry(num_bytes)
        self.num_used_bytes += num_bytes
        self.misses += 1
        self._add_holder(key, holder)

    def insert(self, key: str, value: Any, num_bytes: int) -> bool:
        """Add a ready, unreferenced entry (restored from a lower tier) if it fits; returns whether it was added."""
        if key in self.entries or not self.can_reserve(num_bytes):
            return False
        while self.capacity_bytes - self.num_used_bytes < num_bytes:
            self._evict_one()
        self.entries[key] = _Entry(num_bytes, value=value, ready=True)
        self.num_used_bytes += num_bytes
        self.freeable[key] = None
        return True

    def acquire(self, key: str, holder: Hashable) -> None:
        """A hit: reference an entry that is cached (or reserved earlier this step)."""
        if key not in self.entries:
            raise KeyError(f"encoder cache has no {key!r}; reserve it instead")
        self.hits += 1
        self._add_holder(key, holder)

    def put(self, key: str, value: Any) -> None:
        entry = self.entries.get(key)
        if entry is None:  # its only holder was aborted after the step was scheduled
            return
        entry.value, entry.ready = value, True

    def get(self, key: str) -> Any:
        entry = self.entries[key]
        if not entry.ready:
            raise LookupError(f"encoder output {key!r} is reserved but the runner has not put it yet")
        return entry.value

    def release(self, key: str, holder: Hashable) -> None:
        keys = self.held_keys.get(holder)
        if keys is None or key not in keys:
            return
        keys.discard(key)
        if not keys:
            del self.held_keys[holder]
        entry = self.entries[key]
        entry.holders.discard(holder)
        if not entry.holders:
            if entry.ready:
                self.freeable[key] = None
            else:  # never computed (holder preempted or aborted first): nothing worth keeping
                self._drop(key)

    def release_all(self, holder: Hashable) -> None:
        for key in list(self.held_keys.get(holder, ())):
            self.release(key, holder)

    def _add_holder(self, key: str, holder: Hashable) -> None:
        self.entries[key].holders.add(holder)
        self.held_keys.setdefault(holder, set()).add(key)
        self.freeable.pop(key, None)

    def _evict_one(self) -> None:
        key, _ = self.freeable.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(key, self.entries[key].value)
        self._drop(key)
        self.num_evictions += 1

    def _drop(self, key: str) -> None:
        self.num_used_bytes -= self.entries.pop(key).num_bytes
        self.freeable.pop(key, None)
