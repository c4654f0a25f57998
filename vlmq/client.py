"""The producer SDK: submit image jobs, follow them, cancel them. No torch here."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis as redis_lib

from vlmq import affinity, cachestats, functions, idempotency, keys, prompttokens, remote, rules
from vlmq import batch as batches
from vlmq.batchfile import parse_body
from vlmq.batchsubmit import submit_file
from vlmq.chat import image_parts, parse_messages, single_turn
from vlmq.cost import estimate_job
from vlmq.decoding import check_decoding
from vlmq.errors import BackendError, InvalidRequest, QueueFull
from vlmq.images import ImageLimits, ImageSource, is_storage_url, load_source, probe
from vlmq.jobs import Job, new_job_id
from vlmq.models import ModelSpec, cost_classes, model_folder, resolve_model
from vlmq.prepared import Input, Prepared
from vlmq.queue import DEFAULT_PRIORITY
from vlmq.remote_s3 import in_pool_bucket
from vlmq.request import DEFAULT_MODEL, JobRequest
from vlmq.resolution import image_policy
from vlmq.settings import Settings
from vlmq.storage import ObjectTooLarge, Storage, open_storage
from vlmq.store import JobStore, now
from vlmq.webhook_guard import check_webhook
from vlmq.wire import MessageWriter

log = logging.getLogger(__name__)
# KEYS[1]=job hash, KEYS[2]=queue list, KEYS[3]=wake list; ARGV[1]=record TTL, ARGV[2]=wake TTL,
# ARGV[3]=message, ARGV[4..]=record field, value pairs. The record exists before its message is visible.
CHUNK = 500  # jobs per Redis transaction (records, messages and wake tokens in one round trip)
INPUT_THREADS = 16  # concurrent input uploads of one submit_many
WAKE_TTL = 10  # seconds an unclaimed wake token lives


class Client:
    """Connection to a vlmq pool: a Redis broker and an object store.

    Args:
        broker_url: Redis URL (queues and job records).
        storage_url: ``s3://bucket/prefix`` or ``file:///dir``.
        settings: full settings; ``broker_url``/``storage_url``/``tenant`` override its fields.
        tenant: this producer's tenant id (``VLMQ_TENANT``; ``[a-z0-9-]``, at most 32). Its jobs get ids
            ``<tenant>.<hex>``, its idempotency keys and storage objects are its own (``t/<tenant>/``),
            ``s3://`` inputs must lie under its prefix, and its handles reach only its own jobs. Pair it
            with the tenant's Redis ACL user (``vlmq acl --tenant``) in ``broker_url``; see docs/security.md.
        webhook: default webhook URL of every job submitted here (``VLMQ_WEBHOOK_URL``; see ``submit``).

    Attributes:
        settings: the settings in use.
        tenant: the tenant id, or None for an untenanted producer (which reaches every job).
        storage: the object store (inputs and results).
        store: the job store (records in Redis) that this client's ``Job`` handles read.
    """

    def __init__(self, broker_url: str | None = None, storage_url: str | None = None, *,
                 settings: Settings | None = None, tenant: str | None = None, webhook: str | None = None) -> None:
        base = settings or Settings()
        overrides = {k: v for k, v in (("broker_url", broker_url), ("storage_url", storage_url),
                                       ("tenant", tenant), ("webhook_url", webhook)) if v}
        self.settings = dataclasses.replace(base, **overrides)  # type: ignore[arg-type]
        self.tenant: str | None = self.settings.tenant or None
        redis = redis_lib.Redis.from_url(self.settings.broker_url, socket_connect_timeout=3, socket_timeout=10)
        self.storage: Storage = open_storage(self.settings.storage_url, self.settings.s3_endpoint_url)
        self.store = JobStore(redis, self.storage, self.settings.job_ttl, _safe_url(self.settings.broker_url),
                              tenant=self.tenant)
        self._writer = MessageWriter()
        self._pool: ThreadPoolExecutor | None = None
        self._limits = ImageLimits(max_bytes=self.settings.max_image_bytes, max_pixels=self.settings.max_image_pixels)

    @property
    def redis(self) -> Any:
        """The Redis client behind the job store and the queues."""
        return self.store.redis

    @classmethod
    def from_env(cls, **overrides: Any) -> Client:
        """A client configured from ``VLMQ_*`` environment variables (see ``vlmq.settings``)."""
        return cls(settings=Settings.from_env(**overrides))

    def close(self) -> None:
        """Release connections."""
        self.redis.close()
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, image: ImageSource | None = None, prompt: str | None = None, *,
               messages: Sequence[Mapping[str, Any]] | None = None, model: str = DEFAULT_MODEL,
               max_new_tokens: int = 128, priority: int = DEFAULT_PRIORITY, idempotency_key: str | None = None,
               wait_for_room: float = 0.0, ignore_eos: bool = False, webhook: str | None = None,
               temperature: float = 0.0, seed: int | None = None,
               decoding: Mapping[str, Any] | None = None) -> Job:
        """Validate, price and enqueue one job: a chat (``messages``), or one image and a prompt.

        Args:
            image: a path, bytes, a binary file object, a PIL image, or a URI in the pool's storage.
            prompt: the question or instruction about the image (the shortcut for ``messages=[{"role": "user",
                "content": [<image>, {"type": "text", "text": prompt}]}]``).
            messages: OpenAI Chat Completions messages instead of ``image`` and ``prompt``: ``system``,
                ``developer``, ``user`` and ``assistant`` turns, content a string or ``text`` and ``image_url``
                parts in any order, up to ``VLMQ_MAX_IMAGES_PER_JOB`` images (none too); see ``vlmq.chat``.
                Each image is priced, and the job classed, by the images' vision tokens together.
            model, max_new_tokens, priority, idempotency_key, ignore_eos, temperature, seed: as the fields of
                :class:`vlmq.request.JobRequest` (``temperature`` 0 is greedy; a ``seed`` makes sampling repeatable).
            decoding: stop strings, top_p, penalties, logit_bias, logprobs and the rest (``vlmq.decoding``);
                every control given is applied or the request is refused naming it.
            webhook: http(s) URL that receives the job's signed final event (None: the client's default,
                ``""``: none). Internal addresses are refused (``bad_webhook``) unless in ``VLMQ_WEBHOOK_ALLOW``.
            wait_for_room: when the class queue is full, wait up to this many seconds for room.

        Returns:
            A handle on the queued job.

        Raises:
            InvalidRequest: bad image or parameter; nothing was enqueued.
            QueueFull: the class queue stayed at its limit (``VLMQ_MAX_QUEUE_DEPTH``); nothing was enqueued.
            BackendError: Redis or the object store failed.
        """
        request = JobRequest(image, prompt, model=model, max_new_tokens=max_new_tokens, priority=priority,
                             idempotency_key=idempotency_key, ignore_eos=ignore_eos, webhook=webhook,
                             temperature=temperature, seed=seed, messages=messages, decoding=decoding)
        return self._submit([self._prepare(request)], wait_for_room)[0]

    def submit_body(self, body: Mapping[str, Any], *, wait_for_room: float = 0.0) -> tuple[Job, dict[str, str]]:
        """Submit one OpenAI Chat Completions request body, checked and applied as a batch line's body is
        (``vlmq.batchfile``: every field applied or refused by name); what ``vlmq serve`` runs for
        ``POST /v1/chat/completions``. Images are ``data:`` URLs, ``https://`` URLs or ``s3://`` URIs: a body
        comes from elsewhere, so no local path or ``file://`` URL is read.

        Returns:
            The job and the account fields kept on its record (``user``, ``metadata``, ``service_tier``).

        Raises:
            InvalidRequest: a bad or unsupported field; nothing was enqueued.
            QueueFull: the class queue stayed at its limit; nothing was enqueued.
            BackendError: Redis or the object store failed.
        """
        for url in _image_urls(body.get("messages")):
            if not url[:8].lower().startswith(("data:", "https://", "http://", "s3://")):
                raise InvalidRequest(f"image_url {url[:60]!r}: a request body's images are data: URLs, https:// "
                                     "URLs or s3:// URIs", code="bad_image_source")
        line = parse_body(0, "", dict(body), Path("/nonexistent"), False)
        request = JobRequest(messages=line.messages, model=line.model,
                             priority=min(max(DEFAULT_PRIORITY + line.priority_step, 0), 9),
                             max_new_tokens=line.max_new_tokens or 128, webhook="", temperature=line.temperature,
                             seed=line.seed, decoding=line.decoding)
        return self._submit([self._prepare(request)], wait_for_room, extra=[line.account])[0], line.account

    def submit_many(self, requests: Iterable[JobRequest | Mapping[str, Any]], *, wait_for_room: float = 0.0,
                    on_error: str = "raise") -> list[Any]:
        """Submit several jobs at once; each is a ``JobRequest`` or a mapping of its fields.

        Every request is checked, and the queue limits are checked against everything the batch
        adds, before any is enqueued.

        Args:
            requests: the jobs (``{"messages": [...], "max_new_tokens": ...}``, ``{"image": ..., "prompt": ...}``
                or ``JobRequest``).
            wait_for_room: when a class queue has no room for the batch's jobs, wait up to this many seconds.
            on_error: ``"raise"``: a bad request refuses the whole call; ``"collect"``: each bad request is
                refused alone (its place in the result holds the ``InvalidRequest`` saying why) and the rest
                are enqueued.

        Returns:
            In the order of ``requests``: a ``Job`` handle for each, or with ``on_error="collect"`` the
            ``InvalidRequest`` of each refused one (its message starts ``request <index>:``).

        Raises:
            InvalidRequest: naming the index of the first bad request (``on_error="raise"``); nothing was enqueued.
            QueueFull: a class queue has no room for the good requests; nothing was enqueued.
            BackendError: Redis or the object store failed.
        """
        if on_error not in ("raise", "collect"):
            raise InvalidRequest(f"on_error must be 'raise' or 'collect', got {on_error!r}", code="bad_on_error")
        prepared: list[Prepared] = []
        outcome: list[Any] = []  # per request: its index in prepared, or the InvalidRequest that refused it
        for i, item in enumerate(requests):
            try:
                request = item if isinstance(item, JobRequest) else JobRequest.from_mapping(item)
                prepared.append(self._prepare(request))
                outcome.append(len(prepared) - 1)
            except InvalidRequest as e:
                refused = InvalidRequest(f"request {i}: {e}", code=e.code)
                if on_error == "raise":
                    raise refused from e
                outcome.append(refused)
        jobs = self._submit(prepared, wait_for_room) if prepared else []
        return [jobs[x] if isinstance(x, int) else x for x in outcome]

    def submit_batch(self, path: str | Path, *, completion_window: str = "24h", priority: int = DEFAULT_PRIORITY,
                     max_new_tokens: int = 128, metadata: Mapping[str, str] | None = None,
                     webhook: str | None = None, allow_outside_paths: bool = False,
                     max_bad_share: float | None = None, input_file_id: str | None = None) -> batches.Batch:
        """Submit a batch file in the OpenAI Batch format (``vlmq.batchfile``): one job per line.

        The file is read once, a line at a time, with memory that does not grow with it (``vlmq.batchsubmit``):
        each line is checked, its images read (each recent reference once) and priced, and its inputs stored.
        A bad line (not a request, a bad or unreadable image, a limit, an unknown model, over the text bound) is
        refused alone: it goes to the batch's error file in OpenAI's error-line shape (``Batch.rejected()`` reads
        those lines at once) and counts as a failed request; the rest run. Nothing is enqueued until the whole
        file is read, so a file whose bad lines pass ``max_bad_share`` is refused whole and nothing runs.

        Args:
            path: the JSONL file.
            completion_window: after this (``24h``, ``90m``, ...) requests not yet ended are cancelled and the
                batch ends ``expired``.
            priority: the priority of every job (0 highest .. 9).
            max_new_tokens: for lines without ``max_tokens``/``max_completion_tokens``.
            metadata: string pairs kept on the batch object.
            webhook: http(s) URL that receives a signed ``batch.completed`` event when the batch ends (None: the
                client's default webhook, ``""``: none). Its jobs send no events of their own.
            allow_outside_paths: let local paths and ``file://`` URLs lead outside the batch file's folder (only
                for a batch file you trust: otherwise whoever wrote it can have any image on this machine described).
            max_bad_share: the share of lines (0 to 1) that may be refused before the whole file is (None:
                ``VLMQ_BATCH_MAX_BAD_SHARE``, 0.5; 0: all or nothing). A file with no good line is always refused.
            input_file_id: the File ``path`` was read from (``vlmq.files``; ``vlmq serve`` passes it): the batch
                object's ``input_file_id`` (None: the path).

        Returns:
            A handle on the batch (``in_progress``; its ``request_counts`` already count the refused lines).

        Raises:
            BatchInvalid: the file was refused whole (too many bad lines, or none good); the batch is ``failed``,
                its error file holds every refused line, and nothing was enqueued.
            InvalidRequest: an argument, or the file itself (``bad_batch_file``, ``batch_too_large``); nothing
                was enqueued.
            QueueFull: a class queue has no room for the batch; nothing was enqueued.
            BackendError: Redis or the object store failed.
        """
        share = self.settings.batch_max_bad_share if max_bad_share is None else max_bad_share
        if not 0 <= share <= 1:
            raise InvalidRequest(f"max_bad_share must be between 0 and 1, got {share!r}", code="bad_max_bad_share")
        window = batches.window_seconds(completion_window)
        batch_id, created = batches.new_batch_id(self.tenant), now()
        # a path may hold bytes that are not UTF-8 (os.fsdecode's surrogates): kept readable, never failing in Redis
        shown = str(path).encode("utf-8", "backslashreplace").decode()
        fields = {"endpoint": "/v1/chat/completions", "input_file": shown, "completion_window": completion_window,
                  "created_at": repr(created), "expires_at": repr(created + window),
                  "metadata": json.dumps(batches.check_metadata(metadata))}
        if input_file_id:
            fields["input_file_id"] = input_file_id
        webhook = self.settings.webhook_url if webhook is None else webhook
        if webhook:
            fields["webhook"] = check_webhook(webhook, self.settings.webhook_allow)
        return submit_file(self, Path(path), batch_id, fields, priority=priority, max_new_tokens=max_new_tokens,
                           anywhere=allow_outside_paths, max_bad_share=share)

    def batch(self, batch_id: str) -> batches.Batch:
        """Handle on an existing batch.

        Raises:
            JobNotFound: no such batch, or another tenant's.
        """
        batch = batches.Batch(self.store, batch_id)
        batch.refresh()
        return batch

    def job(self, job_id: str) -> Job:
        """Handle on an existing job.

        Raises:
            JobNotFound: if there is no such job, or it is another tenant's.
        """
        job = Job(self.store, job_id)
        job.info()
        return job

    def queue_depth(self, model: str, cost_class: str) -> int:
        """Messages waiting in one model's cost-class queue (what a queue-length autoscaler reads)."""
        lists = keys.queue_lists(keys.queue(model, cost_class))
        pipe = self.redis.pipeline(transaction=False)
        for name in lists:
            pipe.llen(name)
        return sum(self.store.call(pipe.execute))

    def cache_stats(self) -> dict[str, Any]:
        """What the fleet's caches hold and how often they hit.

        Returns:
            ``{"archive": {model_hash: {"model", "objects", "bytes"}}, "models": {model: {"counters",
            "hit_rates"}}, "workers": {worker: heartbeat fields}}``: the archive as listed under ``kv/`` in the
            pool's storage; counters summed over the live workers of each model (``encoded_images``,
            ``encoder_cache_hits``, ...) and hit rates per cache tier; each live worker's own counters.

        Raises:
            BackendError: Redis or the object store failed, or these credentials may not list them (a
                tenant's may not: fleet accounting is for operators).
        """
        return self.store.call(cachestats.cache_stats, self.redis, self.storage)

    def purge_cache(self, model: str) -> tuple[int, int]:
        """Delete a model's archived KV and encoder outputs (``kv/<model-hash>/`` in the pool's storage).

        Args:
            model: a model name (as workers registered its archive) or a model hash (as ``cache_stats`` shows it).

        Returns:
            (objects, bytes) deleted.

        Raises:
            BackendError: Redis or the object store failed.
        """
        return self.store.call(cachestats.purge, self.redis, self.storage, model)

    # -- internals -----------------------------------------------------------------------------

    def _check_params(self, r: JobRequest) -> ModelSpec:
        # the same rules the worker applies to every record it is handed (vlmq.rules; messages: vlmq.chat)
        rules.check_params(r.prompt, r.max_new_tokens, r.priority, r.idempotency_key, r.model,
                           max_prompt_chars=self.settings.max_prompt_chars,
                           max_new_tokens_limit=self.settings.max_new_tokens, temperature=r.temperature, seed=r.seed,
                           chat=r.messages is not None)
        return resolve_model(r.model, self.settings)

    def _prepare(self, request: JobRequest, loaded: MutableMapping[str, Input] | None = None) -> Prepared:
        """Check, load and price one request; ``loaded`` keeps images already read, by their reference."""
        spec = self._check_params(request)
        decoding = check_decoding(request.decoding, request.max_new_tokens)
        webhook = self.settings.webhook_url if request.webhook is None else request.webhook
        if webhook:
            check_webhook(webhook, self.settings.webhook_allow)
        s = self.settings
        chat = None if request.messages is None else \
            parse_messages(request.messages, max_images=s.max_images_per_job, max_chars=s.max_prompt_chars)
        assert chat is not None or request.image is not None  # JobRequest.__post_init__: messages, or an image
        refs = chat.images if chat is not None else (request.image,)
        policies = None if chat is None else [image_policy(spec.policy, p) for p in image_parts(chat.messages)]
        inputs = tuple(self._load(ref, loaded) for ref in refs if ref is not None)
        cost = estimate_job([(i.info.width, i.info.height) for i in inputs], spec.policy, cost_classes(s), policies)
        prompttokens.check_prompt(model_folder(spec), spec.family, single_turn(request.prompt or "") if chat is None
                                  else chat.messages, request.max_new_tokens, s.text_token_bound)
        return Prepared(request, spec, inputs, cost, webhook, chat, decoding)

    def _load(self, image: ImageSource, loaded: MutableMapping[str, Input] | None) -> Input:
        if loaded is None or not isinstance(image, str):
            return self._read_input(image)
        if image not in loaded:
            loaded[image] = self._read_input(image)
        return loaded[image]

    def _read_input(self, image: ImageSource) -> Input:
        if remote.is_remote(image) or self._foreign_s3(image):  # priced from its header; fetched by the worker
            fetched = remote.price(str(image), self.settings, self._limits)
            return Input(b"", fetched.info(), fetched.sha256, fetched)
        data = self._read_storage_uri(image) if isinstance(image, str) and is_storage_url(image) else \
            load_source(image, self._limits)
        return Input(data, probe(data, self._limits), hashlib.sha256(data).hexdigest())

    def _foreign_s3(self, image: ImageSource) -> bool:
        """An ``s3://`` URI in another bucket than the pool's (``vlmq.remote`` refuses it unless allowed)."""
        return remote.is_s3(image) and not in_pool_bucket(str(image), self.settings)  # the pool's: read below

    def _read_storage_uri(self, uri: str) -> bytes:
        try:
            key = self.storage.key_of(uri)
        except ValueError as e:
            raise InvalidRequest(f"cannot read {uri}: {e}", code="bad_image_source") from e
        if not key.startswith(keys.storage_prefix(self.tenant)):
            raise InvalidRequest(f"{uri} is outside tenant {self.tenant!r}'s objects; a tenant's inputs must lie "
                                 f"under {self.storage.url}/{keys.storage_prefix(self.tenant)}",
                                 code="bad_image_source")
        try:
            return self.storage.get_capped(key, self._limits.max_bytes)
        except ObjectTooLarge as e:
            raise InvalidRequest(f"{uri}: {e}", code="image_too_large") from e
        except (ValueError, KeyError) as e:
            raise InvalidRequest(f"cannot read {uri}: {e}", code="bad_image_source") from e

    def _submit(self, items: list[Prepared], wait_for_room: float, job_ids: list[str] | None = None,
                extra: Sequence[Mapping[str, str]] | None = None) -> list[Job]:
        """Store the inputs, then write records and messages; ``extra`` adds record fields per item."""
        job_ids = job_ids or [keys.tenant_job_id(self.tenant, new_job_id()) for _ in items]
        claimed: list[tuple[str, str]] = []  # (idempotency key, pending value) this call set: released on failure
        try:
            fresh = self._claim_idempotency(items, job_ids, claimed, wait_for_room)
            self._wait_for_room(Counter((items[i].spec.name, items[i].cost.cost_class) for i in fresh), wait_for_room)
            # durability: every input is stored before any message that names it becomes visible
            self._store_inputs(list({x.sha256: x for i in fresh for x in items[i].inputs}.values()))
            self._enqueue([(job_ids[i], items[i], extra[i] if extra else {}) for i in fresh])
        except BaseException:
            if claimed:
                idempotency.release(self.store, claimed)  # best effort: never hides why the submit failed
            raise
        return [Job(self.store, job_id) for job_id in job_ids]

    def _store_inputs(self, items: list[Input]) -> None:
        """Store each uploaded input (a fetched one has no bytes here: its worker fetches it)."""
        items = [x for x in items if not x.fetch]
        if len(items) <= 1:
            for item in items:
                self._store_input(item)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(INPUT_THREADS, thread_name_prefix="vlmq-input")
        list(self._pool.map(self._store_input, items))

    def _enqueue(self, entries: list[tuple[str, Prepared, Mapping[str, str]]]) -> None:
        """Records, messages and wake tokens: one script call per job, one round trip per chunk.

        The script (``vlmq.affinity.ENQUEUE_SCRIPT``) routes the job (a hot image's worker queue, else the shared
        one) and writes its record before its message, atomically, so a worker never pops a message whose
        record is missing and a failed call leaves neither behind.
        """
        for start in range(0, len(entries), CHUNK):
            chunk = entries[start:start + CHUNK]
            calls = [("enqueue", *self._enqueue_call(job_id, item, extra)) for job_id, item, extra in chunk]
            try:
                self.store.call(functions.call_many, self.redis, calls)
            except BackendError as e:
                raise BackendError(f"could not enqueue jobs {start}..{start + len(chunk) - 1} of this submit "
                                   f"({start} were enqueued before; some of these may be): {e}") from e
            for job_id, item, _ in chunk:
                log.info("job %s queued (%s, %d vision tokens)", job_id, item.cost.cost_class,
                         item.cost.vision_tokens)

    def _enqueue_call(self, job_id: str, item: Prepared, extra: Mapping[str, str]) -> tuple[list[str], list[Any]]:
        record = [v for kv in (item.record(job_id, self.tenant) | dict(extra)).items() for v in kv]
        key, priority = item.request.idempotency_key, item.request.priority
        # the key this call holds pending: the script publishes the job id under it once the record is written
        idem = (keys.idempotency(key, self.tenant), idempotency.pending(job_id, item.fingerprint)) if key else None
        return affinity.enqueue_call(
            keys.job(job_id), item.route_key(self.tenant), item.spec.name, item.cost.cost_class,
            priority, bound=self.settings.affinity_queue_bound if self.settings.affinity else 0,  # 0: never routed
            record_ttl=self.settings.job_ttl, wake_ttl=WAKE_TTL,
            message=self._writer.message(job_id, item.queue, priority), record=record, idempotency=idem)

    def _claim_idempotency(self, items: list[Prepared], job_ids: list[str], claimed: list[tuple[str, str]],
                           wait_for_room: float) -> list[int]:
        """Claim each request's idempotency key; returns the indices to enqueue (the others reuse a job id)."""
        fresh: list[int] = []
        mine: dict[str, tuple[str, str]] = {}  # key -> (job id, fingerprint) claimed earlier in this call
        for i, item in enumerate(items):
            key = item.request.idempotency_key
            if key:
                first = mine.get(key) or idempotency.claim(self.store, key, job_ids[i], item.fingerprint,
                                                           idempotency.PENDING_TTL + wait_for_room)
                if first:
                    idempotency.check_same(key, first, item.fingerprint)
                    job_ids[i] = first[0]
                    continue
                claimed.append((key, idempotency.pending(job_ids[i], item.fingerprint)))
                mine[key] = (job_ids[i], item.fingerprint)  # the same key again in this call: this job
            fresh.append(i)
        return fresh

    def _store_input(self, item: Input) -> None:
        input_key = keys.input_object(item.sha256, self.tenant)
        if not self.storage.holds(input_key, item.sha256):  # other bytes at this address are replaced
            self.storage.put_addressed(input_key, item.data)

    def _wait_for_room(self, adding: Mapping[tuple[str, str], int], timeout: float) -> None:
        """Wait until every (model, class) queue has room for what this call adds (``VLMQ_MAX_QUEUE_DEPTH``)."""
        deadline = time.monotonic() + timeout
        for (model, cost_class), count in adding.items():
            queue = keys.queue(model, cost_class)
            limit = self.settings.queue_depth_limit(cost_class)
            if not limit:
                continue
            if count > limit:
                raise QueueFull(f"this submit adds {count} jobs to queue {queue}, its limit is {limit} "
                                "(VLMQ_MAX_QUEUE_DEPTH); submit fewer at a time")
            while (depth := self.queue_depth(model, cost_class)) + count > limit:
                if time.monotonic() >= deadline:
                    raise QueueFull(f"queue {queue} holds {depth} jobs, its limit is {limit} (VLMQ_MAX_QUEUE_DEPTH)"
                                    f" and this submit adds {count}; retry later or pass wait_for_room=seconds")
                time.sleep(0.05)


def _image_urls(messages: object) -> Iterable[str]:
    """The ``image_url.url`` strings of chat messages, as far as they are shaped like them (``vlmq.chat`` checks)."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            image = part.get("image_url") if isinstance(part, dict) else None
            url = image.get("url") if isinstance(image, dict) else None
            if isinstance(url, str):
                yield url


def _safe_url(url: str) -> str:
    """A broker URL for error messages: any password replaced by ``***``."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
