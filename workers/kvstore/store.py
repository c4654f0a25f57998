"""KVStore: the host, disk and archive tiers behind the engine's caches, with their own threads.

The engine calls `demote` (an item left the encoder cache or the prefix cache), `archive` (write an encoder output
through to the archive) and `fetch` (look an item up, promoting it to host memory); all three return at once and
the work runs on the store's threads. A transfer that would pass `max_pending_bytes` is dropped and counted, so a
slow store never holds more than that much memory, and nothing the step loop does waits on storage.

    demote:  engine -> host -> (evicted) -> disk, and prefix blocks also -> archive
    archive: engine -> archive (encoder outputs: the item the fleet most reuses, written once when computed)
    fetch:   host -> disk -> archive (only if the caller chose fetching over recomputing); a hit lands in host

On CUDA, `demote` and `archive` start the device-to-host copy into pinned memory and return (`to_host_async`); the
store's thread waits for the copy, not the step loop. The host tier's tensors are pinned, so the engine's restore
from host memory is an asynchronous copy too.

Disk and archive objects are signed (format.py): the archive with `KVStoreConfig.archive_key`, which every worker
of the pool shares and no producer holds; the disk tier, this worker's own scratch space, with it or with a
random key of this process. An archive object that fails verification is deleted (objects are written once: a
bad one would otherwise keep the good one out forever), except one of a newer format version, which this worker
merely cannot read.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, fields

import torch

from vlmq.storage import Storage
from vlmq.workers.native import thread_pool

from .format import MIN_SECRET_BYTES, QUANTS, BadObject, Expected, decode, encode
from .tiers import ArchiveTier, DiskTier, HostTier, ItemKey, TierStats

log = logging.getLogger(__name__)
COUNTS = ("dropped_transfers", "transfer_errors", "pending_bytes")
CHAIN_FETCHES = 8  # prefix blocks of one chain looked up at once
MAX_REMEMBERED = 1 << 20  # archive keys remembered as written (a forgotten one costs one conditional put)


@dataclass(slots=True)
class KVStoreConfig:
    host_bytes: int = 1 << 30
    disk_dir: str | None = None  # None: no disk tier
    disk_bytes: int = 0
    archive_bytes: int = 16 << 30  # the whole archive (every model), oldest objects deleted first
    quant: str = ""  # archive encoding: "" (lossless, the cache dtype), "int8" or "fp8"
    max_pending_bytes: int = 256 << 20  # tensors waiting for the store's threads
    always_fetch: bool = False  # benchmarks: fetch from the archive without weighing it against recomputing
    # a request waits for its lookups twice the recompute estimate plus this (host and disk lookups cost a little
    # even when recomputing is free); more trades first-token latency for reuse on a loaded machine
    wait_grace_s: float = 0.05
    # signs and verifies archive objects (VLMQ_KV_ARCHIVE_KEY): the same on every worker, never on a producer
    archive_key: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if self.archive_key and len(self.archive_key) < MIN_SECRET_BYTES:
            raise ValueError(f"KVStoreConfig.archive_key must have at least {MIN_SECRET_BYTES} bytes")
        if self.quant not in QUANTS:
            raise ValueError(f"KV archive quantisation must be one of {sorted(QUANTS)}, got {self.quant!r}")
        for name in ("host_bytes", "disk_bytes", "archive_bytes", "max_pending_bytes", "wait_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"KVStoreConfig.{name} must be >= 0")


class RateModel:
    """Transfer time = first-byte latency + bytes / bandwidth, fitted by least squares over recent transfers."""

    def __init__(self, latency_s: float = 0.02, bandwidth: float = 200e6, window: int = 32) -> None:
        self.latency_s, self.bandwidth = latency_s, bandwidth
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, num_bytes: int, seconds: float) -> None:
        self.samples.append((num_bytes, seconds))
        n = len(self.samples)
        mx = sum(b for b, _ in self.samples) / n
        my = sum(s for _, s in self.samples) / n
        var = sum((b - mx) ** 2 for b, _ in self.samples)
        if var > 0:  # distinct sizes: fit both terms
            slope = sum((b - mx) * (s - my) for b, s in self.samples) / var
            if slope > 0:
                self.bandwidth = 1 / slope
                self.latency_s = max(0.0, my - slope * mx)
                return
        self.latency_s = max(0.0, my - mx / self.bandwidth)  # one size only: keep the bandwidth, fit the latency

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bandwidth


class KVStore:
    def __init__(self, model_hash: str, config: KVStoreConfig, storage: Storage | None = None) -> None:
        if storage is not None and not config.archive_key:
            raise ValueError("a KV archive needs KVStoreConfig.archive_key (VLMQ_KV_ARCHIVE_KEY): without it anyone "
                             "who can write kv/ could make workers answer with another image's KV")
        self.model_hash, self.config = model_hash, config
        self._secret = config.archive_key or secrets.token_bytes(32)  # no archive: the disk tier's alone
        self.host = HostTier(config.host_bytes)
        self.disk = DiskTier(config.disk_dir, config.disk_bytes) if config.disk_dir and config.disk_bytes else None
        self.archive_tier = ArchiveTier(storage, model_hash, config.archive_bytes) if storage is not None else None
        self.fetch_rate = RateModel()
        self.counts = dict.fromkeys(COUNTS, 0)
        self._lock = threading.Lock()  # host and disk tiers, counters
        self._archived: OrderedDict[ItemKey, None] = OrderedDict()  # known to be in the archive (bounded LRU)
        # single-threaded torch ops (native.py): an OpenMP team here would slow the model thread's
        self._io = thread_pool(1, "vlmq-kv-io")  # demotions and uploads, in order
        self._fetch = thread_pool(2, "vlmq-kv-fetch")
        self._chain = thread_pool(CHAIN_FETCHES, "vlmq-kv-chain")

    @property
    def has_archive(self) -> bool:
        return self.archive_tier is not None

    # -- from the step loop: never blocks on storage -------------------------------------------
    def demote(self, kind: str, key: str, tensor: torch.Tensor) -> None:
        self._submit(self._demote, (kind, key), tensor)

    def archive(self, kind: str, key: str, tensor: torch.Tensor) -> None:
        if self.archive_tier is not None and (kind, key) not in self._archived:
            self._submit(self._upload, (kind, key), tensor)

    def fetch(self, kind: str, key: str, expected: Expected, use_archive: bool) -> Future:
        """Future of the item's tensor (CPU, verified) or None: a miss, a bad object or a failed store."""
        # an object is accepted only if its signed header names the key it is fetched under
        assert (expected.kind, expected.key) == (kind, key), (kind, key, expected)
        return self._fetch.submit(self._guarded, self._lookup, (kind, key), expected, use_archive)

    def fetch_chain(self, kind: str, expected: list[Expected], use_archive: bool) -> Future:
        """Future of the tensors of the longest prefix of `expected` found (each verified), in order."""
        return self._fetch.submit(self._guarded, self._lookup_chain, kind, expected, use_archive)

    def archive_seconds(self, num_bytes: int) -> float:
        """Estimated time to fetch an object of `num_bytes` from the archive (tracked online)."""
        return self.fetch_rate.seconds(num_bytes)

    def archived_bytes(self, num_bytes: int) -> int:
        """Size in the archive of an item whose tensor has `num_bytes` (quantised: ~1 byte per element)."""
        return num_bytes if not self.config.quant else num_bytes // 4 + num_bytes // 256

    def stats(self) -> dict[str, int]:
        """Flat counters: <tier>_<counter> for host, disk and archive, plus transfer counts."""
        return stats_dict(self.host, self.disk, self.archive_tier, self.counts)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every transfer submitted so far is done (tests, benchmarks, shutdown)."""
        self._io.submit(lambda: None).result(timeout)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._fetch.shutdown(wait=True, cancel_futures=True)
        self._chain.shutdown(wait=True, cancel_futures=True)

    # -- on the store's threads ----------------------------------------------------------------
    def _submit(self, fn, item: ItemKey, tensor: torch.Tensor) -> None:
        with self._lock:
            if self.counts["pending_bytes"] + tensor.nbytes > self.config.max_pending_bytes:
                self.counts["dropped_transfers"] += 1
                return
            self.counts["pending_bytes"] += tensor.nbytes
        host, landed = to_host_async(tensor)
        self._io.submit(self._guarded, fn, item, host, pending=tensor.nbytes, landed=landed)

    def _guarded(self, fn, *args, pending: int = 0, landed: Callable[[], None] | None = None):
        try:
            if landed is not None:
                landed()  # the device-to-host copy started by _submit has finished
            return fn(*args)
        except Exception:  # a failed store costs a recompute, never a request
            log.warning("KV store transfer %s failed", fn.__name__, exc_info=True)
            with self._lock:
                self.counts["transfer_errors"] += 1
            return None
        finally:
            if pending:
                with self._lock:
                    self.counts["pending_bytes"] -= pending

    def _demote(self, item: ItemKey, tensor: torch.Tensor) -> None:
        self._to_host(item, tensor)

    def _to_host(self, item: ItemKey, tensor: torch.Tensor) -> None:
        with self._lock:
            evicted = self.host.put(item, tensor)
        for old, t in evicted:  # host is full: its least recently used items go down a tier
            if self.disk is not None:
                blob = encode(old[0], old[1], self.model_hash, t, secret=self._secret)
                with self._lock:
                    self.disk.put(old, blob)
            if old[0] == "prefix":
                self._upload(old, t)

    def _upload(self, item: ItemKey, tensor: torch.Tensor) -> None:
        if self.archive_tier is None or item in self._archived:
            return
        self.archive_tier.put(item, encode(item[0], item[1], self.model_hash, tensor, self.config.quant,
                                           secret=self._secret))
        self._remember_archived(item)

    def _remember_archived(self, item: ItemKey) -> None:
        with self._lock:
            self._archived[item] = None
            self._archived.move_to_end(item)
            if len(self._archived) > MAX_REMEMBERED:
                self._archived.popitem(last=False)

    def _lookup(self, item: ItemKey, expected: Expected, use_archive: bool) -> torch.Tensor | None:
        with self._lock:
            t = self.host.get(item)
            blob = self.disk.get(item) if t is None and self.disk is not None else None
        if t is not None:
            return t
        if blob is not None and (t := self._decode(self.disk.stats, blob, expected)[0]) is not None:
            self._to_host(item, t)
            return t
        if not use_archive or self.archive_tier is None:
            return None
        t0 = time.perf_counter()
        blob = self.archive_tier.get(item)
        if blob is None:
            return None
        self.fetch_rate.add(len(blob), time.perf_counter() - t0)
        t, refusal = self._decode(self.archive_tier.stats, blob, expected)
        if t is not None:
            self._remember_archived(item)
            self._to_host(item, t)
        elif refusal != "bad_version":  # written once: a bad object would keep the good one out forever
            self.archive_tier.storage.delete(self.archive_tier.object_key(item))
            self.archive_tier.num_deleted += 1
            self._archived.pop(item, None)
        return t

    def _lookup_chain(self, kind: str, expected: list[Expected], use_archive: bool) -> list[torch.Tensor]:
        # CHAIN_FETCHES lookups in flight at once: a chain of n archived blocks costs ~n / CHAIN_FETCHES latencies
        futures = [self._chain.submit(self._guarded, self._lookup, (kind, exp.key), exp, use_archive)
                   for exp in expected]
        found = []
        for f in futures:
            t = f.result()
            if t is None:
                break
            found.append(t)
        for f in futures:
            f.cancel()
        return found

    def _decode(self, stats: TierStats, blob: bytes, expected: Expected) -> tuple[torch.Tensor | None, str]:
        """The verified tensor, or None and why it was refused (format.BadObject.reason)."""
        try:
            t = decode(blob, expected, secret=self._secret)
        except BadObject as e:
            log.warning("refused a KV object (%s %s): %s", expected.kind, expected.key[:16], e)
            stats.bad_objects += 1
            stats.misses += 1
            return None, e.reason
        stats.hits += 1
        return t, ""


def stats_dict(host: HostTier | None, disk: DiskTier | None, archive: ArchiveTier | None,
               counts: dict[str, int]) -> dict[str, int]:
    """The counters `KVStore.stats` reports (all zero for absent tiers)."""
    out: dict[str, int] = {}
    for name, tier in (("host", host), ("disk", disk), ("archive", archive)):
        st = tier.stats if tier is not None else TierStats()
        out.update({f"{name}_{f.name}": getattr(st, f.name) for f in fields(TierStats)})
        out[f"{name}_capacity_bytes"] = tier.capacity_bytes if tier is not None else 0
    out["host_used_bytes"] = host.used_bytes if host is not None else 0
    out["disk_used_bytes"] = disk.used_bytes if disk is not None else 0
    out["archive_deleted"] = archive.num_deleted if archive is not None else 0
    return {**out, **counts}


def empty_stats() -> dict[str, int]:
    return stats_dict(None, None, None, dict.fromkeys(COUNTS, 0))


def compact(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when it is a view of a bigger tensor: a cache that counts `t.nbytes` must not keep the
    rest alive (an image's encoder output sliced from its step's packed output; a block from a batch of blocks)."""
    return t.clone() if t.untyped_storage().nbytes() > t.nbytes else t


def to_host_async(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A host copy of `t` for the store's threads, started without waiting: (copy, landed).

    A CUDA tensor is copied into pinned memory on the current stream (non-blocking: the step loop does not wait);
    `landed()` blocks until the copy has finished, and must be called before the copy is read. A CPU tensor is kept
    as it is (landed None), or compacted: the host tier's byte bound counts what it holds.
    """
    if not t.is_cuda:
        return compact(t), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done.synchronize
