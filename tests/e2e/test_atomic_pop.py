"""The worker's pop: a message popped by a worker that then dies comes back to the queue.

kombu's own BRPOP-then-record leaves a window where a killed worker loses the
message for good; the chaos test caught a job queued forever that way. These
tests pop with the worker's script against the real Redis-compatible server,
never ack (the worker "died" right after the pop), and let kombu's own restore
sweep bring the message back.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from vlmq.queue import TASK_NAME, make_celery
from vlmq.settings import Settings
from vlmq.workers.redispop import pop_command

QUEUE = "vlmq.atomic-pop-test.xs"


@pytest.fixture()
def channel(redis_url: str) -> Iterator[Any]:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    app = make_celery(Settings(broker_url=redis_url, visibility_timeout=1))
    with app.connection_for_write() as conn:
        app.send_task(TASK_NAME, args=["job-1"], queue=QUEUE, priority=3)
        yield conn.default_channel


def queued(channel: Any) -> list[bytes]:
    return [m for key in channel.client.keys(f"{QUEUE}*") for m in channel.client.lrange(key, 0, -1)]


def test_a_popped_message_is_unacked_in_the_same_step_and_restored_after_the_timeout(channel: Any) -> None:
    [original] = queued(channel)
    keys = [channel._q_for_pri(QUEUE, p) for p in channel.priority_steps]
    key, item = channel.client.execute_command(*pop_command(channel, keys))
    assert item == original and key.decode().startswith(QUEUE)
    assert queued(channel) == []
    tag = json.loads(item)["properties"]["delivery_tag"]
    stored, exchange, routing_key = json.loads(channel.client.hget("unacked", tag))
    assert stored == json.loads(item) and routing_key == QUEUE and exchange == json.loads(item)[
        "properties"]["delivery_info"]["exchange"]
    assert channel.client.zscore("unacked_index", tag) is not None

    time.sleep(1.2)  # past the visibility timeout: the popping worker never acked
    channel.qos.restore_visible(num=10, interval=1)
    [back] = [json.loads(m) for m in queued(channel)]
    sent = json.loads(original)
    assert back["body"] == sent["body"] and back["properties"]["delivery_tag"] == tag
    assert back["headers"]["redelivered"] is True  # kombu's restore marks it; Celery sees a redelivery
    assert channel.client.hlen("unacked") == 0
    assert back["headers"]["task"] == TASK_NAME and back["properties"]["priority"] == 3


def test_an_empty_pop_changes_nothing_and_a_foreign_message_is_still_delivered(channel: Any) -> None:
    channel.client.delete(*channel.client.keys(f"{QUEUE}*"))
    assert channel.client.execute_command(*pop_command(channel, [QUEUE])) is None
    channel.client.lpush(QUEUE, b"not json")  # another producer's garbage: popped as BRPOP would, not recorded
    assert channel.client.execute_command(*pop_command(channel, [QUEUE]))[1] == b"not json"
    assert channel.client.hlen("unacked") == 0
