"""Real services for the tests: a Redis-compatible server and an S3-compatible HTTP server.

Both run as child processes on free loopback ports and are stopped by process id
at the end of the session. ``VLMQ_TEST_REDIS_URL`` points the tests at an
existing Redis instead (it is flushed).
"""
from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vlmq import keys
from vlmq.embedded import Server, start_moto, start_valkey

# Triton kernels run through the interpreter on CPU-only machines; this must be set before any
# test module imports a kernel module (they read it when their @triton.jit functions are created).
if not os.path.exists("/dev/nvidiactl") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
BUCKET = "vlmq-test"
# the bundled model's task, training and evaluation live in scripts/tiny/ (never installed); tests import `tiny`
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    given = os.environ.get("VLMQ_TEST_REDIS_URL")
    if given:
        yield given
        return
    server = start_valkey()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Server]:
    import boto3

    server = start_moto()
    try:
        boto3.client("s3", endpoint_url=server.url).create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[object]:
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def s3_storage_url(s3_server: Server) -> str:
    """A fresh prefix in the test bucket for each test."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


# The key sweep: after every test that used Redis (the e2e and SDK suites), after the test's own fixtures
# have stopped their workers and before the next test flushes the database, no key may live forever
# unless an owner deletes it. Owners are kombu's (``vlmq.keys.has_owner``): queue lists and the unacked
# structures, which it deletes as they empty, and its exchange binding tables.
def keys_without_ttl_or_owner(client: Any) -> list[str]:
    """Every key that has no TTL and no owner, sorted."""
    names = list(client.scan_iter(count=1000))
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.ttl(name)
    ttls = pipe.execute()
    return sorted(text for name, ttl in zip(names, ttls, strict=True)
                  if ttl == -1 and not keys.has_owner(text := name.decode(errors="replace")))


@pytest.fixture(autouse=True)
def no_key_lives_forever(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "redis_url" not in request.fixturenames:  # tests without Redis start no server for this
        return
    import redis

    client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    try:
        leaked = keys_without_ttl_or_owner(client)
    finally:
        client.close()
    assert not leaked, f"{len(leaked)} keys have no TTL and no owner to delete them: {leaked[:20]}"
