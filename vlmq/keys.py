"""Every Redis key and storage object name vlmq uses, under one prefix; job ids and tenants.

A job id is ``<32 hex>``, or ``<tenant>.<32 hex>`` for a tenant's job (:data:`JOB_ID_RE`). Every per-job
key and object name is derived from the job id, so a tenant's keys and objects are scoped by
construction: Redis ACL patterns (see ``vlmq.acl``) and object-store policies select them by prefix.

kombu's Redis transport owns the queue lists and the unacked structures; their names are spelled here
only (``vlmq.workers.broker`` checks at start-up that kombu still uses them).
"""
from __future__ import annotations

import re

PREFIX = "vlmq:"
PRIORITY_SEP = ":"  # kombu's ``sep`` transport option: priority p > 0 of queue q lives in the list ``q:p``
PRIORITY_STEPS = tuple(range(10))  # kombu's ``priority_steps``: 0 (highest) to 9, one list each
UNACKED = "unacked"  # kombu: hash delivery_tag -> [message, exchange, routing_key] of every delivered message
UNACKED_INDEX = "unacked_index"  # kombu: sorted set delivery_tag -> delivery time; leases refresh the score
TENANT_RE = r"[a-z0-9][a-z0-9-]{0,31}"
JOB_ID_RE = rf"(?:{TENANT_RE}\.)?[0-9a-f]{{32}}"
BATCH_ID_RE = rf"(?:{TENANT_RE}\.)?batch_[0-9a-f]{{32}}"
BATCH_FILES = ("output", "errors")  # a batch's result files, each a File (``batch_file_id``)
# a File: an upload (``file-[<tenant>.]<32 hex>``) or a batch's result file (``file-<batch id>.output|errors``)
FILE_ID_RE = rf"file-(?:(?:{TENANT_RE}\.)?[0-9a-f]{{32}}|{BATCH_ID_RE}\.(?:output|errors))"
_TENANT = re.compile(TENANT_RE)


def check_tenant(tenant: str) -> str:
    """``tenant`` if it is a valid tenant id: 1 to 32 of ``[a-z0-9-]``, starting with a letter or digit.

    Raises:
        ValueError: any other string.
    """
    if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
        raise ValueError(f"a tenant id is 1 to 32 characters of a-z, 0-9 and '-', starting with a letter or "
                         f"digit; got {tenant!r}")
    return tenant


def tenant_job_id(tenant: str | None, base: str) -> str:
    """The job id of a new job: ``<tenant>.<base>``, or ``base`` without a tenant."""
    return f"{tenant}.{base}" if tenant else base


def tenant_of(job_id: str) -> str | None:
    """The tenant a job id belongs to (``acme`` for ``acme.<hex>``), or None for an untenanted id."""
    head, sep, _ = job_id.partition(".")
    return head if sep and _TENANT.fullmatch(head) else None


def job(job_id: str) -> str:
    """Hash with the job record."""
    return f"{PREFIX}job:{job_id}"


def idempotency(key: str, tenant: str | None = None) -> str:
    """String holding the job id (and request fingerprint) submitted under an idempotency key.

    ``~<job id> <fingerprint>`` (pending) while the submit that claimed it enqueues the job; ``<job id>
    <fingerprint>`` once the job's record exists (``vlmq.idempotency``). A tenant's keys are its own:
    ``vlmq:idem:<tenant>.<key>``.
    """
    return f"{PREFIX}idem:{tenant_job_id(tenant, key)}"


def done(job_id: str) -> str:
    """List pushed once when a job reaches a final status; ``Job.result`` blocks on it."""
    return f"{PREFIX}done:{job_id}"


def canceled(job_id: str) -> str:
    """Durable cancellation flag, checked by workers before and during work."""
    return f"{PREFIX}cancel:{job_id}"


def result_guard(job_id: str) -> str:
    """``SET NX`` guard: the first worker to finish a job owns its result."""
    return f"{PREFIX}result-owner:{job_id}"


def deliveries(subject: str) -> str:
    """List of webhook delivery attempts (JSON, newest last, bounded, with a TTL) of a job or batch.

    Written by delivery workers (``vlmq.delivery``); read by ``Job.deliveries()``.
    """
    return f"{PREFIX}deliveries:{subject}"


