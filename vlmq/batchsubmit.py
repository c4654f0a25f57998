"""Submitting a batch file (``Client.submit_batch``): one streaming pass that checks, prices and stores each line,
then the enqueue, so the producer's memory does not grow with the file.

The pass reads one line at a time. A good line's images are read (each reference once while it is recent:
``RecentImages``), stored a chunk at a time, and its enqueue call (record and message) is written to a spool
file on disk; a bad line becomes an error line (OpenAI's shape, ``LineError.error_line``) in a second spool.
Nothing is enqueued during the pass: if the bad lines pass the allowed share (``VLMQ_BATCH_MAX_BAD_SHARE``), or
no line is good, the batch ends ``failed`` with the refused lines as its error file and nothing runs. Otherwise
the refused lines are stored as the batch's ``rejected.jsonl`` (the head of its error file once it ends, and
counted as failed requests from the start), and the spooled calls are replayed ``CHUNK`` at a time.
What stays in memory, whatever the file's size: the recent images, one chunk of prepared requests (and of spooled
calls while enqueueing), the first ``KEPT_ERRORS`` refusals, the custom_ids seen (``IdSet``: 1 MiB) and the
digests of recently stored images; only the refused lines' error lines are read whole, to be stored.
"""
from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from vlmq import batch as batches
from vlmq import functions, keys
from vlmq.batchfile import LineError, custom_id_of, parse_line
from vlmq.errors import BackendError, InvalidRequest
from vlmq.jobs import new_job_id
from vlmq.prepared import Input, Prepared
from vlmq.request import JobRequest

log = logging.getLogger(__name__)
CHUNK = 500  # jobs per round trip when the spool is replayed (as Client's CHUNK)
STORE_CHUNK = 64  # good lines whose new images are stored together (parallel puts)
KEPT_ERRORS = 100  # refused lines named in the exception and the batch object; all are in the error file
RECENT_IMAGES = 256  # image references kept read, at most ...
RECENT_BYTES = 64 << 20  # ... and at most this many bytes of them
RECENT_STORED = 4096  # digests of images this call stored, not asked of the store again


class RecentImages(OrderedDict[str, Input]):
    """The images read most recently, by reference, bounded by count and bytes (what ``Client._load`` reuses)."""

    def __init__(self, max_items: int = RECENT_IMAGES, max_bytes: int = RECENT_BYTES) -> None:
        super().__init__()
        self.max_items, self.max_bytes, self.held = max_items, max_bytes, 0

    def __getitem__(self, ref: str) -> Input:
        self.move_to_end(ref)
        return super().__getitem__(ref)

    def __setitem__(self, ref: str, item: Input) -> None:
        if ref in self:
            self.held -= len(super().__getitem__(ref).data)
        super().__setitem__(ref, item)
        self.held += len(item.data)
        while len(self) > 1 and (len(self) > self.max_items or self.held > self.max_bytes):
            _, old = self.popitem(last=False)
            self.held -= len(old.data)


class IdSet:
    """The custom_ids seen so far, as 8-byte digests in one table sized for ``MAX_REQUESTS`` (1 MiB, whatever
    the file's size; two ids share a digest with odds of about 1e-10 in a full batch)."""

    def __init__(self, capacity: int = 1 << 17) -> None:
        self._slots = array("Q", bytes(8 * capacity))
        self._mask = capacity - 1

    def add(self, value: str) -> bool:
        """Add ``value``; False if it was there already."""
        digest = int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little") | 1
        i = digest & self._mask
        while self._slots[i]:
            if self._slots[i] == digest:
                return False
            i = (i + 1) & self._mask
        self._slots[i] = digest
        return True


@dataclass
class Intake:
    """What the pass through a file found: counts, the first refusals, the classes its jobs fill."""

    good: int = 0
    bad: int = 0
    errors: list[LineError] = field(default_factory=list)
    classes: Counter[tuple[str, str]] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return self.good + self.bad


