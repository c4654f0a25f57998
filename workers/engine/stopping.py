"""Stop strings, matched on the decoded completion as each token arrives (pure: the decoder is passed in).

A sequence stops at the first token whose text completes one of its stop strings, as transformers'
`StopStringCriteria` does: the string may span tokens and may end inside the last token. The answer is the text
before the match; the tokens are kept as generated (billing counts them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vlmq.decoding import MAX_STOP as MAX_STOP_STRINGS  # the SDK's bounds, checked at submit too
from vlmq.decoding import MAX_STOP_CHARS


def check_stop(stop: Sequence[str]) -> tuple[str, ...]:
    """The stop strings as a tuple; raises ValueError naming what is wrong (too many, empty, too long, not str)."""
    stop = tuple(stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string is a non-empty str of at most {MAX_STOP_CHARS} characters, got {s!r}")
    return stop


class StopMatcher:
    """Feeds a sequence's completion tokens; `feed` says when a stop string is complete, `cut` where the answer
    ends. Each token decodes the completion once (O(length) per token, only for requests with stop strings)."""

    __slots__ = ("stop", "decode", "ids", "text", "cut")

    def __init__(self, stop: tuple[str, ...], decode: Callable[[list[int]], str]) -> None:
        self.stop, self.decode = stop, decode
        self.ids: list[int] = []
        self.text = ""
        self.cut: int | None = None  # index in the decoded completion where the first match starts

    def feed(self, token_id: int) -> bool:
        """Append one completion token; True once a stop string ends within the text this token added."""
        self.ids.append(token_id)
        before, self.text = len(self.text), self.decode(self.ids)
        # a match must end past `before` (earlier text held none); it starts at most len(s) - 1 back, and a few
        # more where the old text ended in a partial character (decoded as U+FFFD) that this token completed
        for s in self.stop:
            at = self.text.find(s, max(0, before - len(s) - 3))
            if at != -1 and (self.cut is None or at < self.cut):
                self.cut = at
        return self.cut is not None
