"""vlmq.wire writes the bytes Celery's send_task writes, and the worker's message gate accepts them."""
from __future__ import annotations

import json

from vlmq import keys
from vlmq.queue import TASK_NAME, make_celery
from vlmq.settings import Settings
from vlmq.wire import MessageWriter, list_for
from vlmq.workers.gate import Gate

JOB_ID = "0123456789abcdef0123456789abcdef"
QUEUE = "vlmq.tiny-shapes.s"


def test_written_message_is_byte_identical_to_send_task_but_for_its_random_ids(redis_client, redis_url) -> None:
    app = make_celery(Settings(broker_url=redis_url), name="vlmq-producer")
    with app.producer_or_acquire() as producer:
        for priority in (0, 3):
            app.send_task(TASK_NAME, args=[JOB_ID], queue=QUEUE, retry=False, producer=producer,
                          priority=priority, declare=[], task_id="fixed-task-id")
    app.close()
    writer = MessageWriter()
    for priority in (0, 3):
        [celery_raw] = redis_client.lrange(keys.priority_list(QUEUE, priority), 0, -1)
        assert list_for(QUEUE, priority) == keys.priority_list(QUEUE, priority)
        celery_msg = json.loads(celery_raw)
        ours = json.loads(writer.message(JOB_ID, QUEUE, priority, task_id="fixed-task-id"))
        # the per-message random values: take Celery's, then every byte must match
        for name in ("reply_to", "delivery_tag"):
            ours["properties"][name] = celery_msg["properties"][name]
        assert json.dumps(ours).encode() == celery_raw


def test_the_gate_accepts_written_messages_and_refuses_a_tampered_one() -> None:
    raw = MessageWriter().message(JOB_ID, QUEUE, 5)
    envelope, reason = Gate().check(QUEUE, raw)
    assert envelope is not None and reason == ""
    envelope, reason = Gate().check("vlmq.tiny-shapes.m", raw)
    assert envelope is None and reason.startswith("wrong_queue")
