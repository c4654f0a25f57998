"""The engine with KV tiers on the bundled model: bad archive objects cost a recompute, never an answer or a step.

Every kind of bad object sits in the archive under the exact key an incoming request looks up (its image's
encoder output and its first prefix block): each is refused, counted, and the request is answered by recomputing,
with the answer a cold engine gives.
"""
from __future__ import annotations

import pickle
import shutil
import threading
from pathlib import Path

import pytest
import torch
from tiny.shapes import make_split

from vlmq import keys
from vlmq.errors import BackendError
from vlmq.storage import FileStorage
from vlmq.workers.engine.block_hash import seq_block_hashes
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.kvstore import KVStore, KVStoreConfig, weights_identity
from vlmq.workers.kvstore.format import encode

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
MAX_NEW = 16
ARCHIVE_KEY = b"test-archive-key-" * 2  # the pool's VLMQ_KV_ARCHIVE_KEY in these tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return Path(shutil.copytree(TARGET, tmp_path_factory.mktemp("m") / "tiny-shapes"))


def bad_blobs(kind: str, key: str, model: str, good: torch.Tensor) -> list[bytes]:
    """Truncated, corrupt (its tag fails), wrong shape, another model's, a pickle: one of each."""
    blob = encode(kind, key, model, good, secret=ARCHIVE_KEY)
    corrupt = bytearray(blob)
    corrupt[-3] ^= 0xFF
    return [blob[:-11], bytes(corrupt), encode(kind, key, model, good[:-1], secret=ARCHIVE_KEY),
            encode(kind, key, "0" * 32, good, secret=ARCHIVE_KEY),
            pickle.dumps(good.numpy())]


def test_bad_archive_objects_are_counted_misses_and_recomputed(model_dir, tmp_path):
    requests = [Request(e.image, e.question, MAX_NEW) for e in make_split(9, 5)]
    cold = Engine.from_model_dir(model_dir, num_blocks=256)
    expected = [o.token_ids for o in cold.generate(requests)]
    model, storage = weights_identity(model_dir), FileStorage(tmp_path / "s3")
    hidden = cold.runner.model.config.text_config.hidden_size
    k = cold.runner.kv_caches[0][0]
    block_shape = (len(cold.runner.kv_caches), 2, *k.shape[1:])
    for i, req in enumerate(requests):  # request i finds bad object i under both of its keys
        seq = cold.preprocessor(f"r{i}", req).seq
        img, h = seq.images[0], seq_block_hashes(seq, 16, 1)[0].hex()
        enc_blob = bad_blobs("enc", img.content_hash, model, torch.randn(img.num_tokens, hidden))[i]
        block_blob = bad_blobs("prefix", h, model, torch.randn(block_shape))[i]
        storage.put(keys.kv_object(model, "enc", img.content_hash), enc_blob)
        storage.put(keys.kv_object(model, "prefix", h), block_blob)
    store = KVStore(model, KVStoreConfig(always_fetch=True, archive_key=ARCHIVE_KEY), storage)
    engine = Engine.from_model_dir(model_dir, num_blocks=256, kv_store=store)
    try:
        outputs = engine.generate(requests)
        assert [o.token_ids for o in outputs] == expected and all(o.error is None for o in outputs)
        stats = store.stats()
        assert stats["archive_bad_objects"] == 2 * len(requests) and stats["archive_hits"] == 0
        assert stats["transfer_errors"] == 0  # refused, not crashed
        assert engine.stats.num_encoded_images == len(requests)  # every image recomputed
        assert engine.tiers.counts["restored_images"] == engine.tiers.counts["restored_blocks"] == 0
        store.flush()
    finally:
        store.close()
    # the bad objects were deleted and the recomputed items archived in their place: another worker reads them
    store = KVStore(model, KVStoreConfig(always_fetch=True, archive_key=ARCHIVE_KEY), storage)
    warm = Engine.from_model_dir(model_dir, num_blocks=256, kv_store=store)
    try:
        assert [o.token_ids for o in warm.generate(requests)] == expected
        assert store.stats()["archive_bad_objects"] == 0 and warm.tiers.counts["restored_images"] == len(requests)
        assert warm.stats.num_encoded_images == 0
    finally:
        store.close()


class GatedStorage(FileStorage):
    """Fault injection around a real file store: reads wait for `gate` (an archive that answers late), or fail."""

    def __init__(self, root, fail: bool = False) -> None:
        super().__init__(root)
        self.gate, self.fail = threading.Event(), fail

    def get(self, key: str) -> bytes:
        if self.fail:
            raise BackendError("object store unreachable (injected)")
        self.gate.wait(30)
        return super().get(key)


