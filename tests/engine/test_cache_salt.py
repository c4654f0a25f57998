"""Cache isolation between tenants: a request's cache salt keeps its encoder outputs, prefix KV blocks and archived
KV apart from every request with another salt, and no salt behaves exactly as before (jobrunner.cache_salt gives
a tenant's jobs the tenant's salt unless VLMQ_TENANT_CACHE_SHARING=1).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tiny.shapes import make_split

from vlmq.settings import Settings
from vlmq.storage import FileStorage
from vlmq.workers.engine import EngineConfig, ImagePlaceholder, SamplingParams, Scheduler, Sequence
from vlmq.workers.engine.block_hash import ROOT_HASH, hash_block, seq_block_hashes
from vlmq.workers.engine.encoder_cache import make_key
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.engine.testing import FakeRunner, run_until_done
from vlmq.workers.jobrunner import cache_salt
from vlmq.workers.kvstore import KVStore, KVStoreConfig, weights_identity

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
PROMPT = list(range(100, 110)) + [7] * 12 + [1, 2, 3]  # system prompt, 12 image pad tokens at [10, 22), question
SETTINGS = {"policy": "native"}


def salted_seq(seq_id: str, salt: str | None) -> Sequence:
    # what intake builds: the salt in the image key and in the block-hash root
    img = ImagePlaceholder(make_key("pixels-of-a-cat", "m", SETTINGS, salt), 10, 12, 48)
    return Sequence(seq_id, PROMPT, images=(img,), sampling=SamplingParams(max_new_tokens=3), cache_salt=salt or "")


def test_no_salt_keeps_every_key_and_hash_as_before():
    seq = salted_seq("r", None)
    assert seq.images[0].content_hash == make_key("pixels-of-a-cat", "m", SETTINGS) == \
        make_key("pixels-of-a-cat", "m", SETTINGS, "")
    assert seq_block_hashes(seq, 4, 1) == [hash_block(ROOT_HASH, PROMPT[:4])]


def test_different_salts_share_no_block_hash_and_no_image_key():
    a, b, a2 = salted_seq("a", "tenant:a"), salted_seq("b", "tenant:b"), salted_seq("a2", "tenant:a")
    plain = salted_seq("p", None)
    ha, hb, hp = (set(seq_block_hashes(s, 4, 6)) for s in (a, b, plain))
    assert not ha & hb and not ha & hp and not hb & hp  # even the system-prompt blocks before the image
    assert seq_block_hashes(a2, 4, 6) == seq_block_hashes(a, 4, 6)
    keys = {s.images[0].content_hash for s in (a, b, plain)}
    assert len(keys) == 3 and a2.images[0].content_hash == a.images[0].content_hash


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_scheduler_reuses_blocks_and_encoder_outputs_only_within_a_salt(prefix_caching):
    # with prefix caching a hit covers the whole image (no encoder use at all); without it the encoder cache serves
    cfg = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64, long_prefill_chunk_size=64,
                       max_num_encoder_patches=96, encoder_cache_bytes=10_000, encoder_bytes_per_token=10,
                       enable_prefix_caching=prefix_caching)
    sched = Scheduler(cfg)
    runner = FakeRunner(cfg.block_size, sched.encoder_cache)
    cached = {}
    for seq in (salted_seq("a", "tenant:a"), salted_seq("b", "tenant:b"), salted_seq("a2", "tenant:a"),
                salted_seq("p", None), salted_seq("p2", None)):
        before = sched.encoder_cache.hits
        sched.add(seq)
        run_until_done(sched, runner, on_step=lambda out, s=seq: cached.setdefault(s.seq_id, s.num_cached_tokens))
        cached[seq.seq_id] = (cached[seq.seq_id], sched.encoder_cache.hits - before)
    assert cached["a"] == cached["b"] == cached["p"] == (0, 0)  # tenant b learns nothing from tenant a's request
    # a hit: the blocks before the last token (24 tokens, the image's included), or the image's encoder output
    assert cached["a2"] == cached["p2"] == ((24, 0) if prefix_caching else (0, 1))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return Path(shutil.copytree(TARGET, tmp_path_factory.mktemp("m") / "tiny-shapes"))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_engine_shares_caches_only_within_a_salt(model_dir, prefix_caching):
    example = make_split(11, 1)[0]
    engine = Engine.from_model_dir(model_dir, num_blocks=128, enable_prefix_caching=prefix_caching)
    answers, hits = [], []
    for salt in ("tenant:a", "tenant:b", "tenant:a", None, None):
        st = engine.stats
        before = (st.encoder_cache_hits, st.prefix_cache_hit_tokens)
        answers.append(engine.generate([Request(example.image, example.question, 4, cache_salt=salt)])[0].token_ids)
        hits.append((st.encoder_cache_hits - before[0], st.prefix_cache_hit_tokens - before[1]))
    assert all(a == answers[0] for a in answers)  # isolation changes speed only
    assert hits[0] == hits[1] == hits[3] == (0, 0)
    assert hits[2] == hits[4]
    # a repeat hits the prefix cache (which holds the image's KV, so no encoder use) or, without it, the encoder's
    assert hits[2][1] > 0 if prefix_caching else hits[2] == (1, 0)


def test_archived_kv_is_named_per_salt(model_dir, tmp_path):
    """Tenant b's worker finds nothing of tenant a's in the archive (its objects have other names); tenant a's
    next request on a fresh worker is served from it."""
    example = make_split(12, 1)[0]
    storage, model = FileStorage(tmp_path / "s3"), weights_identity(model_dir)

    def serve(salt: str) -> tuple[list[int], dict[str, int], set[str]]:
        before = {o.key for o in storage.list_objects("kv/")}
        config = KVStoreConfig(always_fetch=True, archive_key=b"test-archive-key-" * 2)
        store = KVStore(model, config, storage)  # a fresh worker: empty caches
        engine = Engine.from_model_dir(model_dir, num_blocks=128, kv_store=store)
        try:
            out = engine.generate([Request(example.image, example.question, 4, cache_salt=salt)])[0]
            store.flush()
            counts = dict(engine.tiers.counts, encoded=engine.stats.num_encoded_images)
        finally:
            store.close()
        return out.token_ids, counts, {o.key for o in storage.list_objects("kv/")} - before

    first, counts_a, wrote_a = serve("tenant:a")
    other, counts_b, wrote_b = serve("tenant:b")
    again, counts_a2, wrote_a2 = serve("tenant:a")
    assert first == other == again
    kinds = {key.split("/")[2] for key in wrote_a}
    assert kinds == {"enc", "prefix"} and {key.split("/")[2] for key in wrote_b} == kinds  # b archived its own
    assert counts_b["restored_images"] == counts_b["restored_blocks"] == 0 and counts_b["encoded"] == 1
    assert counts_a2["restored_images"] == 1 and counts_a2["restored_blocks"] > 0 and counts_a2["encoded"] == 0
    assert wrote_a2 == set()  # everything it needed was there


def test_a_tenants_jobs_get_the_tenants_salt_unless_the_pool_shares():
    isolated, shared = Settings(), Settings(tenant_cache_sharing=True)
    job = "acme.0123456789abcdef0123456789abcdef"
    assert cache_salt(job, isolated) == "tenant:acme" != cache_salt("bob." + job[5:], isolated)
    assert cache_salt(job[5:], isolated) is None  # untenanted: today's shared caches
    assert cache_salt(job, shared) is None
