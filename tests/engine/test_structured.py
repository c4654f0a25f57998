"""Structured outputs (workers/engine/grammar.py) on the bundled model: 200 requests over 8 JSON schemas (nested
objects, bounded arrays, enums, required and optional fields, numbers, patterns), regexes and choices; every answer
parses and validates (jsonschema) or matches, and the tokens are the same with speculation on and off, batched
and alone."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from decoding_inputs import QUESTIONS, TINY, image

from vlmq.workers.engine import RequestRejected
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.engine.grammar import Grammars, apply_grammars
from vlmq.workers.engine.spec_decode import SpecConfig

MAX_NEW = 96
SHAPE = {"type": "string", "enum": ["circle", "square", "triangle"]}
SCHEMAS = [
    {"type": "object", "properties": {"shape": SHAPE}, "required": ["shape"], "additionalProperties": False},
    {"type": "object", "properties": {"shape": SHAPE, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["shape", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"shapes": {"type": "array", "items": SHAPE, "minItems": 1, "maxItems": 3}},
     "required": ["shapes"], "additionalProperties": False},
    {"type": "object", "properties": {"main": {"type": "object", "properties": {"shape": SHAPE, "big": {
        "type": "boolean"}}, "required": ["shape", "big"], "additionalProperties": False}},
     "required": ["main"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"type": "string", "pattern": "^[a-z]{3,6}$"}},
     "required": ["colour"], "additionalProperties": False},
    {"type": "object", "properties": {"shape": SHAPE, "note": {"type": "string", "maxLength": 8}},
     "required": ["shape"], "additionalProperties": False},
    {"type": "object", "properties": {"size": {"type": "number", "minimum": 0, "maximum": 1}, "shape": SHAPE},
     "required": ["size", "shape"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"shape": SHAPE, "n": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["shape", "n"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
]
REGEX, CHOICE = r"(red|blue|green) (circle|square)", ["yes", "no", "maybe"]


def formats() -> list[dict]:
    out = [{"type": "json_schema", "json_schema": {"name": f"s{n}", "schema": s, "strict": True}}
           for n, s in enumerate(SCHEMAS)]
    return out + [{"type": "regex", "regex": REGEX}, {"type": "choice", "choice": CHOICE}]


def requests() -> list[Request]:
    fmts = formats()
    return [Request(image(n), QUESTIONS[n % len(QUESTIONS)], MAX_NEW, response_format=fmts[n % len(fmts)])
            for n in range(200)]


def check(out, fmt: dict) -> None:
    assert out.error is None, out.error
    if fmt["type"] == "json_schema":
        jsonschema.validate(json.loads(out.text), fmt["json_schema"]["schema"])
    elif fmt["type"] == "regex":
        assert re.fullmatch(REGEX, out.text), out.text
    else:
        assert out.text in CHOICE, out.text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_answer_follows_its_format_with_speculation_off_and_on_batched_and_alone() -> None:
    work = requests()
    answers = {}
    for name, spec in (("plain", "none"), ("ngram", SpecConfig("ngram", max_k=4, max_batch=10_000, adaptive=False))):
        engine = Engine.from_model_dir(TINY, num_blocks=4096, max_num_seqs=64, speculative=spec)
        outs = engine.generate(work)
        for out, req in zip(outs, work, strict=True):
            check(out, req.response_format)
        answers[name] = [o.token_ids for o in outs]
        if name == "ngram":
            assert engine.stats.speculative.num_proposed > 0
            alone = [engine.generate([req])[0].token_ids for req in work[:10]]
            assert alone == answers["plain"][:10]
        engine.close()
    assert answers["ngram"] == answers["plain"]


def test_a_format_the_grammar_engine_cannot_compile_fails_alone() -> None:
    engine = Engine.from_model_dir(TINY, num_blocks=256, speculative="none")
    outs = engine.generate([Request(image(1), QUESTIONS[0], 8, response_format={"type": "regex", "regex": "(a"}),
                            Request(image(2), QUESTIONS[0], 8)])
    engine.close()
    assert isinstance(outs[0].error, RequestRejected) and outs[0].error.code == "bad_response_format"
    assert outs[1].error is None and outs[1].token_ids


def test_proposals_past_the_grammars_stop_token_leave_the_later_rows_unmasked() -> None:
    # a proposer may guess the stop token and then more: the rows after it are never verified, and asking the
    # grammar for a mask past its end would fail the request (xgrammar: "terminated ... trying to find the next mask")
    engine = Engine.from_model_dir(TINY, num_blocks=64, speculative="none")
    tokenizer, eos = engine.tokenizer, engine.eos_token_ids
    grammars = Grammars(tokenizer, engine.runner.model.config.text_config.vocab_size, eos)
    engine.close()
    state = grammars.state({"type": "choice", "choice": ["yes"]})
    answer = tokenizer.encode("yes", add_special_tokens=False)
    proposals = answer + [eos[0]] + answer
    logits = torch.zeros(len(proposals) + 1, len(tokenizer))
    apply_grammars(logits, [(j, state, proposals[:j]) for j in range(len(proposals) + 1)])
    assert torch.isinf(logits[0]).sum() > 0  # the first row is masked to the grammar
    stop_row = len(answer)  # the row after the whole answer allows only the stop token
    assert logits[stop_row].argmax().item() == eos[0] and torch.isfinite(logits[stop_row]).sum() == 1
    assert torch.isfinite(logits[stop_row + 1:]).all()  # past the stop token: left alone
    assert not state.done  # the matcher is back where the sequence is
