"""The rules a job must follow, as pure functions: the SDK applies them at submit, the worker again before serving.

A worker cannot trust a job record (producers hold Redis write access), so it re-checks every record
with the same functions. Each rule raises ``InvalidRequest`` with the code users see.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping

from vlmq import decoding, keys
from vlmq.chat import from_record
from vlmq.errors import InvalidRequest
from vlmq.text import check_utf8 as check_utf8  # re-exported: callers know it as rules.check_utf8

PRIORITIES = range(0, 10)  # 0 is the highest (Celery on Redis)
MAX_IDEMPOTENCY_KEY_CHARS = 200
MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_SEED = 2**63 - 1
_JOB_ID = re.compile(keys.JOB_ID_RE)  # uuid4().hex, after ``<tenant>.`` for a tenant's job
# the statuses a record may hold (``vlmq.jobs.JobStatus`` values)
STATUSES = frozenset({"queued", "started", "finished", "failed", "canceled"})
# record fields the worker reads, and how each must parse
_FLOATS = ("created_at", "queued_at")
_INTS = ("max_new_tokens", "priority")
_TEXTS = ("id", "status", "model")
_SHORTCUT_TEXTS = ("prompt", "input_key")  # a record of the (image, prompt) shortcut; a messages record has messages


def is_job_id(value: object) -> bool:
    """Whether ``value`` is a job id of the form the SDK makes (32 lowercase hex digits, maybe after a tenant)."""
    return isinstance(value, str) and _JOB_ID.fullmatch(value) is not None


def check_prompt(prompt: object, max_chars: int) -> None:
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequest("prompt must be a non-empty string", code="bad_prompt")
    check_utf8(prompt, "prompt", "bad_prompt")
    if len(prompt) > max_chars:
        raise InvalidRequest(f"prompt has {len(prompt)} characters; the limit is {max_chars} "
                             "(VLMQ_MAX_PROMPT_CHARS)", code="prompt_too_long")
    if "<|" in prompt:
        raise InvalidRequest("prompt must not contain special tokens such as <|image_pad|>", code="bad_prompt")


def check_max_new_tokens(value: object, limit: int) -> None:
    if type(value) is not int or not 1 <= value <= limit:
        raise InvalidRequest(f"max_new_tokens must be an integer from 1 to {limit}, got {value!r}",
                             code="bad_max_new_tokens")


def check_priority(value: object) -> None:
    if type(value) is not int or value not in PRIORITIES:
        raise InvalidRequest(f"priority must be an integer from 0 (highest) to 9, got {value!r}", code="bad_priority")


def check_temperature(value: object) -> None:
    # NaN and inf fail the range
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_TEMPERATURE:
        raise InvalidRequest(f"temperature must be a number from 0 (greedy) to {MAX_TEMPERATURE:g}, got {value!r}",
                             code="bad_temperature")


def check_seed(value: object) -> None:
    if value is not None and (type(value) is not int or not 0 <= value <= MAX_SEED):
        raise InvalidRequest(f"seed must be None or an integer from 0 to 2**63 - 1, got {value!r}", code="bad_seed")


def check_idempotency_key(key: object) -> None:
    if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY_CHARS):
        raise InvalidRequest(f"idempotency_key must be a string of 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters",
                             code="bad_idempotency_key")
    if key is not None:
        check_utf8(key, "idempotency_key", "bad_idempotency_key")


def check_model_name(model: object) -> None:
    if not isinstance(model, str):
        raise InvalidRequest("model must be a string", code="unknown_model")


def check_params(prompt: object, max_new_tokens: object, priority: object, idempotency_key: object,
                 model: object, *, max_prompt_chars: int, max_new_tokens_limit: int, temperature: object = 0.0,
                 seed: object = None, chat: bool = False) -> None:
    """Every per-request parameter rule of ``Client.submit`` (the model's existence is checked apart); ``chat``: a
    messages job, without a prompt (``vlmq.chat`` checks its messages)."""
    if not chat:
        check_prompt(prompt, max_prompt_chars)
    check_max_new_tokens(max_new_tokens, max_new_tokens_limit)
    check_priority(priority)
    check_temperature(temperature)
    check_seed(seed)
    check_idempotency_key(idempotency_key)
    check_model_name(model)


def check_input_key(job_id: str, key: object) -> None:
    """The input is a content-addressed ``inputs/<sha256>`` object of the job's own tenant (``keys.input_object``)."""
    if not isinstance(key, str) or not keys.input_key_allowed(job_id, key):
        raise InvalidRequest(f"input_key must be {keys.input_object('<64 hex digits>', keys.tenant_of(job_id))}, "
                             f"got {str(key)[:80]!r}", code="bad_input_key")


def check_record(record: Mapping[str, str], job_id: str, *, max_prompt_chars: int,
                 max_new_tokens_limit: int, max_images: int = 16) -> None:
    """A job record as read from Redis (all values strings) follows the submit rules and the record schema.

    Raises:
        InvalidRequest: ``bad_record`` for a missing, ill-typed or foreign field or an unknown status; the
            parameter codes (``bad_max_new_tokens``, ``bad_prompt``, ``image_count``, ...) and ``bad_input_key``
            otherwise.
    """
    chat = isinstance(record.get("messages"), str)
    texts = (*_TEXTS, *(("messages",) if chat else _SHORTCUT_TEXTS))
    missing = [f for f in (*texts, *_INTS, *_FLOATS) if not isinstance(record.get(f), str)]
    if missing:
        raise InvalidRequest(f"job record lacks {', '.join(missing)}", code="bad_record")
    if record["id"] != job_id:
        raise InvalidRequest(f"job record id {record['id'][:40]!r} is not the message's job id", code="bad_record")
    if record["status"] not in STATUSES:
        raise InvalidRequest(f"job record status {record['status'][:40]!r} is not one of {sorted(STATUSES)}",
                             code="bad_record")
    for name in _FLOATS:
        _parse_float(record, name)
    temperature, seed = sampling(record)
    check_params(record.get("prompt"), _parse_int(record, "max_new_tokens"), _parse_int(record, "priority"),
                 record.get("idempotency_key") or None, record["model"], max_prompt_chars=max_prompt_chars,
                 max_new_tokens_limit=max_new_tokens_limit, temperature=temperature, seed=seed, chat=chat)
    for key in input_keys(record, max_images=max_images, max_chars=max_prompt_chars)[0]:
        check_input_key(job_id, key)
    if record.get("ignore_eos", "0") not in ("0", "1"):
        raise InvalidRequest("job record ignore_eos must be 0 or 1", code="bad_record")
    decoding.from_record(record)


def input_keys(record: Mapping[str, str], *, max_images: int = 16,
               max_chars: int = 8000) -> tuple[list[str], list[dict[str, object]] | None]:
    """A record's image input keys, in order, and its messages (None: the ``(image, prompt)`` shortcut, whose one
    image is ``input_key``); the messages are checked (``vlmq.chat.check_chat``), the keys are not.

    Raises:
        InvalidRequest: ``bad_record`` when ``input_key`` is not the first of a messages record's ``input_keys``;
            the codes of ``vlmq.chat.from_record``.
    """
    if not isinstance(record.get("messages"), str):
        return [record["input_key"]], None
    messages, keys_ = from_record(record, max_images=max_images, max_chars=max_chars)
    if record.get("input_key", keys_[0] if keys_ else None) != (keys_[0] if keys_ else None):
        raise InvalidRequest("job record input_key is not its first input_keys entry", code="bad_record")
    return keys_, messages


def sampling(record: Mapping[str, str]) -> tuple[float, int | None]:
    """A record's (temperature, seed): absent fields (records written before sampling existed) mean greedy, no seed.

    Raises:
        InvalidRequest: ``bad_temperature`` or ``bad_seed`` for a value that is not a number.
    """
    text = record.get("temperature") or "0"
    try:
        temperature = float(text) if re.fullmatch(r"[0-9.eE+-]{1,32}", text) else math.nan
    except ValueError:
        temperature = math.nan
    if not math.isfinite(temperature):
        raise InvalidRequest(f"job record temperature {text[:40]!r} is not a number", code="bad_temperature")
    seed = record.get("seed") or None
    if seed is not None and not re.fullmatch(r"-?[0-9]{1,20}", seed):
        raise InvalidRequest(f"job record seed {seed[:40]!r} is not an integer", code="bad_seed")
    return temperature, None if seed is None else int(seed)


def _parse_int(record: Mapping[str, str], name: str) -> int:
    text = record[name]
    if not re.fullmatch(r"-?[0-9]{1,12}", text):
        raise InvalidRequest(f"job record {name} {text[:40]!r} is not an integer", code="bad_record")
    return int(text)


def _parse_float(record: Mapping[str, str], name: str) -> float:
    try:
        value = float(record[name])
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise InvalidRequest(f"job record {name} {record[name][:40]!r} is not a time", code="bad_record")
    return value
