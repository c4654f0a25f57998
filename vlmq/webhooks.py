"""Webhook events: what is sent, how it is signed, and how it is queued for the delivery workers.

An event is a hash in Redis (``keys.webhook_event``) plus an entry in the due set (``keys.webhook_due``);
:func:`enqueue_event` writes both in one script, so an event is durable the moment it is queued and
queuing it again (a redelivered job) changes nothing. Delivery workers (``vlmq.delivery``) take due events
from the set, post them, and record every attempt on the subject (``keys.deliveries``).

Events: ``job.finished``, ``job.failed``, ``job.canceled`` (sent when a job reaches its final status;
the job's webhook is the ``webhook`` field of its record) and ``batch.completed`` (sent by the batch code).
The body follows Standard Webhooks: ``{"type", "timestamp", "data"}``; a job's ``data`` holds ``id``,
``status``, ``result`` (the result document, or None when larger than ``VLMQ_WEBHOOK_INLINE_MAX``: then
``result_url``, presigned on S3, and ``result_key`` say where it is) and ``error``.

Signing (``webhook-id``, ``webhook-timestamp``, ``webhook-signature``) uses the ``standardwebhooks``
package; every secret in ``VLMQ_WEBHOOK_SECRETS`` signs, so receivers can rotate. Receivers verify with
:func:`verify` (or any Standard Webhooks library) and deduplicate on ``webhook-id``, which is the same on
every attempt of one event.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from vlmq import keys
from vlmq.store import now

log = logging.getLogger(__name__)
JOB_EVENTS = {"finished": "job.finished", "failed": "job.failed", "canceled": "job.canceled"}
EVENT_TYPES = frozenset({*JOB_EVENTS.values(), "batch.completed"})
MAX_DELIVERIES = 50  # attempts kept per job or batch (the newest)

# KEYS[1]=event hash, KEYS[2]=due set; ARGV[1]=event id, ARGV[2]=ttl, ARGV[3]=due time, ARGV[4..]=field, value.
# Writes the event and schedules it once: an event that exists already is left as it is (returns 0).
_ENQUEUE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
"""


def event_id(event_type: str, subject: str) -> str:
    """The stable ``webhook-id`` of a subject's event: the same on every attempt and every re-queue."""
    return "evt_" + hashlib.sha256(f"{event_type}:{subject}".encode()).hexdigest()[:32]


def enqueue_event(redis: Any, event_type: str, payload: Mapping[str, Any] | None, url: str, *,
                  subject: str | None = None, ttl: int = 7 * 24 * 3600) -> str:
    """Queue one event for the delivery workers; returns its id. Queuing the same event again is a no-op.

    Args:
        redis: a Redis client with worker credentials (``vlmq:*`` keys).
        event_type: one of :data:`EVENT_TYPES` (``batch.completed`` for a batch).
        payload: the body's ``data`` (JSON-serialisable), or None for a job event (the delivery worker
            builds it from the job's record and result on its first attempt).
        url: the receiver; checked again by the address guard when sent.
        subject: the job or batch id the event is about (default ``payload["id"]``); its attempts are
            recorded under it (``deliveries``).
        ttl: seconds the event is kept (at least as long as its retries take).

    Raises:
        ValueError: an unknown event type or no subject.
    """
    if event_type not in EVENT_TYPES:
        raise ValueError(f"unknown webhook event type {event_type!r}; one of {sorted(EVENT_TYPES)}")
    subject = subject or (str(payload["id"]) if payload and "id" in payload else None)
    if not subject:
        raise ValueError("a webhook event needs a subject (the job or batch id)")
    eid = event_id(event_type, subject)
    fields = {"url": url, "type": event_type, "subject": subject, "created_at": repr(now()), "attempts": 0,
              "state": "pending", "data": json.dumps(payload) if payload is not None else ""}
    pairs = [x for kv in fields.items() for x in kv]
    if redis.eval(_ENQUEUE, 2, keys.webhook_event(eid), keys.webhook_due(), eid, ttl, repr(now()), *pairs):
        log.info("webhook %s %s for %s queued", eid, event_type, subject)
    return eid