WEBHOOK_QUEUE = "vlmq.webhooks"  # the Celery queue delivery workers consume (``vlmq delivery``)


def webhook_event(event_id: str) -> str:
    """Hash of one webhook event: URL, type, subject, body, attempts, state.

    Written by ``vlmq.webhooks.enqueue_event`` (GPU workers, the batch code) and delivery workers; read by
    delivery workers.
    """
    return f"{PREFIX}webhook:event:{event_id}"


def webhook_due() -> str:
    """Sorted set event id -> when its next attempt is due; the delivery workers' schedule (and outbox)."""
    return f"{PREFIX}webhook:due"


def webhook_disabled(url_digest: str) -> str:
    """Flag set when an endpoint answered 410 Gone: no more deliveries to it (delivery workers)."""
    return f"{PREFIX}webhook:disabled:{url_digest}"


def queue(model: str, cost_class: str) -> str:
    """Celery queue name for a model and cost class."""
    return f"vlmq.{model}.{cost_class}"


def worker_slug(name: str) -> str:
    """A worker name as it appears in key and queue names: ``[A-Za-z0-9_-]``, at most 64 characters.

    ``host:1234`` becomes ``host-1234`` (``:`` separates a queue from its priority lists).
    """
    return re.sub(r"[^A-Za-z0-9_-]", "-", name)[:64] or "worker"


def worker_queue(model: str, cost_class: str, worker: str) -> str:
    """One worker's own queue for a model and cost class (cache-affinity routing, ``vlmq.affinity``).

    The SDK sends a job here when its input is hot on that worker; the worker consumes it before the shared
    class queue; live workers drain it back to the shared queue when the worker dies or it grows too long.
    """
    return f"{worker_queue_prefix(model, cost_class)}{worker_slug(worker)}"


def worker_queue_prefix(model: str, cost_class: str) -> str:
    """What every worker's own queue for a model and cost class starts with (then the worker's slug)."""
    return f"{queue(model, cost_class)}.w."


def shared_queue(queue_name: str) -> str:
    """The shared class queue a queue belongs to: itself, or the class queue of a worker's own queue."""
    head, sep, _ = queue_name.partition(".w.")
    return head if sep else queue_name


def hot_input(input_key: str, model: str) -> str:
    """String ``<worker slug> <classes>``: a worker holds this input hot for this model (affinity routing).

    Written by workers (expiring; refreshed while they hold it, deleted when they evict it); read by producers.
    Named after the tenant-scoped input object, so a tenant's producers read only their own inputs' routes.
    """
    return f"{PREFIX}hot:{input_key}@{model}"


def worker_stats(worker: str) -> str:
    """Hash of one live worker: its model, classes and cache counters; expires when the worker stops renewing.

    Written by workers; read by ``Client.cache_stats`` and by workers draining a dead worker's queues.
    """
    return f"{WORKER_STATS}{worker_slug(worker)}"


WORKER_STATS = f"{PREFIX}worker:"  # the prefix of every worker_stats key


def affinity_workers(model: str) -> str:
    """Sorted set worker slug -> last heartbeat (unix s): workers that may own per-worker queues of a model.

    Written by workers; a member is removed only after its worker is long dead and its queues are empty.
    """
    return f"{PREFIX}affinity:{model}"


def affinity_sweep(model: str) -> str:
    """Short-lived lock: the worker holding it drains a model's worker queues this period (one sweep per period)."""
    return f"{PREFIX}affinity-sweep:{model}"


def kv_models() -> str:
    """Hash model-hash -> model name of the archives under ``kv/<model-hash>/`` (written by workers)."""
    return f"{PREFIX}kv-models"


def priority_list(queue_name: str, priority: int) -> str:
    """kombu's Redis list for one priority step of a queue (0 is the bare queue name)."""
    return f"{queue_name}{PRIORITY_SEP}{priority}" if priority else queue_name


def queue_lists(queue_name: str) -> list[str]:
    """The Redis lists behind one Celery queue: one per priority step (0 = the bare name)."""
    return [priority_list(queue_name, p) for p in PRIORITY_STEPS]


def wake(queue_name: str) -> str:
    """List producers push a token onto after publishing to a queue; idle workers ``BLPOP`` it to wake at once.

    Only a latency hint: a lost or stale token costs one empty pop, never a message.
    """
    return f"{PREFIX}wake:{queue_name}"


