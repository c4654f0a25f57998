"""What the random-weight checkpoint folders built with transformers (tiny.internvl, tiny.llava_next) share: the
Hub checkpoints' chat template, a seeded model with lively random weights, and the folder's files."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GenerationConfig


def chat_template(image: str) -> str:
    """The Hub checkpoints' ChatML template with an image rendered as `image` (the token the processor expands)."""
    return (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '" + image + "\n' }}"
        "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
    )


def random_model(cls, config, seed: int, lively: tuple[str, ...]):
    """`cls` with seeded float32 random weights; parameters whose name contains one of `lively` redrawn from
    N(0, 0.5), which the default init leaves too small or constant for answers that depend on the image."""
    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in lively):
                p.normal_(0, 0.5)
    return model


def save_folder(path: Path, model, tokenizer, image_processor, processor: dict) -> Path:
    """Write the checkpoint folder: weights and config, generation config (stopping at the model's eos), image
    processor, tokenizer, its chat template and `processor` as processor_config.json; returns `path`."""
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=model.config.text_config.eos_token_id).save_pretrained(path)
    image_processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(tokenizer.chat_template)
    (path / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return path
