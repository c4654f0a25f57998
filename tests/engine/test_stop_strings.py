"""Stop strings and stop tokens: matched on the decoded answer across token boundaries, the match and what follows
left out, finish reason "stop"; against transformers' `generate(stop_strings=...)` (its StopStringCriteria), with
speculative decoding off and on."""
from __future__ import annotations

import pytest
import torch
from decoding_inputs import QUESTIONS, TINY, image
from PIL import Image

from vlmq.workers.engine import FinishReason, RequestRejected
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.engine.spec_decode import SpecConfig
from vlmq.workers.engine.stopping import StopMatcher, check_stop
from vlmq.workers.models.processor import load_processor

MAX_NEW = 24
NUM_REQUESTS = 100


def pieces_decoder(vocab: list[str]):
    return lambda ids: "".join(vocab[i] for i in ids)


def feed_all(matcher: StopMatcher, ids: list[int]) -> int | None:
    """The index of the token that completed a stop string, or None."""
    return next((n for n, t in enumerate(ids) if matcher.feed(t)), None)


def test_a_stop_string_is_found_across_tokens_and_inside_the_last_one() -> None:
    vocab = ["la", "s", "to", "pped", " go", "stop", "x"]
    # ["s", "to", "pped"]: stop completes inside "pped"; the answer is the text before "stop"
    m = StopMatcher(("stop",), pieces_decoder(vocab))
    assert feed_all(m, [0, 1, 2, 3, 4]) == 3 and m.text[:m.cut] == "la"
    m = StopMatcher(("stop",), pieces_decoder(vocab))
    assert feed_all(m, [4, 6, 6]) is None and m.cut is None  # no stop string: never stops
    # two stop strings: the earliest match in the text wins, whichever is listed first
    m = StopMatcher(("pped", "asto"), pieces_decoder(vocab))
    assert feed_all(m, [0, 1, 2, 3]) == 2 and m.text[:m.cut] == "l"


def test_a_partial_character_completed_by_the_next_token_still_matches() -> None:
    # a byte-level tokenizer decodes half a character as U+FFFD; the next token turns it into the character
    texts = {1: "a\ufffd", 2: "a\u00e9b"}
    m = StopMatcher(("\u00e9b",), lambda ids: texts[len(ids)])
    assert feed_all(m, [7, 8]) == 1 and m.cut == 1


@pytest.mark.parametrize("stop", [["a"] * 5, [""], ["x" * 257], [3]])
def test_bad_stop_lists_are_refused_naming_the_rule(stop) -> None:
    with pytest.raises(ValueError, match="stop string"):
        check_stop(stop)




