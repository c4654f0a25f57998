"""Structured outputs on xgrammar: a request's response format compiled once per distinct format (the compiler
caches by grammar and tokenizer), a matcher per sequence fed each emitted token, and each step's token bitmask
applied to the batch's logits in one call.

    grammars = Grammars(tokenizer, vocab_size, eos_token_ids)
    state = grammars.state({"type": "json_schema", "json_schema": {"schema": {...}}})  # on a preprocessing thread
    apply_grammars(logits, [(row, state, proposals_before_row), ...])  # in the model runner, each step

Formats (``vlmq.decoding`` checks their shape at submit): OpenAI's ``json_object`` and ``json_schema``, and vlmq's
``regex``, ``choice`` (one of a list of strings) and ``grammar`` (EBNF, GBNF dialect). JSON is compact (no free
whitespace): a model cannot pad an answer with spaces until its token limit.
"""
from __future__ import annotations

import json
import re
from typing import Any

import torch


class GrammarError(ValueError):
    """A response format the grammar engine cannot compile (the request fails alone: ``bad_response_format``)."""


class GrammarState:
    """One sequence's place in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one emitted token; False if the grammar forbids it (never, for a token the mask allowed)."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def done(self) -> bool:
        """The grammar is complete and its stop token accepted: the answer is whole."""
        return bool(self.matcher.is_terminated())


class Grammars:
    """The engine's grammar compiler (one per tokenizer; thread-safe, so preprocessing threads compile)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr  # the worker's dependency; imported where a grammar is first used

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def state(self, response_format: dict[str, Any]) -> GrammarState:
        """A fresh matcher for a response format; raises GrammarError naming what failed."""
        try:
            compiled = self._compile(response_format)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"response_format cannot be compiled: {e}") from None
        return GrammarState(self.xgr.GrammarMatcher(compiled))

    def _compile(self, fmt: dict[str, Any]) -> Any:
        kind, compact = fmt.get("type"), {"any_whitespace": False}
        if kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        if kind == "json_schema":
            spec = fmt["json_schema"]
            strict = bool(spec.get("strict", True))
            return self.compiler.compile_json_schema(json.dumps(spec["schema"]), strict_mode=strict, **compact)
        if kind == "regex":
            return self.compiler.compile_regex(fmt["regex"])
        if kind == "choice":
            return self.compiler.compile_regex("|".join(f"(?:{re.escape(c)})" for c in fmt["choice"]))
        if kind == "grammar":
            return self.compiler.compile_grammar(fmt["grammar"])
        raise GrammarError(f"response_format type {kind!r} is not one vlmq enforces")


def apply_grammars(logits: torch.Tensor, rows: list[tuple[int, GrammarState, list[int]]]) -> None:
    """Mask `logits` [R, vocab] in place at each (row, state, proposals before the row) to the tokens the grammar
    allows after the sequence's answer and those proposals: one bitmask, one apply. A proposal the grammar forbids,
    or one after the grammar's stop token, leaves the rows after it unmasked: verification never reaches them (the
    forbidden proposal's own row gives it -inf; the stop token ends the sequence)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    masked = []
    for n, (row, state, proposals) in enumerate(rows):
        accepted = 0
        for token in proposals:
            if state.matcher.is_terminated() or not state.matcher.accept_token(token):
                break
            accepted += 1
        if accepted == len(proposals) and not state.matcher.is_terminated():
            state.matcher.fill_next_token_bitmask(bitmask, n)
            masked.append((n, row))
        if accepted:
            state.matcher.rollback(accepted)
    if masked:
        index = torch.tensor([r for _, r in masked], device=logits.device)
        sub = logits[index]
        xgr.apply_token_bitmask_inplace(sub, bitmask[[n for n, _ in masked]].to(logits.device))
        logits[index] = sub

