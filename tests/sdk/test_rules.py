"""The job rules both sides apply: the SDK at submit, the worker on every record it reads."""
from __future__ import annotations

import pytest

from vlmq import rules
from vlmq.errors import InvalidRequest

LIMITS = {"max_prompt_chars": 100, "max_new_tokens_limit": 64}
JOB_ID = "0123456789abcdef" * 2
GOOD = {"id": JOB_ID, "status": "queued", "model": "tiny-shapes", "prompt": "Describe the image.",
        "max_new_tokens": "32", "priority": "5", "input_key": "inputs/" + "ab" * 32, "created_at": "1.5",
        "queued_at": "1.5", "idempotency_key": "", "ignore_eos": "0", "attempts": "0"}


def test_a_record_as_the_sdk_writes_it_passes() -> None:
    rules.check_record(GOOD, JOB_ID, **LIMITS)


@pytest.mark.parametrize(("change", "code"), [
    ({"max_new_tokens": "3000"}, "bad_max_new_tokens"),
    ({"max_new_tokens": "0"}, "bad_max_new_tokens"),
    ({"max_new_tokens": "1e3"}, "bad_record"),
    ({"priority": "10"}, "bad_priority"),
    ({"status": "bogus"}, "bad_record"),
    ({"id": "f" * 32}, "bad_record"),
    ({"prompt": "x" * 101}, "prompt_too_long"),
    ({"prompt": "  "}, "bad_prompt"),
    ({"prompt": "look <|image_pad|>"}, "bad_prompt"),
    ({"input_key": "results/x.json"}, "bad_input_key"),
    ({"input_key": "inputs/" + "AB" * 32}, "bad_input_key"),
    ({"input_key": "inputs/../" + "ab" * 30}, "bad_input_key"),
    ({"created_at": "inf"}, "bad_record"),
    ({"queued_at": "soon"}, "bad_record"),
    ({"ignore_eos": "yes"}, "bad_record"),
    ({"idempotency_key": "k" * 201}, "bad_idempotency_key"),
])
def test_each_broken_rule_fails_with_its_code(change: dict[str, str], code: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        rules.check_record({**GOOD, **change}, JOB_ID, **LIMITS)
    assert err.value.code == code


@pytest.mark.parametrize("field", ["id", "status", "model", "prompt", "max_new_tokens", "priority", "input_key",
                                   "created_at", "queued_at"])
def test_a_missing_field_is_a_bad_record(field: str) -> None:
    record = {k: v for k, v in GOOD.items() if k != field}
    with pytest.raises(InvalidRequest, match=f"lacks {field}") as err:
        rules.check_record(record, JOB_ID, **LIMITS)
    assert err.value.code == "bad_record"


def test_submit_parameters_are_checked_by_type_and_range() -> None:
    rules.check_params("Hi", 64, 0, None, "m", **LIMITS)
    for args, code in [(("Hi", True, 0, None, "m"), "bad_max_new_tokens"), (("Hi", 8, 2.0, None, "m"), "bad_priority"),
                       (("Hi", 8, 0, "", "m"), "bad_idempotency_key"), (("Hi", 8, 0, None, 3), "unknown_model"),
                       ((None, 8, 0, None, "m"), "bad_prompt")]:
        with pytest.raises(InvalidRequest) as err:
            rules.check_params(*args, **LIMITS)
        assert err.value.code == code


def test_job_ids_are_the_sdks_shape() -> None:
    assert rules.is_job_id(JOB_ID)
    assert not any(rules.is_job_id(v) for v in (JOB_ID.upper(), JOB_ID + "0", "../x", 7, None))
