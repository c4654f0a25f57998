"""A request that passed every check at submit, with its images read and priced, and the job record it becomes."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from vlmq import keys
from vlmq.chat import Chat
from vlmq.cost import JobCost
from vlmq.decoding import record_field
from vlmq.images import ImageInfo
from vlmq.models import ModelSpec
from vlmq.request import JobRequest, fingerprint
from vlmq.store import JobStatus, now

if TYPE_CHECKING:
    from vlmq.remote import Descriptor


class Input(NamedTuple):
    """An image read and probed (shared by every request of a batch that names it).

    A fetched image (``vlmq.remote``) has no data: ``fetch`` says what was priced, ``sha256`` is its hash.
    """

    data: bytes
    info: ImageInfo
    sha256: str
    fetch: Descriptor | None = None


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request that passed every check: its images in order (none for a text-only chat) and their price.

    Attributes:
        chat: the request's messages in the engine's form (None: the ``(image, prompt)`` shortcut, one input).
    """

    request: JobRequest
    spec: ModelSpec
    inputs: tuple[Input, ...]
    cost: JobCost
    webhook: str = ""
    chat: Chat | None = None
    decoding: dict[str, Any] = field(default_factory=dict)  # request.decoding checked (vlmq.decoding), engine form

    @property
    def queue(self) -> str:
        return keys.queue(self.spec.name, self.cost.cost_class)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.request, self.spec.name, [i.sha256 for i in self.inputs],
                           "" if self.chat is None else self.chat.to_json(), self.decoding)

    def route_key(self, tenant: str | None) -> str:
        """The input whose hot worker the job is routed to: its first image's (a text-only job: one never hot)."""
        return keys.input_object(self.inputs[0].sha256 if self.inputs else "", tenant)

    def record(self, job_id: str, tenant: str | None) -> dict[str, Any]:
        """The job record's fields (``vlmq.rules.check_record`` is what workers hold it to)."""
        cost, request, stamp = self.cost, self.request, repr(now())
        fields = {
            "id": job_id, "status": JobStatus.QUEUED.value, "model": self.spec.name,
            "max_new_tokens": request.max_new_tokens, "priority": request.priority,
            "vision_tokens": cost.vision_tokens, "encoder_patches": cost.encoder_patches, "cost_class": cost.cost_class,
            "created_at": stamp, "queued_at": stamp, "idempotency_key": request.idempotency_key or "",
            "attempts": 0, "ignore_eos": int(bool(request.ignore_eos)), "webhook": self.webhook,
            # sampling: absent (records written before it) or 0 means greedy; "" is no seed
            "temperature": repr(float(request.temperature)), "seed": "" if request.seed is None else request.seed,
        }
        if self.decoding:  # absent: none (records written before them read the same)
            fields["decoding"] = record_field(request.decoding or {})
        input_keys = [keys.input_object(i.sha256, tenant) for i in self.inputs]
        fetches = {k: i.fetch.to_json() for k, i in zip(input_keys, self.inputs, strict=True) if i.fetch}
        if fetches:  # absent: every image is an uploaded input
            fields["fetches"] = json.dumps(fetches, sort_keys=True)
        if self.chat is None:  # the shortcut keeps the record it always had: workers of any version serve it
            info = self.inputs[0].info
            return fields | {"prompt": request.prompt, "input_key": input_keys[0], "image_format": info.format,
                             "width": info.width, "height": info.height}
        # a messages record has no prompt: a worker that predates messages refuses it (bad_record), never guesses
        fields |= {"messages": self.chat.to_json(), "input_keys": json.dumps(input_keys),
                   "image_count": len(input_keys)}
        return fields | ({"input_key": input_keys[0]} if input_keys else {})
