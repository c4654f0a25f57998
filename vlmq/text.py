"""The text rule every field a user writes follows (prompts, messages, ids): it must encode as UTF-8."""
from __future__ import annotations

from vlmq.errors import InvalidRequest


def check_utf8(text: str, what: str, code: str) -> None:
    """``text`` encodes as UTF-8, as Redis and JSON need it to: a lone surrogate (``"\\ud800"``) does not.

    Raises:
        InvalidRequest: with ``code``, naming the first character that does not encode.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{what} is not valid Unicode text: character {e.start} is {text[e.start]!r} "
                             f"({e.reason}); send text that encodes as UTF-8", code=code) from None
