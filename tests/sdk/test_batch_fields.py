"""Every Chat Completions body field (and vLLM's extras) in a batch line is applied or refused by name: a field
that parses must land in what the line carries to its job (the four OpenAI account fields: on its record)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmq.batchfile import parse_line
from vlmq.errors import InvalidRequest

IMAGE = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLv"
         "AAAAAElFTkSuQmCC")
MESSAGES = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                                         {"type": "text", "text": "Describe the image."}]}]
# a valid value for each field a user may send (notes/openai-surface.md)
VALUES = {
    "max_completion_tokens": 32, "max_tokens": 32, "temperature": 0.7, "seed": 3, "top_p": 0.9, "n": 2,
    "stop": ["\n"], "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"5": 1.0}, "logprobs": True,
    "top_logprobs": 2, "response_format": {"type": "json_object"}, "top_k": 20, "min_p": 0.1,
    "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [7], "stream": False,
    "tools": [], "tool_choice": "none", "parallel_tool_calls": False, "reasoning_effort": "low",
    "stream_options": {"include_usage": True}, "ignore_eos": True, "prompt_logprobs": 1, "allowed_token_ids": [1],
    "bad_words": ["x"], "structured_outputs": {"regex": "a"}, "mm_processor_kwargs": {"max_pixels": 1},
    "cache_salt": "s", "priority": 1, "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "flex",
}


def carried(line) -> dict:
    """Where each applied body field ends up on the parsed line."""
    out = {"max_completion_tokens": line.max_new_tokens, "max_tokens": line.max_new_tokens,
           "temperature": line.temperature, "seed": line.seed, "stream": False}
    account = {"user": line.account.get("user"), "service_tier": line.account.get("service_tier"),
               "metadata": json.loads(line.account.get("metadata", "null"))}
    return out | dict(line.decoding) | account


@pytest.mark.parametrize("field", sorted(VALUES))
def test_each_body_field_is_applied_or_refused_by_name(field: str, tmp_path: Path) -> None:
    body = {"model": "tiny-shapes", "messages": MESSAGES, field: VALUES[field]}
    if field == "top_logprobs":
        body["logprobs"] = True
    text = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body})
    try:
        line = parse_line(1, text, tmp_path)
    except InvalidRequest as e:
        assert field in str(e), (field, str(e))  # refused, naming the field
        return
    assert carried(line).get(field) == VALUES[field], field  # accepted: carried to the job as sent


def test_the_account_fields_reach_the_record_and_the_priority(tmp_path: Path) -> None:
    def parsed(**body: object):
        text = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "tiny-shapes", "messages": MESSAGES, **body}})
        return parse_line(1, text, tmp_path)

    assert [parsed(service_tier=t).priority_step for t in ("auto", "default", "flex", "priority")] == [0, 0, 2, -2]
    assert parsed(service_tier="auto").account == {"service_tier": "default"} and parsed(store=True).account == {}
    for body, code in (({"service_tier": "scale"}, "unsupported_field"), ({"store": False}, "unsupported_field"),
                       ({"user": "u" * 257}, "bad_user"), ({"metadata": {str(i): "v" for i in range(17)}},
                                                          "bad_metadata"), ({"metadata": {"k": 1}}, "bad_metadata")):
        with pytest.raises(InvalidRequest) as err:
            parsed(**body)
        assert err.value.code == code, body
