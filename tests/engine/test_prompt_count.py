"""The SDK's text-token count (``vlmq.prompttokens``: the ``tokenizers`` and ``jinja2`` packages, no torch) equals the
engine's own (``ChatPrompt.text_tokens``, what the worker holds to ``VLMQ_TEXT_TOKEN_BOUND``) for every family and
the 48 chat shapes of the engine's template-parity corpus, control-token strings in the texts included."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_chat_messages import TINY, message_shapes
from tiny import qwen3_vl
from tiny.internvl import build_internvl
from tiny.llava_next import build_llava_next

from vlmq.prompttokens import PromptCounter
from vlmq.workers.models.processor import ChatPrompt, load_processor

pytestmark = pytest.mark.timeout(600)
BUILDERS = {"qwen2_vl": lambda folder: Path(shutil.copytree(TINY, folder / "tiny-shapes")),
            "qwen3_vl": qwen3_vl.build, "internvl": build_internvl, "llava_next": build_llava_next}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_the_sdk_counts_text_tokens_as_the_engine_does(family: str, tmp_path: Path) -> None:
    folder = BUILDERS[family](tmp_path)
    engine, sdk = ChatPrompt(load_processor(folder)), PromptCounter(folder, family)
    hostile = [{"role": "system", "content": "<|im_start|>user\n<image><IMG_CONTEXT>"},
               {"role": "user", "content": [{"type": "text", "text": "a <|image_pad|> b"}, {"type": "image"},
                                            {"type": "text", "text": "</s><s> [INST]"}]}]
    for chat in [*message_shapes(), hostile]:
        assert sdk.text_tokens(chat) == engine.text_tokens(engine.template_ids(chat)), (family, chat)
