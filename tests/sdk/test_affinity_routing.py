"""Cache-affinity routing: the routing decision, the producer's routes and the drain script (real Valkey)."""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from vlmq import affinity, keys
from vlmq.affinity import Route
from vlmq.client import Client
from vlmq.settings import Settings

MODEL = "tiny-shapes"


def png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), colour).save(buf, "PNG")
    return buf.getvalue()


def hot_key(data: bytes, tenant: str | None = None) -> str:
    return keys.hot_input(keys.input_object(hashlib.sha256(data).hexdigest(), tenant), MODEL)


def queued(redis: object, queue: str) -> list[tuple[str, dict]]:
    """(list, message) of every message in a queue's lists, next to pop first, priority order."""
    out = []
    for lst in keys.queue_lists(queue):
        out += [(lst, json.loads(m)) for m in reversed(redis.lrange(lst, 0, -1))]
    return out


def job_ids(messages: list[tuple[str, dict]]) -> list[str]:
    return [m["headers"]["argsrepr"].strip("[]'") for _, m in messages]


@pytest.fixture
def settings(redis_client: object, redis_url: str, tmp_path: Path) -> Settings:
    return Settings(broker_url=redis_url, storage_url=f"file://{tmp_path / 'store'}", affinity_queue_bound=3)


def test_a_hot_image_goes_to_the_shared_queue_when_its_worker_does_not_take_its_class_or_the_route_is_bad(
        settings: Settings, redis_client: object) -> None:
    data = png((200, 0, 200))
    with Client(settings=settings) as client:
        for route in ("w1 s,m", "w.1 xs", "w:1 xs", " xs", "w1", "x" * 65 + " xs"):  # xs not taken; malformed
            redis_client.set(hot_key(data), route, ex=30)
            job = client.submit(data, "q")
            assert job.info()["queue"] == "vlmq.tiny-shapes.xs", route
            assert job.id in job_ids(queued(redis_client, "vlmq.tiny-shapes.xs")), route
        redis_client.set(hot_key(data), "w-1_b xs", ex=30)
        assert client.submit(data, "q").info()["queue"] == "vlmq.tiny-shapes.xs.w.w-1_b"


def test_routes_round_trip_and_malformed_ones_mean_the_shared_queue() -> None:
    route = Route(keys.worker_slug("host:12"), frozenset({"s", "xs"}))
    assert route.worker == "host-12" and route.encode() == "host-12 s,xs"
    assert Route.decode(route.encode().encode()) == route
    for bad in (None, b"", b" xs", b"w.1 xs", b"w:1 xs"):
        assert Route.decode(bad) is None
    assert keys.worker_queue(MODEL, "xs", "host:12") == "vlmq.tiny-shapes.xs.w.host-12"  # ':' is kombu's separator


def test_submit_routes_a_hot_image_to_its_worker_up_to_the_bound(settings: Settings, redis_client: object) -> None:
    hot, cold = png((200, 0, 0)), png((0, 200, 0))
    redis_client.set(hot_key(hot), "w1 xs,s", ex=30)  # as a worker writes it
    with Client(settings=settings) as client:
        jobs = client.submit_many([{"image": hot, "prompt": f"q{i}"} for i in range(5)] +
                                  [{"image": cold, "prompt": "q"}])
        assert [j.info()["queue"] for j in jobs] == ["vlmq.tiny-shapes.xs.w.w1"] * 3 + ["vlmq.tiny-shapes.xs"] * 3
        routed = queued(redis_client, "vlmq.tiny-shapes.xs.w.w1")
        assert job_ids(routed) == [j.id for j in jobs[:3]]
        assert {m["properties"]["delivery_info"]["routing_key"] for _, m in routed} == {"vlmq.tiny-shapes.xs.w.w1"}
        assert redis_client.llen(keys.wake("vlmq.tiny-shapes.xs.w.w1")) == 1  # an idle w1 wakes at once
        assert client.submit(hot, "later").info()["queue"] == "vlmq.tiny-shapes.xs"  # w1's queue is at its bound


def test_affinity_off_sends_every_job_to_the_shared_queue(settings: Settings, redis_client: object) -> None:
    hot = png((200, 0, 0))
    redis_client.set(hot_key(hot), "w1 xs", ex=30)  # as a worker writes it
    with Client(settings=Settings(**{**_fields(settings), "affinity": False})) as client:
        assert client.submit(hot, "q").info()["queue"] == "vlmq.tiny-shapes.xs"
    assert not queued(redis_client, "vlmq.tiny-shapes.xs.w.w1")


def _fields(settings: Settings) -> dict:
    return {name: getattr(settings, name) for name in Settings.__dataclass_fields__}


def _fill_worker_queue(settings: Settings, redis_client: object, n: int) -> list[str]:
    """n jobs on w1's own xs queue, priorities alternating 5 and 0."""
    hot = png((0, 0, 200))
    redis_client.set(hot_key(hot), "w1 xs", ex=30)  # as a worker writes it
    with Client(settings=Settings(**{**_fields(settings), "affinity_queue_bound": 100})) as client:
        return [client.submit(hot, f"q{i}", priority=0 if i % 2 else 5).id for i in range(n)]


def test_a_dead_workers_queue_drains_whole_to_the_head_of_the_shared_queue(settings: Settings,
                                                                              redis_client: object) -> None:
    ids = _fill_worker_queue(settings, redis_client, 6)
    own, shared = "vlmq.tiny-shapes.xs.w.w1", "vlmq.tiny-shapes.xs"
    with Client(settings=settings) as client:
        waiting = client.submit(png((9, 9, 9)), "already waiting").id  # on the shared queue, priority 5
    assert affinity.drain(redis_client, MODEL, "xs", "w1", bound=3) == 6  # no heartbeat: w1 is dead
    assert not queued(redis_client, own)
    moved = queued(redis_client, shared)
    # priority lists kept; within each, the moved jobs come first, oldest first, then what already waited
    assert job_ids(moved) == [ids[1], ids[3], ids[5], ids[0], ids[2], ids[4], waiting]
    assert [lst for lst, _ in moved] == [shared] * 3 + [f"{shared}:5"] * 4
    assert {m["properties"]["delivery_info"]["routing_key"] for _, m in moved} == {shared}  # the gate checks it
    assert affinity.drain(redis_client, MODEL, "xs", "w1", bound=3) == 0


def test_a_live_consumers_queue_keeps_its_bound_and_moves_the_rest(settings: Settings, redis_client: object) -> None:
    _fill_worker_queue(settings, redis_client, 6)
    redis_client.hset(keys.worker_stats("w1"), mapping={"model": MODEL, "own_queue_classes": "s"})
    redis_client.expire(keys.worker_stats("w1"), 30)  # a heartbeat expires unless renewed
    assert affinity.drain(redis_client, MODEL, "xs", "w1", bound=4) == 6  # alive, but no longer consuming xs
    ids = _fill_worker_queue(settings, redis_client, 6)
    redis_client.delete(*keys.queue_lists("vlmq.tiny-shapes.xs"))
    redis_client.hset(keys.worker_stats("w1"), "own_queue_classes", "s,xs")  # w1's heartbeat: it consumes xs
    assert affinity.drain(redis_client, MODEL, "xs", "w1", bound=4) == 2
    # the lowest priority list gives up its oldest jobs first
    assert job_ids(queued(redis_client, "vlmq.tiny-shapes.xs")) == [ids[0], ids[2]]
    assert job_ids(queued(redis_client, "vlmq.tiny-shapes.xs.w.w1")) == [ids[1], ids[3], ids[5], ids[4]]
