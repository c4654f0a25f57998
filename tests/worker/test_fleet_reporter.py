"""What a worker tells the fleet: its hot set, its routes (first server keeps one) and its share of the drain."""
from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
from PIL import Image

from vlmq import affinity, keys
from vlmq.client import Client
from vlmq.settings import Settings
from vlmq.workers.fleet import FleetReporter, HotSet

MODEL = "tiny-shapes"


def test_the_hot_set_evicts_least_recently_served_first_within_its_bytes() -> None:
    hot = HotSet(capacity_bytes=100)
    assert hot.add("a", 40) == [] and hot.add("b", 40) == []
    assert hot.add("a", 40) == []  # served again: now the most recent
    assert hot.add("c", 40) == ["b"]
    assert list(hot.entries) == ["a", "c"] and hot.num_used_bytes == 80
    assert hot.add("big", 500) == ["a", "c", "big"]  # larger than the whole cache: nothing stays
    assert len(hot) == 0 and hot.num_used_bytes == 0


def reporter(redis: object, redis_url: str, name: str, capacity: int = 100, **overrides: object) -> FleetReporter:
    settings = Settings(broker_url=redis_url, affinity_ttl=30, **overrides)
    counters = {"encoded_images": 1, "encoder_cache_bytes": capacity, "encoder_bytes_per_token": 10}
    return FleetReporter(redis, settings, MODEL, name, ["xs", "s"], lambda: dict(counters))


def test_routes_are_claimed_by_the_first_server_and_forgotten_on_eviction(redis_client: object,
                                                                          redis_url: str) -> None:
    a, b = reporter(redis_client, redis_url, "host:1"), reporter(redis_client, redis_url, "host:2")
    a.claim("inputs/x")
    b.claim("inputs/x")  # a holds it: b does not take the route over
    route = affinity.Route.decode(redis_client.get(keys.hot_input("inputs/x", MODEL)))
    assert route == affinity.Route("host-1", frozenset({"xs", "s"}))
    assert 0 < redis_client.ttl(keys.hot_input("inputs/x", MODEL)) <= 30
    a.served("inputs/x", image_tokens=6)  # 60 of a's 100 bytes
    b.served("inputs/y", image_tokens=6)
    a.served("inputs/z", image_tokens=6)  # evicts x from a's hot set: its route goes
    assert redis_client.get(keys.hot_input("inputs/x", MODEL)) is None
    assert redis_client.get(keys.hot_input("inputs/z", MODEL)).startswith(b"host-1 ")
    assert redis_client.get(keys.hot_input("inputs/y", MODEL)).startswith(b"host-2 ")
    stats = redis_client.hgetall(keys.worker_stats("host:1"))
    assert stats[b"jobs_served"] == b"2" and stats[b"encoded_images"] == b"1" and stats[b"model"] == b"tiny-shapes"


def test_no_routes_with_affinity_off_but_the_counters_still_go_out(redis_client: object, redis_url: str) -> None:
    a = reporter(redis_client, redis_url, "w1", affinity=False)
    a.claim("inputs/x")
    a.served("inputs/x", image_tokens=1)
    assert redis_client.get(keys.hot_input("inputs/x", MODEL)) is None
    assert redis_client.hget(keys.worker_stats("w1"), "jobs_served") == b"1"


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("dies", [True, False])
def test_a_beat_drains_a_dead_workers_queue_and_forgets_it_later(redis_client: object, redis_url: str,
                                                                 tmp_path: Path, dies: bool) -> None:
    dead, live = reporter(redis_client, redis_url, "w1"), reporter(redis_client, redis_url, "w2")
    dead.beat()  # registers w1
    data = png()
    hot = keys.input_object(hashlib.sha256(data).hexdigest())
    dead.claim(hot)
    with Client(settings=Settings(broker_url=redis_url, storage_url=f"file://{tmp_path}")) as client:
        jobs = client.submit_many([{"image": data, "prompt": f"q{i}"} for i in range(3)])
    own = keys.worker_queue(MODEL, "xs", "w1")
    assert {j.info()["queue"] for j in jobs} == {own}
    if dies:
        dead.stop()  # its heartbeat goes at once (a SIGKILL lets it expire)
    assert not live._take_sweep()  # w1's beat swept this period
    redis_client.delete(keys.affinity_sweep(MODEL))  # the period is over
    live.beat()
    shared_depth, own_depth = affinity.queue_depths(redis_client, [keys.queue(MODEL, "xs"), own])
    assert (shared_depth, own_depth) == ((3, 0) if dies else (0, 3))
    live.forget_after = 0  # long dead: forgotten once its queues are empty
    live.sweep()
    assert (redis_client.zscore(keys.affinity_workers(MODEL), "w1") is None) == dies


def test_a_worker_counts_once_in_vlmq_top_and_once_in_the_cache_stats(redis_client: object, redis_url: str) -> None:
    from vlmq.cachestats import worker_stats
    from vlmq.fleet import worker_statuses
    from vlmq.workers.status import StatusWriter

    name = "host:9"  # the default worker name's form: its slug differs
    reporter(redis_client, redis_url, name)._publish_stats()  # the affinity heartbeat and cache counters
    status = StatusWriter(redis_client, name, {"model": MODEL}, lambda: (0, 0))
    redis_client.hset(status.key, mapping=status.fields())  # what its thread writes every few seconds
    redis_client.expire(status.key, 10)
    assert list(worker_statuses(redis_client)) == [name]
    assert list(worker_stats(redis_client)) == [keys.worker_slug(name)]
