"""What a producer asks for: one typed request per job, and its fingerprint for idempotency."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
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

    A job is either ``messages`` (a chat) or ``image`` and ``prompt`` (the shortcut for one user turn: the image,
    then the prompt).

    Attributes:
        image: a path, bytes, a binary file object, a PIL image, or an ``s3://``/``file://`` URI in the
            pool's storage.
        prompt: the question or instruction about the image.
        messages: OpenAI Chat Completions messages (``system``, ``developer``, ``user``, ``assistant`` turns;
            content a string or ``text`` and ``image_url`` parts in any order, any number of images up to
            ``VLMQ_MAX_IMAGES_PER_JOB``, none too), see ``vlmq.chat``. An ``image_url.url`` is a ``data:`` URL, a
            local path, a ``file://`` URL or an ``s3://`` URI in the pool's storage.
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
        decoding: more decoding controls in OpenAI's names (``stop``, ``top_p``, ``frequency_penalty``,
            ``presence_penalty``, ``logit_bias``, ``logprobs``, ``top_logprobs``) and vLLM's (``stop_token_ids``,
            ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``); see ``vlmq.decoding``.
    """

    image: ImageSource | None = None
    prompt: str | None = None
    model: str = DEFAULT_MODEL
    max_new_tokens: int = 128
    priority: int = DEFAULT_PRIORITY
    idempotency_key: str | None = None
    ignore_eos: bool = False
    webhook: str | None = None
    temperature: float = 0.0
    seed: int | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    decoding: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.messages is not None and (self.image is not None or self.prompt is not None):
            raise InvalidRequest("a request is either messages or an image and a prompt, not both",
                                 code="conflicting_fields")
        if self.messages is None and (self.image is None or self.prompt is None):
            missing = [name for name in ("image", "prompt") if getattr(self, name) is None]
            raise InvalidRequest(f"missing {', '.join(missing)} (or pass messages)", code="missing_field")

    @classmethod
    def from_mapping(cls, item: Mapping[str, Any]) -> JobRequest:
        """A request from a mapping of its fields (what ``submit_many`` accepts).

        Raises:
            InvalidRequest: ``missing_field`` without ``messages`` or ``image`` and ``prompt``;
                ``conflicting_fields`` for both; ``unknown_field`` for any other key.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(item) - names)
        if unknown:
            raise InvalidRequest(f"unknown field(s) {', '.join(map(str, unknown))}; a request takes "
                                 f"{', '.join(sorted(names))}", code="unknown_field")
        return cls(**item)


def fingerprint(request: JobRequest, model: str, image_sha256: Sequence[str], messages: str = "",
                decoding: Mapping[str, Any] | None = None) -> str:
    """A digest of everything that decides a job's answer: model, images' content, prompt or messages (``messages``:
    the chat as its record stores it, ``vlmq.chat.Chat.to_json``) and parameters (``decoding``: the request's
    controls as ``vlmq.decoding.check_decoding`` returns them).

    The idempotency key stores it beside the job id, so a second request under the same key is
    recognised as the same request or refused as a different one.
    """
    content: dict[str, Any] = {"model": model, "max_new_tokens": request.max_new_tokens,
                               "priority": request.priority, "ignore_eos": bool(request.ignore_eos)}
    if request.messages is None:  # the shortcut keeps the digest it had before messages
        content |= {"image": image_sha256[0], "prompt": request.prompt}
    else:
        content |= {"images": list(image_sha256), "messages": messages}
    if request.temperature or request.seed is not None:  # greedy requests keep the digests they had before sampling
        content["sampling"] = [float(request.temperature), request.seed]
    if decoding:  # requests without controls keep the digests they had before them
        content["decoding"] = decoding
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
