"""The KV archive object format and the store's tiers: round trips, refusals, byte bounds.

A bad object (truncated, corrupt, wrong checksum, wrong shape, another model's, another key's, a pickle) is
refused with a reason and, through the store, counted as a miss: never returned, never raised.
"""
from __future__ import annotations

import hashlib
import pickle
import struct

import msgpack
import pytest
import torch

from vlmq import keys
from vlmq.storage import FileStorage
from vlmq.workers.kvstore.format import MAGIC, BadObject, Expected, decode, encode, read_header
from vlmq.workers.kvstore.store import KVStore, KVStoreConfig, RateModel

MODEL = "m" * 32
EMB = torch.randn(7, 24)  # an encoder output [tokens, hidden]
KV = torch.randn(3, 2, 4, 2, 8, dtype=torch.bfloat16)  # a block [layers, K|V, block, heads, dim]
ARCHIVE_KEY = b"test-archive-key-" * 2  # the pool's VLMQ_KV_ARCHIVE_KEY in these tests


def expect(kind: str = "enc", key: str = "k1", t: torch.Tensor = EMB, model: str = MODEL) -> Expected:
    return Expected(kind, key, model, tuple(t.shape), t.dtype)


@pytest.mark.parametrize(("kind", "t"), [("enc", EMB), ("prefix", KV), ("enc", EMB.half())])
def test_lossless_round_trip_is_bit_exact(kind: str, t: torch.Tensor) -> None:
    assert torch.equal(decode(signed(kind, "k1", MODEL, t), expect(kind, "k1", t), secret=ARCHIVE_KEY), t)


@pytest.mark.parametrize(("quant", "max_rel"), [("int8", 1 / 254), ("fp8", 1 / 16)])
def test_quantised_round_trip_is_close_and_smaller(quant: str, max_rel: float) -> None:
    t = torch.randn(64, 256)
    blob = encode("enc", "k1", MODEL, t, quant, secret=ARCHIVE_KEY)
    back = decode(blob, expect(t=t), secret=ARCHIVE_KEY)
    scale = t.abs().amax(-1, keepdim=True)  # one scale per token
    assert ((back - t).abs() <= scale * max_rel + 1e-6).all()
    assert len(blob) < t.nbytes / 3


def signed(kind: str, key: str, model: str, t: torch.Tensor) -> bytes:
    return encode(kind, key, model, t, secret=ARCHIVE_KEY)


def rekeyed(blob: bytes, key: str) -> bytes:
    """`blob` with only its header's key changed: what anyone who can write kv/ can make (issue 36 item 3)."""
    header, _ = read_header(blob)
    raw = msgpack.packb({**header, "key": key})
    (n,) = struct.unpack_from("<I", blob, len(MAGIC))
    return MAGIC + struct.pack("<I", len(raw)) + raw + blob[len(MAGIC) + 4 + n:]


def format_1(t: torch.Tensor) -> bytes:
    """An object as format 1 wrote it: a payload checksum anyone can compute, no tag."""
    payload = t.contiguous().view(torch.uint8).numpy().tobytes()
    header = {"format": 1, "kind": "enc", "key": "k1", "model": MODEL, "layout": "enc: embeds [tokens, hidden]",
              "dtype": "float32", "shape": list(t.shape), "quant": "", "tensors": [["data", "float32", list(t.shape)]],
              "checksum": hashlib.sha256(payload).hexdigest()}
    raw = msgpack.packb(header)
    return MAGIC + struct.pack("<I", len(raw)) + raw + payload


def bad_objects() -> dict[str, tuple[bytes, str]]:
    good = signed("enc", "k1", MODEL, EMB)
    flipped = bytearray(good)
    flipped[-40] ^= 0x40
    return {
        "truncated": (good[:-9], "unauthenticated"),
        "truncated header": (good[:20], "truncated"),
        "corrupt payload": (bytes(flipped), "unauthenticated"),
        "another item's object with this key in its header": (rekeyed(signed("enc", "k2", MODEL, EMB * 2), "k1"),
                                                              "unauthenticated"),
        "signed with another pool's key": (encode("enc", "k1", MODEL, EMB, secret=b"x" * 32), "unauthenticated"),
        "format 1 (checksum, no tag)": (format_1(EMB), "old_version"),
        "wrong shape": (signed("enc", "k1", MODEL, torch.randn(6, 24)), "bad_shape"),
        "wrong dtype": (signed("enc", "k1", MODEL, EMB.half()), "bad_shape"),
        "other model": (signed("enc", "k1", "x" * 32, EMB), "other_model"),
        "other key": (signed("enc", "k2", MODEL, EMB), "wrong_key"),
        "pickle": (pickle.dumps({"data": EMB.numpy()}), "not_archive"),
        "garbage header": (MAGIC + struct.pack("<I", 4) + b"\xc1\xc1\xc1\xc1", "bad_header"),
    }


@pytest.mark.parametrize("name", list(bad_objects()))
def test_bad_objects_are_refused_with_a_reason(name: str) -> None:
    blob, reason = bad_objects()[name]
    with pytest.raises(BadObject) as err:
        decode(blob, expect(), secret=ARCHIVE_KEY)
    assert err.value.reason == reason


