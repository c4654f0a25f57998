"""Fleet accounting: archive objects/bytes per model from storage, hit rates from the workers' counters."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vlmq import keys
from vlmq.cachestats import hit_rates
from vlmq.client import Client
from vlmq.settings import Settings


def test_hit_rates_come_from_counter_pairs() -> None:
    rates = hit_rates({"encoder_cache_hits": 3, "encoder_cache_misses": 1, "prefix_cache_hit_tokens": 30,
                       "prefix_cache_query_tokens": 120, "host_tier_hits": 0, "host_tier_misses": 0,
                       "jobs_served": 9})
    assert rates == {"encoder_cache": 0.75, "prefix_cache": 0.25, "host_tier": None}


@pytest.fixture(params=["file", "s3"])
def client(request: pytest.FixtureRequest, redis_client: object, redis_url: str, tmp_path) -> Client:
    if request.param == "file":
        settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path}")
    else:
        settings = Settings(broker_url=redis_url, storage_url=request.getfixturevalue("s3_storage_url"),
                            s3_endpoint_url=request.getfixturevalue("s3_server").url)
    with Client(settings=settings) as c:
        yield c


def _archive(client: Client) -> None:
    client.storage.put(f"{keys.kv_prefix('h1')}enc/aa", b"x" * 100)
    client.storage.put(f"{keys.kv_prefix('h1')}prefix/bb", b"x" * 50)
    client.storage.put(f"{keys.kv_prefix('h2')}enc/cc", b"x" * 7)
    client.storage.put(keys.input_object("d" * 64), b"not archive")
    client.redis.hset(keys.kv_models(), "h1", "tiny-shapes")
    client.redis.expire(keys.kv_models(), 60)  # as workers keep it


def test_cache_stats_shows_the_archive_per_model_and_counters_across_workers(client: Client) -> None:
    _archive(client)
    for name, hits, misses in (("w1", 3, 1), ("w2", 5, 3)):
        client.redis.hset(keys.worker_stats(name), mapping={
            "model": "tiny-shapes", "classes": "xs,s", "at": "1.5", "encoded_images": misses,
            "encoder_cache_hits": hits, "encoder_cache_misses": misses, "encoder_cache_bytes": 1 << 20})
        client.redis.expire(keys.worker_stats(name), 30)  # a heartbeat expires unless renewed
    stats = client.cache_stats()
    assert stats["archive"] == {"h1": {"model": "tiny-shapes", "objects": 2, "bytes": 150},
                                "h2": {"model": None, "objects": 1, "bytes": 7}}
    model = stats["models"]["tiny-shapes"]
    assert model["counters"] == {"workers": 2, "encoded_images": 4, "encoder_cache_hits": 8,
                                 "encoder_cache_misses": 4}
    assert model["hit_rates"] == {"encoder_cache": 8 / 12}
    assert stats["workers"]["w1"]["classes"] == "xs,s" and stats["workers"]["w2"]["encoder_cache_hits"] == 5


def test_purge_removes_only_that_models_archive(client: Client) -> None:
    _archive(client)
    assert client.purge_cache("tiny-shapes") == (2, 150)
    assert set(client.cache_stats()["archive"]) == {"h2"}
    assert client.purge_cache("h2") == (1, 7)  # a hash as stats shows it
    assert client.cache_stats()["archive"] == {}
    assert client.storage.exists(keys.input_object("d" * 64))


def test_the_cache_command_prints_stats_and_purges(redis_client: object, redis_url: str, tmp_path) -> None:
    env = {**os.environ, "VLMQ_BROKER_URL": redis_url, "VLMQ_STORAGE_URL": f"file://{tmp_path}"}
    with Client(redis_url, f"file://{tmp_path}") as client:
        _archive(client)

    def vlmq(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vlmq.cli", "cache", *args], env=env, capture_output=True,
                              text=True, timeout=60)

    shown = vlmq("stats", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["archive"]["h1"]["bytes"] == 150
    assert "2 objects, 150 B" in vlmq("stats").stdout
    purged = vlmq("purge", "--model", "tiny-shapes")
    assert purged.returncode == 0 and "deleted 2 archived objects (150 bytes)" in purged.stdout
    missing = vlmq("purge")
    assert missing.returncode == 2 and "--model" in missing.stderr
