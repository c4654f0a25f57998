"""A random-weight InternVL checkpoint folder built with transformers: the reference our InternVL code is tested
and benchmarked against (config, safetensors, GotOcr2 image processor, tokenizer with InternVL's image tokens,
chat template), in the layout of the `-hf` checkpoints on the Hub.

The tokenizer is the bundled tiny model's byte-level BPE with `<img>`, `</img>` and `<IMG_CONTEXT>` added (and
`<video>`, which transformers' InternVLProcessor requires)."""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, InternVLConfig, InternVLForConditionalGeneration
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

from tiny import TARGET_DIR
from tiny.hf_folder import chat_template, random_model, save_folder

IMAGE_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                "video_token": "<video>"}
CHAT_TEMPLATE = chat_template("<IMG_CONTEXT>")  # the context token the processor expands
# initializer_range 0.2: greedy answers of a random model that depend on the image (0.02 gives "\n" forever)
TINY_TEXT = dict(model_type="qwen2", initializer_range=0.2, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
                 hidden_act="silu")
TINY_VISION = dict(initializer_range=0.2, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64, image_size=56, patch_size=14, hidden_act="gelu")


def build_internvl(path: str | Path, *, text: dict | None = None, vision: dict | None = None, max_patches: int = 6,
                   seed: int = 0, **config) -> Path:
    """Write a random-weight float32 InternVL checkpoint to `path`; returns it. `text` and `vision` override the
    tiny sizes; `config` overrides InternVLConfig fields (downsample_ratio, vision_feature_layer, ...)."""
    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(TARGET_DIR, extra_special_tokens=IMAGE_TOKENS)
    tokenizer.add_tokens(list(IMAGE_TOKENS.values()), special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    vision = dict(TINY_VISION, **(vision or {}))
    ratio = config.get("downsample_ratio", 0.5)
    tokens_per_tile = int((vision["image_size"] // vision["patch_size"]) ** 2 * ratio**2)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text_config = dict(TINY_TEXT, **(text or {}), vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None)
    cfg = InternVLConfig(text_config=text_config, vision_config=vision, image_seq_length=tokens_per_tile,
                         image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"), **config)
    lively = ("lambda_", "position_embeddings", "cls_token")  # the default init leaves the layer scales at 0.1
    model = random_model(InternVLForConditionalGeneration, cfg, seed, lively)
    size = vision["image_size"]
    image_processor = GotOcr2ImageProcessorPil(size={"height": size, "width": size}, crop_to_patches=True,
                                               max_patches=max_patches, image_mean=[0.485, 0.456, 0.406],
                                               image_std=[0.229, 0.224, 0.225])
    processor = {"image_seq_length": tokens_per_tile, "processor_class": "InternVLProcessor"}
    return save_folder(path, model, tokenizer, image_processor, processor)