def count_lines(path: Path) -> int:
    """The file's non-blank lines, counted without parsing one.

    Raises:
        InvalidRequest: ``bad_batch_file`` (unreadable), ``batch_too_large`` (over ``MAX_REQUESTS``).
    """
    try:
        with open(path, "rb") as f:
            count = sum(1 for raw in f if raw.strip())
    except (OSError, ValueError) as e:  # ValueError: a NUL or lone surrogate in the path
        raise InvalidRequest(f"cannot read batch file {str(path)!r}: {e}", code="bad_batch_file") from e
    if count > batches.MAX_REQUESTS:  # what one finalization reads at most
        raise InvalidRequest(f"a batch holds at most {batches.MAX_REQUESTS} requests, this file has {count}; "
                             "split it", code="batch_too_large")
    return count


def read_lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """The non-blank lines with their 1-based numbers; None for a line that is not UTF-8 text."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError:
                    yield number, None


class FileSubmit:
    """One ``submit_batch`` call: the pass (``check``), then the enqueue (``enqueue``); ``client`` is the
    ``vlmq.Client`` whose ``_prepare``, ``_store_inputs`` and ``_enqueue_call`` a single submit uses too (typed
    ``Any``: ``vlmq.client`` imports this module)."""

    def __init__(self, client: Any, path: Path, batch_id: str, *, priority: int, max_new_tokens: int,
                 anywhere: bool) -> None:
        self.client, self.path, self.batch_id = client, path, batch_id
        self.priority, self.max_new_tokens, self.anywhere = priority, max_new_tokens, anywhere
        self.intake = Intake()
        self._recent = RecentImages()
        self._seen = IdSet()
        self._stored: OrderedDict[str, None] = OrderedDict()  # images this call stored lately (by digest)
        self._chunk: list[tuple[dict[str, str], Prepared]] = []  # each line's extra record fields, its request

    def check(self, calls: IO[str], rejected: IO[str]) -> Intake:
        """Read the file once: spool each good line's enqueue call and each bad line's error line."""
        base = self.path.resolve().parent
        for number, text in read_lines(self.path):
            try:
                extra, prepared = self._prepare(number, text, base)
            except InvalidRequest as e:
                self._refuse(LineError(number, e.code, str(e), custom_id_of(text) if text else None), rejected)
                continue
            self.intake.good += 1
            self.intake.classes[(prepared.spec.name, prepared.cost.cost_class)] += 1
            self._chunk.append((extra, prepared))
            if len(self._chunk) >= STORE_CHUNK:
                self._flush(calls)
        self._flush(calls)
        return self.intake

    def _prepare(self, number: int, text: str | None, base: Path) -> tuple[dict[str, str], Prepared]:
        if text is None:
            raise InvalidRequest("the line is not UTF-8 text", code="bad_json")
        line = parse_line(number, text, base, self.anywhere)
        if not self._seen.add(line.custom_id):
            raise InvalidRequest(f"custom_id {line.custom_id!r} is used by an earlier line", code="duplicate_custom_id")
        priority = min(max(self.priority + line.priority_step, 0), 9)  # service_tier
        request = JobRequest(messages=line.messages, model=line.model, priority=priority,
                             max_new_tokens=line.max_new_tokens or self.max_new_tokens, webhook="",
                             temperature=line.temperature, seed=line.seed, decoding=line.decoding)
        extra = {"batch_id": self.batch_id, "custom_id": line.custom_id, **line.account}
        return extra, self.client._prepare(request, self._recent)

    def _refuse(self, error: LineError, rejected: IO[str]) -> None:
        self.intake.bad += 1
        if len(self.intake.errors) < KEPT_ERRORS:
            self.intake.errors.append(error)
        rejected.write(json.dumps(error.error_line(self.batch_id)) + "\n")

    def _flush(self, calls: IO[str]) -> None:
        """Store the chunk's new images (before any message names them), then spool its enqueue calls."""
        fresh = {x.sha256: x for _, p in self._chunk for x in p.inputs if x.sha256 not in self._stored}
        self.client._store_inputs(list(fresh.values()))
        for sha in fresh:
            self._stored[sha] = None
        while len(self._stored) > RECENT_STORED:
            self._stored.popitem(last=False)
        for extra, prepared in self._chunk:
            job_id = keys.tenant_job_id(self.client.tenant, new_job_id())
            call_keys, args = self.client._enqueue_call(job_id, prepared, extra)
            calls.write(json.dumps([job_id, call_keys, [_text(a) for a in args]]) + "\n")
        self._chunk.clear()

    def enqueue(self, calls: IO[str]) -> int:
        """Replay the spooled calls, ``CHUNK`` at a time: each chunk's ids join the batch's list, then its jobs
        are enqueued (records before messages, as ``Client._enqueue``). Returns how many were enqueued."""
        store, redis, done = self.client.store, self.client.redis, 0
        calls.seek(0)
        for chunk in _chunks(calls, CHUNK):
            entries = [json.loads(text) for text in chunk]
            pipe = redis.pipeline(transaction=False)
            pipe.rpush(keys.batch_jobs(self.batch_id), *(e[0] for e in entries))
            pipe.expire(keys.batch_jobs(self.batch_id), store.job_ttl)
            store.call(pipe.execute)
            try:
                store.call(functions.call_many, redis, [("enqueue", e[1], e[2]) for e in entries])
            except BackendError as e:
                raise BackendError(f"batch {self.batch_id}: could not enqueue requests {done}..{done + len(entries)}"
                                   f" ({done} were enqueued before; some of these may be): {e}") from e
            done += len(entries)
        return done


