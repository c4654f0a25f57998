"""What a producer asks for: one typed request per job, and its fingerprint for idempotency."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vlmq.errors import InvalidRequest
from vlmq.images import ImageSource
from vlmq.queue import DEFAULT_PRIORITY

__all__ = ["DEFAULT_MODEL", "ImageSource", "JobRequest", "fingerprint"]

DEFAULT_MODEL = "tiny-shapes"


@dataclass(frozen=True, slots=True)
class JobRequest:
    """One job as a producer asks for it (``Client.submit``'s arguments); checked at submit.

    Attributes:
        image: a path, bytes, a binary file object, a PIL image, or an ``s3://``/``file://`` URI in the
            pool's storage.
        prompt: the question or instruction about the image.
        model: model name (``tiny-shapes`` is bundled; others come from ``VLMQ_MODELS``).
        max_new_tokens: most tokens to generate (1 .. ``VLMQ_MAX_NEW_TOKENS``).
        priority: 0 (highest) to 9 (lowest).
        idempotency_key: submitting the same request again with this key returns the first job, once that job
            exists: a submit racing one still being enqueued waits for it (``vlmq.idempotency``).
        ignore_eos: generate exactly ``max_new_tokens`` tokens (benchmarks and load tests).
        webhook: an http(s) URL told when the job ends (signed ``job.finished``/``job.failed``/``job.canceled``
            events, see ``vlmq.webhooks``); None uses the client's default, ``""`` sends none.
        temperature: 0 (the default) is greedy; above 0 (at most 2) tokens are sampled at this temperature.
        seed: with a temperature above 0, the same seed gives the same answer (on one model and worker device,
            whatever the job is batched with); None draws fresh randomness. Ignored when greedy.
    """

    image: ImageSource
    prompt: str
    model: str = DEFAULT_MODEL
    max_new_tokens: int = 128
    priority: int = DEFAULT_PRIORITY
    idempotency_key: str | None = None
    ignore_eos: bool = False
    webhook: str | None = None
    temperature: float = 0.0
    seed: int | None = None

    @classmethod
    def from_mapping(cls, item: Mapping[str, Any]) -> JobRequest:
        """A request from a mapping of its fields (what ``submit_many`` accepts).

        Raises:
            InvalidRequest: ``missing_field`` without ``image`` or ``prompt``; ``unknown_field`` for any other key.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(item) - names)
        if unknown:
            raise InvalidRequest(f"unknown field(s) {', '.join(map(str, unknown))}; a request takes "
                                 f"{', '.join(sorted(names))}", code="unknown_field")
        missing = [name for name in ("image", "prompt") if name not in item]
        if missing:
            raise InvalidRequest(f"missing {', '.join(missing)}", code="missing_field")
        return cls(**item)


def fingerprint(request: JobRequest, model: str, image_sha256: str) -> str:
    """A digest of everything that decides a job's answer: model, image content, prompt and parameters.

    The idempotency key stores it beside the job id, so a second request under the same key is
    recognised as the same request or refused as a different one.
    """
    content = {"model": model, "image": image_sha256, "prompt": request.prompt,
               "max_new_tokens": request.max_new_tokens, "priority": request.priority,
               "ignore_eos": bool(request.ignore_eos)}
    if request.temperature or request.seed is not None:  # greedy requests keep the digests they had before sampling
        content["sampling"] = [float(request.temperature), request.seed]
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
