"""The engine end to end on the bundled model: greedy outputs equal transformers' one-at-a-time greedy outputs.

One continuously batched workload of 100 mixed-resolution prompts (requests keep arriving while others
decode; some reuse an earlier image with another question, some repeat a prompt exactly), with the encoder
and prefix caches on, then off; then a KV budget too small for the workload, which forces preemption.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from tiny.shapes import make_split, questions

from vlmq.errors import InvalidRequest
from vlmq.storage import open_storage
from vlmq.workers.backends.base import GenOutput, GenRequest
from vlmq.workers.backends.engine import EngineBackend
from vlmq.workers.engine.engine import Engine, Request, RequestOutput
from vlmq.workers.engine.spec_decode import SpecConfig
from vlmq.workers.kvstore import KVStore, KVStoreConfig, weights_identity
from vlmq.workers.models.processor import load_processor, render_prompt

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
DRAFT = TARGET.parent / "tiny-shapes-draft"
TEST_SEED = 9  # held out from training (see the model's README)
MAX_NEW = 32
NUM_FRESH, NUM_SAME_IMAGE, NUM_REPEATS = 80, 14, 6

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # A private copy: the bundled checkpoint may be rewritten while these tests run.
    torch.set_num_threads(1)
    return Path(shutil.copytree(TARGET, tmp_path_factory.mktemp("m") / "tiny-shapes"))


@pytest.fixture(scope="module")
def workload() -> list[tuple[Image.Image, str]]:
    examples = make_split(TEST_SEED, NUM_FRESH)
    prompts = [(e.image, e.question) for e in examples]
    for i, e in enumerate(examples[:NUM_SAME_IMAGE]):  # same image, another question: encoder-cache hits
        other = [q for q, _ in questions(e.scene) if q != e.question]
        prompts.append((e.image, other[i % len(other)]))
    prompts += prompts[20:20 + NUM_REPEATS]  # exact repeats: whole-prompt prefix-cache hits
    return prompts


@pytest.fixture(scope="module")
def reference(model_dir, workload) -> dict[tuple[int, str], list[int]]:
    """transformers' greedy completion (eos stripped) of every distinct prompt, run one at a time."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = load_processor(model_dir)
    eos = model.generation_config.eos_token_id
    out: dict[tuple[int, str], list[int]] = {}
    for image, question in workload:
        key = (id(image), question)
        if key not in out:
            inputs = processor(text=[render_prompt(processor, question)], images=[image], return_tensors="pt")
            with torch.inference_mode():
                ids = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
            completion = ids[0, inputs["input_ids"].shape[1]:].tolist()
            out[key] = completion[:-1] if completion and completion[-1] == eos else completion
    return out


def run_continuous(engine: Engine, requests: list[Request], first: int, per_step: int) -> list[RequestOutput]:
    """Add `first` requests, then `per_step` more before every step: arrivals join a running batch."""
    ids = [engine.add_request(r) for r in requests[:first]]
    pending = list(requests[first:])
    done: dict[str, RequestOutput] = {}
    while len(done) < len(requests):
        ids += [engine.add_request(r) for r in pending[:per_step]]
        del pending[:per_step]
        done.update((o.request_id, o) for o in engine.step())
    return [done[i] for i in ids]


def check_outputs(outputs, workload, reference) -> None:
    assert len(outputs) == len(workload)
    pairs = zip(workload, outputs, strict=True)
    mismatches = [(i, q, out.token_ids, reference[(id(img), q)])
                  for i, ((img, q), out) in enumerate(pairs) if out.token_ids != reference[(id(img), q)]]
    assert not mismatches, f"{len(mismatches)} of {len(outputs)} differ from transformers, first: {mismatches[0]}"
    for out in outputs:
        assert out.error is None and out.finish_reason in ("stop", "length")
        assert out.finish_reason == "stop" or len(out.token_ids) == MAX_NEW


