"""The vlmq engine as a worker backend (the default; ``--backend engine``): continuous batching, paged KV, caches.

Jobs join the running engine between steps (`start`/`step`); `generate` runs a batch to completion."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vlmq.errors import InvalidRequest
from vlmq.queue import PRIORITY_STEPS
from vlmq.workers.backends.base import GenOutput, GenRequest, StreamingBackend, is_canceled
from vlmq.workers.engine.config import EngineConfig
from vlmq.workers.engine.engine import Engine, Request, RequestOutput
from vlmq.workers.engine.errors import RequestRejected
from vlmq.workers.engine.sequence import TokenLogprob
from vlmq.workers.kvstore.store import KVStore, empty_stats

log = logging.getLogger(__name__)
LOGGED_TIER_STATS = ("encoded_images", "tier_restored_images", "tier_restored_blocks", "host_hits", "disk_hits",
                     "archive_hits", "archive_misses", "archive_bad_objects", "archive_puts")


class EngineBackend(StreamingBackend):
    def __init__(self, model_dir: str, device: str = "cpu", *, kv_tokens: int | None = None,
                 cancel_poll_every: int = 8, kv_store: KVStore | None = None, **engine_config: Any) -> None:
        """`kv_tokens`: tokens the KV cache must hold at once (the worker's budget), so that no job the worker
        may take is refused or preempted for room; `kv_store`: the host / disk / archive tiers below the
        engine's caches (vlmq.workers.kvstore); `engine_config`: EngineConfig fields and
        Engine.from_model_dir options (num_blocks, dtype, ...), which win."""
        self.model_dir = str(model_dir)
        sized = {"num_blocks", "kv_cache_bytes", "kv_cache_memory_fraction"} & engine_config.keys()
        if kv_tokens is not None and not sized:
            engine_config["num_blocks"] = num_blocks_for_tokens(kv_tokens, engine_config)
        self.kv_store = kv_store
        self.engine = Engine.from_model_dir(model_dir, device, kv_store=kv_store, **engine_config)
        self.cancel_poll_every = cancel_poll_every  # steps between polls of GenRequest.canceled
        self._live: dict[str, GenRequest] = {}  # started, not finished (by engine request id)
        self._aborted: set[str] = set()
        self._num_steps = 0
        self._logged_tiers = ""
        self._retired: dict[str, int] = {}  # counters of the engines that failed and were replaced
        self._groups: dict[str, dict[str, RequestOutput | None]] = {}  # n > 1: first handle -> its choices' outputs
        self._root: dict[str, str] = {}  # a choice's engine request id -> its job's handle

    def start(self, request: GenRequest) -> str:
        handles = [self.engine.add_request(r) for r in choice_requests(request)]
        self._live[handles[0]] = request
        if len(handles) > 1:  # n choices: one job, one result once all are done
            self._groups[handles[0]] = {h: None for h in handles}
            self._root.update((h, handles[0]) for h in handles)
        return handles[0]

    def step(self) -> list[tuple[str, GenOutput | Exception]]:
        if self._num_steps % self.cancel_poll_every == 0:
            for handle in [h for h, r in self._live.items() if h not in self._aborted and is_canceled(r)]:
                for choice in self._groups.get(handle, (handle,)):
                    self.engine.abort(choice)  # its output (tokens so far, "canceled") comes from the next step
                self._aborted.add(handle)
        self._num_steps += 1
        try:
            outputs = self.engine.step()
        except Exception:  # a failed step leaves the engine mid-step: start a fresh one, then isolate the culprit
            live, self._live = self._live, {}
            self._groups.clear()
            self._root.clear()
            log.exception("engine step failed with %d requests in it; retrying them one by one on a fresh engine",
                          len(live))
            self._reset()
            return [(handle, self._one(request)) for handle, request in live.items()]
        tokenizer = self.engine.tokenizer
        done = [(h, _choices_output(outs, tokenizer)) for h, outs in self._gathered(outputs)
                if self._live.pop(h, None) is not None]
        self._aborted.difference_update(h for h, _ in done)
        if done and self.kv_store is not None:
            self._log_tiers()
        return done

    def _gathered(self, outputs: list[RequestOutput]) -> list[tuple[str, list[RequestOutput]]]:
        # each finished job's outputs: one, or its n choices once the last of them is done
        ready = []
        for out in outputs:
            root = self._root.get(out.request_id)
            if root is None:
                ready.append((out.request_id, [out]))
                continue
            group = self._groups[root]
            group[out.request_id] = out
            if all(o is not None for o in group.values()):
                del self._groups[root]
                for h in group:
                    self._root.pop(h, None)
                ready.append((root, list(group.values())))
        return ready

    def _log_tiers(self) -> None:
        stats = self.cache_stats()
        line = " ".join(f"{k}={stats[k]}" for k in LOGGED_TIER_STATS)
        if line != self._logged_tiers:
            self._logged_tiers = line
            log.info("kv tiers: %s", line)

    def close(self) -> None:
        self.engine.close()
        if self.kv_store is not None:
            self.kv_store.close()

    def cache_stats(self) -> dict[str, int]:
        """This worker's cache counters, flat: the engine's caches, then `tier_*` (fetch-or-recompute decisions
        and restores) and the store's `host_*`, `disk_*`, `archive_*` counters (zeros without a store)."""
        out = {k: v + self._retired.get(k, 0) for k, v in _engine_counters(self.engine).items()}
        out.update(self.kv_store.stats() if self.kv_store is not None else empty_stats())
        # what the affinity reporter needs to model this worker's encoder cache
        cfg = self.engine.config
        out.update(encoder_cache_bytes=cfg.encoder_cache_bytes, encoder_bytes_per_token=cfg.encoder_bytes_per_token)
        return out

    @property
    def archive_model_hash(self) -> str | None:
        """The checkpoint hash naming this worker's archive prefix (``kv/<hash>/``), None without an archive."""
        return self.kv_store.model_hash if self.kv_store is not None else None

    def _one(self, request: GenRequest) -> GenOutput | Exception:
        try:
            return _choices_output(self.engine.generate(choice_requests(request)), self.engine.tokenizer)
        except Exception as e:  # returned in its slot; the worker fails this job alone
            log.exception("job %s failed alone on the engine", request.job_id)
            self._reset()
            return e

    def _reset(self) -> None:
        for k, v in _engine_counters(self.engine).items():  # counted up to here: the totals stay monotonic
            self._retired[k] = self._retired.get(k, 0) + v
        self.engine = self.engine.fresh()
        self._aborted.clear()


def _engine_counters(engine: Engine) -> dict[str, int]:
    # the counters that live in an engine (a fresh engine after a failed step starts them at zero)
    st = engine.stats
    out = {"encoder_cache_hits": st.encoder_cache_hits, "encoder_cache_misses": st.encoder_cache_misses,
           "encoded_images": st.num_encoded_images, "prefix_cache_hit_tokens": st.prefix_cache_hit_tokens,
           "prefix_cache_query_tokens": st.prefix_cache_query_tokens}
    for name in ("restored_images", "restored_blocks", "fetch_late", "fetch_skipped", "archive_fetches"):
        out[f"tier_{name}"] = engine.tiers.counts[name] if engine.tiers is not None else 0
    return out


# The SDK's priority levels (0 highest .. 9) in the scheduler's units: its priority is also "lower runs first", but
# it ages waiting sequences by `aging_rate` per step (0.05 by default), so one level there is 20 steps of waiting,
# less than one short answer. Scaled, one SDK level is worth 200 steps (about one 256-token answer) of waiting.
PRIORITY_SCALE = 10


def engine_request(request: GenRequest) -> Request:
    if request.priority not in PRIORITY_STEPS:  # a record not written by the SDK
        raise InvalidRequest(f"priority must be an integer from 0 (highest) to 9, got {request.priority!r}",
                             code="bad_priority")
    options = {"max_new_tokens": request.max_new_tokens, "ignore_eos": request.ignore_eos,
               "priority": request.priority * PRIORITY_SCALE, "temperature": request.temperature,
               "seed": request.seed, "max_text_tokens": request.max_text_tokens, "cache_salt": request.cache_salt,
               **request.controls}
    if request.messages is not None:
        return Request.chat(request.messages, request.images, **options)
    return Request(request.image, request.prompt, **options)


def choice_requests(request: GenRequest) -> list[Request]:
    """The engine requests of a job: one, or one per choice (a seeded job's choice i draws with seed + i)."""
    base = engine_request(request)
    if request.n == 1:
        return [base]
    return [dataclasses.replace(base, seed=None if base.seed is None else base.seed + i) for i in range(request.n)]


def _choices_output(outs: list[RequestOutput], tokenizer) -> GenOutput | Exception:
    results = [_gen_output(o, tokenizer) for o in outs]
    failed = next((r for r in results if isinstance(r, Exception)), None)
    if failed is not None or len(results) == 1:
        return failed or results[0]
    first = results[0]
    return dataclasses.replace(first, choices=results)


def _gen_output(out: RequestOutput, tokenizer) -> GenOutput | Exception:
    if isinstance(out.error, RequestRejected):  # the worker boundary: the engine's reason becomes the SDK's code
        return InvalidRequest(str(out.error), code=out.error.code)
    if out.error is not None:
        return out.error
    first = None if out.first_token_time is None else out.first_token_time - out.arrival_time
    logprobs = None if out.logprobs is None else openai_logprobs(out.token_ids, out.logprobs, tokenizer)
    return GenOutput(out.text, out.token_ids, out.finish_reason, out.prompt_tokens, out.image_tokens, first,
                     logprobs)


def openai_logprobs(token_ids: list[int], entries: list[TokenLogprob], tokenizer) -> list[dict[str, Any]]:
    """The engine's logprobs in OpenAI's ``choices[].logprobs.content`` shape: each token's text (as it decodes
    alone), logprob, UTF-8 bytes, and its top alternatives."""
    def token(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}

    return [token(t, e.logprob) | {"top_logprobs": [token(a, lp) for a, lp in e.top]}
            for t, e in zip(token_ids, entries, strict=True)]


def num_blocks_for_tokens(kv_tokens: int, engine_config: dict[str, Any]) -> int:
    # Each running sequence rounds its tokens up to whole blocks: one spare block per sequence slot.
    default = EngineConfig()
    block_size = int(engine_config.get("block_size", default.block_size))
    max_num_seqs = int(engine_config.get("max_num_seqs", default.max_num_seqs))
    return max(default.num_blocks, -(-kv_tokens // block_size) + max_num_seqs)
