"""The producer SDK: submit image jobs, follow them, cancel them. No torch here."""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis as redis_lib

from vlmq import keys, records
from vlmq.cost import CostEstimate, estimate
from vlmq.errors import BackendError, InvalidRequest, JobNotFound, QueueFull
from vlmq.images import ImageInfo, ImageLimits, load_source, probe
from vlmq.jobs import Job, JobStatus, new_job_id, now
from vlmq.models import ModelSpec, cost_classes, resolve_model
from vlmq.queue import DEFAULT_PRIORITY, TASK_NAME, make_celery
from vlmq.settings import Settings
from vlmq.storage import Storage, open_storage, split_uri

log = logging.getLogger(__name__)

ImageSource = Any  # path, bytes, binary file object, PIL image, or s3:// URI in storage
_IDEM_TTL = 7 * 24 * 3600


@dataclass(frozen=True, slots=True)
class _Priced:
    data: bytes
    info: ImageInfo
    sha256: str
    cost: CostEstimate


class Client:
    """Connection to a vlmq pool: a Redis broker and an object store.

    Args:
        broker_url: Redis URL (queues and job records).
        storage_url: ``s3://bucket/prefix`` or ``file:///dir``.
        settings: full settings; ``broker_url``/``storage_url`` override its fields.
    """

    def __init__(self, broker_url: str | None = None, storage_url: str | None = None, *,
                 settings: Settings | None = None) -> None:
        base = settings or Settings()
        overrides = {k: v for k, v in (("broker_url", broker_url), ("storage_url", storage_url)) if v}
        self.settings = dataclasses.replace(base, **overrides)  # type: ignore[arg-type]
        self.redis = redis_lib.Redis.from_url(self.settings.broker_url, socket_connect_timeout=3, socket_timeout=10)
        self.storage: Storage = open_storage(self.settings.storage_url, self.settings.s3_endpoint_url)
        self._celery = make_celery(self.settings, name="vlmq-producer")
        self._limits = ImageLimits(max_bytes=self.settings.max_image_bytes, max_pixels=self.settings.max_image_pixels)

    @classmethod
    def from_env(cls, **overrides: Any) -> Client:
        """A client configured from ``VLMQ_*`` environment variables (see ``vlmq.settings``)."""
        return cls(settings=Settings.from_env(**overrides))

    def close(self) -> None:
        """Release connections."""
        self.redis.close()
        self._celery.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, image: ImageSource, prompt: str, *, model: str = "tiny-shapes", max_new_tokens: int = 128,
               priority: int = DEFAULT_PRIORITY, idempotency_key: str | None = None,
               wait_for_room: float = 0.0, ignore_eos: bool = False) -> Job:
        """Validate, price and enqueue one image job.

        Args:
            image: a path, bytes, a binary file object, a PIL image, or an ``s3://`` URI in the pool's bucket.
            prompt: the question or instruction about the image.
            model: model name (``tiny-shapes`` is bundled; others come from ``VLMQ_MODELS``).
            max_new_tokens: most tokens to generate (1 .. ``VLMQ_MAX_NEW_TOKENS``).
            priority: 0 (highest) to 9 (lowest).
            idempotency_key: submitting again with the same key returns the first job.
            wait_for_room: when the class queue is full, wait up to this many seconds for room.
            ignore_eos: generate exactly ``max_new_tokens`` tokens (benchmarks and load tests).

        Returns:
            A handle on the queued job.

        Raises:
            InvalidRequest: bad image or parameter; nothing was enqueued.
            QueueFull: the class queue stayed at its limit (``VLMQ_MAX_QUEUE_DEPTH``); nothing was enqueued.
            BackendError: Redis or the object store failed.
        """
        spec = self._check_params(prompt, model, max_new_tokens, priority, idempotency_key)
        if idempotency_key:
            existing = self._get(keys.idempotency(idempotency_key))
            if existing:
                return Job(self, existing)
        priced = self._price(image, spec)
        self._wait_for_room(spec.name, priced.cost.cost_class, wait_for_room)
        job_id = new_job_id()
        if idempotency_key and not self._claim_idempotency(idempotency_key, job_id):
            return Job(self, self._get(keys.idempotency(idempotency_key)) or job_id)
        options = {"prompt": prompt, "model": model, "max_new_tokens": max_new_tokens, "priority": priority,
                   "idempotency_key": idempotency_key, "ignore_eos": ignore_eos}
        return self._enqueue(job_id, spec, priced, options)

    def submit_many(self, requests: Iterable[Mapping[str, Any]]) -> list[Job]:
        """Submit several jobs; each mapping holds ``submit``'s arguments (``image``, ``prompt``, ...).

        Every request is validated before any is enqueued.

        Raises:
            InvalidRequest: naming the index of the first bad request; nothing was enqueued.
        """
        items = [dict(r) for r in requests]
        specs = []
        for i, item in enumerate(items):
            try:
                item.setdefault("model", "tiny-shapes")
                spec = self._check_params(item.get("prompt", ""), item["model"], item.get("max_new_tokens", 128),
                                          item.get("priority", DEFAULT_PRIORITY), item.get("idempotency_key"))
                item["image"] = self._price(item["image"], spec)
                specs.append(spec)
            except InvalidRequest as e:
                raise InvalidRequest(f"request {i}: {e}", code=e.code) from e
            except KeyError as e:
                raise InvalidRequest(f"request {i}: missing {e}", code="missing_field") from e
        if any(item.get("idempotency_key") or item.get("wait_for_room") for item in items):
            return [self.submit(item.pop("image"), item.pop("prompt"), **item) for item in items]
        return self._enqueue_bulk(items, specs)

    def _enqueue_bulk(self, items: list[dict[str, Any]], specs: list[ModelSpec]) -> list[Job]:
        # one storage check per distinct image, one Redis round trip for all records, one producer connection
        for priced in {item["image"].sha256: item["image"] for item in items}.values():
            self._store_input(priced)
        classes = {(spec.name, item["image"].cost.cost_class) for spec, item in zip(specs, items, strict=True)}
        for model, cost_class in classes:
            self._wait_for_room(model, cost_class, 0.0)
        jobs = [(new_job_id(), spec, item) for spec, item in zip(specs, items, strict=True)]
        pipe = self.redis.pipeline(transaction=False)
        for job_id, spec, item in jobs:
            pipe.hset(keys.job(job_id), mapping=self._record(job_id, spec, item["image"], item))
        self._call(pipe.execute)
        with self._celery.producer_or_acquire() as producer:
            for job_id, _, item in jobs:
                self._publish(job_id, item["image"].cost.cost_class, item, producer)
        return [Job(self, job_id) for job_id, _, _ in jobs]

    def job(self, job_id: str) -> Job:
        """Handle on an existing job.

        Raises:
            JobNotFound: if there is no such job.
        """
        job = Job(self, job_id)
        job.info()
        return job

    def queue_depth(self, model: str, cost_class: str) -> int:
        """Messages waiting in one model's cost-class queue (what a queue-length autoscaler reads)."""
        lists = keys.queue_lists(keys.queue(model, cost_class))
        pipe = self.redis.pipeline(transaction=False)
        for name in lists:
            pipe.llen(name)
        return sum(self._call(pipe.execute))

    # -- internals -----------------------------------------------------------------------------

    def _check_params(self, prompt: str, model: str, max_new_tokens: int, priority: int,
                      idempotency_key: str | None) -> ModelSpec:
        s = self.settings
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequest("prompt must be a non-empty string", code="bad_prompt")
        if len(prompt) > s.max_prompt_chars:
            raise InvalidRequest(f"prompt has {len(prompt)} characters; the limit is {s.max_prompt_chars} "
                                 "(VLMQ_MAX_PROMPT_CHARS)", code="prompt_too_long")
        if "<|" in prompt:
            raise InvalidRequest("prompt must not contain special tokens such as <|image_pad|>", code="bad_prompt")
        if type(max_new_tokens) is not int or not 1 <= max_new_tokens <= s.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens must be an integer from 1 to {s.max_new_tokens}, "
                                 f"got {max_new_tokens!r}", code="bad_max_new_tokens")
        if type(priority) is not int or not 0 <= priority <= 9:
            raise InvalidRequest(f"priority must be an integer from 0 (highest) to 9, got {priority!r}",
                                 code="bad_priority")
        if idempotency_key is not None and (not isinstance(idempotency_key, str)
                                            or not 1 <= len(idempotency_key) <= 200):
            raise InvalidRequest("idempotency_key must be a string of 1 to 200 characters", code="bad_idempotency_key")
        if not isinstance(model, str):
            raise InvalidRequest("model must be a string", code="unknown_model")
        return resolve_model(model, s)

    def _price(self, image: ImageSource, spec: ModelSpec) -> _Priced:
        if isinstance(image, _Priced):
            return image
        if isinstance(image, str) and image.startswith("s3://"):
            data = self._read_uri(image)
        else:
            data = load_source(image, self._limits)
        info = probe(data, self._limits)
        cost = estimate(info.width, info.height, spec.policy, cost_classes(self.settings))
        return _Priced(data, info, hashlib.sha256(data).hexdigest(), cost)

    def _read_uri(self, uri: str) -> bytes:
        bucket, key = split_uri(uri)
        if getattr(self.storage, "bucket", None) != bucket:
            raise InvalidRequest(f"{uri} is not in this pool's storage ({self.storage.url})", code="bad_image_source")
        try:
            data: bytes = self.storage.client.get_object(Bucket=bucket, Key=key)["Body"].read()  # type: ignore[attr-defined]
        except Exception as e:  # botocore raises many kinds; the user needs the key and the reason
            raise InvalidRequest(f"cannot read {uri}: {e}", code="bad_image_source") from e
        if len(data) > self._limits.max_bytes:
            raise InvalidRequest(f"{uri} has {len(data)} bytes; the limit is {self._limits.max_bytes}",
                                 code="image_too_large")
        return data

    def _enqueue(self, job_id: str, spec: ModelSpec, priced: _Priced, options: dict[str, Any]) -> Job:
        self._store_input(priced)
        self._call(self.redis.hset, keys.job(job_id), mapping=self._record(job_id, spec, priced, options))
        self._publish(job_id, priced.cost.cost_class, options)
        log.info("job %s queued (%s, %d vision tokens)", job_id, priced.cost.cost_class, priced.cost.vision_tokens)
        return Job(self, job_id)

    def _store_input(self, priced: _Priced) -> None:
        input_key = keys.input_object(priced.sha256)
        if not self.storage.exists(input_key):
            self.storage.put(input_key, priced.data)

    def _record(self, job_id: str, spec: ModelSpec, priced: _Priced,
                options: Mapping[str, Any]) -> dict[Any, Any]:
        cost, stamp = priced.cost, repr(now())
        return {
            "id": job_id, "status": JobStatus.QUEUED.value, "model": spec.name, "prompt": options["prompt"],
            "max_new_tokens": options.get("max_new_tokens", 128), "priority": options.get("priority", DEFAULT_PRIORITY),
            "input_key": keys.input_object(priced.sha256), "image_format": priced.info.format,
            "width": priced.info.width, "height": priced.info.height, "vision_tokens": cost.vision_tokens,
            "encoder_patches": cost.encoder_patches, "cost_class": cost.cost_class,
            "queue": keys.queue(spec.name, cost.cost_class), "created_at": stamp, "queued_at": stamp,
            "idempotency_key": options.get("idempotency_key") or "", "attempts": 0,
            "ignore_eos": int(bool(options.get("ignore_eos", False))),
        }

    def _publish(self, job_id: str, cost_class: str, options: Mapping[str, Any], producer: Any = None) -> None:
        queue = keys.queue(options.get("model", "tiny-shapes"), cost_class)
        try:
            self._celery.send_task(TASK_NAME, args=[job_id], queue=queue, retry=False, producer=producer,
                                   priority=options.get("priority", DEFAULT_PRIORITY))
        except Exception as e:  # kombu/redis raise many connection errors; the job must not look queued
            records.transition(self.redis, job_id, [JobStatus.QUEUED], JobStatus.FAILED,
                               {"error_type": "backend_error", "error_message": f"publish failed: {e}"})
            raise BackendError(f"could not enqueue job {job_id}: {e}") from e

    def _wait_for_room(self, model: str, cost_class: str, timeout: float) -> None:
        limit = self.settings.queue_depth_limit(cost_class)
        if not limit:
            return
        deadline = time.monotonic() + timeout
        while (depth := self.queue_depth(model, cost_class)) >= limit:
            if time.monotonic() >= deadline:
                raise QueueFull(f"queue {keys.queue(model, cost_class)} holds {depth} jobs, its limit is {limit} "
                                "(VLMQ_MAX_QUEUE_DEPTH); retry later or pass wait_for_room=seconds")
            time.sleep(0.05)

    def _claim_idempotency(self, key: str, job_id: str) -> bool:
        return bool(self._call(self.redis.set, keys.idempotency(key), job_id, nx=True, ex=_IDEM_TTL))

    def _get(self, key: str) -> str | None:
        value = self._call(self.redis.get, key)
        return value.decode() if value else None

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except redis_lib.RedisError as e:
            raise BackendError(f"Redis at {self.settings.broker_url} failed: {e}") from e

    def _read_record(self, job_id: str) -> dict[str, str]:
        return self._call(records.read, self.redis, job_id)  # type: ignore[no-any-return]

    def _wait_done(self, job_id: str, timeout: float) -> None:
        # LPOP + RPUSH back keeps the marker for other waiters; BLPOP blocks until it appears
        popped = self._call(self.redis.blpop, [keys.done(job_id)], timeout=max(timeout, 0.01))
        if popped:
            self._call(self.redis.rpush, keys.done(job_id), popped[1])

    def _cancel(self, job_id: str) -> bool:
        self._call(self.redis.set, keys.canceled(job_id), "1", ex=self.settings.job_ttl)
        changed, previous = self._call(records.transition, self.redis, job_id,
                                       [JobStatus.QUEUED, JobStatus.STARTED], JobStatus.CANCELED,
                                       ttl=self.settings.job_ttl)
        if previous is None:
            raise JobNotFound(f"no job {job_id!r}")
        return bool(changed) or previous == JobStatus.CANCELED.value
