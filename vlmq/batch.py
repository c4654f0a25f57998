"""Batches: many jobs from one OpenAI-Batch-format file, followed as one object with counts and result files.

Lifecycle (``BatchStatus``): ``validating`` (lines checked, inputs stored) -> ``in_progress`` (every job
enqueued) -> ``finalizing`` (every request ended; output and error files being written) -> ``completed``;
or ``failed`` (the file was refused whole: too many bad lines, or none good; nothing was enqueued),
``cancelling`` -> ``cancelled``, and ``expired`` (the completion window passed: requests not yet ended are
cancelled, with code ``batch_expired``). Lines refused at submit count as failed requests from the start
(``n_rejected``) and head the error file (``REJECTED``, ``vlmq.batchsubmit``).

Counting: each job's final transition (``vlmq.store``) increments ``n_<status>`` in the batch hash, so a request
is counted once, by whoever ended it. Finalizing: whoever sees every request ended finalizes (the worker that
ends a batch's last job, ``Batch.refresh``/``wait``, ``vlmq batch status|wait``) under a lease
(``keys.batch_lock``); it is idempotent: files are rewritten whole from the job records, the final status is set
once, and a finalizer that dies leaves the lease to expire for the next one.
"""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vlmq import functions, keys, rules
from vlmq.errors import InvalidRequest, JobNotFound, JobTimeout
from vlmq.storage import Storage
from vlmq.store import JobStatus, JobStore, WireEnum, decode_record, now, transition_call, transition_reply

