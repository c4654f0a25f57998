"""The SDK's text-token count (``vlmq.prompttokens``: the ``tokenizers`` and ``jinja2`` packages, no torch) equals the
engine's own (``ChatPrompt.text_tokens``, what the worker holds to ``VLMQ_TEXT_TOKEN_BOUND``) for every family and
the 48 chat shapes of the engine's template-parity corpus, control-token strings in the texts included; and a
multi-image chat is priced at submit as the engine lays its images out."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PIL import Image
from test_chat_messages import TINY, message_shapes
from tiny import qwen3_vl
from tiny.internvl import build_internvl
from tiny.llava_next import build_llava_next

from vlmq.cost import estimate_job
from vlmq.families import read_model_folder
from vlmq.prompttokens import PromptCounter
from vlmq.workers.engine.engine import Engine, Request
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


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_a_multi_image_chat_is_priced_as_the_engine_lays_its_images_out(family: str, tmp_path: Path) -> None:
    # the price at submit (estimate_job: each image by its family's rule, summed) is the image tokens and encoder
    # patches the engine gives the same chat's images
    folder = BUILDERS[family](tmp_path)
    engine = Engine.from_model_dir(folder, num_blocks=64)
    sizes = [(200, 60), (37, 90), (128, 128)]
    images = tuple(Image.new("RGB", size, (30 * i, 90, 200)) for i, size in enumerate(sizes))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Same?"}, {"type": "image"}]},
            {"role": "assistant", "content": "no"}, {"role": "user", "content": [{"type": "image"}]}]
    placeholders = engine.preprocessor("r", Request.chat(chat, images)).seq.images
    price = estimate_job(sizes, read_model_folder(folder)[1])
    assert [p.num_tokens for p in placeholders] == [e.vision_tokens for e in price.images]
    assert price.vision_tokens == sum(p.num_tokens for p in placeholders)
    assert price.encoder_patches == sum(p.num_patches for p in placeholders)
    engine.close()
