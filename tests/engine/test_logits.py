"""The logits pipeline (workers/engine/logits.py) against transformers' processors of the same names, batched with
mixed settings per row; then through the engine: greedy with penalties and bias equal to transformers' generate,
sampling that draws from the processed law, speculation changing nothing."""
from __future__ import annotations

import random

import pytest
import torch
from decoding_inputs import QUESTIONS, TINY, image
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vlmq.workers.engine import FinishReason, RequestRejected
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.engine.logits import process
from vlmq.workers.engine.sequence import SamplingParams
from vlmq.workers.engine.spec_decode import SpecConfig

VOCAB, PROMPT, EOS = 200, 12, 7


def settings(rng: random.Random) -> dict:
    pick = rng.choice
    return dict(temperature=pick([0.0, 0.7, 1.0, 1.6]), top_p=pick([1.0, 0.9, 0.5, 0.2]), top_k=pick([0, 1, 5, 40]),
                min_p=pick([0.0, 0.05, 0.3]), repetition_penalty=pick([1.0, 1.3, 0.8]),
                logit_bias=pick([(), ((3, 5.0), (9, -100.0)), ((EOS, 2.5),)]), min_tokens=pick([0, 3, 30]))


def transformers_law(scores: torch.Tensor, history: list[int], p: SamplingParams) -> torch.Tensor:
    """transformers' processors for one row, in the order generate() builds them; warpers at p.temperature."""
    chain = LogitsProcessorList()
    if p.logit_bias:
        chain.append(SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias}))
    if p.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.min_tokens:
        chain.append(MinNewTokensLengthLogitsProcessor(PROMPT, p.min_tokens, [EOS]))
    if p.temperature > 0:
        chain.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k:
            chain.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            chain.append(TopPLogitsWarper(p.top_p))
        if p.min_p:
            chain.append(MinPLogitsWarper(p.min_p))
    return chain(torch.tensor([history]), scores[None].clone())[0]


def test_each_row_equals_transformers_processors_with_mixed_settings() -> None:
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    for trial in range(40):
        params = [SamplingParams(64, (EOS,), **settings(rng)) for _ in range(8)]
        histories = [[rng.randrange(VOCAB) for _ in range(PROMPT + rng.randrange(0, 40))] for _ in params]
        logits = torch.randn(len(params) + 2, VOCAB, generator=gen) * 4
        rows = [(n + 1, p, h, len(h) - PROMPT) for n, (p, h) in enumerate(zip(params, histories, strict=True))]
        untouched = logits[[0, -1]].clone()
        out = process(logits.clone(), rows)
        assert torch.equal(out[[0, -1]], untouched)  # rows not asked for are left alone
        for (row, p, h, _), ours in zip(rows, out[1:-1], strict=True):
            ref = transformers_law(logits[row], h, p)
            ours = ours / p.temperature if p.temperature > 0 else ours
            assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (trial, p)
            finite = ~torch.isinf(ref)
            assert torch.allclose(ours[finite], ref[finite], atol=1e-6, rtol=0), (trial, p)


def test_frequency_and_presence_penalties_follow_openais_formula() -> None:
    logits = torch.zeros(1, VOCAB)
    answer = [4, 4, 4, 9]
    p = SamplingParams(64, (), frequency_penalty=0.5, presence_penalty=1.5)
    out = process(logits.clone(), [(0, p, [1] * PROMPT + answer, len(answer))])[0]
    assert out[4] == -(3 * 0.5 + 1.5) and out[9] == -(0.5 + 1.5) and out[1] == 0  # the prompt is not the answer


@pytest.mark.parametrize("bad", [dict(top_p=0.0), dict(top_k=-1), dict(min_p=1.5), dict(repetition_penalty=0),
                                 dict(frequency_penalty=3), dict(logit_bias=((1, 101.0),)), dict(min_tokens=65)])
def test_out_of_range_settings_are_refused_naming_the_field(bad) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(64, (), **bad)