@pytest.mark.parametrize("fault", ["late", "failed"])
def test_a_late_or_failed_fetch_is_a_recompute(model_dir, tmp_path, fault):
    requests = [Request(e.image, e.question, MAX_NEW) for e in make_split(9, 3)]
    model = weights_identity(model_dir)
    filled = KVStore(model, KVStoreConfig(archive_key=ARCHIVE_KEY), FileStorage(tmp_path / "s3"))
    first = Engine.from_model_dir(model_dir, num_blocks=256, kv_store=filled)
    expected = [o.token_ids for o in first.generate(requests)]
    filled.close()  # the archive now holds every image's encoder output and prefix chain
    storage = GatedStorage(tmp_path / "s3", fail=fault == "failed")
    store = KVStore(model, KVStoreConfig(always_fetch=True, archive_key=ARCHIVE_KEY), storage)
    engine = Engine.from_model_dir(model_dir, num_blocks=256, kv_store=store)
    try:
        assert [o.token_ids for o in engine.generate(requests)] == expected
        assert engine.stats.num_encoded_images == len(requests)  # recomputed, not restored
        if fault == "late":
            assert engine.tiers.counts["fetch_late"] == len(requests)
        else:
            assert store.stats()["transfer_errors"] > 0
    finally:
        storage.gate.set()
        store.close()


def test_a_wider_encoder_output_is_restored_from_the_archive(tmp_path):
    # Qwen3-VL keeps DeepStack features beside each image token's input embedding: its encoder outputs are wider
    # than the LM's hidden size, and an archived one must be looked up with that width to be restored
    from tiny.qwen3_vl import build  # noqa: PLC0415 - only this test builds the checkpoint

    model_dir = build(tmp_path / "qwen3")
    (example,) = make_split(7, 1)
    request = Request(example.image, example.question, 4)
    model, storage = weights_identity(model_dir), FileStorage(tmp_path / "s3")
    answers = []
    for _ in range(2):  # the first worker computes and archives, the second restores
        store = KVStore(model, KVStoreConfig(always_fetch=True, archive_key=ARCHIVE_KEY), storage)
        engine = Engine.from_model_dir(model_dir, num_blocks=64, kv_store=store, enable_prefix_caching=False)
        try:
            answers.append(engine.generate([request])[0].token_ids)
            store.flush()
        finally:
            store.close()
    assert engine.runner.model.encoder_output_width > engine.runner.model.config.text_config.hidden_size
    assert answers[0] == answers[1] and store.stats()["archive_bad_objects"] == 0
    assert engine.tiers.counts["restored_images"] == 1 and engine.stats.num_encoded_images == 0


def test_the_archive_is_skipped_when_recomputing_is_measured_cheaper(model_dir, tmp_path):
    # The decision rule of every archive lookup: fetch while this worker has no rates yet; once it has, fetch only
    # when bytes / bandwidth + first-byte latency beat the recompute estimate; always_fetch overrides it.
    store = KVStore(weights_identity(model_dir), KVStoreConfig(archive_key=ARCHIVE_KEY), FileStorage(tmp_path / "s3"))
    engine = Engine.from_model_dir(model_dir, num_blocks=64, kv_store=store)
    try:
        tiers, shape = engine.tiers, (64, 128)  # an encoder output of 64 tokens: 32 KiB
        assert tiers._worth_fetching(shape, None, 1)  # no rates measured yet
        store.fetch_rate.latency_s, store.fetch_rate.bandwidth = 0.2, 1e9  # a slow first byte
        assert not tiers._worth_fetching(shape, 0.05, 1)  # recomputing in 50 ms beats 200 ms to the first byte
        assert tiers._worth_fetching(shape, 0.5, 1)
        store.fetch_rate.latency_s, store.fetch_rate.bandwidth = 0.001, 1e4  # fast first byte, 10 kB/s
        assert not tiers._worth_fetching(shape, 0.5, 1)  # 3.3 s of transfer
        assert tiers.counts["fetch_skipped"] == 2 and tiers.counts["archive_fetches"] == 2
        store.config.always_fetch = True
        assert tiers._worth_fetching(shape, 0.05, 1)
    finally:
        engine.close()
        store.close()


def test_a_fresh_engine_does_not_keep_the_old_kv_cache(model_dir, tmp_path):
    # Recovery replaces a failed engine while the caller still holds it: its KV cache must be free by then (on a
    # GPU sized by kv_cache_memory_fraction there is no room for two), tiers or not.
    import gc
    import weakref

    store = KVStore(weights_identity(model_dir), KVStoreConfig(archive_key=ARCHIVE_KEY), FileStorage(tmp_path / "s3"))
    old = Engine.from_model_dir(model_dir, num_blocks=64, kv_store=store)
    kv = weakref.ref(old.runner.kv_caches[0][0])
    new = old.fresh()
    gc.collect()
    try:
        assert kv() is None and new.tiers is not None and new.tiers.store is store
    finally:
        new.close()
        store.close()
