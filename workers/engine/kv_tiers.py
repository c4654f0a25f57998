"""The engine's side of the KV tiers (vlmq.workers.kvstore): demote on eviction, fetch or recompute at admission.

- An encoder output evicted from the encoder cache, or a cached prefix block about to be overwritten, is handed
  to the store (host memory, then disk and the archive) instead of being dropped. Block KV is copied out right
  after schedule(), before the step's forward can overwrite it.
- Every newly computed encoder output is written through to the archive (once; other workers read it).
- A prepared request is parked while its missing encoder outputs and prefix blocks are looked up on the store's
  threads. For the archive it first weighs fetch time (bytes / bandwidth + first-byte latency, measured online)
  against recompute time (patches and prefill tokens at this worker's measured rates) and skips the archive when
  recomputing is cheaper. A parked request joins the scheduler when its lookups finish, or at its deadline
  (twice the recompute estimate): a late, failed or refused fetch is a recompute, never a failed request.
  Restored items were verified on decode (key, model, shape, dtype, checksum) and land as cache hits.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from vlmq.workers.kvstore.format import Expected
from vlmq.workers.kvstore.store import CHAIN_FETCHES, KVStore

from .block_hash import seq_block_hashes
from .encoder_cache import encoder_output_width
from .intake import Prepared


@dataclass(slots=True)
class _Parked:
    prepared: Prepared
    deadline: float
    enc: dict[str, Future] = field(default_factory=dict)  # image key -> tensor or None
    blocks: list[bytes] = field(default_factory=list)  # hashes of the blocks looked up, in order
    chain: Future | None = None  # -> their tensors found, in order

    def done(self) -> bool:
        return all(f.done() for f in self.enc.values()) and (self.chain is None or self.chain.done())


class _Rate:
    """Work per second, as an exponential moving average of measured steps (None until measured)."""

    def __init__(self) -> None:
        self.per_s: float | None = None

    def add(self, work: int, seconds: float) -> None:
        if work > 0 and seconds > 0:
            r = work / seconds
            self.per_s = r if self.per_s is None else 0.8 * self.per_s + 0.2 * r

    def seconds(self, work: int) -> float | None:
        return None if self.per_s is None else work / self.per_s


class KVTiers:
    def __init__(self, store: KVStore, scheduler, runner, dtype: torch.dtype) -> None:
        self.store, self.scheduler, self.runner, self.dtype = store, scheduler, runner, dtype
        self.cache, self.bm = scheduler.encoder_cache, scheduler.block_manager
        self.cache.on_evict = lambda key, value: store.demote("enc", key, value)
        self.bm.on_evict = lambda block_id, h: self._evicted.append((block_id, h))
        self._evicted: list[tuple[int, bytes]] = []
        self.parked: dict[str, _Parked] = {}
        self.encode_rate, self.prefill_rate = _Rate(), _Rate()
        self._timings = dict(runner.timings)
        self.wake = lambda: None  # called (on a store thread) when a lookup of a parked request finishes
        self.counts = dict.fromkeys(("restored_images", "restored_blocks", "fetch_late", "fetch_skipped",
                                     "archive_fetches"), 0)

    # -- around a step ------------------------------------------------------------------------
    def before_execute(self) -> None:
        """Copy out the KV of cached blocks that schedule() just evicted, before the forward overwrites it."""
        if not self._evicted:
            return
        evicted, self._evicted = self._evicted, []
        ids = torch.tensor([b for b, _ in evicted], device=self.runner.device)
        kv = read_blocks(self.runner.kv_caches, ids)  # [layers, 2, n, block, heads, dim]
        for i, (_, h) in enumerate(evicted):
            self.store.demote("prefix", h.hex(), kv[:, :, i])

    def after_execute(self, out) -> None:
        for enc in out.encoder_inputs:
            if enc.key in self.cache and self.cache.entries[enc.key].ready:
                self.store.archive("enc", enc.key, self.cache.get(enc.key))
        for s in out.scheduled:
            self._archive_image_chain(s.seq, s.start, s.start + s.num_new_tokens)
        t = self.runner.timings
        self.encode_rate.add(out.num_encoder_patches, t["encode"] - self._timings["encode"])
        if out.num_scheduled_tokens > len(out.scheduled):  # prefill work in it, not only decodes
            self.prefill_rate.add(out.num_scheduled_tokens, t["forward"] - self._timings["forward"])
        self._timings = dict(t)

    def _archive_image_chain(self, seq, start: int, end: int) -> None:
        # The chunk that completes an image's KV: write the full blocks up to the image's end through to the
        # archive (a new question on the image reuses them). Blocks taken from the prefix cache are not rewritten.
        bs = self.bm.block_size
        for img in seq.images:
            if not (start < img.end <= end) or not self.bm.enable_prefix_caching:
                continue
            first, last = seq.num_cached_tokens // bs, min(img.end // bs, len(seq.block_table))
            if first >= last:
                continue
            hashes = seq_block_hashes(seq, bs, last)
            ids = torch.tensor(seq.block_table[first:last], device=self.runner.device)
            kv = read_blocks(self.runner.kv_caches, ids)  # [layers, 2, n, block, heads, dim]
            for i in range(last - first):
                self.store.archive("prefix", hashes[first + i].hex(), kv[:, :, i])

    # -- admission ----------------------------------------------------------------------------
    def park(self, request_id: str, prepared: Prepared) -> bool:
        """Start the lookups `prepared` needs; False if it needs none (it joins the scheduler now)."""
        seq, now = prepared.seq, time.perf_counter()
        p = _Parked(prepared, now)
        missing = [img for img in seq.images if img.content_hash not in self.cache]
        for img in missing:
            shape = (img.num_tokens, encoder_output_width(self.runner.model))
            recompute = self.encode_rate.seconds(img.num_patches)
            use_archive = self._worth_fetching(shape, recompute, 1)
            p.enc[img.content_hash] = self.store.fetch("enc", img.content_hash, self._expect("enc", img.content_hash,
                                                       shape), use_archive)
            p.deadline = max(p.deadline, self._deadline(now, recompute, shape, 1))
        self._park_blocks(p, now)
        if not p.enc and p.chain is None:
            return False
        self.parked[request_id] = p
        for f in [*p.enc.values(), *([p.chain] if p.chain else [])]:
            f.add_done_callback(lambda _: self.wake())
        return True

    def _park_blocks(self, p: _Parked, now: float) -> None:
        seq, bs = p.prepared.seq, self.bm.block_size
        if not self.bm.enable_prefix_caching:
            return
        hashes = seq_block_hashes(seq, bs, (seq.num_tokens - 1) // bs)
        first = next((i for i, h in enumerate(hashes) if h not in self.bm.hash_to_block), len(hashes))
        p.blocks = hashes[first:]
        if not p.blocks:
            return
        k = self.runner.kv_caches[0][0]  # [num_blocks, block, heads, dim]
        shape = (len(self.runner.kv_caches), 2, *k.shape[1:])
        recompute = self.prefill_rate.seconds(len(p.blocks) * bs)
        use_archive = self._worth_fetching(shape, recompute, len(p.blocks))
        p.chain = self.store.fetch_chain("prefix", [self._expect("prefix", h.hex(), shape) for h in p.blocks],
                                         use_archive)
        p.deadline = max(p.deadline, self._deadline(now, recompute, shape, len(p.blocks)))

    def _deadline(self, now: float, recompute_s: float | None, shape: tuple[int, ...], num_objects: int) -> float:
        # Twice the recompute estimate; before this worker has measured its rates, twice the fetch estimate + 1 s.
        if recompute_s is not None:
            return now + 2 * recompute_s + self.store.config.wait_grace_s
        return now + 2 * self._fetch_seconds(shape, num_objects) + 1.0

    def _fetch_seconds(self, shape: tuple[int, ...], num_objects: int) -> float:
        # n objects, CHAIN_FETCHES at a time: ceil(n / CHAIN_FETCHES) first-byte latencies + the bytes over the
        # bandwidth (one stream's: parallel streams are not assumed to add bandwidth)
        nbytes = self.store.archived_bytes(num_objects * torch.Size(shape).numel() * self.dtype.itemsize)
        waves = -(-num_objects // CHAIN_FETCHES)
        return self.store.archive_seconds(nbytes) + (waves - 1) * self.store.fetch_rate.latency_s

    def _expect(self, kind: str, key: str, shape: tuple[int, ...]) -> Expected:
        return Expected(kind, key, self.store.model_hash, tuple(shape), self.dtype)

    def _worth_fetching(self, shape: tuple[int, ...], recompute_s: float | None, num_objects: int) -> bool:
        if not self.store.has_archive:
            return False
        use = (recompute_s is None or self.store.config.always_fetch
               or self._fetch_seconds(shape, num_objects) < recompute_s)
        self.counts["archive_fetches" if use else "fetch_skipped"] += 1
        return use

    def ready(self) -> list[tuple[str, Prepared]]:
        """Parked requests whose lookups are done or past their deadline, with what was found installed."""
        now, out = time.perf_counter(), []
        for request_id, p in list(self.parked.items()):
            if p.done() or now >= p.deadline:
                del self.parked[request_id]
                self.counts["fetch_late"] += not p.done()
                self._install(p)
                out.append((request_id, p.prepared))
        return out

    def drop(self, request_id: str) -> bool:
        return self.parked.pop(request_id, None) is not None

    def seconds_to_deadline(self) -> float | None:
        if not self.parked:
            return None
        return max(0.0, min(p.deadline for p in self.parked.values()) - time.perf_counter())

    def _install(self, p: _Parked) -> None:
        seq = p.prepared.seq
        for img in seq.images:
            f = p.enc.get(img.content_hash)
            if f is not None and f.done() and (t := f.result()) is not None:
                value = t.to(self.runner.device, self.dtype, non_blocking=True)  # async from pinned host memory
                nbytes = img.num_tokens * self.scheduler.config.encoder_bytes_per_token
                if self.cache.insert(img.content_hash, value, nbytes):
                    self.counts["restored_images"] += 1
        if p.chain is None or not p.chain.done():
            return
        for h, kv in zip(p.blocks, p.chain.result() or [], strict=False):
            block_id = self.bm.install_cached(h)
            if block_id is None:
                break
            self.before_execute()  # the install may have evicted a cached block: copy it out first
            write_block(self.runner.kv_caches, block_id, kv.to(self.runner.device, self.dtype, non_blocking=True))
            self.counts["restored_blocks"] += 1


def read_blocks(kv_caches, ids: torch.Tensor) -> torch.Tensor:
    """KV of blocks `ids` [n]: [layers, 2, n, block, heads, dim], a copy (later writes do not change it)."""
    return torch.stack([torch.stack([k.index_select(0, ids), v.index_select(0, ids)]) for k, v in kv_caches])


def write_block(kv_caches, block_id: int, kv: torch.Tensor) -> None:
    """Write one block's KV, kv: [layers, 2, block, heads, dim]."""
    for layer, (k, v) in enumerate(kv_caches):
        k[block_id].copy_(kv[layer, 0])
        v[block_id].copy_(kv[layer, 1])
