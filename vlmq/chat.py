"""A job as chat messages: OpenAI Chat Completions ``messages``, checked and put in the form workers run.

Producers send the turns users bring from OpenAI (``system``, ``developer``, ``user``, ``assistant``; ``content`` a
string or a list of ``text`` and ``image_url`` parts in any order, images in user turns only)::

    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
                                  {"type": "text", "text": "What shape?"}]},
     {"role": "assistant", "content": "circle"},
     {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                  {"type": "image_url", "image_url": {"url": "photos/b.png"}}]}]

:func:`parse_messages` turns them into a :class:`Chat`: the turns in the engine's form (each image part
``{"type": "image"}``, rendered by the model folder's chat template where it stands) and the image references in
order. The record stores that form beside the images' input keys; :func:`check_chat` is the rule both the SDK
and the worker apply to it. A field we accept is a field we apply: anything else (a ``name``, ``tool_calls``, a
``tool`` turn, an ``input_audio`` part, ...) is refused naming it. An ``image_url`` may carry OpenAI's ``detail``
and vlmq's ``min_pixels`` / ``max_pixels``: kept on its engine-form part (``{"type": "image", "detail": "low"}``)
and applied by ``vlmq.resolution.image_policy``, in the SDK's price and the worker's resize alike.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vlmq.errors import InvalidRequest
from vlmq.resolution import BOUND_FIELDS, check_bounds
from vlmq.text import check_utf8

ROLES = ("system", "developer", "user", "assistant")
MAX_MESSAGES = 256
# OpenAI fields of a message or part that vlmq does not apply: refused by name, never dropped
_UNAPPLIED = frozenset({"name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio", "prefix"})
_UNAPPLIED_PARTS = frozenset({"input_audio", "file", "refusal", "video_url", "input_image"})


@dataclass(frozen=True, slots=True)
class Chat:
    """A job's turns in the engine's form and its images.

    Attributes:
        messages: ``{"role", "content"}`` turns; content a string or a list of ``{"type": "text", "text"}`` and
            ``{"type": "image"}`` parts.
        images: one reference per image part, in order (the ``image_url.url`` as given, or an input key).
    """

    messages: list[dict[str, Any]]
    images: tuple[str, ...]

    def to_json(self) -> str:
        """The messages as the record stores them (compact JSON)."""
        return json.dumps(self.messages, separators=(",", ":"), ensure_ascii=False)


def single_turn(prompt: str) -> list[dict[str, Any]]:
    """The ``(image, prompt)`` shortcut in the engine's form: one user turn, the image, then the prompt."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]


def with_urls(messages: list[dict[str, Any]], urls: Sequence[str]) -> list[dict[str, Any]]:
    """The engine form back in OpenAI's, each image part an ``image_url`` with the next of ``urls``."""
    it = iter(urls)

    def part(p: dict[str, Any]) -> dict[str, Any]:
        if p["type"] != "image":
            return p
        return {"type": "image_url", "image_url": {"url": next(it), **{k: v for k, v in p.items() if k != "type"}}}

    return [m if isinstance(m["content"], str) else {**m, "content": [part(p) for p in m["content"]]}
            for m in messages]


def image_parts(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The engine form's image parts, in order (each with the bounds it asks for, if any)."""
    return [p for m in messages if not isinstance(m["content"], str) for p in m["content"] if p["type"] == "image"]


def parse_messages(messages: object, *, max_images: int, max_chars: int) -> Chat:
    """OpenAI Chat Completions messages as a :class:`Chat`.

    Args:
        messages: the list of turns.
        max_images: most image parts in all (``VLMQ_MAX_IMAGES_PER_JOB``).
        max_chars: most characters of text in all (``VLMQ_MAX_PROMPT_CHARS``).

    Returns:
        The chat; ``images`` holds each ``image_url.url`` unresolved.

    Raises:
        InvalidRequest: naming the first bad field (``messages[2].content[0].image_url.url``): ``bad_messages``
            (not the format), ``unsupported_field`` (an OpenAI field vlmq does not apply), ``image_count``,
            ``prompt_too_long`` or ``bad_prompt``.
    """
    images: list[str] = []
    turns = [_message(m, f"messages[{i}]", images) for i, m in enumerate(_check_list(messages))]
    chat = Chat(turns, tuple(images))
    check_chat(chat.messages, len(images), max_images=max_images, max_chars=max_chars)
    return chat


def check_chat(messages: object, num_images: int, *, max_images: int, max_chars: int) -> None:
    """The engine form's rules: what the SDK writes to a record and the worker re-checks before serving it.

    Raises:
        InvalidRequest: ``bad_messages`` for a turn or part not of the form, ``image_count`` when the image parts
            are not ``num_images`` or more than ``max_images``, ``prompt_too_long`` past ``max_chars`` characters
            of text, ``bad_prompt`` for text that is not UTF-8 or holds a special token.
    """
    chars = parts = 0
    for i, message in enumerate(_check_list(messages)):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) != {"role", "content"} or message["role"] not in ROLES:
            raise InvalidRequest(f"{where} must be {{role, content}} with a role of {', '.join(ROLES)}",
                                 code="bad_messages")
        content = message["content"]
        if not isinstance(content, str) and (not isinstance(content, list) or not content):
            raise InvalidRequest(f"{where}.content must be a string or a non-empty list of parts", code="bad_messages")
        for j, part in enumerate([{"type": "text", "text": content}] if isinstance(content, str) else content):
            if _is_image(part, f"{where}.content[{j}]") and message["role"] == "user":
                parts += 1
            elif isinstance(part, dict) and set(part) == {"type", "text"} and part["type"] == "text":
                chars += _text(part["text"], f"{where}.content[{j}].text")
            else:
                raise InvalidRequest(f"{where}.content[{j}] is neither a text part nor an image part of a user "
                                     "turn", code="bad_messages")
    if parts != num_images:
        raise InvalidRequest(f"the messages have {parts} image parts for {num_images} images", code="image_count")
    check_image_count(parts, max_images)
    if chars > max_chars:
        raise InvalidRequest(f"the messages have {chars} characters of text; the limit is {max_chars} "
                             "(VLMQ_MAX_PROMPT_CHARS)", code="prompt_too_long")


