"""Batch input files in the OpenAI Batch format: one chat-completions request per JSONL line.

A line looks like::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "tiny-shapes", "max_tokens": 32, "messages": [
         {"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": [{"type": "text", "text": "How many shapes?"},
                                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}]}}

``body.messages`` is the job, as ``Client.submit(messages=...)`` takes it (``vlmq.chat``): system, developer, user
and assistant turns rendered by the model's chat template, any number of images (none too) where their parts
stand. An ``image_url`` is a ``data:`` URL, an ``https://`` URL or an ``s3://`` URI (the pool's storage, or a
bucket ``VLMQ_IMAGE_FETCH_ALLOW`` lists; fetched by the worker, priced from a ranged read: ``vlmq.remote``), a
``file://`` URL or a local path (relative paths are read from the batch file's folder). A batch file
may come from someone else, so local paths and ``file://`` URLs must lead (symlinks resolved) into the batch
file's folder unless the caller passes ``allow_outside_paths``; only regular files are read (``vlmq.images``).
``temperature`` (0 to 2) and ``seed`` are applied as ``Client.submit`` applies them; unlike OpenAI, a body without
``temperature`` is decoded greedily (temperature 0). The other decoding fields (``stop``, ``top_p``, penalties,
``logit_bias``, ``logprobs``, ``top_logprobs`` and vLLM's ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``) are applied as ``vlmq.decoding`` checks them. OpenAI's account fields are
applied too (``ACCOUNT_FIELDS``): ``user`` and ``metadata`` are kept on the job's record, ``metadata`` returns in
the output line's body; ``service_tier`` sets the job's priority (``flex`` two steps below the batch's, ``priority``
two above, ``auto``/``default`` the batch's) and returns as the tier that served it; ``store`` may be true or
absent (vlmq stores every result until ``VLMQ_RETENTION``), ``store: false`` is refused. Every other field is
refused by name.
Parsing here reads nothing but the file itself (local paths are resolved, not opened); ``Client.submit_batch``
(``vlmq.batchsubmit``) then loads and prices each line's images, a line at a time, and refuses a bad line alone
(``LineError.error_line``: OpenAI's error-line shape).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmq import rules
from vlmq.chat import parse_messages, with_urls
from vlmq.decoding import FIELDS as DECODING_FIELDS
from vlmq.decoding import check_decoding
from vlmq.errors import InvalidRequest
from vlmq.images import file_url_path

ENDPOINT = "/v1/chat/completions"
MAX_CUSTOM_ID_CHARS = 512
MAX_JSON_DEPTH = 32  # a request needs 7 levels (line, body, messages, message, content, part, image_url)
# OpenAI account fields: no bearing on the answer, each applied (BatchLine.account)
ACCOUNT_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})
SERVICE_TIERS = {"auto": 0, "default": 0, "flex": 2, "priority": -2}  # priority steps (9 lowest .. 0 highest)
MAX_USER_CHARS = 256
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds
_BODY_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "stream", "temperature",
                          "seed"}) | DECODING_FIELDS | ACCOUNT_FIELDS
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal, escapes included
_BRACKET = re.compile(r"[\[\]{}]")
_NO_LIMIT = 1 << 30  # the limits on images and text are the client's (settings), checked when it prepares the line


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of a batch file, parsed (its image not yet loaded).

    Attributes:
        line: 1-based line number in the file.
        custom_id: the caller's id, copied to the output and error files.
        model: the ``body.model``.
        messages: the ``body.messages``, each ``image_url`` a ``data:`` URL, an ``s3://`` URI or an absolute path
            with symlinks resolved (only ``url`` kept).
        max_new_tokens: ``max_completion_tokens`` or ``max_tokens`` (None: the client's default).
        temperature: ``temperature`` (absent or null: 0, greedy).
        seed: ``seed`` (absent or null: None).
        decoding: the body's decoding controls as it names them, checked (``vlmq.decoding``; empty: none).
        account: the account fields the job's record keeps (``user``, ``metadata`` as JSON, ``service_tier``).
        priority_step: what ``service_tier`` adds to the batch's priority (``SERVICE_TIERS``).
    """

    line: int
    custom_id: str
    model: str
    messages: list[dict[str, Any]]
    max_new_tokens: int | None
    temperature: float = 0.0
    seed: int | None = None
    decoding: dict[str, Any] = field(default_factory=dict)
    account: dict[str, str] = field(default_factory=dict)
    priority_step: int = 0


