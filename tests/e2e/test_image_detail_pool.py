"""Resolution per image end to end (issue 29 item 3): a real Valkey, file storage and a real worker with the bundled
model. One large image sent at the model's own bounds, with ``detail: "low"`` and with ``max_pixels``: each job is
priced at submit with the vision tokens the worker's engine then counted, the low one at most 256, and each answer
is the engine's own for the same messages; a tiling model's bounds and impossible bounds are refused at submit."""
from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from tiny.shapes import make_split
from workerproc import ready_worker

from vlmq.client import Client
from vlmq.errors import InvalidRequest
from vlmq.images import decode
from vlmq.settings import Settings
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.main import ASSETS

pytestmark = pytest.mark.timeout(600)
MAX_NEW = 12


def chat(url: str, **bounds: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, **bounds}},
                                         {"type": "text", "text": "Describe the image."}]}]


def test_each_image_runs_and_is_priced_at_the_resolution_it_asked_for(redis_url: str, tmp_path: Path) -> None:
    big = make_split(31, 1)[0].image.resize((1000, 1000), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    big.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    asks = [{}, {"detail": "low"}, {"max_pixels": 56 * 56 * 64}, {"detail": "high"}]
    settings = Settings(broker_url=redis_url, storage_url=(tmp_path / "store").as_uri())
    with ready_worker(redis_url, settings, tmp_path / "worker.log"), Client(settings=settings) as client:
        jobs = [client.submit(messages=chat(url, **ask), max_new_tokens=MAX_NEW) for ask in asks]
        results = [job.result(timeout=240) for job in jobs]
        prices = [int(job.info()["vision_tokens"]) for job in jobs]
        for bad, code in (({"max_pixels": 1 << 24}, "bad_pixels"), ({"detail": "medium"}, "bad_messages"),
                          ({"min_pixels": 5000, "max_pixels": 4000}, "bad_pixels"), ({"max_pixels": "4"},
                                                                                      "bad_messages")):
            with pytest.raises(InvalidRequest) as err:
                client.submit(messages=chat(url, **bad))
            assert err.value.code == code, bad
    engine = Engine.from_model_dir(Path(ASSETS) / "tiny-shapes")
    image = decode(buf.getvalue())
    forms = [[{"role": "user", "content": [{"type": "image", **{k: v for k, v in ask.items() if v != "high"}},
                                           {"type": "text", "text": "Describe the image."}]}] for ask in asks]
    direct = engine.generate([Request.chat(form, (image,), max_new_tokens=MAX_NEW) for form in forms])
    for result, price, want in zip(results, prices, direct, strict=True):
        assert want.error is None, want.error
        assert (result.token_ids, result.text) == (want.token_ids, want.text)
        assert result.usage["image_tokens"] == want.image_tokens == price
    full, low, capped, high = prices
    assert low <= 256 < full and capped == 64 and high == full
    # another size of the same image is another encoder input: its own key in the encoder and prefix caches
    hashes = [engine.preprocessor(f"r{i}", Request.chat(form, (image,), max_new_tokens=MAX_NEW)).seq.images[0]
              .content_hash for i, form in enumerate(forms)]
    assert len(set(hashes[:3])) == 3 and hashes[3] == hashes[0]
