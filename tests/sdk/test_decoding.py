"""vlmq.decoding: OpenAI's decoding fields checked by name and range, carried in the record in the engine's
forms and read back the same (the worker's check is the submit check)."""
from __future__ import annotations

import pytest

from vlmq.decoding import FIELDS, check_decoding, engine_controls, from_record, record_field
from vlmq.errors import InvalidRequest

EVERY = {"stop": ["\n\n", "END"], "stop_token_ids": [2, 7], "top_p": 0.9, "top_k": 40, "min_p": 0.05,
         "repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": -0.5,
         "logit_bias": {"12": -100, "7": 2.5}, "min_tokens": 3, "logprobs": True, "top_logprobs": 4}


def test_every_field_is_kept_in_the_engines_form_and_reads_back_from_the_record() -> None:
    assert set(EVERY) == FIELDS - {"response_format", "n"}
    checked = check_decoding(EVERY, max_new_tokens=64)
    assert set(checked) == FIELDS - {"top_logprobs", "response_format", "n"}  # top_logprobs: logprobs = n
    assert checked["logit_bias"] == [[7, 2.5], [12, -100.0]] and checked["logprobs"] == 4
    assert "top_logprobs" not in checked and checked["stop"] == ["\n\n", "END"]
    assert from_record({"decoding": record_field(EVERY), "max_new_tokens": "64"}) == checked
    controls = engine_controls(checked)
    assert controls["stop"] == ("\n\n", "END") and controls["logit_bias"] == ((7, 2.5), (12, -100.0))


def test_defaults_and_nulls_are_no_controls() -> None:
    assert check_decoding(None) == check_decoding({}) == {}
    assert check_decoding({"top_p": 1.0, "top_k": 0, "frequency_penalty": 0, "stop": None, "logprobs": False}) == {}
    assert check_decoding({"stop": "x"}) == {"stop": ["x"]} and check_decoding({"top_k": -1}) == {}
    assert from_record({}) == {}


@pytest.mark.parametrize(("fields", "code", "named"), [
    ({"best_of": 2}, "unknown_field", "best_of"), ({"n": 17}, "bad_n", "n must"), ({"n": 0}, "bad_n", "n must"),
    ({"stop": ["a"] * 5}, "bad_stop", "stop"), ({"stop": [""]}, "bad_stop", "stop"), ({"stop": 3}, "bad_stop", "stop"),
    ({"stop_token_ids": [-1]}, "bad_stop", "stop_token_ids"), ({"top_p": 0}, "bad_sampling", "top_p"),
    ({"top_p": 1.5}, "bad_sampling", "top_p"), ({"top_k": 2.5}, "bad_sampling", "top_k"),
    ({"min_p": -0.1}, "bad_sampling", "min_p"), ({"repetition_penalty": 0}, "bad_sampling", "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "bad_sampling", "frequency_penalty"),
    ({"presence_penalty": float("nan")}, "bad_sampling", "presence_penalty"),
    ({"logit_bias": {"x": 1}}, "bad_sampling", "logit_bias"),
    ({"logit_bias": {"1": 101}}, "bad_sampling", "logit_bias"),
    ({"min_tokens": 65}, "bad_sampling", "min_tokens"), ({"logprobs": 1}, "bad_logprobs", "logprobs"),
    ({"top_logprobs": 3}, "bad_logprobs", "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "bad_logprobs",
                                                            "top_logprobs"),
])
def test_bad_fields_are_refused_naming_the_field(fields, code, named) -> None:
    with pytest.raises(InvalidRequest, match=named) as e:
        check_decoding(fields, max_new_tokens=64)
    assert e.value.code == code


def test_a_record_that_was_tampered_with_is_refused() -> None:
    for text in ("[1]", "{not json", '{"logit_bias": [[1]]}', '{"top_p": 7}', '{"min_tokens": 65}'):
        with pytest.raises(InvalidRequest):
            from_record({"decoding": text, "max_new_tokens": "64"})


SCHEMA = {"type": "object", "properties": {"shape": {"enum": ["circle", "square"]}}, "required": ["shape"]}


def test_response_formats_keep_their_shape_and_text_is_none() -> None:
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
                {"type": "regex", "regex": "[a-z]+"}, {"type": "choice", "choice": ["yes", "no"]},
                {"type": "grammar", "grammar": 'root ::= "a" | "b"'}):
        checked = check_decoding({"response_format": fmt})
        assert checked == {"response_format": fmt}
        assert from_record({"decoding": record_field({"response_format": fmt})}) == checked
    assert check_decoding({"response_format": {"type": "text"}}) == {}


@pytest.mark.parametrize(("fmt", "named"), [
    ({"type": "xml"}, "response_format.type"), ({"type": "json_schema"}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}, "not a valid JSON schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "format": 1}}, "not format"),
    ({"type": "json_object", "schema": SCHEMA}, "not schema"), ({"type": "choice", "choice": []}, "choice"),
    ({"type": "regex", "regex": ""}, "regex"), ("json", "response_format.type"),
])
def test_bad_response_formats_are_refused_by_name(fmt, named) -> None:
    with pytest.raises(InvalidRequest, match=named) as e:
        check_decoding({"response_format": fmt})
    assert e.value.code == "bad_response_format"