def wake_pattern() -> str:
    """Glob pattern of every wake list."""
    return wake("*")


def new_batch_id(tenant: str | None, base: str) -> str:
    """The id of a new batch: ``batch_<hex>``, after ``<tenant>.`` for a tenant's batch."""
    return tenant_job_id(tenant, f"batch_{base}")


def batch_id_allowed(job_id: str, batch_id: object) -> bool:
    """Whether a job's record may name ``batch_id``: a batch of the job's own tenant (``<tenant>.batch_<hex>``).

    A tenant writes its own records, so the ``batch_id`` a record names is checked before anyone acts on it.
    """
    pattern = re.escape(new_batch_id(tenant_of(job_id), "")) + "[0-9a-f]{32}"
    return isinstance(batch_id, str) and re.fullmatch(pattern, batch_id) is not None


def batch_member_allowed(batch_id: str, job_id: object) -> bool:
    """Whether ``job_id`` may be a request of ``batch_id``: a job id of the batch's own tenant (none for none).

    A tenant writes its own batch's job list, so every entry is checked before a finalizer reads its record.
    """
    return (isinstance(job_id, str) and re.fullmatch(JOB_ID_RE, job_id) is not None
            and tenant_of(job_id) == tenant_of(batch_id))


def batch_file_id(batch_id: str, kind: str) -> str:
    """The File id of a batch's ``output`` or ``errors`` file (``file-<batch id>.<kind>``)."""
    if kind not in BATCH_FILES:
        raise ValueError(f"kind must be one of {BATCH_FILES}, got {kind!r}")
    return f"file-{batch_id}.{kind}"


def file_id_allowed(file_id: object, tenant: str | None) -> bool:
    """Whether ``file_id`` has a File id's shape and belongs to ``tenant`` (None: an untenanted File)."""
    if not isinstance(file_id, str) or re.fullmatch(FILE_ID_RE, file_id) is None:
        return False
    return tenant_of(file_id.removeprefix("file-")) == tenant


def file_object(file_id: str) -> str:
    """Storage key of a File's bytes (``file_id_allowed`` checked): an upload's ``files/<id>``, a batch's result
    file where its finalizer wrote it (``batch_object``); under the File's tenant prefix."""
    bare = file_id.removeprefix("file-")
    batch_id, dot, kind = bare.rpartition(".")
    if dot and kind in BATCH_FILES:
        return batch_object(batch_id, f"{kind}.jsonl")
    return f"{storage_prefix(tenant_of(bare))}files/{file_id}"


def file_meta(file_id: str) -> str:
    """Storage key of an uploaded File's JSON description (filename, purpose, bytes, created_at), written once
    after its bytes by whoever uploaded it (``vlmq.files``)."""
    return f"{file_object(file_id)}.json"


def files_prefix(tenant: str | None) -> str:
    """Storage prefix under which a tenant's uploaded Files lie (``GET /v1/files`` lists it)."""
    return f"{storage_prefix(tenant)}files/"


def api_keys() -> str:
    """Hash sha256(API key) -> JSON ``{id, tenant, name, created_at}``: the keys of ``vlmq serve``.

    Written by ``vlmq keys create|revoke`` (``vlmq.apikeys``); read by ``vlmq serve`` on every request. Kept on
    purpose, without a TTL: a key lives until it is revoked.
    """
    return f"{PREFIX}api-keys"


def batch(batch_id: str) -> str:
    """Hash with a batch object (status, counts, files). Written by the SDK; the request counters
    (``n_finished``, ``n_failed``, ``n_canceled``) by every final job transition (``vlmq.store``)."""
    return f"{PREFIX}batch:{batch_id}"


def batch_index(tenant: str | None) -> str:
    """Sorted set batch id -> created_at of a tenant's batches (``GET /v1/batches`` pages it, newest first).

    Written by the SDK when it creates a batch (its TTL renewed to the record TTL then, older members pruned).
    """
    return f"{PREFIX}batch-index:{tenant or ''}"


def batch_jobs(batch_id: str) -> str:
    """List of a batch's job ids in the order of its input lines. Written once by the SDK at submit.

    Its writer holds the tenant's credentials, so finalizers trust no entry: each must be a job of the batch's
    tenant whose record names this batch (``vlmq.batch.members``), and at most the batch's ``total`` are read.
    """
    return f"{PREFIX}batch-jobs:{batch_id}"


