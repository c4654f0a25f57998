"""One job on a worker: the adapter between job records (users' statuses) and the backend."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis as redis_lib

from vlmq import decoding, keys, remote, rules, store, webhooks
from vlmq.decoding import engine_controls
from vlmq.errors import InvalidRequest, JobFailed
from vlmq.fetch import FetchError
from vlmq.images import ImageLimits
from vlmq.jobs import JobStatus, now
from vlmq.settings import Settings
from vlmq.storage import Storage
from vlmq.webhook_guard import Resolver
from vlmq.workers import faults, metrics
from vlmq.workers.backends.base import GenOutput, GenRequest
from vlmq.workers.batcher import Batcher, HandBack
from vlmq.workers.decode import decode
from vlmq.workers.fleet import FleetReporter
from vlmq.workers.handback import Delivery, OwedAttempts, hand_back
from vlmq.workers.logs import job_context, phase

log = logging.getLogger(__name__)
_ACTIVE = (JobStatus.QUEUED, JobStatus.STARTED)
_FINAL = frozenset(s.value for s in JobStatus if s.is_final)
T = TypeVar("T")


@dataclass(slots=True)
class WorkerContext:
    settings: Settings
    redis: Any
    storage: Storage
    batcher: Batcher
    model: str
    name: str
    fleet: FleetReporter | None = None  # hot routes and counters for the fleet (None: this worker reports nothing)
    owed: OwedAttempts | None = None  # attempts handed back while Redis was down, taken off once it is back
    resolver: Resolver | None = None  # name lookups of image fetches (None: socket.getaddrinfo; tests stub it)

    def __post_init__(self) -> None:
        if self.owed is None:
            self.owed = OwedAttempts(self.redis)

    @property
    def limits(self) -> ImageLimits:
        return ImageLimits(max_bytes=self.settings.max_image_bytes, max_pixels=self.settings.max_image_pixels)


__all__ = ["Delivery", "WorkerContext", "hand_back", "run_job"]


def run_job(ctx: WorkerContext, job_id: str, delivery: Delivery | None = None) -> str:
    """Serve one job end to end; returns the final status. Never raises for a job's own fault; raises HandBack
    for an infrastructure error anywhere (``vlmq.workers.faults``), which is never the job's failure."""
    delivery = delivery or Delivery()
    try:
        return _run_and_announce(ctx, job_id, delivery)
    except HandBack:
        raise
    except Exception as e:
        if faults.is_infra(e):
            raise HandBack(f"job {job_id}: {type(e).__name__}: {e}") from e
        raise


def _run_and_announce(ctx: WorkerContext, job_id: str, delivery: Delivery) -> str:
    status = _run_job(ctx, job_id, delivery)
    if status in _FINAL:  # its webhook event, if any: queued (idempotently) for the delivery workers, never sent here
        try:
            webhooks.job_ended(ctx.redis, job_id, ctx.settings.job_ttl)
        except redis_lib.RedisError as e:  # requeued: the redelivery finds the job ended and queues the event again
            raise HandBack(f"could not queue job {job_id}'s webhook event: {e}") from e
    return status


def _run_job(ctx: WorkerContext, job_id: str, delivery: Delivery) -> str:
    record = store.read(ctx.redis, job_id)
    with job_context(job_id, record.get("model", ""), record.get("cost_class", "")):
        return _run(ctx, job_id, record, delivery)


