"""Load a Qwen2-VL, InternVL or LLaVA-NeXT processor offline, without torchvision and without remote code.

transformers' `Qwen2VLProcessor` insists on a video processor (which needs torchvision), and
`AutoProcessor.from_pretrained` silently falls back to the bare tokenizer when it cannot build
one (or, when the folder names `processor_class: Qwen2VLProcessor` as real checkpoints do, raises
ImportError). `Qwen2VLImageProcessor` is the image-only subclass used here instead: the same `__call__`
(input_ids, attention_mask, pixel_values, image_grid_thw, mm_token_type_ids), built from the
image processor, the tokenizer and the chat template found in the checkpoint folder. The same
file layout is used by real Qwen2-VL checkpoints. `InternVLImageProcessor` does the same for InternVL;
`LlavaNextImageProcessor` adds the same methods to LLaVA-NeXT's processor (which has no video processor).

Each of them says how one image placeholder of the chat template expands (`image_span`): Qwen2-VL repeats
`<|image_pad|>`, LLaVA-NeXT `<image>`; InternVL wraps its `<IMG_CONTEXT>` tokens in `<img>` ... `</img>`.

The image processor is always the PIL one (`backend="pil"`, e.g. `Qwen2VLImageProcessorPil`): left to choose,
transformers 5 takes the torchvision one wherever torchvision is installed (GPU machines), which resizes
differently (pixel values up to about 0.03 apart after normalisation), while the engine's own preprocessing
(engine/preprocess.py, engine/tiling.py) and the pricing are bit for bit PIL's. So the `hf` backend, the engine
parity tests and the benchmarks see the same pixels as the engine on every machine.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from transformers import AutoTokenizer

# from its module: transformers 5.17's top-level name is a placeholder that demands torchvision (5.24's is not)
from transformers.models.auto.image_processing_auto import AutoImageProcessor
from transformers.models.internvl.processing_internvl import InternVLProcessor
from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

# a text's stand-in in the rendered template, shared with the SDK's count of prompt tokens (one rendering rule)
from vlmq.prompttokens import STAND_IN as _STAND_IN
from vlmq.prompttokens import stand_in as _stand_in_message


class Qwen2VLImageProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor for images only (no video processor, so no torchvision)."""

    # ProcessorMixin takes its attributes from this signature: image_processor and tokenizer only
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs)

    def image_span(self, num_tokens: int) -> list[int]:
        """Token ids that stand for one image of `num_tokens` LM tokens in the prompt."""
        return [self.image_token_id] * num_tokens

    def image_inputs(self, images) -> tuple[dict, list[int]]:
        """transformers' model inputs for `images` and each image's LM tokens (for the `hf` backend)."""
        feats = self.image_processor(images=images, return_tensors="pt")
        merge = self.image_processor.merge_size
        return dict(feats), [int(grid.prod()) // merge**2 for grid in feats["image_grid_thw"]]

    def text_inputs(self, input_ids, attention_mask) -> dict:
        """Inputs transformers' model derives from the prompt: Qwen2-VL's M-RoPE needs the image-token mask."""
        return {"mm_token_type_ids": (input_ids == self.image_token_id).int() * attention_mask}


class InternVLImageProcessor(InternVLProcessor):
    """InternVLProcessor for images only (no video processor, so no torchvision)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs)

    def image_span(self, num_tokens: int) -> list[int]:
        return [self.start_image_token_id, *[self.image_token_id] * num_tokens, self.end_image_token_id]

    def image_inputs(self, images) -> tuple[dict, list[int]]:
        feats = self.image_processor(images=images, crop_to_patches=True, return_tensors="pt")  # as __call__ does
        return {"pixel_values": feats["pixel_values"]}, [int(n) * self.image_seq_length for n in feats["num_patches"]]

    def text_inputs(self, input_ids, attention_mask) -> dict:
        return {}


class LlavaNextImageProcessor(LlavaNextProcessor):
    """LlavaNextProcessor with the engine's image_span / image_inputs / text_inputs (it has no video processor)."""

    def image_span(self, num_tokens: int) -> list[int]:
        return [self.image_token_id] * num_tokens

    def image_inputs(self, images) -> tuple[dict, list[int]]:
        feats = self.image_processor(images=images, return_tensors="pt")
        tile = feats["pixel_values"].shape[-2:]  # as replace_image_token counts: the tiles' size, CLS dropped
        drop = int(self.vision_feature_select_strategy == "default")
        return dict(feats), [self._get_number_of_features(h, w, *tile) - drop for h, w in feats["image_sizes"].tolist()]

    def text_inputs(self, input_ids, attention_mask) -> dict:
        return {}


IMAGE_BACKEND = "pil"  # the image processor the engine's preprocessing equals (see the module docstring)

# model_type -> image-only processor; Qwen2-VL's otherwise
_PROCESSORS = {"internvl": InternVLImageProcessor, "llava_next": LlavaNextImageProcessor}


def _chat_template(model_dir: Path, tokenizer) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    legacy = model_dir / "chat_template.json"
    if legacy.is_file():
        return json.loads(legacy.read_text())["chat_template"]
    return getattr(tokenizer, "chat_template", None)


# processor_config.json settings each family's processor takes: InternVL's image_seq_length (LM tokens per tile),
# LLaVA-NeXT's feature settings (its image token count)
_PROCESSOR_KEYS = {"llava_next": ("patch_size", "num_additional_image_tokens", "vision_feature_select_strategy")}


def _processor_kwargs(model_dir: Path, model_type: str | None) -> dict:
    path = model_dir / "processor_config.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    return {k: saved[k] for k in _PROCESSOR_KEYS.get(model_type, ("image_seq_length",)) if k in saved}


def load_processor(model_dir: str | Path) -> Qwen2VLImageProcessor | InternVLImageProcessor | LlavaNextImageProcessor:
    """Build the image-only processor of the checkpoint's family from a local checkpoint folder (offline)."""
    model_dir = Path(model_dir)
    config = model_dir / "config.json"  # a processor-only folder (tokenizer and image settings) is Qwen2-VL's
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    image_processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True, backend=IMAGE_BACKEND)
    if image_processor.backend != IMAGE_BACKEND:  # transformers falls back to another backend when one is missing
        raise RuntimeError(f"{model_dir}: {type(image_processor).__name__} is not a {IMAGE_BACKEND} image processor")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    cls = _PROCESSORS.get(model_type, Qwen2VLImageProcessor)
    processor = cls(image_processor, tokenizer, chat_template=_chat_template(model_dir, tokenizer),
                    **_processor_kwargs(model_dir, model_type))
    if not hasattr(processor, "image_processor"):
        raise RuntimeError(f"{model_dir}: processor has no image processor; check preprocessor_config.json")
    return processor


