"""Sampling with top-k, top-p and min-p draws from the law transformers' warpers define, with speculation off and
on (issue 30): chi-square tests of the first two tokens after a start token on a bigram model, whose every row
goes through the engine's logits pipeline (``logits.process``) and then its sampler (``spec_decode.verify``, with
k = 0 for no speculation), against the law of transformers' ``TopKLogitsWarper``, ``TopPLogitsWarper`` and
``MinPLogitsWarper`` on the same logits; and a deliberately broken warper is caught."""
from __future__ import annotations

import pytest
import torch
from test_speculative import chi_square_p
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vlmq.workers.engine import logits as pipeline
from vlmq.workers.engine.sequence import SamplingParams
from vlmq.workers.engine.spec_decode import verify

VOCAB = 12
SETTINGS = {"top_k": SamplingParams(temperature=0.9, top_k=4), "top_p": SamplingParams(temperature=0.8, top_p=0.7),
            "min_p": SamplingParams(temperature=1.1, min_p=0.15),
            "all": SamplingParams(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05)}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops
    yield
    torch.set_num_threads(threads)


def bigram(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = 2 * torch.randn(VOCAB, VOCAB, generator=g)
    return target, target.flip(1) + torch.randn(VOCAB, VOCAB, generator=g)  # a draft far from the target


def reference_law(target: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V, V]: the next token's law after each token, by transformers' warpers (in generate's order)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    warpers += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    warpers += [TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []
    warpers += [MinPLogitsWarper(params.min_p)] if params.min_p else []
    scores = warpers(torch.zeros(VOCAB, 1, dtype=torch.long), target.clone())
    return torch.softmax(scores.double(), -1)


def first_pairs(target, draft, params: SamplingParams, speculate: bool, n: int, seed: int = 3) -> torch.Tensor:
    """Counts [V, V] of the first two tokens after token 0, through the engine's pipeline and sampler."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.softmax(draft, -1)
    pairs = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for i in range(n):
        out = [0]
        while len(out) < 3:
            proposal, probs = [], []
            for _ in range(1 + i % 3 if speculate else 0):
                prev = (out + proposal)[-1]
                proposal.append(int(torch.multinomial(q[prev], 1, generator=gen)))
                probs.append(q[prev])
            rows = target[torch.tensor(out[-1:] + proposal)].clone()  # [k + 1, V]: after x0 and each proposal
            history = out + proposal
            pipeline.process(rows, [(r, params, history[:len(out) + r], len(out) - 1 + r) for r in range(len(rows))])
            out += verify(rows, proposal, torch.stack(probs) if proposal else None, params.temperature, gen)
        pairs[out[1], out[2]] += 1
    return pairs


def law_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test of counts against a law that forbids some tokens: a forbidden token drawn at all is p = 0."""
    forbidden = expected == 0
    if counts[forbidden].sum() > 0:
        return 0.0
    return chi_square_p(counts[~forbidden], expected[~forbidden])


def p_values(params: SamplingParams, speculate: bool, n: int) -> tuple[float, float]:
    target, draft = bigram(5)
    law = reference_law(target, params)
    pairs = first_pairs(target, draft, params, speculate, n)
    exact = law[0][:, None] * law  # P(a, b) = p(a | 0) p(b | a)
    return law_p(pairs.sum(1), n * law[0]), law_p(pairs.flatten(), n * exact.flatten())


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_sampling_draws_from_the_warpers_law(name: str, speculate: bool) -> None:
    first, pair = p_values(SETTINGS[name], speculate, 3000)
    assert first > 0.01 and pair > 0.01, (first, pair)


def keep_one_more(original):
    """top_k keeping one token more than asked: a plausible off-by-one."""
    def broken(scaled, params):
        return original(scaled, [SamplingParams(temperature=p.temperature, top_k=p.top_k + 1 if p.top_k else 0,
                                                top_p=p.top_p, min_p=p.min_p) for p in params])
    return broken


def no_top_p(original):
    """top_p ignored."""
    def broken(scaled, params):
        return original(scaled, [SamplingParams(temperature=p.temperature, top_k=p.top_k, min_p=p.min_p)
                                 for p in params])
    return broken


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize(("name", "breaker"), [("top_k", keep_one_more), ("top_p", no_top_p)])
def test_a_broken_warper_is_caught(monkeypatch, name: str, breaker, speculate: bool) -> None:
    monkeypatch.setattr(pipeline, "_warped_out", breaker(pipeline._warped_out))
    first, pair = p_values(SETTINGS[name], speculate, 3000)
    assert min(first, pair) < 0.01, (first, pair)