def _run(ctx: WorkerContext, job_id: str, record: dict[str, str], delivery: Delivery) -> str:
    if not record:
        log.warning("job %s: no record; dropping its message", job_id, extra=phase("dropped"))
        return "missing"
    if record.get("status") in _FINAL or ctx.redis.exists(keys.canceled(job_id)):
        log.info("job %s already %s; skipping", job_id, record["status"], extra=phase("skipped"))
        return record["status"]
    try:
        check_record(ctx, job_id, record)
    except InvalidRequest as e:  # a forged or corrupt record: fail it alone, never serve it
        return _fail_record(ctx, job_id, record, e)
    attempts = ctx.redis.hincrby(keys.job(job_id), "attempts", 1)
    delivery.counted = True  # from here a hand-back takes this attempt off again
    if attempts > ctx.settings.max_attempts:
        # every earlier delivery crashed its worker or timed out: stop the loop here
        return _fail(ctx, job_id, record, "poison", f"delivered {attempts} times; the previous {attempts - 1} "
                     "deliveries crashed their worker or timed out", False)
    store.transition(ctx.redis, job_id, _ACTIVE, JobStatus.STARTED, {"worker": ctx.name})
    log.info("job %s started on %s", job_id, ctx.name, extra=phase("started"))
    if ctx.fleet is not None and record.get("input_key"):  # a text-only job has no image to route by
        ctx.fleet.claim(record["input_key"])
    try:
        return _serve(ctx, job_id, record)
    except JobFailed as e:
        return _fail(ctx, job_id, record, e.error_type, e.message, e.retryable)
    except HandBack:
        raise
    except Exception as e:  # anything unexpected fails this job alone, with its traceback logged
        if faults.is_infra(e):  # Redis or the store went away: not the job's fault, and _fail would need them
            raise HandBack(f"job {job_id}: {type(e).__name__}: {e}") from e
        log.exception("job %s: unexpected failure", job_id, extra=phase("failed"))
        return _fail(ctx, job_id, record, "internal_error", f"{type(e).__name__}: {e}", True)


def _serve(ctx: WorkerContext, job_id: str, record: dict[str, str]) -> str:
    t0 = time.monotonic()
    if record["model"] != ctx.model:
        raise JobFailed("wrong_model", f"job is for model {record['model']!r}; this worker serves {ctx.model!r}")
    s = ctx.settings  # messages None: the (image, prompt) shortcut; both checked with the record (check_record)
    input_keys, messages = rules.input_keys(record, max_images=s.max_images_per_job, max_chars=s.max_prompt_chars)
    try:
        fetches = remote.descriptors(record)  # images priced from their header at submit: fetched here
    except InvalidRequest as e:
        raise JobFailed(e.code, str(e)) from e
    blobs = [fetch_remote(ctx, fetches[key]) if key in fetches else fetch_input(ctx, key) for key in input_keys]
    t1 = time.monotonic()
    try:
        images = tuple(decode(data, ctx.limits) for data in blobs)
    except InvalidRequest as e:
        raise JobFailed(e.code, str(e)) from e
    t2 = time.monotonic()
    temperature, seed = rules.sampling(record)  # checked with the record (check_record)
    chat = messages is not None
    controls = engine_controls(decoding.from_record(record))  # checked with the record
    request = GenRequest(job_id, None if chat else images[0], record.get("prompt", ""),
                         int(record["max_new_tokens"]), messages=messages, images=images if chat else (),
                         ignore_eos=record.get("ignore_eos") == "1", priority=int(record.get("priority", 5)),
                         temperature=temperature, seed=seed if temperature > 0 else None,
                         max_text_tokens=ctx.settings.text_token_bound,
                         canceled=lambda: bool(ctx.redis.exists(keys.canceled(job_id))),
                         cache_salt=cache_salt(job_id, ctx.settings),
                         controls=controls, n=controls.pop("n", 1))
    try:
        output = ctx.batcher.submit(request).result()
    except HandBack:
        raise
    except InvalidRequest as e:  # the backend cannot ever serve this job (too long for its KV, ...)
        raise JobFailed(e.code, str(e)) from e
    except Exception as e:
        if faults.is_infra(e):
            raise HandBack(f"job {job_id}: {type(e).__name__}: {e}") from e
        raise JobFailed("model_error", f"{type(e).__name__}: {e}", retryable=True) from e
    t3 = time.monotonic()
    if ctx.fleet is not None and record.get("input_key"):
        ctx.fleet.served(record["input_key"], output.image_tokens)
    timings = {"queue": max(0.0, now() - float(record["queued_at"]) - (t3 - t0)), "fetch": t1 - t0,
               "decode_image": t2 - t1, "model": t3 - t2}
    return _finish(ctx, job_id, record, output, timings, {"temperature": request.temperature, "seed": request.seed})


