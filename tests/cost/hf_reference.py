"""transformers' processors as the reference for the cost model, built locally (no hub, no torchvision).

InternVL's and Qwen3-VL's processors insist on a video processor, which needs torchvision; the image-only
subclasses here take the same arguments without it (as ``workers/models/processor.py`` does for Qwen2-VL).
The tokenizer is a word-level one holding just the family's special tokens.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.internvl.processing_internvl import InternVLProcessor
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
QWEN_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def tokenizer(special: list[str], named: dict[str, str] | None = None) -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer knowing ``special`` (and ``named``'s values) as special tokens."""
    vocab = {"<unk>": 0, "describe": 1}
    for token in [*special, *(named or {}).values()]:
        vocab.setdefault(token, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # transformers 5 reads extra_special_tokens as a name -> token dict or, without names, a list
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", extra_special_tokens=named or special)


class InternVLImageProcessor(InternVLProcessor):
    """InternVLProcessor without a video processor."""

    def __init__(self, image_processor=None, tokenizer=None, image_seq_length=256, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, image_seq_length=image_seq_length,
                         chat_template=chat_template, **kwargs)


class Qwen3VLImageProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without a video processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def internvl_processor(image_processor: dict[str, Any], image_seq_length: int) -> InternVLImageProcessor:
    return InternVLImageProcessor(GotOcr2ImageProcessorPil(**image_processor), tokenizer([], INTERNVL_TOKENS),
                                  image_seq_length=image_seq_length)


def internvl_context_tokens(processor: InternVLImageProcessor, image_sizes: Sequence[tuple[int, int]]) -> list[int]:
    """<IMG_CONTEXT> tokens of each (height, width) by the processor's count helper, which counted the <img> and
    </img> around them up to transformers 5.24 and leaves them out from 5.25: which one is read off a real call
    (the prompt of one image is the context tokens and the two wrappers)."""
    size = (56, 40)
    ids = processor(text=[processor.image_token], images=[Image.new("RGB", size)])["input_ids"][0]
    counted = processor._get_num_multimodal_tokens(image_sizes=[size[::-1]])["num_image_tokens"][0]
    wrappers_counted = {len(ids): 2, len(ids) - 2: 0}[counted]  # a third way of counting fails here, loudly
    counts = processor._get_num_multimodal_tokens(image_sizes=list(image_sizes))["num_image_tokens"]
    return [int(n) - wrappers_counted for n in counts]


def llava_next_processor(image_processor: dict[str, Any], **processor: Any) -> LlavaNextProcessor:
    return LlavaNextProcessor(LlavaNextImageProcessorPil(**image_processor), tokenizer(["<image>"]), **processor)


def qwen3_vl_processor(image_processor: dict[str, Any]) -> Qwen3VLImageProcessor:
    return Qwen3VLImageProcessor(Qwen2VLImageProcessorPil(**image_processor), tokenizer(list(QWEN_TOKENS)))


def parity_sizes(seed: int, ties: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """(height, width) pairs: tiny, ordinary, huge, extreme aspect ratios and the family's exact ties."""
    rng = random.Random(seed)
    sizes = [(h, w) for h in (1, 2, 3, 7, 13, 28) for w in (1, 2, 3, 7, 13, 28)]
    sizes += [(rng.randint(1, 4000), rng.randint(1, 4000)) for _ in range(300)]
    sizes += [(rng.randint(5000, 60000), rng.randint(5000, 60000)) for _ in range(50)]
    for _ in range(40):  # long strips both ways, from mild to absurd
        short, ratio = rng.randint(1, 400), rng.choice((3, 17, 199, 200, 201, 1000, 5000))
        sizes += [(short, short * ratio), (short * ratio, short)]
    sizes += ties
    return sizes
