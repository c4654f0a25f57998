"""The key sweep: after every end-to-end test, no key in Redis lives forever unless an owner deletes it.

Runs after the test's own fixtures have stopped their workers and before the next test flushes the
database. Owners are kombu's (``vlmq.keys.has_owner``): queue lists and the unacked structures, which
it deletes as they empty, and its exchange bindings.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from vlmq import keys


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
    if "redis_url" not in request.fixturenames:
        return
    import redis

    client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    try:
        leaked = keys_without_ttl_or_owner(client)
    finally:
        client.close()
    assert not leaked, f"{len(leaked)} keys have no TTL and no owner to delete them: {leaked[:20]}"