def fetch_input(ctx: WorkerContext, input_key: str) -> bytes:
    """The input's bytes, which must hash to the SHA-256 its key names (anyone who can write the bucket could
    have put other bytes there); raises JobFailed ``input_missing`` or ``input_corrupt``, neither retryable."""
    try:
        data = with_storage_retry(ctx, lambda: ctx.storage.get(input_key))
    except KeyError:
        raise JobFailed("input_missing", f"input object {input_key} is not in this worker's storage "
                        f"({ctx.storage.url}); producers and workers must share VLMQ_STORAGE_URL") from None
    if hashlib.sha256(data).hexdigest() != keys.input_sha256(input_key):
        raise JobFailed("input_corrupt", f"input object {input_key} does not hold the bytes its name is the "
                        "SHA-256 of (overwritten or damaged); submit the image again")
    return data


def fetch_remote(ctx: WorkerContext, descriptor: remote.Descriptor) -> bytes:
    """A fetched image's bytes (``vlmq.remote.fetch``: the guard, the caps, the priced bytes); raises JobFailed
    with the fetch's code (``fetch_timeout`` and 5xx ``fetch_failed`` retryable)."""
    try:
        return remote.fetch(descriptor, ctx.settings, ctx.limits, ctx.resolver)
    except FetchError as e:
        raise JobFailed(e.code, e.message, retryable=e.retryable) from None


def choice_doc(index: int, out: GenOutput) -> dict[str, Any]:
    """One of n choices in the result document."""
    return {"index": index, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
            **({"logprobs": out.logprobs} if out.logprobs is not None else {})}


def _finish(ctx: WorkerContext, job_id: str, record: dict[str, str], out: GenOutput,
            timings: dict[str, float], sampling: dict[str, Any]) -> str:
    if ctx.redis.exists(keys.canceled(job_id)):
        log.info("job %s canceled while running (%s after %d tokens); result dropped", job_id, out.finish_reason,
                 len(out.token_ids), extra=phase("canceled"))
        metrics.job_ended(record["model"], record.get("cost_class", ""), JobStatus.CANCELED.value)
        return JobStatus.CANCELED.value
    status = JobStatus(store.read(ctx.redis, job_id).get("status", JobStatus.FAILED.value))
    if status.is_final:  # another delivery already ended it (finished, or failed as poison)
        log.info("job %s already %s; this delivery's result dropped", job_id, status.value, extra=phase("skipped"))
        return status.value
    timings["total"] = now() - float(record["created_at"])
    doc = {
        "job_id": job_id, "model": record["model"], "text": out.text, "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "usage": {"prompt_tokens": out.prompt_tokens, "image_tokens": out.image_tokens,  # the prompt billed once
                  "generated_tokens": sum(len(c.token_ids) for c in out.choices or [out])},
        "sampling": sampling,  # what was applied: temperature 0 is greedy (and its seed None)
        **({"decoding": decoding.from_record(record)} if record.get("decoding") else {}),
        **({"logprobs": out.logprobs} if out.logprobs is not None else {}),
        **({"choices": [choice_doc(i, c) for i, c in enumerate(out.choices)]} if out.choices else {}),
        "timings": timings, "worker": ctx.name, "finished_at": now(),
    }
    key = keys.result_object(job_id)
    wrote = with_storage_retry(ctx, lambda: ctx.storage.put_if_absent(key, json.dumps(doc).encode()))
    if not wrote:
        log.info("job %s: a result already exists; keeping the first", job_id)
        out = GenOutput("", json.loads(with_storage_retry(ctx, lambda: ctx.storage.get(key)))["token_ids"], "", 0, 0)
    changed, previous = store.transition(ctx.redis, job_id, _ACTIVE, JobStatus.FINISHED,
                                           {"result_key": key, "generated_tokens": len(out.token_ids)},
                                           ttl=ctx.settings.job_ttl)
    if not changed and previous == JobStatus.CANCELED.value:
        # canceled between the check above and the transition: a canceled job has no result
        if wrote:
            with_storage_retry(ctx, lambda: ctx.storage.delete(key))
        log.info("job %s canceled as it finished; result dropped", job_id, extra=phase("canceled"))
        metrics.job_ended(record["model"], record.get("cost_class", ""), JobStatus.CANCELED.value)
        return JobStatus.CANCELED.value
    log.info("job %s finished (%d tokens)", job_id, len(out.token_ids), extra=phase("finished"))
    first_token = None if out.first_token_s is None else timings["total"] - timings["model"] + out.first_token_s
    metrics.job_finished(record["model"], record.get("cost_class", ""), timings["total"], first_token,
                         out.prompt_tokens, len(out.token_ids))
    return JobStatus.FINISHED.value


