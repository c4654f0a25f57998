"""Two keys of two tenants through the official client: neither reaches the other's Files, batches or results
(404, as for what does not exist); no key, a bad key and a revoked key are 401."""
from __future__ import annotations

import time

import openai
import pytest
import redis
from serveproc import Door
from test_openai_client import api, batch_file

from vlmq import apikeys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def finished(client: openai.OpenAI, batch_id: str) -> openai.types.Batch:
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch_id)).status != "completed" and time.monotonic() < deadline:
        time.sleep(0.3)
    return batch


def test_a_tenants_key_reaches_only_its_own_files_batches_and_results(door: Door) -> None:
    with api(door, door.key_a) as acme, api(door, door.key_b) as globex:
        upload = acme.files.create(file=("a.jsonl", batch_file(2)), purpose="batch")
        batch = finished(acme, acme.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                   completion_window="24h").id)
        assert batch.status == "completed" and batch.output_file_id
        for attempt in (lambda: globex.files.retrieve(upload.id), lambda: globex.files.content(upload.id),
                        lambda: globex.files.delete(upload.id), lambda: globex.batches.retrieve(batch.id),
                        lambda: globex.batches.cancel(batch.id), lambda: globex.files.content(batch.output_file_id),
                        lambda: globex.files.retrieve(batch.error_file_id),
                        lambda: globex.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                      completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert upload.id not in {f.id for f in globex.files.list().data}
        assert batch.id not in {b.id for b in globex.batches.list().data}
        assert acme.files.retrieve(upload.id).id == upload.id  # still there for its owner
        assert acme.files.content(batch.output_file_id).read().count(b"\n") == 2


def test_no_key_a_bad_key_and_a_revoked_key_are_refused_401(door: Door) -> None:
    client = redis.Redis.from_url(door.settings.broker_url)
    key = apikeys.create(client, "acme", "doomed")
    with api(door, key) as allowed:
        assert allowed.models.list().data
    [record] = [r for r in apikeys.list_keys(client, "acme") if r.name == "doomed"]
    assert apikeys.revoke(client, record.id)
    for bad in (key, "vlmq-" + "x" * 43, "sk-not-ours"):
        with api(door, bad) as refused_client, pytest.raises(openai.AuthenticationError) as refused:
            refused_client.files.list()
        assert refused.value.code == "invalid_api_key"
    import httpx

    answer = httpx.get(f"{door.url}/files")
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "missing_api_key"
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    client.close()
