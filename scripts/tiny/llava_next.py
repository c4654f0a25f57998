"""A random-weight LLaVA-NeXT checkpoint folder built with transformers: the reference our LLaVA-NeXT code is tested
against (config, safetensors, LlavaNext PIL image processor, processor config, tokenizer with `<image>`, chat
template), a CLIP vision tower and a Llama (or Qwen2 / Mistral) language model as transformers' own tests build it.

Tiles are 56 px (14-px patches, a 4×4 feature grid per tile) and the pinpoints are LLaVA-NeXT's default five
scaled to that tile, so small images exercise every grid, unpadding and `image_newline`."""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, LlavaNextConfig, LlavaNextForConditionalGeneration
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

from tiny import TARGET_DIR
from tiny.hf_folder import chat_template, random_model, save_folder

CHAT_TEMPLATE = chat_template("<image>")
TILE = 56
PINPOINTS = [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]
# initializer_range 0.2: greedy answers of a random model that depend on the image
TINY_TEXT = dict(model_type="llama", initializer_range=0.2, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
                 hidden_act="silu")
TINY_VISION = dict(model_type="clip_vision_model", initializer_range=0.2, hidden_size=32, num_hidden_layers=3,
                   num_attention_heads=4, intermediate_size=64, image_size=TILE, patch_size=14,
                   projection_dim=32)


def build_llava_next(path: str | Path, *, text: dict | None = None, vision: dict | None = None, seed: int = 0,
                     **config) -> Path:
    """Write a random-weight float32 LLaVA-NeXT checkpoint to `path`; returns it. `text` and `vision` override the
    tiny sizes; `config` overrides LlavaNextConfig fields (vision_feature_layer, ...)."""
    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(TARGET_DIR)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    vision = dict(TINY_VISION, **(vision or {}))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text_config = dict(TINY_TEXT, **(text or {}), vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None)
    cfg = LlavaNextConfig(text_config=text_config, vision_config=vision, image_grid_pinpoints=PINPOINTS,
                          image_token_index=tokenizer.convert_tokens_to_ids("<image>"), **config)
    lively = ("class_embedding", "position_embedding", "image_newline")  # the vision embeddings and the newline
    model = random_model(LlavaNextForConditionalGeneration, cfg, seed, lively)
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": TILE},
                                                 crop_size={"height": TILE, "width": TILE},
                                                 image_grid_pinpoints=PINPOINTS)
    processor = {"patch_size": vision["patch_size"], "num_additional_image_tokens": 1,
                 "vision_feature_select_strategy": cfg.vision_feature_select_strategy,
                 "processor_class": "LlavaNextProcessor"}
    return save_folder(path, model, tokenizer, image_processor, processor)