@dataclass(frozen=True, slots=True)
class LineError:
    """Why one line of a batch file was refused (``custom_id``: the line's, when it has a readable one)."""

    line: int
    code: str
    message: str
    custom_id: str | None = None

    def __str__(self) -> str:
        return f"line {self.line}: {self.code}: {self.message}"

    def error_line(self, batch_id: str) -> dict[str, Any]:
        """The line's entry in the batch's error file, in OpenAI's shape for a request refused with HTTP 400
        (``response.body.error``), with vlmq's ``line`` and ``retryable`` (False: the same line fails again)."""
        error = {"message": self.message, "type": "invalid_request_error", "param": None, "code": self.code,
                 "line": self.line, "retryable": False}
        request_id = f"{batch_id}-line-{self.line}"
        return {"id": f"batch_req_{request_id}", "custom_id": self.custom_id,
                "response": {"status_code": 400, "request_id": request_id, "body": {"error": error}}, "error": None}


def custom_id_of(text: str) -> str | None:
    """A refused line's ``custom_id`` for its error line, if the line is a JSON object that has a valid one."""
    try:
        check_depth(text, 4 * MAX_JSON_DEPTH)  # a line refused for its depth may still name itself
        item = json.loads(text)
    except (InvalidRequest, ValueError):
        return None
    custom_id = item.get("custom_id") if isinstance(item, dict) else None
    if isinstance(custom_id, str) and 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        try:
            rules.check_utf8(custom_id, "custom_id", "bad_custom_id")
            return custom_id
        except InvalidRequest:
            return None
    return None


def read_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a JSONL file with their 1-based numbers."""
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                yield number, text


def parse_line(number: int, text: str, base_dir: Path, allow_outside_paths: bool = False) -> BatchLine:
    """Parse one line; relative image paths are resolved against ``base_dir`` and must stay inside it unless
    ``allow_outside_paths``.

    Raises:
        InvalidRequest: the line is not a valid request (``code`` says which rule).
    """
    check_depth(text)
    try:
        item = json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"not JSON: {e}", code="bad_json") from None
    if not isinstance(item, dict):
        raise InvalidRequest("a line must be a JSON object", code="bad_line")
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise InvalidRequest(f"unknown field(s) {', '.join(unknown)}", code="unknown_field")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise InvalidRequest(f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters",
                             code="bad_custom_id")
    rules.check_utf8(custom_id, "custom_id", "bad_custom_id")
    if item.get("method") != "POST":
        raise InvalidRequest(f"method must be \"POST\", got {item.get('method')!r}", code="bad_method")
    if item.get("url") != ENDPOINT:
        raise InvalidRequest(f"url must be {ENDPOINT!r}, got {item.get('url')!r}", code="bad_url")
    body = item.get("body")
    if not isinstance(body, dict):
        raise InvalidRequest("body must be an object", code="bad_body")
    return parse_body(number, custom_id, body, base_dir, allow_outside_paths)


def check_depth(text: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than ``MAX_JSON_DEPTH`` before parsing it (``json.loads`` would recurse until
    ``RecursionError``, at a depth that depends on the caller's stack).

    Raises:
        InvalidRequest: ``bad_json``.
    """
    depth = 0
    for bracket in _BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if bracket[0] in "[{" else -1
        if depth > limit:
            raise InvalidRequest(f"not JSON vlmq accepts: nested deeper than {limit} levels", code="bad_json")


