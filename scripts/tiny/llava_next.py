"""A random-weight LLaVA-NeXT checkpoint folder built with transformers: the reference our LLaVA-NeXT code is tested
against (config, safetensors, LlavaNext PIL image processor, processor config, tokenizer with `<image>`, chat
template), a CLIP vision tower and a Llama (or Qwen2 / Mistral) language model as transformers' own tests build it.

Tiles are 56 px (14-px patches, a 4×4 feature grid per tile) and the pinpoints are LLaVA-NeXT's default five
scaled to that tile, so small images exercise every grid, unpadding and `image_newline`."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, LlavaNextConfig, LlavaNextForConditionalGeneration
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

TOKENIZER = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
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
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    vision = dict(TINY_VISION, **(vision or {}))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text_config = dict(TINY_TEXT, **(text or {}), vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None)
    cfg = LlavaNextConfig(text_config=text_config, vision_config=vision, image_grid_pinpoints=PINPOINTS,
                          image_token_index=tokenizer.convert_tokens_to_ids("<image>"), **config)
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration._from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # lively random weights for the vision tower's embeddings and the newline
        for name, p in model.named_parameters():
            if "class_embedding" in name or "position_embedding" in name or "image_newline" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=eos).save_pretrained(path)
    LlavaNextImageProcessorPil(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
                               image_grid_pinpoints=PINPOINTS).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    processor = {"patch_size": vision["patch_size"], "num_additional_image_tokens": 1,
                 "vision_feature_select_strategy": cfg.vision_feature_select_strategy,
                 "processor_class": "LlavaNextProcessor"}
    (path / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return path