log = logging.getLogger(__name__)
LOCK_TTL = 300  # seconds a finalizer's lease lasts; a dead finalizer's batch is taken over after it
MAX_REQUESTS = 50_000  # requests one batch holds at most (OpenAI's limit): what one finalization reads at most
READ_CHUNK = 1000  # records read per round trip while finalizing
OUTPUT, ERRORS = "output.jsonl", "errors.jsonl"
REJECTED = "rejected.jsonl"  # lines refused at submit (error lines): the head of the error file
_WINDOW = re.compile(r"([1-9][0-9]*)([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class BatchStatus(WireEnum):
    """Lifecycle of a batch (OpenAI Batch API values)."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        """Whether the batch can no longer change."""
        return self in (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


_RUNNING = (BatchStatus.IN_PROGRESS.value, BatchStatus.CANCELLING.value, BatchStatus.FINALIZING.value)


class BatchInvalid(InvalidRequest):
    """A batch file was refused whole: nothing was enqueued.

    Attributes:
        errors: ``vlmq.batchfile.LineError`` for the first refused lines (at most ``batchsubmit.KEPT_ERRORS``),
            in file order; every one is in the failed batch's error file.
        batch_id: the ``failed`` batch object recording them.
        refused: how many lines were refused, of ``total``.
    """

    def __init__(self, errors: list[Any], batch_id: str, *, refused: int | None = None, total: int | None = None,
                 share: float | None = None) -> None:
        refused = len(errors) if refused is None else refused
        shown = "\n".join(str(e) for e in errors[:20])
        more = f"\n... and {refused - min(20, len(errors))} more" if refused > 20 else ""
        why = "" if total is None or share is None else \
            f" of {total}, more than the {share:.0%} allowed (VLMQ_BATCH_MAX_BAD_SHARE)"
        super().__init__(f"{refused} line(s) of the batch file were refused{why}; nothing was enqueued "
                         f"(batch {batch_id} is failed; its error file has every refused line):\n{shown}{more}",
                         code="batch_invalid")
        self.errors = errors
        self.batch_id = batch_id
        self.refused = refused


def window_seconds(window: str) -> int:
    """Seconds of a completion window such as ``24h`` (also ``90m``, ``2d``, ``30s``).

    Raises:
        InvalidRequest: ``bad_completion_window``.
    """
    match = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    if not match:
        raise InvalidRequest(f"completion_window must look like 24h, 90m, 2d or 30s, got {window!r}",
                             code="bad_completion_window")
    return int(match[1]) * _UNIT[match[2]]


def check_metadata(metadata: object) -> dict[str, str]:
    """A batch's ``metadata``: string keys and values (OpenAI's rule), each valid text.

    Raises:
        InvalidRequest: ``bad_metadata``.
    """
    pairs = dict(metadata or {}) if metadata is None or isinstance(metadata, Mapping) else None
    if pairs is None or not all(isinstance(k, str) and isinstance(v, str) for k, v in pairs.items()):
        raise InvalidRequest("metadata must map strings to strings", code="bad_metadata")
    for key, value in pairs.items():
        rules.check_utf8(key + value, f"metadata {key[:40]!r}", "bad_metadata")
    return pairs


def new_batch_id(tenant: str | None) -> str:
    """A new batch id (``batch_<hex>``, after ``<tenant>.`` for a tenant)."""
    return keys.new_batch_id(tenant, uuid.uuid4().hex)


def create(store: JobStore, batch_id: str, fields: dict[str, Any], job_ids: list[str]) -> None:
    """Write a new batch hash (status ``validating``) and its job list, with the record TTL."""
    pipe = store.redis.pipeline(transaction=True)
    pipe.hset(keys.batch(batch_id), mapping={"id": batch_id, "status": BatchStatus.VALIDATING.value, **fields})
    pipe.expire(keys.batch(batch_id), store.job_ttl)
    if job_ids:
        pipe.rpush(keys.batch_jobs(batch_id), *job_ids).expire(keys.batch_jobs(batch_id), store.job_ttl)
    index, created = keys.batch_index(keys.tenant_of(batch_id)), float(fields.get("created_at", now()))
    pipe.zadd(index, {batch_id: created}).zremrangebyscore(index, "-inf", created - store.job_ttl)
    pipe.expire(index, store.job_ttl)
    store.call(pipe.execute)


def list_page(store: JobStore, tenant: str | None, after: str | None, limit: int) -> dict[str, Any]:
    """A page of a tenant's batches, newest first (``after``: the last id of the previous page), as OpenAI's
    list object; batches whose records have expired are left out."""
    ids = [b.decode() for b in store.call(store.redis.zrevrange, keys.batch_index(tenant), 0, -1)]
    if after:
        ids = ids[ids.index(after) + 1:] if after in ids else []
    page = []
    for batch_id in ids:
        record = store.call(read, store.redis, batch_id)
        if record:
            page.append(to_object(record))
        if len(page) > limit:
            break
    data = page[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(page) > limit}


def read(redis: Any, batch_id: str) -> dict[str, str]:
    """The batch hash as a str dict (empty if missing)."""
    return decode_record(redis.hgetall(keys.batch(batch_id)))


def set_status(redis: Any, batch_id: str, status: BatchStatus, **fields: object) -> None:
    """Set a batch's status and ``<status>_at``, with more fields."""
    redis.hset(keys.batch(batch_id), mapping={"status": status.value, f"{status.value}_at": repr(now()),
                                              **{k: str(v) for k, v in fields.items()}})


def counts(record: dict[str, str]) -> dict[str, int]:
    """OpenAI's ``request_counts`` (``total``, ``completed``, ``failed``: failed, cancelled and expired
    requests and lines refused at submit), plus vlmq's ``cancelled`` (how many of the failed ones were cancelled
    or expired) and ``rejected`` (how many were lines refused at submit, each in the error file)."""
    finished, failed, canceled = (int(record.get(f"n_{s.value}", 0)) for s in
                                  (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED))
    rejected = _count(record.get("n_rejected"))
    return {"total": int(record.get("total", 0)), "completed": finished, "failed": failed + canceled + rejected,
            "cancelled": canceled, "rejected": rejected}


