import pytest

from vlmq.workers.engine import EngineConfig, ImagePlaceholder, SamplingParams, Scheduler, Sequence
from vlmq.workers.engine.encoder_cache import EncoderCache, make_key
from vlmq.workers.engine.errors import RequestRejected
from vlmq.workers.engine.testing import FakeRunner, check_step, reference_completion, run_until_done


def test_make_key_is_canonical_and_exact():
    key = make_key("px1", "qwen2-vl-2b", {"min_pixels": 3136, "max_pixels": 1003520, "size": [1, 2]})
    assert key == make_key("px1", "qwen2-vl-2b", {"size": (1, 2), "max_pixels": 1003520.0, "min_pixels": 3136})
    assert len({key,
                make_key("px2", "qwen2-vl-2b", {"min_pixels": 3136, "max_pixels": 1003520, "size": [1, 2]}),
                make_key("px1", "qwen2-vl-7b", {"min_pixels": 3136, "max_pixels": 1003520, "size": [1, 2]}),
                make_key("px1", "qwen2-vl-2b", {"min_pixels": 3136, "max_pixels": 12845056, "size": [1, 2]})}) == 4
    with pytest.raises(ValueError, match="not JSON-like"):
        make_key("px1", "m", {"resample": object()})


def filled(cache: EncoderCache, key: str, num_bytes: int, holder: object) -> None:
    cache.reserve(key, num_bytes, holder)
    cache.put(key, f"tensor:{key}")


def test_hits_misses_and_values():
    cache = EncoderCache(capacity_bytes=100)
    filled(cache, "a", 40, holder=1)
    assert cache.get("a") == "tensor:a" and "a" in cache
    cache.acquire("a", holder=2)
    assert (cache.hits, cache.misses) == (1, 1)
    cache.reserve("b", 10, holder=3)
    with pytest.raises(LookupError, match="has not put it yet"):
        cache.get("b")
    with pytest.raises(KeyError):
        cache.acquire("zzz", holder=1)


def test_lru_eviction_of_unreferenced_entries_within_byte_bound():
    cache = EncoderCache(capacity_bytes=100)
    for key, holder in (("a", 1), ("b", 2), ("c", 3)):
        filled(cache, key, 30, holder)
    cache.release_all(2)  # b unreferenced first, then a: b is least recently released
    cache.release_all(1)
    filled(cache, "d", 30, holder=4)  # 120 > 100: evicts b only
    assert set(cache.entries) == {"a", "c", "d"} and cache.num_used_bytes == 90
    assert not cache.can_reserve(50, keep=["a"])  # a is the only evictable entry; keeping it leaves 10 bytes
    assert cache.can_reserve(40)
    filled(cache, "e", 40, holder=5)  # evicts a
    assert set(cache.entries) == {"c", "d", "e"} and cache.num_evictions == 2
    assert not cache.can_reserve(1)  # everything left is referenced
    with pytest.raises(MemoryError):
        cache.reserve("f", 1, holder=6)
    assert cache.num_used_bytes <= cache.capacity_bytes


def test_acquire_protects_an_entry_from_eviction():
    cache = EncoderCache(capacity_bytes=50)
    filled(cache, "a", 30, holder=1)
    cache.release("a", 1)
    cache.acquire("a", holder=2)
    assert not cache.can_reserve(30)
    cache.release("a", 2)
    assert cache.can_reserve(30)


def test_released_before_computed_is_dropped_and_late_put_ignored():
    cache = EncoderCache(capacity_bytes=50)
    cache.reserve("a", 30, holder=1)
    cache.release_all(1)  # e.g. the request was aborted before the runner ran
    assert "a" not in cache and cache.num_used_bytes == 0
    cache.put("a", "late")
    assert "a" not in cache


def image_seq(seq_id, image_key, question):
    prompt = [1, 2, 3] + [9] * 8 + question
    return Sequence(seq_id, prompt, images=(ImagePlaceholder(image_key, 3, 8, 32),),
                    sampling=SamplingParams(max_new_tokens=3))