def parse_body(number: int, custom_id: str, body: dict[str, Any], base_dir: Path, anywhere: bool) -> BatchLine:
    """A Chat Completions request body checked as a batch line's (its number and custom_id name it)."""
    unknown = sorted(set(body) - _BODY_FIELDS)
    if unknown:
        raise InvalidRequest(f"body field(s) {', '.join(unknown)} are not supported", code="unsupported_field")
    if not isinstance(body.get("model"), str):
        raise InvalidRequest("body.model must be a string", code="bad_model")
    if body.get("stream", False) is not False:
        raise InvalidRequest("stream must be false (a batch line's answer is written whole)", code="unsupported_field")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (type(limit) is not int or limit < 1):
        raise InvalidRequest(f"max_tokens must be a positive integer, got {limit!r}", code="bad_max_new_tokens")
    chat = parse_messages(body.get("messages"), max_images=_NO_LIMIT, max_chars=_NO_LIMIT)
    messages = with_urls(chat.messages, [_image_ref(url, base_dir, anywhere) for url in chat.images])
    temperature = 0.0 if body.get("temperature") is None else body["temperature"]
    seed = body.get("seed")
    rules.check_temperature(temperature)
    rules.check_seed(seed)
    decoding = {k: body[k] for k in DECODING_FIELDS & body.keys()}  # as OpenAI names them: JobRequest.decoding
    check_decoding(decoding, limit)
    account, step = account_fields(body)
    return BatchLine(number, custom_id, body["model"], messages, limit, temperature, seed, decoding, account, step)


def account_fields(body: dict[str, Any]) -> tuple[dict[str, str], int]:
    """A body's ``user``, ``metadata``, ``store`` and ``service_tier``, checked: the record fields they become
    and the priority step of the tier.

    Raises:
        InvalidRequest: ``bad_user``, ``bad_metadata``, ``unsupported_field`` (``store: false``, an unknown tier).
    """
    account: dict[str, str] = {}
    user = body.get("user")
    if user is not None:
        if not isinstance(user, str) or len(user) > MAX_USER_CHARS:
            raise InvalidRequest(f"user must be a string of at most {MAX_USER_CHARS} characters", code="bad_user")
        rules.check_utf8(user, "user", "bad_user")
        account["user"] = user
    metadata = body.get("metadata")
    if metadata is not None:
        account["metadata"] = json.dumps(_metadata(metadata), ensure_ascii=False)
    if body.get("store") not in (None, True):
        raise InvalidRequest("store must be true or absent: vlmq stores every result (until VLMQ_RETENTION) and "
                             "cannot honour store: false", code="unsupported_field")
    tier = body.get("service_tier")
    if tier is None:
        return account, 0
    if tier not in SERVICE_TIERS:
        raise InvalidRequest(f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {str(tier)[:20]!r}",
                             code="unsupported_field")
    account["service_tier"] = "default" if tier == "auto" else tier
    return account, SERVICE_TIERS[tier]


def _metadata(metadata: object) -> dict[str, str]:
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
            for k, v in metadata.items()):
        raise InvalidRequest(f"metadata must map at most {MAX_METADATA_PAIRS} strings of at most {MAX_METADATA_KEY} "
                             f"characters to strings of at most {MAX_METADATA_VALUE}", code="bad_metadata")
    for key, value in metadata.items():
        rules.check_utf8(key + value, f"metadata {key[:40]!r}", "bad_metadata")
    return metadata


def _image_ref(url: str, base_dir: Path, anywhere: bool) -> str:
    lowered = url[:8].lower()
    if lowered.startswith(("data:", "s3://", "https://", "http://")):  # http(s): the client prices or refuses it
        return url
    if lowered.startswith("file://"):
        return str(local_path(file_url_path(url), base_dir, anywhere))
    if _SCHEME.match(url):
        raise InvalidRequest(f"image_url {url[:60]!r}: not a scheme vlmq reads; use a data: URL, an https:// URL "
                             "(VLMQ_IMAGE_FETCH_ALLOW), an s3:// URI or a local path", code="bad_image_source")
    return str(local_path(base_dir / url, base_dir, anywhere)) if url else url


def local_path(path: Path, base_dir: Path, anywhere: bool = False) -> Path:
    """``path`` with symlinks resolved, refused outside ``base_dir`` unless ``anywhere`` (nothing is opened, so a
    refused path says nothing about what exists there).

    Raises:
        InvalidRequest: ``image_outside_folder``; ``bad_image_source`` for a path with a NUL or a lone surrogate.
    """
    try:
        resolved, base = path.resolve(), base_dir.resolve()
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise InvalidRequest(f"bad image path {str(path)[:80]!r}: {e}", code="bad_image_source") from None
    if not anywhere and not resolved.is_relative_to(base):
        raise InvalidRequest(f"image path {str(path)[:80]!r} leads outside the batch file's folder {str(base)!r}; "
                             "put the image there, or pass allow_outside_paths=True (vlmq batch submit "
                             "--allow-outside-paths) for a batch file you trust", code="image_outside_folder")
    return resolved
