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

from vlmq import keys
from vlmq.queue import TASK_NAME, make_celery
from vlmq.settings import Settings
from vlmq.workers.broker import MAX_MESSAGE_BYTES, pop_command

QUEUE = keys.queue("atomic-pop-test", "xs")


@pytest.fixture()
def channel(redis_url: str) -> Iterator[Any]:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    app = make_celery(Settings(broker_url=redis_url, visibility_timeout=1))
    with app.connection_for_write() as conn:
        app.send_task(TASK_NAME, args=["job-1"], queue=QUEUE, priority=3)
        yield conn.default_channel


def queued(channel: Any) -> list[bytes]:
    return [m for key in keys.queue_lists(QUEUE) for m in channel.client.lrange(key, 0, -1)]


def test_a_popped_message_is_unacked_in_the_same_step_and_restored_after_the_timeout(channel: Any) -> None:
    [original] = queued(channel)
    key, item, state, tag = channel.client.execute_command(*pop_command(keys.queue_lists(QUEUE)))
    assert item == original and key.decode() == keys.priority_list(QUEUE, 3) and state == b"recorded"
    assert queued(channel) == []
    assert tag.decode() == json.loads(item)["properties"]["delivery_tag"]
    stored, exchange, routing_key = json.loads(channel.client.hget(keys.UNACKED, tag))
    assert stored == json.loads(item) and routing_key == QUEUE and exchange == json.loads(item)[
        "properties"]["delivery_info"]["exchange"]
    assert channel.client.zscore(keys.UNACKED_INDEX, tag) is not None

    time.sleep(1.2)  # past the visibility timeout: the popping worker never acked
    channel.qos.restore_visible(num=10, interval=1)
    [back] = [json.loads(m) for m in queued(channel)]
    sent = json.loads(original)
    assert back["body"] == sent["body"] and back["properties"]["delivery_tag"] == tag.decode()
    assert back["headers"]["redelivered"] is True  # kombu's restore marks it; Celery sees a redelivery
    assert channel.client.hlen(keys.UNACKED) == 0
    assert back["headers"]["task"] == TASK_NAME and back["properties"]["priority"] == 3


def test_an_empty_pop_changes_nothing_and_foreign_messages_are_flagged(channel: Any) -> None:
    channel.client.delete(*keys.queue_lists(QUEUE))
    assert channel.client.execute_command(*pop_command([QUEUE])) is None
    channel.client.lpush(QUEUE, b"not json")  # another producer's garbage: popped for the gate, not recorded
    assert channel.client.execute_command(*pop_command([QUEUE]))[1:3] == [b"not json", b"unrecorded"]
    assert channel.client.hlen(keys.UNACKED) == 0
    channel.client.lpush(QUEUE, b"x" * (MAX_MESSAGE_BYTES + 10))  # only a prefix leaves Redis
    _, item, state, _ = channel.client.execute_command(*pop_command([QUEUE]))
    assert (len(item), state) == (MAX_MESSAGE_BYTES, b"oversized")


def test_a_forged_copy_of_a_held_delivery_tag_is_flagged_and_leaves_the_holder_alone(channel: Any) -> None:
    [original] = queued(channel)
    channel.client.execute_command(*pop_command(keys.queue_lists(QUEUE)))
    channel.client.lpush(QUEUE, original)  # same delivery tag as the message now held
    _, item, state, tag = channel.client.execute_command(*pop_command(keys.queue_lists(QUEUE)))
    assert state == b"duplicate" and channel.client.hexists(keys.UNACKED, tag)
