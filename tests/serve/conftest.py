"""A real pool behind a real ``vlmq serve``: Valkey, moto's S3 server, one worker of the bundled model, and the
serve process, for the module that asks for ``door``; keys of two tenants."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # workerproc, inputs

from serveproc import Door, ServeProcess, serve_settings  # noqa: E402
from workerproc import ready_worker  # noqa: E402

from vlmq import apikeys, keys  # noqa: E402


@pytest.fixture(scope="module")
def door(redis_url: str, s3_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    import redis

    settings = serve_settings(redis_url, s3_server.url, "serve")
    folder = tmp_path_factory.mktemp("serve")
    with ready_worker(redis_url, settings, folder / "worker.log"):
        client = redis.Redis.from_url(redis_url)
        key_a, key_b = apikeys.create(client, "acme", "test"), apikeys.create(client, "globex", "test")
        serve = ServeProcess(settings, folder / "serve.log", VLMQ_SERVE_READ_TIMEOUT="2")
        try:
            serve.wait_ready()
            yield Door(settings, serve, f"{serve.url}/v1", key_a, key_b)
        finally:
            serve.stop()
            client.delete(keys.api_keys())
            client.close()