def start(store: JobStore, batch_id: str) -> None:
    """Every job is enqueued: the batch is ``in_progress``, unless it was cancelled while it was validating (then
    the jobs enqueued since are cancelled too)."""
    record = store.call(read, store.redis, batch_id)
    if record.get("cancel_requested") == "1":
        cancel_jobs(store, batch_id, record)
    else:
        store.call(set_status, store.redis, batch_id, BatchStatus.IN_PROGRESS)


def cancel_jobs(store: JobStore, batch_id: str, record: dict[str, str]) -> int:
    """Cancel every job of a batch that has not ended (one pipeline); returns how many were cancelled."""
    calls = [transition_call(job_id, [JobStatus.QUEUED, JobStatus.STARTED], JobStatus.CANCELED, None, store.job_ttl,
                             keys.canceled(job_id)) for job_id in members(store.redis, batch_id, record)]
    return sum(transition_reply(r)[0] for r in store.call(functions.call_many, store.redis, calls))


def members(redis: Any, batch_id: str, record: dict[str, str]) -> list[str]:
    """The job ids a batch's list names, each a job of the batch's own tenant; at most its ``total`` of them.

    The batch hash and its list are written with the tenant's credentials, so both may be forged: an entry of
    another tenant (or an untenanted one) is dropped before anyone reads its record, and however long the list
    or large the ``total``, no more than ``MAX_REQUESTS`` entries are read.
    """
    total = min(_count(record.get("total")), MAX_REQUESTS)
    raw = redis.lrange(keys.batch_jobs(batch_id), 0, total - 1) if total else []
    listed = [j.decode(errors="replace") for j in raw]
    kept = [j for j in listed if keys.batch_member_allowed(batch_id, j)]
    if len(kept) < len(listed):
        log.warning("batch %s: %d entries of its job list are not jobs of its tenant; ignored", batch_id,
                    len(listed) - len(kept))
    return kept


def _count(value: object) -> int:
    try:
        return max(0, int(str(value)))
    except ValueError:
        return 0


def expire_if_due(store: JobStore, batch_id: str, record: dict[str, str]) -> bool:
    """Past its completion window, a running batch cancels what is left and is marked to end ``expired``."""
    if record.get("status") != BatchStatus.IN_PROGRESS.value or now() < float(record.get("expires_at", "inf")):
        return False
    store.call(store.redis.hset, keys.batch(batch_id), "expired", "1")
    cancelled = cancel_jobs(store, batch_id, record)
    log.info("batch %s expired; %d requests cancelled", batch_id, cancelled)
    return True


def finalize_if_done(redis: Any, storage: Storage, batch_id: str, job_ttl: int) -> bool:
    """Finalize a batch whose requests have all ended (idempotent; safe from any process).

    Returns:
        True if this call finalized it.
    """
    record = read(redis, batch_id)
    if record.get("status") not in _RUNNING:
        return False
    c = counts(record)
    if c["completed"] + c["failed"] < c["total"]:
        return False
    token = uuid.uuid4().hex
    if not redis.set(keys.batch_lock(batch_id), token, nx=True, ex=LOCK_TTL):
        return False  # someone else is finalizing it (or died doing so: the lease expires)
    try:
        record = read(redis, batch_id)  # re-read under the lease: it may have just been finalized
        if record.get("status") not in _RUNNING:
            return False
        set_status(redis, batch_id, BatchStatus.FINALIZING)
        _write_files(redis, storage, batch_id, record)
        final = (BatchStatus.CANCELLED if record.get("cancel_requested") == "1" else
                 BatchStatus.EXPIRED if record.get("expired") == "1" else BatchStatus.COMPLETED)
        set_status(redis, batch_id, final, output_file_id=keys.batch_file_id(batch_id, "output"),
                   error_file_id=keys.batch_file_id(batch_id, "errors"))
        pipe = redis.pipeline(transaction=False)
        pipe.expire(keys.batch(batch_id), job_ttl).rpush(keys.batch_done(batch_id), final.value)
        pipe.expire(keys.batch_done(batch_id), job_ttl).execute()
        log.info("batch %s %s: %s", batch_id, final.value, counts(record))
        if record.get("webhook"):
            _announce(redis, batch_id, record["webhook"], job_ttl)
        return True
    finally:
        if redis.get(keys.batch_lock(batch_id)) == token.encode():
            redis.delete(keys.batch_lock(batch_id))