def batch_done(batch_id: str) -> str:
    """List pushed once when a batch reaches a final status; ``Batch.wait`` blocks on it."""
    return f"{PREFIX}batch-done:{batch_id}"


def batch_lock(batch_id: str) -> str:
    """``SET NX`` lease held by whoever finalizes a batch (a worker or the SDK); expires if its holder dies."""
    return f"{PREFIX}batch-lock:{batch_id}"


def batch_object(batch_id: str, name: str) -> str:
    """Storage key of a batch's file (``output.jsonl``, ``errors.jsonl``), under the batch's tenant prefix."""
    return f"{storage_prefix(tenant_of(batch_id))}batches/{batch_id}/{name}"


def dead_letter(queue_name: str) -> str:
    """List of messages the worker's gate refused from one queue (reason + raw bytes); bounded, with a TTL.

    Written by the gate (``vlmq.workers.gate``); read by operators.
    """
    return f"{PREFIX}dead:{queue_name}"


def worker_status(name: str) -> str:
    """Hash of one live worker's model, device, load and counters, refreshed every few seconds with a short TTL.

    Written by each worker (``vlmq.workers.status``); read by ``vlmq top`` (``vlmq.fleet``). Its own prefix:
    ``worker_stats`` (the affinity heartbeat and cache counters) lives under ``vlmq:worker:``, and a scan of one
    must never find the other (a worker would count twice).
    """
    return f"{PREFIX}worker-status:{name}"


def idle_wait(token: str) -> str:
    """A list nobody writes: an idle worker's ``BLPOP`` on it is a short server-side sleep between pops."""
    return f"{PREFIX}idle-wait:{token}"


def tenant_key_patterns(tenant: str) -> list[str]:
    """Glob patterns of every Redis key a tenant's producers read and write (its ACL, ``vlmq.acl``).

    ``.`` cannot occur in a tenant id, so ``acme.*`` never matches another tenant's ``acme-2.<hex>``.
    """
    ids = tenant_job_id(check_tenant(tenant), "*")
    return [job(ids), done(ids), canceled(ids), idempotency("*", tenant), deliveries(ids), batch(ids),
            batch_jobs(ids), batch_done(ids), batch_lock(ids), batch_index(tenant)]


def tenant_read_patterns(tenant: str) -> list[str]:
    """Glob patterns of keys a tenant's producers may read but never write: the affinity routes of its inputs."""
    return [hot_input(input_object("*", check_tenant(tenant)), "*")]


def queue_pattern() -> str:
    """Glob pattern of every queue list (all models, classes and priority steps)."""
    return queue("*", "*")


def worker_key_patterns() -> list[str]:
    """Glob patterns of every Redis key a worker touches: vlmq's own, the queue lists, and kombu's.

    kombu (Redis transport): ``unacked``, ``unacked_index`` and ``unacked_mutex`` (messages delivered and
    not acked, shared by every queue), ``_kombu.binding*`` (exchange bindings) and each worker's
    ``<name>.celery.pidbox`` lists (remote control).
    """
    return [f"{PREFIX}*", queue_pattern(), "_kombu.*", UNACKED, UNACKED_INDEX, UNACKED_MUTEX,
            "*.celery.pidbox*"]


def storage_prefix(tenant: str | None) -> str:
    """Where a tenant's objects live in the pool's storage: ``t/<tenant>/`` (nothing without a tenant)."""
    return f"t/{tenant}/" if tenant else ""


def input_object(sha256: str, tenant: str | None = None) -> str:
    """Storage key of a content-addressed input image (per tenant: ``t/<tenant>/inputs/<sha256>``)."""
    return f"{storage_prefix(tenant)}inputs/{sha256}"


def input_sha256(key: str) -> str:
    """The SHA-256 (hex) an input's storage key names: its last 64 characters (``input_key_allowed`` checked)."""
    return key[-64:]


def input_key_allowed(job_id: str, key: str) -> bool:
    """Whether a job may read ``key`` as its input: an ``inputs/<sha256>`` object of the job's own tenant.

    Workers check it before reading a record's ``input_key``, so a forged record cannot make a worker
    serve another tenant's image.
    """
    pattern = re.escape(input_object("", tenant_of(job_id))) + "[0-9a-f]{64}"
    return isinstance(key, str) and re.fullmatch(pattern, key) is not None