def test_store_counts_bad_archive_objects_as_misses(tmp_path) -> None:
    storage = FileStorage(tmp_path / "s3")
    store = KVStore(MODEL, KVStoreConfig(host_bytes=1 << 20, archive_key=ARCHIVE_KEY), storage)
    try:
        for i, (blob, _) in enumerate(bad_objects().values()):
            storage.put(keys.kv_object(MODEL, "enc", f"k{i}"), blob.replace(b"k1", f"k{i}".encode()[:2]))
            assert store.fetch("enc", f"k{i}", expect(key=f"k{i}"), use_archive=True).result(10) is None
        stats = store.stats()
        assert stats["archive_bad_objects"] == len(bad_objects()) and stats["archive_hits"] == 0
        assert stats["host_used_bytes"] == 0  # nothing refused was promoted
    finally:
        store.close()


def test_an_archive_needs_its_key_and_a_format_1_object_makes_room_for_a_signed_one(tmp_path) -> None:
    storage = FileStorage(tmp_path / "s3")
    with pytest.raises(ValueError, match="VLMQ_KV_ARCHIVE_KEY"):
        KVStore(MODEL, KVStoreConfig(), storage)
    name = keys.kv_object(MODEL, "enc", "k1")
    storage.put(name, format_1(EMB))  # written before objects were signed: never read, deleted
    for _ in range(2):  # the second store is a fresh worker reading what the first archived
        store = KVStore(MODEL, KVStoreConfig(host_bytes=1 << 20, archive_key=ARCHIVE_KEY), storage)
        try:
            found = store.fetch("enc", "k1", expect(), use_archive=True).result(10)
            if found is None:
                assert not storage.exists(name) and store.stats()["archive_bad_objects"] == 1
                store.archive("enc", "k1", EMB)
                store.flush()
            else:
                assert torch.equal(found, EMB) and store.stats()["archive_hits"] == 1
        finally:
            store.close()
    assert torch.equal(decode(storage.get(name), expect(), secret=ARCHIVE_KEY), EMB)


def test_demoted_items_flow_host_disk_archive_within_their_budgets(tmp_path) -> None:
    item = 7 * 24 * 4
    blob = len(signed("prefix", "b000", MODEL, torch.randn(7, 24)))
    storage = FileStorage(tmp_path / "s3")
    config = KVStoreConfig(host_bytes=3 * item, disk_dir=str(tmp_path / "disk"), disk_bytes=4 * blob,
                           archive_bytes=12 * blob, archive_key=ARCHIVE_KEY)
    store = KVStore(MODEL, config, storage)
    num_items = 5 * (3 + 4 + 12)  # a workload 5x larger than all tiers together
    tensors = {f"b{i:03d}": torch.randn(7, 24) for i in range(num_items)}
    try:
        for key, t in tensors.items():
            store.demote("prefix", key, t)  # prefix blocks reach the archive when they leave host
            store.flush()
            st = store.stats()
            assert st["host_used_bytes"] <= config.host_bytes and st["disk_used_bytes"] <= config.disk_bytes
            total = sum(o.size for o in storage.list_objects(keys.KV_ROOT))
            assert total <= config.archive_bytes
        assert store.stats()["archive_deleted"] > 0  # the oldest were deleted to hold the bound
        newest = f"b{num_items - 1:03d}"  # in host: a hit there; an older one from disk; one from the archive
        assert torch.equal(store.fetch("prefix", newest, expect("prefix", newest), True).result(10), tensors[newest])
        on_disk = next(k for k in tensors if ("prefix", k) in store.disk.sizes)
        assert torch.equal(store.fetch("prefix", on_disk, expect("prefix", on_disk), True).result(10),
                           tensors[on_disk])
        in_archive = next(k for k in sorted(tensors, reverse=True)
                          if ("prefix", k) not in store.disk.sizes and ("prefix", k) not in store.host.items
                          and storage.exists(keys.kv_object(MODEL, "prefix", k)))
        assert torch.equal(store.fetch("prefix", in_archive, expect("prefix", in_archive), True).result(10),
                           tensors[in_archive])
        st = store.stats()
        assert st["host_hits"] >= 1 and st["disk_hits"] == 1 and st["archive_hits"] == 1
    finally:
        store.close()


def test_a_demoted_block_sliced_from_a_batch_holds_only_its_own_bytes() -> None:
    # The engine copies evicted blocks out as one [layers, 2, n, block, heads, dim] tensor and demotes block i as
    # a view of it: a view kept as is would keep all n blocks alive while the host tier counted one.
    batch = torch.randn(3, 2, 16, 4, 2, 8)
    store = KVStore(MODEL, KVStoreConfig(host_bytes=1 << 20))
    try:
        store.demote("prefix", "b0", batch[:, :, 0])
        store.flush()
        held = store.host.items[("prefix", "b0")]
        assert torch.equal(held, batch[:, :, 0])
        assert held.untyped_storage().nbytes() == held.nbytes == store.stats()["host_used_bytes"]
    finally:
        store.close()


def test_fetch_time_model_learns_latency_and_bandwidth() -> None:
    rate = RateModel()
    for nbytes in (1_000, 1_000_000, 4_000_000, 10_000):
        rate.add(nbytes, 0.005 + nbytes / 50e6)  # 5 ms to the first byte, then 50 MB/s
    assert rate.latency_s == pytest.approx(0.005, rel=1e-6) and rate.bandwidth == pytest.approx(50e6, rel=1e-6)
    assert rate.seconds(2_000_000) == pytest.approx(0.045, rel=1e-6)