def _announce(redis: Any, batch_id: str, url: str, job_ttl: int) -> None:
    """Queue the ``batch.completed`` webhook event (its ``data`` is the batch object; ``status`` says whether it
    completed, was cancelled or expired). Queuing it again is a no-op, so a finalizer that retries is safe."""
    from vlmq.webhooks import enqueue_event

    enqueue_event(redis, "batch.completed", to_object(read(redis, batch_id)), url, subject=batch_id, ttl=job_ttl)


def finalize_job_batch(redis: Any, storage: Storage, job_id: str, job_ttl: int) -> None:
    """After a job ended: finalize its batch if it was the last one (what a worker calls)."""
    raw = redis.hget(keys.job(job_id), "batch_id")
    batch_id = raw.decode(errors="replace") if raw else ""
    if batch_id and not keys.batch_id_allowed(job_id, batch_id):  # a forged record naming another tenant's batch
        log.warning("job %s names batch %r, not one of its tenant's; not finalizing it", job_id, batch_id[:80])
    elif batch_id:
        finalize_if_done(redis, storage, batch_id, job_ttl)


def _write_files(redis: Any, storage: Storage, batch_id: str, batch: dict[str, str]) -> None:
    records = _member_records(redis, batch_id, members(redis, batch_id, batch))
    finished = [r for r in records if r.get("status") == JobStatus.FINISHED.value]
    with ThreadPoolExecutor(16) as pool:
        docs = dict(zip((r["id"] for r in finished), pool.map(lambda r: _result(storage, r["id"]), finished),
                        strict=True))
    out: list[str] = []
    err: list[str] = []
    for record in records:
        doc = docs.get(record["id"])
        line = output_line(record, doc) if doc else error_line(record, batch)
        (out if doc else err).append(json.dumps(line))
    storage.put(keys.batch_object(batch_id, OUTPUT), "".join(f"{line}\n" for line in out).encode())
    head = _rejected(storage, batch_id) if _count(batch.get("n_rejected")) else ""
    err = ([head] if head else []) + err
    storage.put(keys.batch_object(batch_id, ERRORS), "".join(f"{line}\n" for line in err).encode())


def _rejected(storage: Storage, batch_id: str) -> str:
    """The lines refused at submit, as error lines (JSONL, newline-terminated; empty if the object is gone)."""
    try:
        return storage.get(keys.batch_object(batch_id, REJECTED)).decode().removesuffix("\n")
    except KeyError:
        return ""


def _member_records(redis: Any, batch_id: str, job_ids: list[str]) -> list[dict[str, str]]:
    """The records of ``job_ids`` that name this batch (a job of the tenant's listed in its batch by a forged
    list, but submitted on its own or in another batch, is not this batch's), read ``READ_CHUNK`` at a time.
    A record that has expired stays, with only its id: the request gets an error line, as before."""
    records = []
    for start in range(0, len(job_ids), READ_CHUNK):
        chunk = job_ids[start:start + READ_CHUNK]
        pipe = redis.pipeline(transaction=False)
        for job_id in chunk:
            pipe.hgetall(keys.job(job_id))
        records += [decode_record(r) | {"id": job_id} for job_id, r in zip(chunk, pipe.execute(), strict=True)]
    kept = [r for r in records if r.get("batch_id") == batch_id or r.keys() == {"id"}]
    if len(kept) < len(records):
        log.warning("batch %s: %d listed jobs do not name it; left out of its files", batch_id,
                    len(records) - len(kept))
    return kept