CONTROLS = dict(repetition_penalty=1.4, logit_bias=((64, 3.0), (262, -4.0)))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_greedy_with_penalty_and_bias_equals_transformers_with_speculation_off_and_on() -> None:
    from transformers import AutoModelForImageTextToText

    from vlmq.workers.models.processor import load_processor

    torch.set_num_threads(1)
    processor = load_processor(TINY)
    model = AutoModelForImageTextToText.from_pretrained(TINY).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    work = [(image(n), QUESTIONS[n % 3]) for n in range(12)]
    expected = []
    for img, q in work:
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}]
        inputs = processor(text=[processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)],
                           images=[img], return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=20, do_sample=False, repetition_penalty=1.4,
                                 sequence_bias={(t,): b for t, b in CONTROLS["logit_bias"]})
        expected.append([t for t in out[0, inputs["input_ids"].shape[1]:].tolist() if t not in eos])
    plain = None
    for spec in ("none", SpecConfig("ngram", max_k=4, max_batch=10_000, adaptive=False)):
        engine = Engine.from_model_dir(TINY, num_blocks=1024, speculative=spec)
        outs = engine.generate([Request(img, q, 20, **CONTROLS) for img, q in work]
                               + [Request(img, q, 20) for img, q in work[:3]])
        engine.close()
        assert [o.token_ids for o in outs[:12]] == expected
        plain = plain or [o.token_ids for o in outs[12:]]
        assert [o.token_ids for o in outs[12:]] == plain  # the others in the batch keep their own answers
    assert plain != expected[:3]  # the controls changed something


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sampling_draws_only_from_what_top_k_and_top_p_keep_and_seeds_repeat() -> None:
    engine = Engine.from_model_dir(TINY, num_blocks=2048, max_num_seqs=256, speculative="none")
    img, q = image(1), QUESTIONS[0]
    [free] = engine.generate([Request(img, q, 1, ignore_eos=True, temperature=1.0, top_k=1)])
    draws = engine.generate([Request(img, q, 1, ignore_eos=True, temperature=2.0, top_k=1) for _ in range(50)])
    assert {tuple(o.token_ids) for o in draws} == {tuple(free.token_ids)}  # top_k=1: always the argmax
    wide = engine.generate([Request(img, q, 1, ignore_eos=True, temperature=10.0) for _ in range(300)])
    kept = engine.generate([Request(img, q, 1, ignore_eos=True, temperature=10.0, top_k=3) for _ in range(300)])
    assert len({o.token_ids[0] for o in wide}) > 3 >= len({o.token_ids[0] for o in kept})
    seeded = [Request(img, q, 16, ignore_eos=True, temperature=1.2, top_p=0.8, min_p=0.05, seed=11)]
    alone = engine.generate(seeded)[0].token_ids
    engine.close()
    spec = Engine.from_model_dir(TINY, num_blocks=2048, speculative=SpecConfig("ngram", max_k=4, max_batch=10_000,
                                                                               adaptive=False))
    crowd = spec.generate(seeded + [Request(image(n), q, 16, temperature=1.0) for n in range(2, 9)])
    spec.close()
    assert crowd[0].token_ids == alone  # the seed repeats its answer, batched and speculated


def test_bad_settings_fail_their_request_alone() -> None:
    engine = Engine.from_model_dir(TINY, num_blocks=256, speculative="none")
    img, q = image(4), QUESTIONS[1]
    # a request whose free answer stops early: min_tokens holds its eos back
    short = next(r for r in (Request(image(n), QUESTIONS[n % 3], 24) for n in range(40))
                 if (o := engine.generate([r])[0]).finish_reason is FinishReason.STOP and len(o.token_ids) < 4)
    held = len(engine.generate([short])[0].token_ids) + 2
    outs = engine.generate([Request(img, q, 8, top_p=0.0), Request(img, q, 8, logit_bias=((10 ** 9, 1.0),)),
                            Request(short.image, short.question, 24, min_tokens=held)])
    engine.close()
    for out in outs[:2]:
        assert isinstance(out.error, RequestRejected) and out.error.code == "bad_sampling"
    assert outs[2].error is None and len(outs[2].token_ids) >= held