def cache_salt(job_id: str, settings: Settings) -> str | None:
    """The salt of a job's cache entries: its tenant's, so that no tenant's job hits (and, by timing or cache
    counters, learns of) another tenant's encoder outputs, prefix KV or archived KV; None for an untenanted job,
    and for every job with VLMQ_TENANT_CACHE_SHARING=1 (tenants that trust each other share the caches)."""
    tenant = keys.tenant_of(job_id)
    return None if tenant is None or settings.tenant_cache_sharing else f"tenant:{tenant}"


def check_record(ctx: WorkerContext, job_id: str, record: dict[str, str]) -> None:
    """The record follows the SDK's rules (``vlmq.rules``) under this worker's settings; raises InvalidRequest."""
    s = ctx.settings
    rules.check_record(record, job_id, max_prompt_chars=s.max_prompt_chars, max_new_tokens_limit=s.max_new_tokens,
                       max_images=s.max_images_per_job)


def _fail_record(ctx: WorkerContext, job_id: str, record: dict[str, str], error: InvalidRequest) -> str:
    if record.get("status") not in rules.STATUSES:  # a bogus status: make it one the transition can leave
        ctx.redis.hset(keys.job(job_id), "status", JobStatus.QUEUED.value)
    return _fail(ctx, job_id, record, error.code, f"the job record was refused: {error}", False)


def with_storage_retry(ctx: WorkerContext, call: Callable[[], T]) -> T:
    """Run a storage call, retrying an unreachable store with backoff; hand the job back if it stays down."""
    deadline = time.monotonic() + ctx.settings.storage_retry
    delay = 0.2
    while True:
        try:
            return call()
        except HandBack:
            raise
        except Exception as e:
            if not faults.is_infra(e):  # a refusal the store will repeat (KeyError: no such object, ...)
                raise
            if time.monotonic() + delay > deadline:
                raise HandBack(f"object store unreachable for {ctx.settings.storage_retry} s: {e}") from e
            log.warning("object store failed (%s); retrying in %.1f s", e, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _fail(ctx: WorkerContext, job_id: str, record: dict[str, str], code: str, message: str, retryable: bool) -> str:
    store.transition(ctx.redis, job_id, _ACTIVE, JobStatus.FAILED,
                       {"error_type": code, "error_message": message[:2000], "retryable": int(retryable),
                        "worker": ctx.name}, ttl=ctx.settings.job_ttl)
    log.info("job %s failed: %s: %s", job_id, code, message, extra=phase("failed"))
    metrics.job_ended(str(record.get("model", "")), str(record.get("cost_class", "")), JobStatus.FAILED.value, code)
    return JobStatus.FAILED.value
