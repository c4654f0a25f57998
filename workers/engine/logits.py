"""The logits pipeline: every sampling control a request may set, applied to a step's logits in one batched pass.

Order, as transformers' `generate` builds its processors (then vLLM's OpenAI penalties, which transformers lacks):
logit_bias (SequenceBias) -> repetition_penalty (prompt and answer, RepetitionPenalty) -> frequency_penalty and
presence_penalty (the answer so far) -> min_tokens (eos masked, MinNewTokensLength) -> [temperature] -> top_k ->
top_p -> min_p. Temperature stays with the sampler (spec_decode divides by it): top_k, top_p and min_p are decided
on logits / temperature, as transformers' warpers see them, and written back as -inf on the unscaled logits, so
softmax(out / T) is transformers' law. Greedy rows take the argmax of `out` (penalties and bias change it; the
warpers never remove the argmax). Rows whose request sets nothing are left alone and cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sequence import SamplingParams


def needs_processing(sampling: SamplingParams) -> bool:
    return bool(sampling.logit_bias or sampling.repetition_penalty != 1.0 or sampling.frequency_penalty
                or sampling.presence_penalty or sampling.min_tokens or sampling.top_k or sampling.top_p < 1.0
                or sampling.min_p)


def process(logits: torch.Tensor, rows: Sequence[tuple[int, SamplingParams, Sequence[int], int]]) -> torch.Tensor:
    """Apply each row's controls to `logits` [R, vocab] float32, in place; returns it.

    rows: (row index, its sampling params, the tokens before it (prompt, answer, proposals before this row),
    how many of those are the answer's) for the rows to process; every other row is untouched.
    """
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    idx = torch.tensor([r for r, *_ in rows], device=dev)
    sub = logits[idx]
    params = [p for _, p, _, _ in rows]

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], device=dev, dtype=torch.float32)[:, None]

    bias = [(n, t, b) for n, p in enumerate(params) for t, b in p.logit_bias]
    if bias:
        n, t, b = zip(*bias, strict=True)
        sub.index_put_((torch.tensor(n, device=dev), torch.tensor(t, device=dev)),
                       torch.tensor(b, device=dev, dtype=torch.float32), accumulate=True)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _counts(rows, vocab, dev, answer_only=False) > 0
        penalty = column("repetition_penalty").expand_as(sub)
        scored = torch.where(sub < 0, sub * penalty, sub / penalty)
        sub = torch.where(seen, scored, sub)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        counts = _counts(rows, vocab, dev, answer_only=True)
        sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
    eos_rows = [(n, t) for n, (_, p, _, answer) in enumerate(rows) if answer < p.min_tokens for t in p.eos_token_ids]
    if eos_rows:
        n, t = zip(*eos_rows, strict=True)
        sub[torch.tensor(n, device=dev), torch.tensor(t, device=dev)] = float("-inf")
    if any(p.temperature > 0 and (p.top_k or p.top_p < 1.0 or p.min_p) for p in params):
        t = column("temperature")  # greedy rows (0) are not warped: the warpers never remove the argmax
        sub = sub.masked_fill(_warped_out(sub / t.clamp(min=1e-6), params) & (t > 0), float("-inf"))
    logits[idx] = sub
    return logits


def _counts(rows, vocab: int, dev: torch.device, *, answer_only: bool) -> torch.Tensor:
    # [rows, vocab] how often each token occurs in each row's history (its answer only, or prompt and answer)
    ids = [list(h[len(h) - a:] if answer_only else h) for _, _, h, a in rows]
    flat = torch.tensor([t for h in ids for t in h], device=dev, dtype=torch.long)
    which = torch.repeat_interleave(torch.arange(len(ids), device=dev), torch.tensor([len(h) for h in ids], device=dev))
    counts = torch.zeros(len(ids), vocab, device=dev)
    return counts.index_put_((which, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)


def _warped_out(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The tokens top_k, top_p and min_p remove, each row with its own settings (0 / 1.0 / 0: off), as
    transformers' warpers in that order, each keeping at least one token."""
    dev, vocab = scaled.device, scaled.shape[1]
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32)[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=torch.float32)[:, None]
    ordered, order = scaled.sort(dim=-1, descending=True)
    kth = ordered.gather(1, (top_k - 1)[:, None])
    out = scaled < kth  # top_k: below the k-th value (ties kept, as transformers)
    scaled = scaled.masked_fill(out, float("-inf"))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    # top_p: drop the tail whose mass is at most 1 - top_p (ascending cumulative sum, as transformers)
    probs = ordered.softmax(-1).flip(-1)
    tail = (probs.cumsum(-1) <= 1 - top_p).flip(-1)
    tail[:, 0] = False
    tail &= top_p < 1.0
    out |= torch.zeros_like(out).scatter_(1, order, tail)
    scaled = scaled.masked_fill(out, float("-inf"))
    # min_p: below min_p times the most likely token's probability
    p = scaled.softmax(-1)
    return out | (p < min_p * p.max(dim=-1, keepdim=True).values)  # min_p <= 1: the most likely stays
