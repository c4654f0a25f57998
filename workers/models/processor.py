"""Load a Qwen2-VL processor offline, without torchvision and without remote code.

transformers' `Qwen2VLProcessor` insists on a video processor (which needs torchvision), and
`AutoProcessor.from_pretrained` silently falls back to the bare tokenizer when it cannot build
one (or, when the folder names `processor_class: Qwen2VLProcessor` as real checkpoints do, raises
ImportError). `Qwen2VLImageProcessor` is the image-only subclass used here instead: the same `__call__`
(input_ids, attention_mask, pixel_values, image_grid_thw, mm_token_type_ids), built from the
image processor, the tokenizer and the chat template found in the checkpoint folder. The same
file layout is used by real Qwen2-VL checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoImageProcessor, AutoTokenizer
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor


class Qwen2VLImageProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor for images only (no video processor, so no torchvision)."""

    # ProcessorMixin takes its attributes from this signature: image_processor and tokenizer only
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs)


def _chat_template(model_dir: Path, tokenizer) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    legacy = model_dir / "chat_template.json"
    if legacy.is_file():
        return json.loads(legacy.read_text())["chat_template"]
    return getattr(tokenizer, "chat_template", None)


def load_processor(model_dir: str | Path) -> Qwen2VLImageProcessor:
    """Build the image-only Qwen2-VL processor from a local checkpoint folder (offline)."""
    model_dir = Path(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    processor = Qwen2VLImageProcessor(image_processor, tokenizer, chat_template=_chat_template(model_dir, tokenizer))
    if not hasattr(processor, "image_processor"):
        raise RuntimeError(f"{model_dir}: processor has no image processor; check preprocessor_config.json")
    return processor


def render_prompt(processor, question: str) -> str:
    """Chat text for one user turn (one image, then the question), with the assistant turn opened."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