def _result(storage: Storage, job_id: str) -> dict[str, Any] | None:
    try:
        return dict(json.loads(storage.get(keys.result_object(job_id))))
    except KeyError:
        return None


def _choice(choice: dict[str, Any]) -> dict[str, Any]:
    logprobs = {"content": choice["logprobs"], "refusal": None} if "logprobs" in choice else None
    return {"index": choice["index"], "message": {"role": "assistant", "content": choice["text"], "refusal": None},
            "logprobs": logprobs, "finish_reason": choice["finish_reason"]}


def _json_object(text: str | None) -> dict[str, Any] | None:
    """A record's JSON object field (a record may be forged: anything else reads as absent)."""
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def output_line(record: dict[str, str], doc: dict[str, Any]) -> dict[str, Any]:
    """One line of the output file: the request's answer as an OpenAI chat completion."""
    usage = doc["usage"]
    body = {"id": f"chatcmpl-{record['id']}", "object": "chat.completion",
            "created": int(float(record.get("finished_at", doc.get("finished_at", 0)))), "model": doc["model"],
            "choices": [_choice(c) for c in doc.get("choices") or [doc | {"index": 0}]],
            "usage": {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["generated_tokens"],
                      "total_tokens": usage["prompt_tokens"] + usage["generated_tokens"]}}
    if record.get("service_tier"):  # the tier the line asked for, as its priority applied it
        body["service_tier"] = record["service_tier"]
    if (metadata := _json_object(record.get("metadata"))) is not None:
        body["metadata"] = metadata
    return {"id": f"batch_req_{record['id']}", "custom_id": record.get("custom_id", ""),
            "response": {"status_code": 200, "request_id": record["id"], "body": body}, "error": None}


def error_line(record: dict[str, str], batch: dict[str, str]) -> dict[str, Any]:
    """One line of the error file: why the request has no answer."""
    status = record.get("status")
    if status == JobStatus.CANCELED.value and batch.get("expired") == "1":
        code, message = "batch_expired", "the request was not run before the batch's completion window ended"
    elif status == JobStatus.CANCELED.value:
        code, message = "batch_cancelled", "the request was cancelled before it ended"
    elif status == JobStatus.FINISHED.value:
        code, message = "result_missing", ("the job finished but its result object is missing; producers and "
                                           "workers must share VLMQ_STORAGE_URL")
    else:
        code, message = record.get("error_type", "unknown"), record.get("error_message", "")
    return {"id": f"batch_req_{record['id']}", "custom_id": record.get("custom_id", ""), "response": None,
            "error": {"code": code, "message": message}}


