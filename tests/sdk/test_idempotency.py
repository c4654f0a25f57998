"""Idempotency keys against real Valkey, through a tenant's ACL user: a key names a job only once it exists.

Issue 36 item 5: with the queue full, a submit waiting for room held its key bound to a job id it had not
enqueued; a second submit with the same request got that id at once, the first then gave up (``QueueFull``) and
deleted the key, and the id the second one held was ``JobNotFound`` for ever.
"""
from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from PIL import Image

from vlmq import acl, functions, idempotency, keys
from vlmq.client import Client
from vlmq.errors import QueueFull
from vlmq.jobs import JobStatus
from vlmq.settings import Settings
from vlmq.store import JobStore


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (20, 120, 220)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def settings(redis_client: Any, redis_url: str, tmp_path: Path) -> Iterator[Settings]:
    """Tenant acme's settings: its ACL user, a queue limit of one job per class."""
    user = acl.tenant_user("acme")
    redis_client.execute_command("ACL", "SETUSER", *acl.setuser_args(user, "pw", acl.tenant_rules("acme")))
    functions.load(redis_client)  # what a worker does when it starts
    parts = urlsplit(redis_url)
    url = urlunsplit(parts._replace(netloc=f"{user}:pw@{parts.hostname}:{parts.port}"))
    yield Settings(broker_url=url, storage_url=f"file://{tmp_path / 'store'}", tenant="acme", max_queue_depth="1")
    redis_client.execute_command("ACL", "DELUSER", user)


def test_a_key_never_hands_out_a_job_that_does_not_exist(settings: Settings, redis_client: Any) -> None:
    with Client(settings=settings) as client:
        queue = client.submit(png(), "Fill the queue.").info()["queue"]  # its class queue is now at its limit
    outcomes: dict[str, Any] = {}

    def submit(name: str, wait_for_room: float) -> None:
        with Client(settings=settings) as client:
            try:
                outcomes[name] = client.submit(png(), "What colour?", idempotency_key="k", wait_for_room=wait_for_room)
            except QueueFull as e:
                outcomes[name] = e

    first = threading.Thread(target=submit, args=("first", 2.0))
    first.start()
    time.sleep(1.0)
    second = threading.Thread(target=submit, args=("second", 30.0))  # the same request, while the first waits
    second.start()
    first.join()
    assert isinstance(outcomes["first"], QueueFull)
    assert second.is_alive() and "second" not in outcomes  # it waited instead of taking the first's job id
    redis_client.delete(*keys.queue_lists(queue))  # room again: the second submit enqueues its own job
    second.join(timeout=30)
    job = outcomes["second"]
    with Client(settings=settings) as client:
        assert client.job(job.id).status() is JobStatus.QUEUED
        assert client.submit(png(), "What colour?", idempotency_key="k").id == job.id
    assert redis_client.get(keys.idempotency("k", "acme")).decode().startswith(job.id + " ")  # published


def test_a_release_deletes_only_its_own_pending_binding(settings: Settings, redis_client: Any) -> None:
    with Client(settings=settings) as client:
        store: JobStore = client.store
        name = keys.idempotency("k2", "acme")
        assert idempotency.claim(store, "k2", "acme." + "a" * 32, "fp", 60) is None
        redis_client.set(name, "acme." + "b" * 32 + " fp")  # the pending value lapsed and another submit took it
        idempotency.release(store, [("k2", idempotency.pending("acme." + "a" * 32, "fp"))])
        assert redis_client.get(name) == ("acme." + "b" * 32 + " fp").encode()
        idempotency.release(store, [("k2", "acme." + "b" * 32 + " fp")])  # its own value: deleted
        assert redis_client.get(name) is None