KV_ROOT = "kv/"  # the archive of every model: ``kv/<model-hash>/...`` in the pool's storage (its byte bound)


def kv_prefix(model_hash: str) -> str:
    """Storage prefix of one model's archived KV and encoder outputs (``kv/<model-hash>/``; ``vlmq cache purge``)."""
    return f"{KV_ROOT}{model_hash}/"


def result_object(job_id: str) -> str:
    """Storage key of a job's result JSON (a tenant's job: ``t/<tenant>/results/<job_id>.json``)."""
    return f"{storage_prefix(tenant_of(job_id))}results/{job_id}.json"


def object_kind(key: str) -> str | None:
    """``input`` or ``result`` for an input or result object of any tenant (or none), else None (``kv/`` ...)."""
    tenant = rf"(?:t/{TENANT_RE}/)?"
    if re.fullmatch(rf"{tenant}inputs/[0-9a-f]{{64}}", key):
        return "input"
    if re.fullmatch(rf"{tenant}results/{JOB_ID_RE}\.json", key):
        return "result"
    return None


RETAINED_PREFIXES = ("inputs/", "results/", "t/")  # where input and result objects live, for the retention sweep


def job_pattern() -> str:
    """``SCAN`` pattern matching every job record (the retention sweep reads the live ones' inputs)."""
    return f"{PREFIX}job:*"


def retention_lock() -> str:
    """``SET NX EX`` lock: the worker that sets it runs this period's object-store retention sweep.

    Written by ``vlmq.workers.retention``; it expires after the sweep period and is never deleted, so
    the fleet sweeps at most once per period.
    """
    return f"{PREFIX}retention-sweep"


def orphan_lock() -> str:
    """``SET NX EX`` lock: the worker that sets it runs this period's orphan sweep (``vlmq.workers.orphans``)."""
    return f"{PREFIX}orphan-sweep"


def orphans_seen() -> str:
    """Hash job id -> when the orphan sweep first found the job active with no message anywhere.

    Written and read by the orphan sweep; it expires unless a sweep renews it.
    """
    return f"{PREFIX}orphans-seen"


def orphans_resent() -> str:
    """Counter of messages the orphan sweep re-sent from job records (``/metrics``, ``vlmq top``).

    Written by the orphan sweep; its TTL is renewed on every increment.
    """
    return f"{PREFIX}orphans-resent"


# kombu's Redis transport: the restore sweep's mutex (UNACKED and UNACKED_INDEX are above)
UNACKED_MUTEX = f"{UNACKED}_mutex"
# exchange bindings: ``_kombu.binding.<exchange>`` and ``_kombu.binding_permanent.<exchange>`` (sets of the queues
# bound to it) and ``_kombu.binding_deadlines`` (when the bindings of expiring queues lapse; kombu 5.7)
KOMBU_BINDING_PREFIX = "_kombu.binding"


def is_queue_list(name: str) -> bool:
    """Whether ``name`` is one of the Redis lists behind a vlmq Celery queue (see :func:`queue_lists`)."""
    base = name.partition(":")[0]
    model, _, cost_class = base.removeprefix("vlmq.").rpartition(".")
    return base.startswith("vlmq.") and bool(model and cost_class) and name in queue_lists(base)


def has_owner(name: str) -> bool:
    """Whether a key without a TTL is owned: kombu deletes it when it empties (queue lists, unacked
    structures) or keeps it on purpose (exchange bindings, a handful per pool)."""
    return (is_queue_list(name) or name in (UNACKED, UNACKED_INDEX, UNACKED_MUTEX, api_keys())
            or name.startswith(KOMBU_BINDING_PREFIX))


def kv_object(model_hash: str, kind: str, key: str) -> str:
    """Storage key of one archived KV item, written once by the worker that computed it, read by any worker.

    ``kind`` is ``enc`` (a vision encoder output, ``key`` = the encoder-cache key) or ``prefix`` (one prefix-cache
    block's KV, ``key`` = its block hash in hex). Two hex digits of the key spread objects over S3 prefixes.
    """
    if kind not in ("enc", "prefix"):
        raise ValueError(f"kind must be enc or prefix, got {kind!r}")
    return f"{kv_prefix(model_hash)}{kind}/{key[:2]}/{key}"