class Batch:
    """Handle on a submitted batch (``Client.submit_batch``, ``Client.batch``); every call reads Redis.

    Args:
        store: the client's job store.
        batch_id: the batch's id.
    """

    def __init__(self, store: JobStore, batch_id: str) -> None:
        self._store = store
        self.id = batch_id

    def __repr__(self) -> str:
        return f"Batch({self.id!r})"

    def refresh(self) -> dict[str, Any]:
        """The batch object (OpenAI's shape); expires or finalizes the batch when due.

        Raises:
            JobNotFound: no such batch (never submitted, expired record, or another tenant's).
        """
        self._store.own(self.id)
        record = self._store.call(read, self._store.redis, self.id)
        if not record:
            raise JobNotFound(f"no batch {self.id!r} (never submitted, or its record expired)")
        changed = expire_if_due(self._store, self.id, record)
        if record.get("status") in _RUNNING or changed:
            if self._store.call(finalize_if_done, self._store.redis, self._store.storage, self.id,
                                self._store.job_ttl) or changed:
                record = self._store.call(read, self._store.redis, self.id)
        return to_object(record)

    def status(self) -> BatchStatus:
        """The current status."""
        return BatchStatus(self.refresh()["status"])

    def wait(self, timeout: float | None = None,
             on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Wait until the batch reaches a final status; returns the batch object.

        Args:
            timeout: seconds to wait (None: forever).
            on_progress: called with the batch object about once a second.

        Raises:
            JobTimeout: still running after ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        done = keys.batch_done(self.id)
        while True:
            batch = self.refresh()
            if on_progress:
                on_progress(batch)
            if BatchStatus(batch["status"]).is_final:
                return batch
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise JobTimeout(f"batch {self.id} still {batch['status']} after {timeout} s")
            # woken at once when the batch ends; at most a second between progress updates
            self._store.call(self._store.redis.blmove, done, done, min(1.0, left or 1.0), "LEFT", "RIGHT")

    def cancel(self) -> dict[str, Any]:
        """Cancel the batch: queued requests never run, running ones stop; it ends ``cancelled``.

        Returns:
            The batch object after cancelling (``cancelled``, or ``cancelling`` while another process finalizes).
        """
        record = self._store.call(read, self._store.redis, self._store.own(self.id))
        if not record:
            raise JobNotFound(f"no batch {self.id!r}")
        if record["status"] in (BatchStatus.IN_PROGRESS.value, BatchStatus.VALIDATING.value):
            self._store.call(set_status, self._store.redis, self.id, BatchStatus.CANCELLING, cancel_requested=1)
            cancel_jobs(self._store, self.id, record)
        return self.refresh()

    def rejected(self) -> list[dict[str, Any]]:
        """The lines refused at submit, as error-file lines (OpenAI's shape: ``response.status_code`` 400,
        ``response.body.error`` with ``code``, ``message``, vlmq's ``line`` and ``retryable``), readable while
        the batch runs; the error file starts with them once it ends."""
        self._store.own(self.id)
        text = self._store.call(_rejected, self._store.storage, self.id)
        return [json.loads(line) for line in text.splitlines() if line]

    def download(self, which: str = "output") -> bytes:
        """The output (``output``) or error (``error``) file of a final batch, as JSONL bytes.

        Raises:
            InvalidRequest: ``batch_not_final`` before the batch has ended.
        """
        batch = self.refresh()
        if not batch.get(f"{which}_file_id"):
            raise InvalidRequest(f"batch {self.id} is {batch['status']}; its files exist once it has ended",
                                 code="batch_not_final")
        return self._store.storage.get(keys.batch_object(self.id, OUTPUT if which == "output" else ERRORS))


def _time(record: dict[str, str], name: str) -> int | None:
    value = record.get(name)
    return int(float(value)) if value else None


def to_object(record: dict[str, str]) -> dict[str, Any]:
    """A batch hash as OpenAI's batch object (``openai.types.Batch`` parses it): times in epoch seconds,
    ``request_counts`` (with vlmq's ``cancelled`` and ``rejected``), the result files as File ids (``vlmq.files``
    reads them; ``vlmq serve`` serves them at ``/v1/files/<id>/content``). ``input_file_id`` is the uploaded
    File's id, or for a batch submitted from a file on the producer (``Client.submit_batch(path)``) that path."""
    errors = json.loads(record["errors"]) if record.get("errors") else None
    return {
        "id": record["id"], "object": "batch", "endpoint": record.get("endpoint", "/v1/chat/completions"),
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": record.get("input_file_id") or record.get("input_file", ""),
        "completion_window": record.get("completion_window"), "status": record["status"],
        "output_file_id": record.get("output_file_id"), "error_file_id": record.get("error_file_id"),
        **{f"{s}_at": _time(record, f"{s}_at") for s in ("created", "in_progress", "expires", "finalizing",
                                                          "completed", "failed", "expired", "cancelling",
                                                          "cancelled")},
        "request_counts": counts(record),
        "metadata": json.loads(record["metadata"]) if record.get("metadata") else None,
    }