def _text(arg: Any) -> Any:
    """A script argument as JSON can hold it (the message envelope is ASCII JSON bytes)."""
    return arg.decode("ascii") if isinstance(arg, bytes) else arg


def _chunks(f: IO[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for text in f:
        chunk.append(text)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def submit_file(client: Any, path: Path, batch_id: str, fields: dict[str, Any], *, priority: int,
                max_new_tokens: int, anywhere: bool, max_bad_share: float) -> batches.Batch:
    """The body of ``Client.submit_batch`` (which documents it), after its arguments are checked."""
    total = count_lines(path)
    submit = FileSubmit(client, path, batch_id, priority=priority, max_new_tokens=max_new_tokens,
                        anywhere=anywhere)
    with tempfile.TemporaryFile("w+", encoding="utf-8") as calls, \
            tempfile.TemporaryFile("w+", encoding="utf-8") as rejected:
        intake = submit.check(calls, rejected) if total else Intake()
        if not intake.good or intake.bad > max_bad_share * intake.total:
            _refuse_whole(client, batch_id, fields, intake, rejected, max_bad_share)
        batches.create(client.store, batch_id, fields | {"total": intake.total, "n_rejected": intake.bad}, [])
        try:
            if intake.bad:
                rejected.seek(0)
                client.store.call(client.storage.put, keys.batch_object(batch_id, batches.REJECTED),
                                  rejected.read().encode())
            client._wait_for_room(intake.classes, 0.0)
            submit.enqueue(calls)
        except BaseException:
            client.store.call(batches.set_status, client.redis, batch_id, batches.BatchStatus.FAILED)
            raise
    batches.start(client.store, batch_id)
    log.info("batch %s in progress: %d requests, %d lines refused", batch_id, intake.good, intake.bad)
    batch = batches.Batch(client.store, batch_id)
    batch.refresh()  # every job may have ended already: finalize now
    return batch


def _refuse_whole(client: Any, batch_id: str, fields: dict[str, Any], intake: Intake, rejected: IO[str],
                  share: float) -> None:
    """The batch ends ``failed`` with its refused lines as its error file; nothing was enqueued."""
    errors = intake.errors or [LineError(0, "empty_file", "the batch file has no requests")]
    kept = [{"code": e.code, "message": e.message, "line": e.line} for e in errors]
    batches.create(client.store, batch_id, fields | {"total": intake.total, "errors": json.dumps(kept)}, [])
    rejected.seek(0)
    error_key = keys.batch_object(batch_id, batches.ERRORS)
    client.store.call(client.storage.put, error_key, rejected.read().encode())
    client.store.call(batches.set_status, client.redis, batch_id, batches.BatchStatus.FAILED,
                      error_file_id=keys.batch_file_id(batch_id, "errors"))
    raise batches.BatchInvalid(errors, batch_id, refused=max(intake.bad, 1), total=intake.total, share=share)
