"""``vlmq delivery``: the webhook delivery worker, a CPU-only Celery worker on the ``vlmq.webhooks`` queue.

GPU workers only queue an event (``vlmq.webhooks.enqueue_event``: one Redis script); everything slow
happens here, so a slow or dead receiver never holds a GPU worker.

- **Schedule**: a thread in each delivery worker claims due events from ``keys.webhook_due`` (a script
  that pushes their due time one lease ahead) and publishes one ``vlmq.deliver_webhook`` task per event. A
  worker that dies mid-attempt leaves the event in the set, so it is claimed again when the lease runs
  out: delivery is at least once, and receivers deduplicate on ``webhook-id``.
- **Attempt**: the address guard (``vlmq.webhook_guard``) resolves the host and checks every address;
  the request goes to the checked address with a bounded time (``VLMQ_WEBHOOK_TIMEOUT`` for the connect,
  each read, and the whole request, TLS handshake included); redirects are never followed.
- **TLS**: an ``https://`` target gets SNI, ``Host`` and the certificate check for the URL's host name, not for
  the pinned address; the trust store is the system's (``SSL_CERT_FILE``/``SSL_CERT_DIR`` replace it) plus
  ``VLMQ_WEBHOOK_CA_FILE`` (a private CA). A certificate that fails is an attempt's error like any other
  (retried); nothing is ever sent without a verified certificate.
- **Outcome**: 2xx delivered; 410 Gone disables the endpoint (its later events are not sent); a refused
  target fails at once; anything else (other statuses, 3xx, timeouts, connection errors) is retried after
  the next delay of ``VLMQ_WEBHOOK_RETRY_SCHEDULE`` ±20% (longer when a 429/503 asks with
  ``Retry-After``), and fails after the last. Every attempt is appended to the job's (or batch's)
  delivery list (``Job.deliveries()``).
"""
from __future__ import annotations

import argparse
import http.client
import json
import logging
import random
import re
import socket
import ssl
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from vlmq import keys, webhooks
from vlmq.errors import BackendError
from vlmq.settings import Settings, parse_delays
from vlmq.storage import ObjectTooLarge, Storage
from vlmq.store import JobStatus, decode_record, now, read
from vlmq.webhook_guard import Network, Refused, Resolver, parse_networks, resolve, split_url

log = logging.getLogger(__name__)
DELIVER_TASK = "vlmq.deliver_webhook"
EVENT_ID_RE = re.compile(r"evt_[0-9a-f]{32}")
JITTER = 0.2  # each retry delay is scaled by a uniform factor in [1 - JITTER, 1 + JITTER]
_JITTER_RNG = random.Random()  # its own generator: the jitter never moves the process's global random state
RESULT_URL_EXPIRES = 7 * 24 * 3600  # presigned result URLs (the longest SigV4 allows)

