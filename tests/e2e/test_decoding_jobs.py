"""Decoding controls end to end (issue 30): a real Valkey, file storage and a real worker process with the bundled
model. Stop strings, logit_bias, penalties, top_k and logprobs given to ``Client.submit`` and in batch lines reach
the engine and come back as the engine gives them directly; logprobs come back in OpenAI's shape; a field vlmq
does not apply is refused by name at submit."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny.shapes import make_split
from workerproc import ready_worker

from vlmq.client import Client
from vlmq.decoding import check_decoding, engine_controls
from vlmq.errors import InvalidRequest
from vlmq.images import decode
from vlmq.settings import Settings
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.main import ASSETS

pytestmark = pytest.mark.timeout(600)
MAX_NEW = 32
SCHEMA = {"type": "object", "properties": {"shape": {"enum": ["circle", "square", "triangle"]}},
          "required": ["shape"], "additionalProperties": False}
QUESTION = "Describe the image."


def png(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def test_decoding_controls_reach_the_engine_and_come_back(redis_url: str, tmp_path: Path) -> None:
    images = [png(example.image) for example in make_split(30, 4)]
    pil = [decode(data) for data in images]
    engine = Engine.from_model_dir(Path(ASSETS) / "tiny-shapes")
    [free] = engine.generate([Request(pil[0], QUESTION, MAX_NEW, ignore_eos=True)])
    stop = free.text[4:7]  # inside the free answer: the stopped answer is shorter
    controls = [{"stop": [stop], "logprobs": True, "top_logprobs": 2},
                {"logit_bias": {str(free.token_ids[0]): -100}, "repetition_penalty": 1.3, "top_k": 5},
                {"frequency_penalty": 1.5, "presence_penalty": 0.5, "min_tokens": 4},
                {"response_format": {"type": "json_schema", "json_schema": {"name": "shape", "schema": SCHEMA}}}]
    direct = engine.generate([Request(pil[n], QUESTION, MAX_NEW, ignore_eos=n == 0,
                                      **engine_controls(check_decoding(c, MAX_NEW)))
                              for n, c in enumerate(controls)])
    (tmp_path / "a.png").write_bytes(images[1])
    batch_file = tmp_path / "batch.jsonl"
    batch_file.write_text(json.dumps({"custom_id": "line", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "tiny-shapes", "max_tokens": MAX_NEW, "stop": stop, "logprobs": True, "top_logprobs": 1, "n": 2,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                                  {"type": "text", "text": QUESTION}]}]}}) + "\n")
    [line_direct] = engine.generate([Request(pil[1], QUESTION, MAX_NEW, stop=(stop,), logprobs=1)])
    sampled = engine.generate([Request(pil[2], QUESTION, MAX_NEW, temperature=1.0, seed=5 + i) for i in range(3)])
    engine.close()
    settings = Settings(broker_url=redis_url, storage_url=(tmp_path / "store").as_uri())
    with ready_worker(redis_url, settings, tmp_path / "worker.log"), Client(settings=settings) as client:
        jobs = [client.submit(images[n], QUESTION, max_new_tokens=MAX_NEW, ignore_eos=n == 0, decoding=c)
                for n, c in enumerate(controls)]
        results = [job.result(timeout=240) for job in jobs]
        three = client.submit(images[2], QUESTION, max_new_tokens=MAX_NEW, temperature=1.0, seed=5,
                              decoding={"n": 3}).result(timeout=240)
        for bad, named in [({"best_of": 2}, "best_of"), ({"top_p": 0}, "top_p"), ({"stop": ["a"] * 5}, "stop"),
                           ({"top_logprobs": 3}, "top_logprobs"), ({"logit_bias": {"x": 1}}, "logit_bias")]:
            with pytest.raises(InvalidRequest, match=named):  # refused at submit, by name
                client.submit(images[0], QUESTION, decoding=bad)
        batch = client.submit_batch(batch_file)
        assert batch.wait(timeout=240)["request_counts"]["completed"] == 1
        (line,) = [json.loads(x) for x in batch.download("output").splitlines()]
    for result, want in zip(results, direct, strict=True):
        assert want.error is None, want.error
        assert (result.token_ids, result.text) == (want.token_ids, want.text)
    assert results[0].finish_reason == "stop" and stop not in results[0].text and len(results[0].token_ids) < MAX_NEW
    assert results[1].token_ids[0] != free.token_ids[0]  # the bias banned the free answer's first token
    assert json.loads(results[3].text)["shape"] in ("circle", "square", "triangle")  # the schema held
    logprobs = results[0].logprobs
    assert [e["logprob"] for e in logprobs] == pytest.approx([e.logprob for e in direct[0].logprobs], abs=1e-6)
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 and isinstance(e["token"], str) for e in logprobs)
    assert results[0].raw["decoding"] == {"stop": [stop], "logprobs": 2}  # what was applied, in the result
    assert results[1].logprobs is None
    assert [c["token_ids"] for c in three.choices] == [s.token_ids for s in sampled]  # choice i: seed + i
    assert three.usage["generated_tokens"] == sum(len(s.token_ids) for s in sampled)
    assert three.usage["prompt_tokens"] == sampled[0].prompt_tokens  # the prompt billed once
    choices = line["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1] and choices[0]["message"] == choices[1]["message"]  # greedy
    choice = choices[0]
    assert choice["message"]["content"] == line_direct.text and choice["finish_reason"] == "stop"
    content = choice["logprobs"]["content"]
    assert [e["logprob"] for e in content] == pytest.approx([e.logprob for e in line_direct.logprobs], abs=1e-6)
    assert all(len(e["top_logprobs"]) == 1 and e["bytes"] == list(e["token"].encode()) for e in content)
