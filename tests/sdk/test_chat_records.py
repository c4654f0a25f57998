"""A messages record as the worker reads it (``vlmq.rules.check_record`` with ``vlmq.chat.check_chat``): what the
SDK writes passes; a forged or broken one fails with its code before the worker fetches anything."""
from __future__ import annotations

import json

import pytest

from vlmq import rules
from vlmq.errors import InvalidRequest

LIMITS = {"max_prompt_chars": 100, "max_new_tokens_limit": 64, "max_images": 3}
JOB_ID = "0123456789abcdef" * 2
KEYS = ["inputs/" + "ab" * 32, "inputs/" + "cd" * 32]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Same shape?"},
                                         {"type": "image"}]},
            {"role": "assistant", "content": "yes"}, {"role": "user", "content": "Sure?"}]
GOOD = {"id": JOB_ID, "status": "queued", "model": "tiny-shapes", "messages": json.dumps(MESSAGES),
        "input_keys": json.dumps(KEYS), "input_key": KEYS[0], "max_new_tokens": "32", "priority": "5",
        "created_at": "1.5", "queued_at": "1.5", "idempotency_key": "", "ignore_eos": "0", "attempts": "0"}


def test_a_messages_record_as_the_sdk_writes_it_passes_and_names_its_inputs() -> None:
    rules.check_record(GOOD, JOB_ID, **LIMITS)
    assert rules.input_keys(GOOD) == (KEYS, MESSAGES)
    text_only = {**GOOD, "messages": json.dumps(MESSAGES[3:]), "input_keys": "[]"}
    del text_only["input_key"]
    rules.check_record(text_only, JOB_ID, **LIMITS)
    assert rules.input_keys(text_only) == ([], MESSAGES[3:])


def messages(*turns: object) -> str:
    return json.dumps(list(turns))


@pytest.mark.parametrize(("change", "code"), [
    ({"messages": "[{"}, "bad_record"),
    ({"input_keys": '{"a": 1}'}, "bad_record"),
    ({"input_keys": json.dumps(KEYS[:1])}, "image_count"),  # two image parts, one input
    ({"input_key": KEYS[1]}, "bad_record"),
    ({"input_keys": json.dumps(["results/x.json", KEYS[1]]), "input_key": "results/x.json"}, "bad_input_key"),
    ({"input_keys": json.dumps([KEYS[0], "t/other/inputs/" + "cd" * 32])}, "bad_input_key"),
    ({"messages": messages({"role": "user", "content": [{"type": "image"}] * 4}),
      "input_keys": json.dumps(KEYS * 2)}, "image_count"),
    ({"messages": messages({"role": "tool", "content": "x"})}, "bad_messages"),
    ({"messages": messages({"role": "user", "content": "x", "name": "n"})}, "bad_messages"),
    ({"messages": messages({"role": "assistant", "content": [{"type": "image"}, {"type": "image"}]})},
     "bad_messages"),
    ({"messages": messages({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})},
     "bad_messages"),
    ({"messages": messages({"role": "user", "content": 7})}, "bad_messages"),
    ({"messages": messages({"role": "user", "content": [{"type": "image"}, {"type": "image"}]},
                           {"role": "user", "content": "x" * 101})}, "prompt_too_long"),
    ({"messages": messages({"role": "user", "content": "a <|im_end|>"})}, "bad_prompt"),
    ({"messages": "[]"}, "bad_messages"),
])
def test_a_broken_messages_record_fails_with_its_code(change: dict[str, str], code: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        rules.check_record({**GOOD, **change}, JOB_ID, **LIMITS)
    assert err.value.code == code, str(err.value)


def test_a_record_with_neither_messages_nor_a_prompt_is_a_bad_record() -> None:
    record = {k: v for k, v in GOOD.items() if k != "messages"}
    with pytest.raises(InvalidRequest, match="lacks prompt") as err:
        rules.check_record(record, JOB_ID, **LIMITS)
    assert err.value.code == "bad_record"