# KEYS[1]=due set; ARGV[1]=now, ARGV[2]=lease end, ARGV[3]=most ids. Claims due events by moving them one lease
# ahead, so two delivery workers never take the same one, and one that dies loses nothing.
_CLAIM = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], ARGV[2], id) end
return ids
"""


@dataclass(slots=True)
class DeliveryContext:
    settings: Settings
    redis: Any
    storage: Storage
    secrets: list[str]
    resolver: Resolver = socket.getaddrinfo
    allow: tuple[Network, ...] = field(init=False)
    delays: tuple[float, ...] = field(init=False)
    tls: ssl.SSLContext = field(init=False)

    def __post_init__(self) -> None:
        self.allow = parse_networks(self.settings.webhook_allow)
        self.delays = parse_delays(self.settings.webhook_retry_schedule)
        self.tls = tls_context(self.settings.webhook_ca_file)

    @property
    def lease(self) -> float:
        """Seconds a claimed event stays hidden from other claims: longer than any attempt takes."""
        return 2 * self.settings.webhook_timeout + 30


def tls_context(ca_file: str = "") -> ssl.SSLContext:
    """The context every https delivery verifies with: the system's trust store, plus ``ca_file`` when given.

    Raises:
        OSError, ssl.SSLError: ``ca_file`` cannot be read or holds no certificate.
    """
    context = ssl.create_default_context()  # verifies the chain and the host name; TLS 1.2 at least
    if ca_file:
        context.load_verify_locations(cafile=ca_file)
    return context


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to an address the guard checked, whatever the host name resolves to now."""

    def __init__(self, host: str, port: int, ip: str, timeout: float, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(host, port, timeout=timeout)
        self.ip = ip
        self.tls = tls
        self.aborted = False

    def connect(self) -> None:
        self.sock = socket.create_connection((self.ip, self.port), self.timeout)

    def abort(self) -> None:
        """Cut the connection (from the watchdog thread): a blocked read or TLS handshake returns at once."""
        self.aborted = True
        sock = self.sock
        if sock is not None:
            try:  # the plain socket's shutdown: SSLSocket's own drops its TLS state under a reading thread
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass


class _PinnedHTTPS(_PinnedHTTP):
    """TLS to the pinned address, with SNI and the certificate check for the URL's host name."""

    def connect(self) -> None:
        assert self.tls is not None
        raw = socket.create_connection((self.ip, self.port), self.timeout)
        # the handshake runs after self.sock is the TLS socket, so the watchdog can cut a handshake that trickles
        self.sock = self.tls.wrap_socket(raw, server_hostname=self.host, do_handshake_on_connect=False)
        self.sock.do_handshake()


@dataclass(slots=True)
class Reply:
    status: int
    location: str
    retry_after: str


def post(url: str, headers: dict[str, str], data: bytes, *, timeout: float, allow: Sequence[Network] = (),
         resolver: Resolver = socket.getaddrinfo, tls: ssl.SSLContext | None = None) -> Reply:
    """POST ``data`` to ``url`` once: guarded address, no redirects, at most ``timeout`` s for the request.

    ``tls`` verifies https targets (default: :func:`tls_context`, the system's trust store).

    Raises:
        Refused: the guard refused the URL or an address it resolves to.
        OSError, http.client.HTTPException: the request failed (``TimeoutError`` when it took too long,
            ``ssl.SSLCertVerificationError`` when the certificate was not trusted or not for the host).
    """
    scheme, host, port = split_url(url)
    ip = resolve(host, port, allow, resolver)
    if scheme == "https":
        conn: _PinnedHTTP = _PinnedHTTPS(host, port, ip, timeout, tls or tls_context())
    else:
        conn = _PinnedHTTP(host, port, ip, timeout)
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    watchdog = threading.Timer(timeout, conn.abort)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request("POST", path, body=data, headers={**headers, "content-type": "application/json",
                                                       "user-agent": "vlmq-webhooks"})
        response = conn.getresponse()
        response.read(4096)
        return Reply(response.status, response.getheader("location") or "", response.getheader("retry-after") or "")
    except (OSError, http.client.HTTPException) as e:
        if conn.aborted:
            raise TimeoutError(f"no complete answer within {timeout:g} s") from e
        raise
    finally:
        watchdog.cancel()
        conn.close()


def job_data(ctx: DeliveryContext, job_id: str, event_type: str) -> dict[str, Any]:
    """A job event's ``data``: id, status, result (inline when small, else ``result_url``/``result_key``), error."""
    record = read(ctx.redis, job_id)
    status = record.get("status") or event_type.partition(".")[2]
    data: dict[str, Any] = {"id": job_id, "status": status, "result": None, "error": None}
    if status == JobStatus.FAILED.value:
        data["error"] = {"type": record.get("error_type", "unknown"), "message": record.get("error_message", ""),
                         "retryable": record.get("retryable") == "1"}
    elif status == JobStatus.CANCELED.value:
        data["error"] = {"type": "canceled", "message": f"job {job_id} was canceled", "retryable": False}
    elif status == JobStatus.FINISHED.value:
        key = data["result_key"] = keys.result_object(job_id)
        try:
            data["result"] = json.loads(ctx.storage.get_capped(key, ctx.settings.webhook_inline_max))
        except ObjectTooLarge:
            data["result_url"] = ctx.storage.presigned_url(key, RESULT_URL_EXPIRES)
        except KeyError:
            data["error"] = {"type": "result_missing", "message": f"result object {key} is missing",
                             "retryable": False}
    return data


def _body_text(ctx: DeliveryContext, event_id: str, event: dict[str, str]) -> str:
    """The event's body; a job event's data is built on its first attempt and kept, so every attempt sends it."""
    if not event["data"]:
        event["data"] = json.dumps(job_data(ctx, event["subject"], event["type"]))
        ctx.redis.hset(keys.webhook_event(event_id), "data", event["data"])
    return webhooks.body(event["type"], float(event["created_at"]), json.loads(event["data"]))


def _send(ctx: DeliveryContext, event_id: str, event: dict[str, str], entry: dict[str, Any]) -> str:
    """One attempt; fills ``entry`` and returns ``delivered``, ``disabled``, ``refused`` or ``error``."""
    url = event["url"]
    if ctx.redis.exists(keys.webhook_disabled(webhooks.url_digest(url))):
        entry["error"] = "endpoint disabled: it answered 410 Gone to an earlier event"
        return "disabled"
    try:
        text = _body_text(ctx, event_id, event)
        headers = webhooks.sign(ctx.secrets, event_id, now(), text)
        reply = post(url, headers, text.encode(), timeout=ctx.settings.webhook_timeout, allow=ctx.allow,
                     resolver=ctx.resolver, tls=ctx.tls)
    except Refused as e:
        entry["error"] = f"refused: {e}"
        return "refused"
    except ssl.SSLCertVerificationError as e:
        entry["error"] = (f"TLS certificate rejected: {e.verify_message or e}; not sent. A receiver with a private "
                          "CA needs it in VLMQ_WEBHOOK_CA_FILE")[:500]
        return "error"
    except ssl.SSLError as e:
        entry["error"] = f"TLS handshake failed: {e.reason or e}; not sent"[:500]
        return "error"
    except (OSError, http.client.HTTPException, BackendError) as e:
        entry["error"] = f"{type(e).__name__}: {e}"[:500]
        return "error"
    entry["status_code"] = reply.status
    if 200 <= reply.status < 300:
        return "delivered"
    if reply.status == 410:
        ctx.redis.set(keys.webhook_disabled(webhooks.url_digest(url)), "410", ex=ctx.settings.job_ttl)
        entry["error"] = "410 Gone: endpoint disabled"
        return "disabled"
    if 300 <= reply.status < 400:
        entry["error"] = f"redirect to {reply.location[:200]!r} not followed; a webhook must answer 2xx itself"
    else:
        entry["error"] = f"HTTP {reply.status}"
    entry["retry_after"] = reply.retry_after if reply.status in (429, 503) else ""
    return "error"


def _next_delay(ctx: DeliveryContext, attempt: int, retry_after: str) -> float | None:
    """Seconds until the next attempt after failed attempt number ``attempt`` (None: no more attempts)."""
    if attempt > len(ctx.delays):
        return None
    delay = ctx.delays[attempt - 1] * _JITTER_RNG.uniform(1 - JITTER, 1 + JITTER)
    if retry_after.isdigit():  # the receiver asks for a pause; never longer than the schedule's longest step
        delay = max(delay, min(float(retry_after), max(ctx.delays)))
    return delay


def malformed(event: dict[str, str]) -> str | None:
    """Why an event hash cannot be sent (anything in Redis may be forged or corrupt), or None."""
    if event.get("type") not in webhooks.EVENT_TYPES:
        return f"unknown type {event.get('type', '')[:40]!r}"
    if not 0 < len(event.get("subject", "")) <= 200 or not event.get("url"):
        return "no subject or url"
    if not event.get("attempts", "").isdigit():
        return "bad attempts"
    try:
        float(event.get("created_at", ""))
        json.loads(event.get("data") or "{}")
    except ValueError:
        return "bad created_at or data"
    return None


def attempt(ctx: DeliveryContext, event_id: str) -> str:
    """Deliver one event once and schedule what follows; returns the attempt's outcome."""
    event_key, due = keys.webhook_event(event_id), keys.webhook_due()
    event = decode_record(ctx.redis.hgetall(event_key))
    why = malformed(event) if event.get("state") == "pending" else None
    if event.get("state") != "pending" or why:
        if why:  # dropped for good, never raised into the consumer (it would come back every lease)
            log.warning("webhook %s dropped: malformed event (%s)", event_id, why)
            ctx.redis.hset(event_key, "state", "failed")
        ctx.redis.zrem(due, event_id)
        return "malformed" if why else event.get("state", "missing")
    number, started = int(event["attempts"]) + 1, now()
    entry: dict[str, Any] = {"event_id": event_id, "type": event["type"], "attempt": number, "at": started,
                             "url": event["url"], "status_code": None, "error": ""}
    outcome = _send(ctx, event_id, event, entry)
    entry["duration_s"] = round(now() - started, 3)
    delay = _next_delay(ctx, number, entry.pop("retry_after", "")) if outcome == "error" else None
    pipe = ctx.redis.pipeline(transaction=True)
    pipe.hset(event_key, "attempts", number)
    if delay is not None:
        outcome, entry["next_at"] = "retry", now() + delay
        pipe.zadd(due, {event_id: entry["next_at"]})
    else:
        outcome = "failed" if outcome == "error" else outcome
        pipe.hset(event_key, "state", "failed" if outcome == "refused" else outcome)
        pipe.zrem(due, event_id)
    pipe.execute()
    entry["outcome"] = outcome
    webhooks.record_attempt(ctx.redis, event["subject"], entry, ctx.settings.job_ttl)
    log.info("webhook %s (%s for %s) attempt %d: %s %s", event_id, event["type"], event["subject"], number,
             outcome, entry["error"])
    return outcome


def claim_due(ctx: DeliveryContext, limit: int = 100) -> list[str]:
    """Event ids whose attempt is due, claimed for one lease."""
    t = now()
    return [i.decode() if isinstance(i, bytes) else i
            for i in ctx.redis.eval(_CLAIM, 1, keys.webhook_due(), repr(t), repr(t + ctx.lease), limit)]


def schedule_loop(app: Any, ctx: DeliveryContext, stop: threading.Event) -> None:
    """Publish a delivery task for every due event until ``stop`` is set."""
    while not stop.wait(ctx.settings.webhook_poll):
        try:
            for event_id in claim_due(ctx):
                try:
                    app.send_task(DELIVER_TASK, args=[event_id], queue=keys.WEBHOOK_QUEUE, retry=False)
                except Exception:  # the broker hiccuped: make it due again rather than wait out the lease
                    ctx.redis.zadd(keys.webhook_due(), {event_id: now()})
                    raise
        except Exception:
            log.exception("webhook schedule: claiming or publishing failed; trying again")


def make_delivery_app(ctx: DeliveryContext) -> Any:
    """The delivery worker's Celery app: one task, on the ``vlmq.webhooks`` queue."""
    from kombu.entity import Queue

    from vlmq.queue import make_celery

    app = make_celery(ctx.settings, name="vlmq-delivery")
    app.conf.task_queues = [Queue(keys.WEBHOOK_QUEUE, routing_key=keys.WEBHOOK_QUEUE)]  # type: ignore[no-untyped-call]
    app.conf.worker_concurrency = ctx.settings.webhook_concurrency
    app.conf.worker_pool = "threads"

    def deliver_webhook(event_id: str) -> str:
        if not isinstance(event_id, str) or not EVENT_ID_RE.fullmatch(event_id):
            log.warning("webhook task with a bad event id %r dropped", str(event_id)[:80])
            return "bad"
        return attempt(ctx, event_id)

    app.task(name=DELIVER_TASK, acks_late=True)(deliver_webhook)
    return app


def run_delivery(settings: Settings, name: str | None = None) -> int:
    """Run one delivery worker until stopped."""
    import os

    import redis as redis_lib
    from celery.signals import worker_ready, worker_shutting_down

    from vlmq.storage import open_storage

    try:
        secrets = webhooks.parse_secrets(settings.webhook_secrets)
    except ValueError as e:
        raise SystemExit(f"vlmq delivery: VLMQ_WEBHOOK_SECRETS: {e}") from None
    if not secrets:
        raise SystemExit("vlmq delivery: set VLMQ_WEBHOOK_SECRETS to one or more whsec_ secrets (receivers verify "
                         "with them); `python -m vlmq.webhooks` prints a new one")
    try:
        tls_context(settings.webhook_ca_file)
    except OSError as e:  # ssl.SSLError too: a file without a certificate
        raise SystemExit(f"vlmq delivery: VLMQ_WEBHOOK_CA_FILE={settings.webhook_ca_file!r} is not a readable PEM "
                         f"file of CA certificates: {e}") from None
    ctx = DeliveryContext(settings, redis_lib.Redis.from_url(settings.broker_url, socket_connect_timeout=3),
                          open_storage(settings.storage_url, settings.s3_endpoint_url), secrets)
    app = make_delivery_app(ctx)
    stop = threading.Event()
    worker_ready.connect(lambda **_: threading.Thread(target=schedule_loop, args=(app, ctx, stop), daemon=True,
                                                     name="webhook-schedule").start(), weak=False)
    worker_shutting_down.connect(lambda **_: stop.set(), weak=False)
    name = name or f"{socket.gethostname()}:{os.getpid()}"
    log.info("delivery worker %s: queue %s, %d at once, timeout %g s, %d retries, CA file %s", name,
             keys.WEBHOOK_QUEUE, settings.webhook_concurrency, settings.webhook_timeout, len(ctx.delays),
             settings.webhook_ca_file or "none (system trust store)")
    app.worker_main(["worker", "--loglevel", "INFO", "--hostname", f"{name}@vlmq-delivery", "--without-gossip",
                     "--without-mingle", "--without-heartbeat", "--pool", "threads",
                     "--concurrency", str(settings.webhook_concurrency)])
    return 0


def main_from_args(args: argparse.Namespace) -> int:
    overrides = {"webhook_concurrency": args.concurrency} if args.concurrency else {}
    return run_delivery(Settings.from_env(**overrides), args.name)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from vlmq.worker_args import add_delivery_arguments

    parser = argparse.ArgumentParser(prog="vlmq delivery", description="Deliver webhooks (the vlmq.webhooks queue).")
    add_delivery_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