def test_prompt_and_pixels_equal_the_processor(model_dir, workload):
    engine = Engine.from_model_dir(model_dir, num_blocks=64)
    processor = load_processor(model_dir)
    for image, question in workload[:: len(workload) // 6]:
        prepared = engine.preprocessor("r", Request(image, question))
        ref = processor(text=[render_prompt(processor, question)], images=[image], return_tensors="pt")
        assert prepared.seq.token_ids == ref["input_ids"][0].tolist()
        assert torch.equal(prepared.grid_thw, ref["image_grid_thw"])
        assert torch.equal(prepared.pixel_values, ref["pixel_values"])
    engine.close()


def test_greedy_equals_transformers_with_caches_on(model_dir, workload, reference):
    engine = Engine.from_model_dir(model_dir, num_blocks=2048, enable_prefix_caching=True)
    outputs = run_continuous(engine, [Request(img, q, MAX_NEW) for img, q in workload], first=40, per_step=3)
    check_outputs(outputs, workload, reference)
    stats = engine.stats
    assert stats.num_encoded_images == stats.encoder_cache_misses <= NUM_FRESH  # each distinct image at most once
    # a repeated image is served from cached KV blocks (the register tokens after the image fill its last block),
    # so it needs neither the encoder nor its cache
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.num_encoder_calls < stats.num_encoded_images  # images of one step share one packed call
    engine.close()


def test_greedy_equals_transformers_with_only_the_encoder_cache(model_dir, workload, reference):
    engine = Engine.from_model_dir(model_dir, num_blocks=2048, enable_prefix_caching=False)
    outputs = run_continuous(engine, [Request(img, q, MAX_NEW) for img, q in workload], first=40, per_step=3)
    check_outputs(outputs, workload, reference)
    stats = engine.stats
    assert stats.prefix_cache_hit_tokens == 0
    assert stats.num_encoded_images == stats.encoder_cache_misses <= NUM_FRESH  # each distinct image at most once
    assert stats.encoder_cache_hits > 0  # a repeated image's features come from the encoder cache
    engine.close()


def test_greedy_equals_transformers_with_caches_off(model_dir, workload, reference):
    engine = Engine.from_model_dir(model_dir, num_blocks=2048, enable_prefix_caching=False,
                                   share_encoder_outputs=False)
    outputs = run_continuous(engine, [Request(img, q, MAX_NEW) for img, q in workload], first=60, per_step=5)
    check_outputs(outputs, workload, reference)
    assert engine.stats.encoder_cache_hits == 0 and engine.stats.prefix_cache_hit_tokens == 0
    assert engine.stats.num_encoded_images == len(workload)
    engine.close()


def test_requests_sharing_an_image_reuse_its_kv(model_dir, workload, reference):
    """Two questions per image, all at once: the second waits for the first's image KV, then reuses it."""
    pairs = workload[:NUM_SAME_IMAGE] + workload[NUM_FRESH:NUM_FRESH + NUM_SAME_IMAGE]
    engine = Engine.from_model_dir(model_dir, num_blocks=2048)
    outputs = engine.generate([Request(img, q, MAX_NEW) for img, q in pairs], prepare_all_first=True)
    check_outputs(outputs, pairs, reference)
    stats = engine.stats
    assert stats.num_encoded_images == NUM_SAME_IMAGE
    assert 0 < stats.num_deferred_admissions <= NUM_SAME_IMAGE  # unless its leader was already past the image
    image_tokens = sum(out.image_tokens for out in outputs[NUM_SAME_IMAGE:])
    assert stats.prefix_cache_hit_tokens >= image_tokens - NUM_SAME_IMAGE * 16  # all but a partial block each
    engine.close()


def test_preemption_keeps_outputs_identical(model_dir, workload, reference):
    small = [(img, q) for img, q in workload if img.width * img.height <= 300 * 300][:24]
    engine = Engine.from_model_dir(model_dir, num_blocks=10, block_size=16, max_num_batched_tokens=256,
                                   long_prefill_chunk_size=128)
    outputs = engine.generate([Request(img, q, MAX_NEW) for img, q in small], prepare_all_first=True)
    assert engine.stats.num_preemptions > 0  # the budget really was too small for the batch
    check_outputs(outputs, small, reference)
    engine.close()


@pytest.mark.parametrize("method", ["ngram", f"draft:{DRAFT}", "head"], ids=["ngram", "draft", "head"])
def test_speculative_greedy_equals_transformers_with_caches_and_preemption(model_dir, workload, reference, method):
    """Proposals verified in (k+1)-token chunks change no token: the whole workload at once, prefix and encoder
    caches on, a KV budget that forces preemption, max_k proposals at every batch size (fixed k: deterministic)."""
    spec = SpecConfig(method, max_k=4, max_batch=10_000, adaptive=False)  # 4: this KV budget preempts
    engine = Engine.from_model_dir(model_dir, num_blocks=30, speculative=spec)
    outputs = engine.generate([Request(img, q, MAX_NEW) for img, q in workload], prepare_all_first=True)
    check_outputs(outputs, workload, reference)
    stats, spec = engine.stats, engine.stats.speculative
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0 and stats.encoder_cache_hits > 0
    assert spec.num_proposed > spec.num_accepted > 0 and spec.tokens_per_forward > 1
    free = engine.scheduler.block_manager.num_free_blocks
    assert free == engine.config.num_blocks  # every block back, rejected proposals' included
    engine.close()


def test_speculative_sampling_draws_like_plain_sampling(model_dir, workload):
    """The whole engine at temperature 1.5 (unseeded: seeded requests verify by matching, spec_decode.verify_seeded):
    the tokens drawn with draft-model proposals (drawn from the draft, verified by rejection sampling) and without
    follow one law (chi-square, p = 0.01)."""
    from test_speculative import two_sample_p

    image, question = next((img, q) for img, q in workload if q.startswith("Describe"))
    requests = [Request(image, question, 3, ignore_eos=True, temperature=1.5) for _ in range(600)]
    draws = {}
    for spec in (None, SpecConfig(f"draft:{DRAFT}", max_batch=10_000, adaptive=False)):
        engine = Engine.from_model_dir(model_dir, num_blocks=1024, max_num_seqs=256, speculative=spec)
        draws[spec is None] = [tuple(o.token_ids) for o in engine.generate(requests)]
        if spec is not None:
            assert engine.stats.speculative.num_proposed > engine.stats.speculative.num_accepted > 0
        engine.close()
    plain, spec = draws[True], draws[False]
    assert len({t[1:] for t in plain}) >= 5  # a spread-out law, not one answer
    for part in (slice(0, 1), slice(1, 3)):  # the first token (no proposals yet), then the next two
        p = two_sample_p([t[part] for t in plain], [t[part] for t in spec])
        assert p > 0.01, (part, p)


def test_backend_serves_genrequests(model_dir, workload, reference):
    backend = EngineBackend(str(model_dir), "cpu", num_blocks=512)
    (img0, q0), (img1, q1), (img2, q2) = workload[:3]
    calls = []
    requests = [
        GenRequest("a", img0, q0, MAX_NEW),
        GenRequest("b", img1, q1, 40, ignore_eos=True),
        GenRequest("c", img2, q2, 200, ignore_eos=True, canceled=lambda: calls.append(1) or len(calls) > 3),
        GenRequest("d", Image.new("L", (64, 64)), "How many shapes?", 8),  # not canonical RGB: fails alone
    ]
    a, b, c, d = backend.generate(requests)
    assert isinstance(a, GenOutput) and a.token_ids == reference[(id(img0), q0)]
    assert a.prompt_tokens > a.image_tokens > 0 and a.finish_reason in ("stop", "length")
    assert isinstance(b, GenOutput) and b.finish_reason == "length" and len(b.token_ids) == 40
    assert isinstance(c, GenOutput) and c.finish_reason == "canceled" and len(c.token_ids) < 200
    assert isinstance(d, InvalidRequest) and d.code == "invalid_image" and "RGB" in str(d)
    assert backend.generate([GenRequest("e", img0, q0, MAX_NEW)])[0].token_ids == a.token_ids  # engine reused
    backend.close()


def test_backend_recovers_from_a_failed_step(model_dir, workload, reference, monkeypatch):
    # Fault injection (nothing real makes a model call raise on demand): the model runner fails once mid-batch.
    # The backend must serve every job on a fresh engine, one by one, and keep serving afterwards.
    backend = EngineBackend(str(model_dir), "cpu", num_blocks=512)
    (img0, q0), (img1, q1), (img2, q2) = workload[:3]
    backend.generate([GenRequest("warm", img2, q2, 4)])
    before = backend.cache_stats()
    failed = []
    real_execute = backend.engine.runner.execute

    def execute_once_failing(out):
        if not failed:
            failed.append(1)
            raise RuntimeError("injected runner failure")
        return real_execute(out)

    monkeypatch.setattr(backend.engine.runner, "execute", execute_once_failing)
    old = backend.engine
    a, b = backend.generate([GenRequest("a", img0, q0, MAX_NEW), GenRequest("b", img1, q1, MAX_NEW)])
    assert failed and backend.engine is not old  # the failure happened and the engine was replaced
    assert a.token_ids == reference[(id(img0), q0)] and b.token_ids == reference[(id(img1), q1)]
    # the worker's published cache counters keep counting across the replacement (vlmq cache, vlmq top)
    after = backend.cache_stats()
    assert after["encoded_images"] == before["encoded_images"] + 2
    assert after["prefix_cache_query_tokens"] > before["prefix_cache_query_tokens"]
    backend.close()


def test_encoder_budget_fits_the_largest_image_the_processor_emits(tmp_path):
    import json

    # the tiny model's processor allows 150 x 150 patches here: 22,500 in one image, over the 16,384 default
    model_dir = Path(shutil.copytree(TARGET, tmp_path / "big-images"))
    config_path = model_dir / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    config["size"]["longest_edge"] = (150 * config["patch_size"]) ** 2
    config_path.write_text(json.dumps(config))
    assert Engine.from_model_dir(model_dir, num_blocks=8).config.max_num_encoder_patches == 150 * 150
    assert Engine.from_model_dir(TARGET, num_blocks=8).config.max_num_encoder_patches == 16_384  # default kept
    engine = Engine.from_model_dir(model_dir, num_blocks=8, max_num_encoder_patches=30_000)
    assert engine.config.max_num_encoder_patches == 30_000  # an explicit budget wins


def tiered_engine(model_dir, storage, tmp_path, name: str) -> Engine:
    # Caches far smaller than the workload: encoder outputs and prefix blocks are evicted all the time and go
    # down to host (1 MiB, ~30 blocks of 32 KiB), disk (2 MiB) and the S3 archive. Requests wait for their lookups
    # however loaded the machine is (test_kv_tiers.py checks a late fetch becomes a recompute), and fetch from the
    # archive even when this worker's rates say recomputing is cheaper (on a loaded machine moto's latency makes it
    # so; test_kv_tiers.py checks that choice): this checks the tiers.
    config = KVStoreConfig(host_bytes=1 << 20, disk_dir=str(tmp_path / name), disk_bytes=2 << 20,
                           archive_bytes=256 << 20, wait_grace_s=10.0, always_fetch=True,
                           archive_key=b"test-archive-key-" * 2)
    store = KVStore(weights_identity(model_dir), config, storage)
    return Engine.from_model_dir(model_dir, num_blocks=96, encoder_cache_bytes=400 << 10, kv_store=store)


def test_greedy_equals_transformers_with_kv_tiers_and_archive(model_dir, workload, reference, s3_storage_url,
                                                              s3_server, tmp_path):
    """Pass 1 demotes; pass 2 (same store) is served from host and disk; pass 3 (a new store, as on another
    worker) from the S3 archive. Every answer equals transformers'."""
    storage = open_storage(s3_storage_url, s3_server.url)
    first = tiered_engine(model_dir, storage, tmp_path, "a")
    requests = [Request(img, q, MAX_NEW) for img, q in workload]
    check_outputs(run_continuous(first, requests, first=40, per_step=3), workload, reference)
    first.tiers.store.flush()
    second = Engine(*first._args[:3], **first._args[3])  # same store, empty device caches
    part = slice(0, 40)
    check_outputs(second.generate(requests[part]), workload[part], reference)
    third = tiered_engine(model_dir, storage, tmp_path, "b")
    check_outputs(third.generate(requests[part]), workload[part], reference)
    st2, st3 = second.tiers.store.stats(), third.tiers.store.stats()
    assert st2["host_hits"] > 0 and st2["disk_hits"] > 0  # served from host and disk
    assert st3["archive_hits"] > 0 and st3["host_hits"] + st3["disk_hits"] == 0  # fresh store: only S3
    for engine in (second, third):
        assert engine.tiers.counts["restored_images"] > 0 and engine.tiers.counts["restored_blocks"] > 0
        assert engine.stats.num_encoded_images < 40 - 10  # most images came from a tier, not the encoder
        st = engine.tiers.store.stats()  # every tier held its byte budget
        assert st["host_used_bytes"] <= st["host_capacity_bytes"]
        assert st["disk_used_bytes"] <= st["disk_capacity_bytes"]
    assert sum(o.size for o in storage.list_objects("kv/")) <= 256 << 20
    for engine in (first, third):
        engine.tiers.store.close()
