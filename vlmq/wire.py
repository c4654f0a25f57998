"""vlmq's Celery task message, written straight to Redis: the bytes ``send_task`` writes, without Celery.

A producer publishes with ``LPUSH <queue list> <envelope>`` inside the same Redis transaction as the job
records (one round trip per chunk of jobs instead of one per message). The envelope is kombu's Redis
transport form of a Celery protocol 2 message for ``vlmq.run_job`` with JSON body
``[[job_id], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]``, the same keys in
the same order as ``Celery.send_task(..., declare=[])`` produces (kombu 5.7 / Celery 5.7; the contract is
tested against ``send_task`` itself and against the worker's message gate).
"""
from __future__ import annotations

import base64
import json
import os
import socket
import uuid

from vlmq import keys
from vlmq.queue import TASK_NAME

_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


class MessageWriter:
    """Builds task messages for one producer process (its ``origin`` and ``reply_to`` are fixed)."""

    def __init__(self) -> None:
        self.origin = f"gen{os.getpid()}@{socket.gethostname()}"  # Celery's anon_nodename()
        self.reply_to = str(uuid.uuid4())

    def message(self, job_id: str, queue: str, priority: int, task_id: str | None = None) -> bytes:
        """The envelope of one job's message, as kombu's Redis transport stores it."""
        task_id = task_id or str(uuid.uuid4())
        body = json.dumps([[job_id], {}, _EMBED]).encode()
        envelope = {
            "body": base64.b64encode(body).decode(), "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {"lang": "py", "task": TASK_NAME, "id": task_id, "shadow": None, "eta": None,
                        "expires": None, "group": None, "group_index": None, "retries": 0,
                        "timelimit": [None, None], "root_id": task_id, "parent_id": None,
                        "argsrepr": repr([job_id]), "kwargsrepr": "{}", "origin": self.origin,
                        "ignore_result": None, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {}},
            "properties": {"correlation_id": task_id, "reply_to": self.reply_to, "delivery_mode": 2,
                           "delivery_info": {"exchange": "", "routing_key": queue}, "priority": priority,
                           "body_encoding": "base64", "delivery_tag": str(uuid.uuid4())},
        }
        return json.dumps(envelope).encode()


def list_for(queue: str, priority: int) -> str:
    """The Redis list a message of this priority goes to (kombu's ``_q_for_pri`` with vlmq's steps)."""
    return keys.priority_list(queue, priority)