@pytest.fixture(scope="module")
def workload() -> list[tuple[Image.Image, str]]:
    return [(image(n), QUESTIONS[n % len(QUESTIONS)]) for n in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def stops(workload) -> list[str]:
    """One stop string per request, straddling a token boundary in the middle of its free greedy answer."""
    engine = Engine.from_model_dir(TINY, num_blocks=1024, speculative="none")
    outs = engine.generate([Request(img, q, MAX_NEW, ignore_eos=True) for img, q in workload])
    decode, special, stops = engine.tokenizer.decode, set(engine.tokenizer.all_special_ids), []
    for n, out in enumerate(outs):
        ids = out.token_ids
        # between two plain tokens whose neighbours are plain too: transformers matches on token strings, where a
        # special token (left out of the answer) stands between texts; we match on the answer's text
        plain = [k for k in range(2, len(ids) - 1) if not special & set(ids[k - 2:k + 2])] or [len(ids) // 2]
        k = plain[n % len(plain)]
        at = len(decode(ids[:k], skip_special_tokens=True))
        stops.append(out.text[max(0, at - 2):at + 2] or out.text[:3] or "never said")
    engine.close()
    assert sum(len(s) > 1 for s in stops) >= NUM_REQUESTS * 0.9
    return stops


@pytest.fixture(scope="module")
def reference(workload, stops) -> list[tuple[list[int], str]]:
    """transformers' greedy generate with stop_strings: its tokens (eos dropped) and its text cut before the
    match."""
    from transformers import AutoModelForImageTextToText

    torch.set_num_threads(1)
    processor = load_processor(TINY)
    model = AutoModelForImageTextToText.from_pretrained(TINY).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    expected = []
    for (img, question), stop in zip(workload, stops, strict=True):
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[text], images=[img], return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, stop_strings=[stop],
                                 tokenizer=processor.tokenizer)[0, inputs["input_ids"].shape[1]:]
        ids = [t for t in out.tolist() if t not in eos]
        answer = processor.tokenizer.decode(ids, skip_special_tokens=True)
        expected.append((ids, answer.split(stop)[0]))
    return expected


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_stop_strings_end_answers_as_transformers_does(workload, stops, reference, speculative) -> None:
    spec = "none" if speculative == "none" else SpecConfig("ngram", max_k=4, max_batch=10_000, adaptive=False)
    engine = Engine.from_model_dir(TINY, num_blocks=1024, speculative=spec)
    outs = engine.generate([Request(img, q, MAX_NEW, stop=(stop,)) for (img, q), stop in zip(workload, stops,
                                                                                              strict=True)])
    stopped = 0
    for out, stop, (ids, text) in zip(outs, stops, reference, strict=True):
        assert out.error is None
        assert (out.token_ids, out.text) == (ids, text)
        assert stop not in out.text
        stopped += out.finish_reason is FinishReason.STOP and len(ids) < MAX_NEW
    assert stopped >= NUM_REQUESTS * 0.9  # the stop strings really ended most answers early
    if speculative != "none":
        assert engine.stats.speculative.num_accepted > 0
    assert engine.scheduler.block_manager.num_free_blocks == engine.config.num_blocks
    engine.close()


def test_stop_token_ids_end_the_answer_like_eos_and_bad_stops_fail_alone() -> None:
    engine = Engine.from_model_dir(TINY, num_blocks=256, speculative="none")
    img, question = image(1), QUESTIONS[0]
    [free] = engine.generate([Request(img, question, MAX_NEW, ignore_eos=True)])
    token = free.token_ids[3]
    first = free.token_ids.index(token)
    outs = engine.generate([Request(img, question, MAX_NEW, ignore_eos=True, stop_token_ids=(token,)),
                            Request(img, question, MAX_NEW, stop=("a",) * 5),
                            Request(img, question, MAX_NEW, stop_token_ids=(10 ** 9,)),
                            Request(img, question, MAX_NEW)])
    assert outs[0].finish_reason is FinishReason.STOP and outs[0].token_ids == free.token_ids[:first]
    for out in outs[1:3]:
        assert isinstance(out.error, RequestRejected) and out.error.code == "invalid_stop"
    assert outs[3].error is None and outs[3].token_ids
    engine.close()


def test_the_worker_backends_apply_stop_or_refuse_it_by_name() -> None:
    from vlmq.errors import InvalidRequest
    from vlmq.workers.backends.base import GenRequest
    from vlmq.workers.backends.engine import EngineBackend
    from vlmq.workers.backends.hf import HFBackend

    img, question = image(2), QUESTIONS[1]
    engine = EngineBackend(str(TINY), "cpu", num_blocks=256)
    try:
        [free] = engine.generate([GenRequest("free", img, question, MAX_NEW, ignore_eos=True)])
        stop = free.text[3:6]
        [out] = engine.generate([GenRequest("stop", img, question, MAX_NEW, ignore_eos=True,
                                            controls={"stop": (stop,)})])
    finally:
        engine.close()
    assert out.finish_reason is FinishReason.STOP and out.text == free.text.split(stop)[0]
    [refused] = HFBackend(str(TINY)).generate([GenRequest("hf", img, question, MAX_NEW, controls={"stop": (stop,)})])
    assert isinstance(refused, InvalidRequest) and refused.code == "unsupported_control" and "stop" in str(refused)


def test_n_choices_share_the_prompt_and_each_draws_its_own_seed() -> None:
    from vlmq.workers.backends.base import GenRequest
    from vlmq.workers.backends.engine import EngineBackend

    img, question = image(5), QUESTIONS[0]
    backend = EngineBackend(str(TINY), "cpu", num_blocks=512)
    try:
        alone = [backend.generate([GenRequest(f"a{i}", img, question, MAX_NEW, temperature=1.0, seed=40 + i)])[0]
                 for i in range(4)]
        before = backend.cache_stats()["prefix_cache_hit_tokens"]
        [out] = backend.generate([GenRequest("n", image(6), question, MAX_NEW, temperature=1.0, seed=40, n=4)])
        hits = backend.cache_stats()["prefix_cache_hit_tokens"] - before
        [seeded] = backend.generate([GenRequest("n", img, question, MAX_NEW, temperature=1.0, seed=40, n=4)])
    finally:
        backend.close()
    assert [c.token_ids for c in seeded.choices] == [a.token_ids for a in alone]  # choice i: seed + i
    assert seeded.token_ids == seeded.choices[0].token_ids and len(out.choices) == 4
    # the prompt computed once: the other three choices read its full blocks from the prefix cache
    assert hits >= 3 * (out.prompt_tokens // 16 - 1) * 16