def test_scheduler_encodes_a_shared_image_once_and_counts_hits():
    cfg = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64, long_prefill_chunk_size=32,
                       max_num_encoder_patches=64, encoder_cache_bytes=1000, encoder_bytes_per_token=10,
                       enable_prefix_caching=False)
    sched = Scheduler(cfg)
    runner = FakeRunner(cfg.block_size, sched.encoder_cache)
    seqs = [image_seq(0, "cat", [4, 5]), image_seq(1, "cat", [6]), image_seq(2, "dog", [4, 5])]
    for s in seqs:
        sched.add(s)
    outs = []
    done = run_until_done(sched, runner, on_step=lambda out: (check_step(sched, out), outs.append(out)))
    assert sorted(e.key for out in outs for e in out.encoder_inputs) == ["cat", "dog"]
    assert runner.num_encoded_images == 2
    assert (sched.encoder_cache.hits, sched.encoder_cache.misses) == (1, 2)
    assert sum(out.num_encoder_cache_hits for out in outs) == 1
    assert all(done[s.seq_id] == reference_completion(s) for s in seqs)
    later = image_seq(3, "dog", [7])  # the entry outlives its requests (unreferenced, not evicted)
    sched.add(later)
    run_until_done(sched, runner)
    assert runner.num_encoded_images == 2 and sched.encoder_cache.hits == 2


def test_scheduler_rejects_an_image_bigger_than_the_encoder_cache():
    sched = Scheduler(EngineConfig(encoder_cache_bytes=70, encoder_bytes_per_token=10))
    with pytest.raises(RequestRejected, match="raise encoder_cache_bytes") as e:
        sched.add(image_seq(0, "cat", [4]))
    assert e.value.code == "image_too_large"


def test_an_image_repeated_in_one_prompt_does_not_stall_a_small_encoder_cache():
    # The cache fits one image's output; the prompt shows "a", then "b", then "a" again.
    cfg = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64, long_prefill_chunk_size=64,
                       max_num_encoder_patches=64, encoder_cache_bytes=80, encoder_bytes_per_token=10)
    img = [ImagePlaceholder(k, off, 8, 32) for k, off in (("a", 2), ("b", 12), ("a", 22))]
    seq = Sequence(0, [1, 2] + [9] * 8 + [3, 4] + [9] * 8 + [5, 6] + [9] * 8 + [7], images=tuple(img),
                   sampling=SamplingParams(max_new_tokens=2))
    sched = Scheduler(cfg)
    runner = FakeRunner(cfg.block_size, sched.encoder_cache)
    sched.add(seq)
    keys = []
    done = run_until_done(sched, runner, max_steps=20,
                          on_step=lambda out: (check_step(sched, out), keys.extend(e.key for e in out.encoder_inputs)))
    assert keys == ["a", "b", "a"]  # "a" was evicted to make room for "b", so it is encoded again
    assert done[0] == reference_completion(seq)


def test_the_same_image_twice_in_one_chunk_is_encoded_once():
    cfg = EngineConfig(block_size=2, num_blocks=32, max_num_batched_tokens=32, long_prefill_chunk_size=32,
                       max_num_encoder_patches=64, encoder_cache_bytes=130, encoder_bytes_per_token=10)
    img = tuple(ImagePlaceholder("x", off, 3, 12) for off in (1, 5))
    seq = Sequence(0, [1, 7, 7, 7, 2, 7, 7, 7, 3], images=img, sampling=SamplingParams(max_new_tokens=2))
    sched = Scheduler(cfg)
    runner = FakeRunner(cfg.block_size, sched.encoder_cache)
    sched.add(seq)
    out = sched.schedule()
    assert [e.key for e in out.encoder_inputs] == ["x"] and out.scheduled[0].num_new_tokens == 9
    sched.update(runner.execute(out))
    assert run_until_done(sched, runner)[0] == reference_completion(seq)
