"""Decoding controls a job may set beyond temperature and seed, in OpenAI's Chat Completions names, checked once at
submit and again by the worker (the same function), and carried in the record as JSON in the engine's names.

    decoding = check_decoding({"stop": ["\\n\\n"], "top_p": 0.9, "logprobs": True, "top_logprobs": 3})
    # -> {"stop": ["\\n\\n"], "top_p": 0.9, "logprobs": 3}

Every field here is applied by the engine (``workers/engine/logits.py``, ``stopping.py``); any other name is refused
(``unknown_field``). ``stop_token_ids``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``min_tokens`` are vLLM's
extras with vLLM's meanings.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from vlmq.errors import InvalidRequest

MAX_STOP, MAX_STOP_CHARS = 4, 256  # stop strings (as OpenAI) and their length; the engine's too (stopping.py)
MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS = 16, 300, 20

_RANGES = {"top_p": (0.0, 1.0, False), "min_p": (0.0, 1.0, True), "repetition_penalty": (0.0, 10.0, False),
           "frequency_penalty": (-2.0, 2.0, True), "presence_penalty": (-2.0, 2.0, True)}
_DEFAULTS = {"stop": [], "stop_token_ids": [], "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
             "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": [], "min_tokens": 0, "n": 1}
FIELDS = frozenset({"stop", "stop_token_ids", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                    "presence_penalty", "logit_bias", "min_tokens", "logprobs", "top_logprobs", "response_format", "n"})
MAX_N = 16  # choices per request
MAX_FORMAT_CHARS, MAX_CHOICES = 65536, 256
# response_format types and the one field each carries (OpenAI's json_object and json_schema; vlmq's others)
_FORMATS = {"json_object": None, "json_schema": "json_schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}


def check_decoding(fields: Mapping[str, Any] | None, max_new_tokens: int | None = None) -> dict[str, Any]:
    """The controls in the engine's names, defaults left out ({} for none); ``None`` values count as absent.

    Raises:
        InvalidRequest: ``unknown_field`` for a name not in :data:`FIELDS`; ``bad_stop``, ``bad_sampling`` or
            ``bad_logprobs`` naming the field and its rule.
    """
    given = {k: v for k, v in (fields or {}).items() if v is not None}
    unknown = sorted(set(given) - FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown decoding field(s) {', '.join(map(str, unknown))}; vlmq applies "
                             f"{', '.join(sorted(FIELDS))}", code="unknown_field")
    out: dict[str, Any] = {}
    for name, check in _CHECKS.items():
        if name in given:
            out[name] = check(given[name])
    for name, (low, high, closed) in _RANGES.items():
        if name in given:
            out[name] = _in_range(name, given[name], low, high, closed)
    if "min_tokens" in given:
        value = given["min_tokens"]
        if not _is_int(value) or value < 0 or (max_new_tokens is not None and value > max_new_tokens):
            raise InvalidRequest(f"min_tokens must be an integer from 0 to max_tokens, got {value!r}",
                                 code="bad_sampling")
        out["min_tokens"] = value
    out |= _logprobs(given)
    if out.get("response_format", 0) is None:  # type text: none
        del out["response_format"]
    return {k: v for k, v in out.items() if k not in _DEFAULTS or v != _DEFAULTS[k]}  # what changes nothing: left out


def to_json(decoding: Mapping[str, Any]) -> str:
    """Compact, key-sorted JSON (the record's and the fingerprint's form)."""
    return json.dumps(decoding, sort_keys=True, separators=(",", ":"))


def from_record(record: Mapping[str, str]) -> dict[str, Any]:
    """A record's ``decoding`` field (absent: none; written by :func:`record_field`), checked as at submit: the
    controls in the engine's forms.

    Raises:
        InvalidRequest: ``bad_record`` for text that is not a JSON object; the codes of :func:`check_decoding`.
    """
    text = record.get("decoding") or "{}"
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequest("job record decoding is not a JSON object", code="bad_record")
    max_new = record.get("max_new_tokens", "")
    return check_decoding(value, int(max_new) if max_new.isdigit() else None)


def record_field(fields: Mapping[str, Any]) -> str:
    """A request's checked controls as its record keeps them: the fields as the caller named them
    (:func:`from_record` checks them again on the worker)."""
    return to_json({k: v for k, v in fields.items() if v is not None})


def engine_controls(decoding: Mapping[str, Any]) -> dict[str, Any]:
    """The engine Request's keyword arguments for checked controls (tuples where the engine keeps tuples); ``n`` is
    the backend's (choices), not the engine request's: callers take it out."""
    out = dict(decoding)
    for name in ("stop", "stop_token_ids"):
        if name in out:
            out[name] = tuple(out[name])
    if "logit_bias" in out:
        out["logit_bias"] = tuple((int(t), float(b)) for t, b in out["logit_bias"])
    return out


def _stop_token_ids(ids: object) -> list[int]:
    if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS or not all(_is_int(t) and t >= 0 for t in ids):
        raise InvalidRequest(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids",
                             code="bad_stop")
    return list(ids)


def _n(value: object) -> int:
    if not _is_int(value) or not 1 <= value <= MAX_N:
        raise InvalidRequest(f"n must be an integer from 1 to {MAX_N} (choices per request), got {value!r}",
                             code="bad_n")
    return value


def _top_k(value: object) -> int:
    if not _is_int(value) or value < -1:
        raise InvalidRequest(f"top_k must be an integer, -1 or 0 for all, got {value!r}", code="bad_sampling")
    return max(0, value)


def _in_range(name: str, value: object, low: float, high: float, closed: bool) -> float:
    if not _is_number(value) or not (low <= value if closed else low < value) or value > high:
        raise InvalidRequest(f"{name} must be a number in {'[' if closed else '('}{low:g}, {high:g}], got {value!r}",
                             code="bad_sampling")
    return float(value)


def _stop(value: object) -> list[str]:
    stop = [value] if isinstance(value, str) else value
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise InvalidRequest(f"stop must be a string or a list of at most {MAX_STOP} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters", code="bad_stop")
    return list(stop)


def _logit_bias(value: object) -> list[list[float]]:
    # OpenAI's map from token id (a JSON object's keys are strings) to a bias from -100 to 100
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids", code="bad_sampling")
    out = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() and len(key) < 10 else key
        if not _is_int(token) or token < 0 or not _is_number(bias) or not -100 <= bias <= 100:
            raise InvalidRequest(f"logit_bias maps token ids to numbers from -100 to 100, got {key!r}: {bias!r}",
                                 code="bad_sampling")
        out.append([token, float(bias)])
    return sorted(out)


def _logprobs(given: Mapping[str, Any]) -> dict[str, int]:
    wanted, top = given.get("logprobs", False), given.get("top_logprobs")
    if not isinstance(wanted, bool):
        raise InvalidRequest(f"logprobs must be true or false, got {wanted!r}", code="bad_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS or not wanted):
        raise InvalidRequest(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, with logprobs true",
                             code="bad_logprobs")
    return {"logprobs": top or 0} if wanted else {}


def _response_format(value: object) -> dict[str, Any] | None:
    """OpenAI's response_format (``text``: none), its shape checked; the worker's grammar engine compiles it and
    fails the job alone (``bad_response_format``) where it cannot."""
    if not isinstance(value, dict) or value.get("type") not in (*_FORMATS, "text"):
        raise InvalidRequest(f"response_format.type must be one of text, {', '.join(_FORMATS)}",
                             code="bad_response_format")
    kind = value["type"]
    if kind == "text":
        return None
    field = _FORMATS[kind]
    extra = sorted(set(value) - {"type", *([field] if field else [])})
    if extra or (field and field not in value):
        raise InvalidRequest(f"response_format of type {kind} takes {field or 'no other field'}"
                             f"{'; not ' + ', '.join(extra) if extra else ''}", code="bad_response_format")
    if len(json.dumps(value)) > MAX_FORMAT_CHARS:
        raise InvalidRequest(f"response_format is over {MAX_FORMAT_CHARS} characters", code="bad_response_format")
    if kind == "json_schema":
        _json_schema(value["json_schema"])
    elif kind == "choice" and not (isinstance(value["choice"], list) and 0 < len(value["choice"]) <= MAX_CHOICES
                                   and all(isinstance(c, str) and c for c in value["choice"])):
        raise InvalidRequest(f"response_format.choice must be a list of 1 to {MAX_CHOICES} non-empty strings",
                             code="bad_response_format")
    elif kind in ("regex", "grammar") and not (isinstance(value[field], str) and value[field]):
        raise InvalidRequest(f"response_format.{field} must be a non-empty string", code="bad_response_format")
    return dict(value)


def _json_schema(spec: object) -> None:
    import jsonschema  # the check only: the worker enforces it

    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object",
                             code="bad_response_format")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise InvalidRequest(f"response_format.json_schema takes name, schema, strict and description; not "
                             f"{', '.join(extra)}", code="bad_response_format")
    try:
        jsonschema.Draft202012Validator.check_schema(spec["schema"])
    except jsonschema.SchemaError as e:
        raise InvalidRequest(f"response_format.json_schema.schema is not a valid JSON schema: {e.message}",
                             code="bad_response_format") from None


def _is_int(value: object) -> bool:
    return type(value) is int


def _is_number(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


_CHECKS = {"stop": _stop, "stop_token_ids": _stop_token_ids, "top_k": _top_k, "logit_bias": _logit_bias,
           "response_format": _response_format, "n": _n}

