"""The engine on a tiny random-weight Qwen3-VL checkpoint folder: greedy outputs of one continuously batched
workload of mixed-resolution prompts (caches on, prefills chunked through images) equal transformers' greedy
outputs run one prompt at a time."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image
from tiled_parity import MAX_NEW, greedy_answers
from tiny.qwen3_vl import build

from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.models.processor import load_processor

NUM_FRESH, NUM_SAME_IMAGE, NUM_REPEATS = 44, 8, 4
WORDS = "what colour shape is at the left right top bottom of this image count how many red blue".split()

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build(tmp_path_factory.mktemp("tiny-qwen3-vl"))


@pytest.fixture(scope="module")
def workload() -> list[tuple[Image.Image, str]]:
    rnd = random.Random(3)
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (rnd.randint(20, 240), rnd.randint(20, 240), 3),
                                                                 dtype=np.uint8)) for i in range(NUM_FRESH)]
    prompts = [(img, " ".join(rnd.choices(WORDS, k=rnd.randint(2, 9))) + "?") for img in images]
    prompts += [(img, q + " again") for img, q in prompts[:NUM_SAME_IMAGE]]  # same image: encoder-cache hits
    return prompts + prompts[10:10 + NUM_REPEATS]  # exact repeats: prefix-cache hits


@pytest.fixture(scope="module")
def reference(model_dir, workload) -> dict[tuple[int, str], list[int]]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    return greedy_answers(model, load_processor(model_dir), workload)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix+encoder-cache", "encoder-cache"])
def test_greedy_equals_transformers_continuously_batched(model_dir, workload, reference, prefix_caching):
    assert len(workload) >= 50
    engine = Engine.from_model_dir(model_dir, num_blocks=1024, max_num_batched_tokens=96, long_prefill_chunk_size=40,
                                   enable_prefix_caching=prefix_caching)  # prefills cut through images
    requests = [Request(img, q, MAX_NEW) for img, q in workload]
    ids = [engine.add_request(r) for r in requests[:20]]
    pending, done = requests[20:], {}
    while len(done) < len(requests):  # arrivals join a running batch, 3 before every step
        ids += [engine.add_request(r) for r in pending[:3]]
        del pending[:3]
        done.update((o.request_id, o) for o in engine.step())
    outputs = [done[i] for i in ids]
    mismatches = [(i, out.token_ids, reference[(id(img), q)])
                  for i, ((img, q), out) in enumerate(zip(workload, outputs, strict=True))
                  if out.token_ids != reference[(id(img), q)]]
    assert not mismatches, f"{len(mismatches)} of {len(outputs)} differ from transformers, first: {mismatches[0]}"
    assert all(out.error is None for out in outputs)
    assert len({tuple(out.token_ids) for out in outputs}) > len(outputs) // 2  # outputs depend on the prompt
    stats = engine.stats
    assert stats.num_encoded_images == stats.encoder_cache_misses == NUM_FRESH  # shared images encoded once
    assert stats.num_encoder_calls < stats.num_encoded_images  # images of one step share one packed call
    if prefix_caching:  # a repeated image's KV (DeepStack already in it) comes from cached blocks
        assert stats.prefix_cache_hit_tokens > 0
    else:  # a repeated image's features, DeepStack taps included, come from the encoder cache
        assert stats.prefix_cache_hit_tokens == 0 and stats.encoder_cache_hits >= NUM_SAME_IMAGE
    engine.close()