def single_turn(question: str) -> list[dict]:
    """The chat of one user turn: one image, then the question."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def render_prompt(processor, question: str) -> str:
    """Chat text for one user turn (one image, then the question), with the assistant turn opened."""
    return processor.apply_chat_template(single_turn(question), tokenize=False, add_generation_prompt=True)


class ChatPrompt:
    """A chat (OpenAI-style turns; image parts ``{"type": "image"}``) as token ids, the assistant turn opened,
    with every text, whatever its role, tokenized as plain text: an image token or `<|im_start|>` a user types is
    text, never a control token (transformers' processor would parse it as one).

    The template is rendered once per shape of the chat (roles, part kinds) with a stand-in for each text and
    tokenized around them; it puts control tokens between a text and its neighbours, so tokenizing the parts apart
    gives the same ids as tokenizing the whole (for text without control tokens). Its own logic must not depend on
    the texts. `ids(question)` is the one-turn chat of `render_prompt`.
    """

    def __init__(self, processor, cache_size: int = 4096) -> None:
        self.processor, self.tokenizer = processor, processor.tokenizer
        self.image_token_id = processor.image_token_id  # the template's placeholder for one image
        self.image_span = processor.image_span
        self._lock = threading.Lock()  # a fast tokenizer must not be entered from two threads at once
        self._shapes: dict[str, list[tuple[str, list[int]]]] = {}  # chat shape -> template segments
        self._texts: dict[str, list[int]] = {}  # text -> its plain ids
        self._cache_size = cache_size  # bounded: prompts are free-form text

    def ids(self, question: str, num_image_tokens: int = 1) -> list[int]:
        """The one-turn prompt's ids with the image placeholder expanded for `num_image_tokens` LM tokens."""
        return self.expand(self.template_ids(single_turn(question)), [num_image_tokens])[0]

    def messages_ids(self, messages: list[dict], num_image_tokens: list[int]) -> tuple[list[int], list[int]]:
        """`expand(template_ids(messages), num_image_tokens)`."""
        return self.expand(self.template_ids(messages), num_image_tokens)

    def template_ids(self, messages: list[dict]) -> list[int]:
        """The chat's ids with each image still one placeholder token (`image_token_id`)."""
        texts: list[str] = []
        shape = [_stand_in_message(m, texts) for m in messages]
        ids: list[int] = []
        for kind, value in self._segments(shape):
            ids += value if kind == "ids" else self._plain("".join(texts[i] for i in value))
        return ids

    def expand(self, ids: list[int], num_image_tokens: list[int]) -> tuple[list[int], list[int]]:
        """Each placeholder of `ids` expanded for its image's LM tokens (`image_span`), in order, and the offset of
        each image's first image token.

        Raises ValueError when `ids` holds another number of placeholders than `num_image_tokens` has."""
        spans = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(spans) != len(num_image_tokens):
            raise ValueError(f"the chat template placed {len(spans)} images; the request has {len(num_image_tokens)}")
        out: list[int] = []
        offsets: list[int] = []
        start = 0
        for at, n in zip(spans, num_image_tokens, strict=True):
            out += ids[start:at]
            span = self.image_span(n)
            offsets.append(len(out) + span.index(self.image_token_id))
            out += span
            start = at + 1
        return out + ids[start:], offsets

    def text_tokens(self, template_ids: list[int]) -> int:
        """Prompt tokens that are not an image's own: an image's wrappers (InternVL's <img> </img>) count as text."""
        num_images = template_ids.count(self.image_token_id)
        return len(template_ids) + num_images * (len(self.image_span(1)) - 2)

    def _plain(self, text: str) -> list[int]:
        ids = self._texts.get(text)
        if ids is None:
            ids = self._tokenize(text, plain=True)
            if len(self._texts) >= self._cache_size:
                self._texts.clear()
            self._texts[text] = ids
        return ids

    def _segments(self, shape: list[dict]) -> list[tuple[str, list[int]]]:
        # ("ids", template token ids) and ("text", [indices of texts rendered side by side]), in prompt order
        key = json.dumps(shape, sort_keys=True)
        if (cached := self._shapes.get(key)) is not None:
            return cached
        rendered = self.processor.apply_chat_template(shape, tokenize=False, add_generation_prompt=True)
        segments: list[tuple[str, list[int]]] = []
        for n, piece in enumerate(_STAND_IN.split(rendered)):
            if n % 2:  # a text's index
                if segments and segments[-1][0] == "text":
                    segments[-1][1].append(int(piece))
                else:
                    segments.append(("text", [int(piece)]))
            elif piece:
                segments.append(("ids", self._tokenize(piece, add_special_tokens=not segments)))
        if len(self._shapes) >= self._cache_size:
            self._shapes.clear()
        self._shapes[key] = segments
        return segments

    def _tokenize(self, text: str, *, add_special_tokens: bool = False, plain: bool = False) -> list[int]:
        # plain: control-token strings in `text` are split like any other text (split_special_tokens)
        with self._lock:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens,
                                       split_special_tokens=plain)["input_ids"])