def _is_image(part: object, where: str) -> bool:
    """An engine-form image part: ``{"type": "image"}`` with at most the bounds ``check_bounds`` keeps."""
    if not isinstance(part, dict) or part.get("type") != "image" or not set(part) <= {"type", *BOUND_FIELDS}:
        return False
    bounds = {k: v for k, v in part.items() if k != "type"}
    return check_bounds(bounds, where) == bounds


def check_image_count(count: int, max_images: int) -> None:
    """Raises InvalidRequest ``image_count`` for more than ``max_images`` images in one job."""
    if count > max_images:
        raise InvalidRequest(f"the job has {count} images; the limit is {max_images} per job "
                             "(VLMQ_MAX_IMAGES_PER_JOB): split it into several jobs", code="image_count")


def from_record(record: Mapping[str, str], *, max_images: int,
                max_chars: int) -> tuple[list[dict[str, Any]], list[str]]:
    """A messages record's (messages, input keys), checked (``check_chat``; the keys are the caller's to check).

    Raises:
        InvalidRequest: ``bad_record`` for fields that are not JSON of the form; the codes of ``check_chat``.
    """
    try:
        messages, input_keys = json.loads(record["messages"]), json.loads(record.get("input_keys") or "[]")
    except ValueError as e:
        raise InvalidRequest(f"job record messages or input_keys are not JSON: {e}", code="bad_record") from None
    if not isinstance(input_keys, list) or not all(isinstance(k, str) for k in input_keys):
        raise InvalidRequest("job record input_keys must be a JSON list of strings", code="bad_record")
    check_chat(messages, len(input_keys), max_images=max_images, max_chars=max_chars)
    return messages, input_keys


def _check_list(messages: object) -> Sequence[Any]:
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise InvalidRequest("messages must be a non-empty list of turns", code="bad_messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"messages has {len(messages)} turns; the limit is {MAX_MESSAGES}", code="bad_messages")
    return messages


def _message(message: object, where: str, images: list[str]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"{where} must be an object with role and content", code="bad_messages")
    _refuse_fields(message, {"role", "content"}, where)
    role = message.get("role")
    if role not in ROLES:
        code = "unsupported_field" if role in ("tool", "function") else "bad_messages"
        raise InvalidRequest(f"{where}.role {str(role)[:40]!r} is not one of {', '.join(ROLES)}", code=code)
    content = message.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, Sequence) or isinstance(content, bytes) or not content:
        raise InvalidRequest(f"{where}.content must be a string or a non-empty list of parts", code="bad_messages")
    return {"role": role, "content": [_part(p, f"{where}.content[{j}]", role, images) for j, p in enumerate(content)]}


def _part(part: object, where: str, role: str, images: list[str]) -> dict[str, Any]:
    if not isinstance(part, Mapping):
        raise InvalidRequest(f"{where} must be a part object with a type", code="bad_messages")
    kind = part.get("type")
    if kind == "text":
        _refuse_fields(part, {"type", "text"}, where)
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}.text must be a string", code="bad_messages")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        _refuse_fields(part, {"type", "image_url"}, where)
        if role != "user":
            raise InvalidRequest(f"{where}: images belong in user turns, not {role} turns", code="bad_messages")
        url, bounds = _image_url(part.get("image_url"), f"{where}.image_url")
        images.append(url)
        return {"type": "image", **bounds}
    code = "unsupported_field" if kind in _UNAPPLIED_PARTS else "bad_messages"
    raise InvalidRequest(f"{where}.type {str(kind)[:40]!r} is not supported; a part is text or image_url", code=code)


def _image_url(value: object, where: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"{where} must be an object {{url}}", code="bad_messages")
    _refuse_fields(value, {"url", *BOUND_FIELDS}, where)
    url = value.get("url")
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}.url must be a non-empty string (a data: URL, a path or a storage URI), "
                             f"got {type(url).__name__}", code="bad_messages")
    return url, check_bounds(value, where)


def _refuse_fields(item: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(str(k) for k in set(item) - allowed)
    if extra:
        code = "unsupported_field" if _UNAPPLIED & set(extra) else "bad_messages"
        raise InvalidRequest(f"{where} has field(s) {', '.join(extra)} that vlmq does not apply; it takes "
                             f"{', '.join(sorted(allowed))}", code=code)


def _text(text: object, where: str) -> int:
    if not isinstance(text, str):
        raise InvalidRequest(f"{where} must be a string", code="bad_messages")
    check_utf8(text, where, "bad_prompt")
    if "<|" in text:
        raise InvalidRequest(f"{where} must not contain special tokens such as <|image_pad|>", code="bad_prompt")
    return len(text)
