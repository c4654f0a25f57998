"""What the engine's caches count is what they hold: an image's encoder output, encoded in one packed call with
other images, is kept as its own tensor, so evicting it frees its bytes (a slice of the packed output would keep
every image of that call alive while the cache counted one)."""
from __future__ import annotations

from pathlib import Path

import torch
from tiny.shapes import make_split

from vlmq.workers.engine.engine import Engine, Request

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"


def test_encoder_outputs_of_one_packed_call_are_cached_as_separate_tensors():
    examples = make_split(9, 4)
    engine = Engine.from_model_dir(TARGET, speculative="none")
    try:
        outputs = engine.generate([Request(e.image, e.question, 1) for e in examples], prepare_all_first=True)
        assert all(o.error is None for o in outputs)
        assert engine.runner.num_encoder_calls < engine.runner.num_encoded_images  # images shared a packed call
        cached = [e.value for e in engine.scheduler.encoder_cache.entries.values() if e.ready]
        assert len(cached) == len(examples)
        for value in cached:
            assert isinstance(value, torch.Tensor)
            assert value.untyped_storage().nbytes() == value.nbytes
    finally:
        engine.close()
