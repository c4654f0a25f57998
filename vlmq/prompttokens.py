"""Text tokens at submit: a chat's prompt counted as the engine counts it, with the model folder's own tokenizer and
chat template (the ``tokenizers`` and ``jinja2`` packages: no torch, no transformers).

The engine (``vlmq.workers.models.processor.ChatPrompt``) renders the template once per chat shape with a stand-in
for each text, tokenizes the template's pieces with control tokens and every text as plain text, and counts each
image's wrappers (InternVL's ``<img>`` ``</img>``) as text and its placeholder not. This module does the same, so
``prompt tokens + max_new_tokens > VLMQ_TEXT_TOKEN_BOUND`` is refused (``prompt_too_long``) before anything is
enqueued; workers still re-check.
"""
from __future__ import annotations

import json
import re
import threading
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from vlmq.errors import InvalidRequest

STAND_IN = re.compile("\x00(\\d+)\x00")  # text i stands in the rendered template as NUL i NUL
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# extra text tokens per image beyond its one placeholder: the wrappers its span adds (image_span(1) minus 2)
# (InternVL: <img> <IMG_CONTEXT>... </img>; Qwen's and LLaVA-NeXT's spans are the image tokens alone)
_IMAGE_EXTRA = {"internvl": 1}
SHAPE_CACHE = 4096  # rendered chat shapes kept per model


class PromptCounter:
    """Counts a chat's text tokens (everything but the images' own tokens) for one model folder.

    Args:
        model_dir: the Hugging Face folder (``tokenizer.json``, a chat template, ``tokenizer_config.json``).
        family: its ``model_type`` (``vlmq.families``).
    """

    def __init__(self, model_dir: str | Path, family: str) -> None:
        from tokenizers import Tokenizer

        folder = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _json(folder / "tokenizer_config.json")
        self.template = _template(folder, config)
        self.special = {k: _content(config[k]) for k in _SPECIAL if config.get(k) is not None}
        self.image_extra = _IMAGE_EXTRA.get(family, -1)
        self._lock = threading.Lock()  # a Tokenizer's encode_special_tokens is state shared by every caller
        self._shapes: dict[str, list[str]] = {}  # chat shape (roles, part kinds) -> its rendered pieces

    def text_tokens(self, messages: list[dict[str, Any]]) -> int:
        """Text tokens of a chat in the engine's form (``vlmq.chat``), the assistant turn opened.

        Raises:
            InvalidRequest: ``bad_messages`` when the model's chat template refuses the chat.
        """
        texts: list[str] = []
        shape = [stand_in(m, texts) for m in messages]
        count, pending = 0, []
        for n, piece in enumerate(self._pieces(shape)):
            if n % 2:
                pending.append(texts[int(piece)])
            elif piece:
                if pending:  # texts rendered side by side are tokenized together, as the engine does
                    count += self._plain("".join(pending))
                    pending = []
                with self._lock:
                    count += len(self.tokenizer.encode(piece, add_special_tokens=n == 0).ids)
        count += self._plain("".join(pending)) if pending else 0
        images = sum(1 for m in shape if not isinstance(m["content"], str) for p in m["content"]
                     if p["type"] == "image")
        return count + images * self.image_extra

    def _pieces(self, shape: list[dict[str, Any]]) -> list[str]:
        # the rendered template split at the stand-ins: template text at even places, text numbers at odd ones
        key = json.dumps(shape, sort_keys=True)
        if (cached := self._shapes.get(key)) is not None:
            return cached
        try:
            rendered = self.template.render(messages=shape, add_generation_prompt=True, **self.special)
        except Exception as e:  # the template's raise_exception, or its own error on this shape
            raise InvalidRequest(f"the model's chat template refuses these messages: {e}", code="bad_messages") \
                from None
        if len(self._shapes) >= SHAPE_CACHE:
            self._shapes.clear()
        self._shapes[key] = pieces = STAND_IN.split(rendered)
        return pieces

    def _plain(self, text: str) -> int:
        with self._lock:  # control-token strings in a user's text are split like any other text
            self.tokenizer.encode_special_tokens = True
            try:
                return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
            finally:
                self.tokenizer.encode_special_tokens = False


@lru_cache(maxsize=16)
def counter(model_dir: str, family: str) -> PromptCounter:
    """The counter of a model folder, loaded once per process."""
    return PromptCounter(model_dir, family)


def check_prompt(folder: Path | None, family: str, messages: list[dict[str, Any]], max_new_tokens: int,
                 bound: int) -> None:
    """A chat's text tokens (engine form) and ``max_new_tokens`` fit ``bound``; a folder without ``tokenizer.json``
    or a chat template is not counted here (its workers count).

    Raises:
        InvalidRequest: ``prompt_too_long``; ``bad_messages`` when the chat template refuses the chat.
    """
    if folder is None or not (folder / "tokenizer.json").is_file():
        return
    counted = counter(str(folder), family)
    if counted.template is not None:
        check_text_bound(counted.text_tokens(messages), max_new_tokens, bound)


def check_text_bound(num_text_tokens: int, max_new_tokens: int, bound: int) -> None:
    """Raises InvalidRequest ``prompt_too_long`` when prompt and answer pass ``VLMQ_TEXT_TOKEN_BOUND``."""
    if num_text_tokens + max_new_tokens > bound:
        raise InvalidRequest(
            f"the prompt has {num_text_tokens} text tokens and max_new_tokens is {max_new_tokens}: "
            f"{num_text_tokens + max_new_tokens} text tokens, over the bound of {bound} (VLMQ_TEXT_TOKEN_BOUND); "
            "shorten the prompt or lower max_new_tokens", code="prompt_too_long")


def stand_in(message: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """The message with each text replaced by its stand-in (appended to ``texts``); image parts kept (the engine's
    ``ChatPrompt`` renders with the same stand-ins)."""
    content = message["content"]
    if isinstance(content, str):
        texts.append(content)
        return {**message, "content": f"\x00{len(texts) - 1}\x00"}
    parts = []
    for part in content:
        if part["type"] == "text":
            texts.append(part["text"])
            parts.append({"type": "text", "text": f"\x00{len(texts) - 1}\x00"})
        else:
            parts.append({"type": "image"})
    return {**message, "content": parts}


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _content(token: Any) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


def _template(folder: Path, config: dict[str, Any]) -> Any:
    # the engine's order (processor._chat_template): chat_template.jinja, chat_template.json, the tokenizer's
    jinja = folder / "chat_template.jinja"
    source = jinja.read_text() if jinja.is_file() else \
        _json(folder / "chat_template.json").get("chat_template") or config.get("chat_template")
    return _environment().from_string(source) if isinstance(source, str) else None


def _environment() -> Any:
    # transformers' chat-template environment (utils.chat_template_utils): sandboxed, trimmed blocks, loop
    # controls, its tojson (no HTML escaping), raise_exception and strftime_now; {% generation %} renders its body
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env
