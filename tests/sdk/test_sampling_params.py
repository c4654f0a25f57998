"""Sampling parameters in the SDK: checked at submit, stored in the record, part of the idempotency fingerprint,
taken from the CLI and from batch-file bodies (real Redis-compatible server, file storage, no worker)."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from PIL import Image

from vlmq import keys, rules
from vlmq.batchfile import parse_line
from vlmq.cli import main
from vlmq.client import Client
from vlmq.errors import InvalidRequest


def png(width: int = 64, height: int = 48) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (30, 90, 200)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def client(redis_client: object, redis_url: str, tmp_path: Path) -> Client:
    with Client(redis_url, tmp_path.as_uri()) as c:
        yield c


@pytest.mark.parametrize(("params", "code"), [
    ({"temperature": -0.1}, "bad_temperature"), ({"temperature": 2.01}, "bad_temperature"),
    ({"temperature": math.nan}, "bad_temperature"), ({"temperature": math.inf}, "bad_temperature"),
    ({"temperature": "0.8"}, "bad_temperature"), ({"temperature": True}, "bad_temperature"),
    ({"seed": -1}, "bad_seed"), ({"seed": 2**63}, "bad_seed"), ({"seed": 1.0}, "bad_seed"),
    ({"seed": "7"}, "bad_seed"), ({"seed": True}, "bad_seed")])
def test_bad_sampling_parameters_are_refused_before_anything_is_enqueued(client: Client, params: dict,
                                                                         code: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        client.submit(png(), "Describe the image.", **params)
    assert err.value.code == code
    with pytest.raises(InvalidRequest) as err:
        client.submit_many([{"image": png(), "prompt": "Describe the image."},
                            {"image": png(), "prompt": "Describe the image.", **params}])
    assert err.value.code == code and str(err.value).startswith("request 1:")
    assert client.redis.keys(keys.job("*")) == []  # no record, so nothing enqueued


def test_the_record_holds_what_was_asked_and_an_old_record_means_greedy(client: Client) -> None:
    greedy = client.submit(png(), "Describe the image.").info()
    sampled = client.submit(png(), "Describe the image.", temperature=0.8, seed=2**63 - 1).info()
    [many] = client.submit_many([{"image": png(), "prompt": "Describe the image.", "temperature": 2, "seed": 0}])
    assert (greedy["temperature"], greedy["seed"]) == ("0.0", "")
    assert (sampled["temperature"], sampled["seed"]) == ("0.8", str(2**63 - 1))
    assert (many.info()["temperature"], many.info()["seed"]) == ("2.0", "0")
    for record, want in ((greedy, (0.0, None)), (sampled, (0.8, 2**63 - 1))):
        assert rules.sampling(record) == want
        rules.check_record(record, record["id"], max_prompt_chars=1000, max_new_tokens_limit=1024)
    old = {k: v for k, v in greedy.items() if k not in ("temperature", "seed")}  # written before sampling existed
    assert rules.sampling(old) == (0.0, None)
    rules.check_record(old, old["id"], max_prompt_chars=1000, max_new_tokens_limit=1024)
    for forged, code in (({"temperature": "3"}, "bad_temperature"), ({"temperature": "nan"}, "bad_temperature"),
                         ({"temperature": "hot"}, "bad_temperature"), ({"seed": "-1"}, "bad_seed"),
                         ({"seed": "0x10"}, "bad_seed")):
        with pytest.raises(InvalidRequest) as err:
            rules.check_record(greedy | forged, greedy["id"], max_prompt_chars=1000, max_new_tokens_limit=1024)
        assert err.value.code == code, forged


def test_a_different_temperature_or_seed_under_one_idempotency_key_is_a_conflict(client: Client) -> None:
    first = client.submit(png(), "Describe the image.", idempotency_key="k", temperature=1.0, seed=3)
    assert client.submit(png(), "Describe the image.", idempotency_key="k", temperature=1, seed=3).id == first.id
    for change in ({"temperature": 0.9, "seed": 3}, {"temperature": 1.0, "seed": 4}, {"temperature": 1.0}):
        with pytest.raises(InvalidRequest) as err:
            client.submit(png(), "Describe the image.", idempotency_key="k", **change)
        assert err.value.code == "idempotency_conflict", change
    greedy = client.submit(png(), "Describe the image.", idempotency_key="g")
    with pytest.raises(InvalidRequest):
        client.submit(png(), "Describe the image.", idempotency_key="g", temperature=0.5)
    assert client.submit(png(), "Describe the image.", idempotency_key="g").id == greedy.id


def test_the_cli_passes_temperature_and_seed(client: Client, redis_url: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    image = tmp_path / "img.png"
    image.write_bytes(png())
    flags = ["--broker", redis_url, "--storage", client.storage.url]
    assert main(["submit", str(image), "Describe the image.", "--temperature", "0.7", "--seed", "42", *flags]) == 0
    record = client.job(capsys.readouterr().out.strip()).info()
    assert (record["temperature"], record["seed"]) == ("0.7", "42")


def batch_line(**body: object) -> str:
    content = [{"type": "text", "text": "Describe the image."}, {"type": "image_url", "image_url": {"url": "a.png"}}]
    return json.dumps({"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny-shapes", "messages": [{"role": "user", "content": content}], **body}})


def test_batch_bodies_apply_temperature_and_seed_and_ignore_top_p(client: Client, tmp_path: Path) -> None:
    parsed = parse_line(1, batch_line(temperature=0.8, seed=11, top_p=0.5), tmp_path)
    assert (parsed.temperature, parsed.seed) == (0.8, 11)
    assert (parse_line(1, batch_line(temperature=None), tmp_path).temperature, parsed.seed) == (0.0, 11)
    for body, code in (({"temperature": 2.5}, "bad_temperature"), ({"seed": -3}, "bad_seed"),
                       ({"seed": "11"}, "bad_seed")):
        with pytest.raises(InvalidRequest) as err:
            parse_line(1, batch_line(**body), tmp_path)
        assert err.value.code == code
    (tmp_path / "a.png").write_bytes(png())
    path = tmp_path / "requests.jsonl"
    path.write_text(batch_line(temperature=1.2, seed=5) + "\n")
    batch = client.submit_batch(path)
    [job_id] = client.redis.lrange(keys.batch_jobs(batch.id), 0, -1)
    record = client.job(job_id.decode()).info()
    assert (record["temperature"], record["seed"]) == ("1.2", "5")