def job_ended(redis: Any, job_id: str, ttl: int) -> str | None:
    """After a job's final transition: queue its event if it has a webhook. Returns the event id, if any."""
    status, url = (v.decode() if isinstance(v, bytes) else v
                   for v in redis.hmget(keys.job(job_id), "status", "webhook"))
    if not url or status not in JOB_EVENTS:
        return None
    return enqueue_event(redis, JOB_EVENTS[status], None, url, subject=job_id, ttl=ttl)


def body(event_type: str, created_at: float, data: Mapping[str, Any]) -> str:
    """The exact text that is signed and sent (Standard Webhooks' ``type``/``timestamp``/``data``)."""
    stamp = datetime.fromtimestamp(created_at, tz=timezone.utc).isoformat().replace("+00:00", "Z")
    return json.dumps({"type": event_type, "timestamp": stamp, "data": data}, separators=(",", ":"))


def parse_secrets(raw: str) -> list[str]:
    """``whsec_...`` secrets separated by spaces or commas; each must decode to at least 16 bytes.

    Raises:
        ValueError: a secret is malformed.
    """
    import base64
    import binascii

    found = raw.replace(",", " ").split()
    for secret in found:
        try:
            text = secret[6:]
            ok = secret.startswith("whsec_") and len(base64.b64decode(text + "=" * (-len(text) % 4),
                                                                     validate=True)) >= 16
        except (binascii.Error, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"webhook secrets look like whsec_<base64 of 16 to 64 random bytes>, got "
                             f"{secret[:10]}...; `python -m vlmq.webhooks` prints a new one")
    return found


def new_secret() -> str:
    """A fresh signing secret in the ``whsec_`` form (24 random bytes)."""
    import base64
    import secrets

    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def sign(secrets: Sequence[str], msg_id: str, timestamp: float, text: str) -> dict[str, str]:
    """The three Standard Webhooks headers for one attempt; every secret adds one ``v1,`` signature."""
    from standardwebhooks import Webhook

    when = datetime.fromtimestamp(int(timestamp), tz=timezone.utc)
    signatures = " ".join(Webhook(s).sign(msg_id, when, text) for s in secrets)
    return {"webhook-id": msg_id, "webhook-timestamp": str(int(timestamp)), "webhook-signature": signatures}


def verify(secret: str, data: bytes | str, headers: Mapping[str, str]) -> Any:
    """For receivers: check a request's signature and timestamp (±5 min); returns the parsed body.

    Raises:
        standardwebhooks.WebhookVerificationError: a bad or missing signature, or a stale timestamp.
    """
    from standardwebhooks import Webhook

    return Webhook(secret).verify(data, dict(headers))


def url_digest(url: str) -> str:
    """Names an endpoint in Redis keys (``keys.webhook_disabled``)."""
    return hashlib.sha256(url.encode()).hexdigest()[:32]


def enable_endpoint(redis: Any, url: str) -> bool:
    """Resume deliveries to an endpoint disabled by a 410 Gone (events recorded ``disabled`` meanwhile stay so).

    Returns:
        Whether it was disabled.
    """
    return bool(redis.delete(keys.webhook_disabled(url_digest(url))))


def record_attempt(redis: Any, subject: str, entry: Mapping[str, Any], ttl: int) -> None:
    """Append one attempt to the subject's delivery list (bounded to the newest :data:`MAX_DELIVERIES`)."""
    key = keys.deliveries(subject)
    pipe = redis.pipeline(transaction=True)
    pipe.rpush(key, json.dumps(entry))
    pipe.ltrim(key, -MAX_DELIVERIES, -1)
    pipe.expire(key, ttl)
    pipe.execute()


def read_deliveries(redis: Any, subject: str) -> list[dict[str, Any]]:
    """Every recorded attempt for a job or batch, oldest first."""
    return [json.loads(raw) for raw in redis.lrange(keys.deliveries(subject), 0, -1)]


if __name__ == "__main__":
    print(new_secret())
