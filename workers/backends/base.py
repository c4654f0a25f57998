"""What every backend takes and returns."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlmq.workers.engine.sequence import FinishReason

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GenRequest:
    job_id: str
    image: Any  # PIL.Image.Image, canonical RGB
    prompt: str
    max_new_tokens: int
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks, load tests)
    priority: int = 5  # the job's priority as the SDK takes it: 0 (highest) to 9 (vlmq.queue.DEFAULT_PRIORITY = 5)
    max_text_tokens: int | None = None  # text prompt tokens + max_new_tokens allowed (VLMQ_TEXT_TOKEN_BOUND)
    canceled: Callable[[], bool] | None = None  # polled during generation; True stops this request
    cache_salt: str | None = None  # cache entries are shared only among requests of one salt (jobrunner.cache_salt)
    temperature: float = 0.0  # 0 = greedy; otherwise sampled at this temperature (vlmq.rules: at most 2)
    seed: int | None = None  # with temperature > 0: the same seed gives the same tokens (None: fresh randomness)
    # a chat (vlmq.chat's engine form: image parts {"type": "image"}) instead of image and prompt, and its images
    messages: list[dict] | None = None
    images: tuple[Any, ...] = ()  # with messages: PIL RGB images in the order of the image parts (none: text only)
    # decoding controls, by the engine Request's field names (stop, stop_token_ids, top_p, top_k, min_p,
    # repetition/frequency/presence_penalty, logit_bias, min_tokens, logprobs); checked by vlmq.decoding at submit
    controls: dict[str, Any] = field(default_factory=dict)
    n: int = 1  # choices: n answers from one prompt (its KV computed once: the prefix cache shares it)


@dataclass(slots=True)
class GenOutput:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason  # stop, length or canceled (an error is returned in the request's slot instead)
    prompt_tokens: int
    image_tokens: int
    first_token_s: float | None = None  # seconds from start() to the first generated token, where the backend knows
    # where the request asked (controls "logprobs"): one per token, in OpenAI's shape ({"token", "logprob",
    # "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]})
    logprobs: list[dict[str, Any]] | None = None
    choices: list[GenOutput] | None = None  # with n > 1: every choice, the first being this output's own fields


class Backend(ABC):
    model_dir: str

    @abstractmethod
    def generate(self, requests: list[GenRequest]) -> list[GenOutput | Exception]:
        """Serve a batch; a failure of one request is returned in its slot, not raised."""

    def cache_stats(self) -> dict[str, int]:
        """Cache counters and sizes the worker publishes to the fleet (``vlmq.workers.fleet``); none by default.

        ``encoder_cache_bytes`` and ``encoder_bytes_per_token`` size the worker's hot set (affinity routing).
        """
        return {}


class StreamingBackend(Backend):
    """A backend requests can join while others run (continuous batching): the worker's batcher starts each
    job as it arrives and steps the backend, instead of handing it whole batches."""

    @abstractmethod
    def start(self, request: GenRequest) -> str:
        """Add a request; returns its handle. Its result comes out of a later `step()`."""

    @abstractmethod
    def step(self) -> list[tuple[str, GenOutput | Exception]]:
        """Advance every started request one step; returns (handle, result) of those that finished.

        A failure of one request is returned in its slot, not raised."""

    def generate(self, requests: list[GenRequest]) -> list[GenOutput | Exception]:
        results: dict[int, GenOutput | Exception] = {}
        slots: dict[str, int] = {}  # handle -> index in requests
        for i, request in enumerate(requests):
            try:
                slots[self.start(request)] = i
            except Exception as e:  # refused at the door (a bad parameter): its slot holds the error
                results[i] = e
        while len(results) < len(requests):
            results.update((slots[h], out) for h, out in self.step() if h in slots)
        return [results[i] for i in range(len(requests))]


def is_canceled(request: GenRequest) -> bool:
    """Poll a request's cancel flag; a failing check (Redis restarting) counts as not canceled, for now."""
    if request.canceled is None:
        return False
    try:
        return bool(request.canceled())
    except Exception as e:  # the next poll asks again; the job's own Redis calls decide its fate
        log.warning("job %s: cancel check failed (%s); generation goes on", request.job_id, e)
        return False
