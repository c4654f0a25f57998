"""A tiny random-weight Qwen3-VL checkpoint folder, built with transformers, for tests and local pool runs.

    python -m tiny.qwen3_vl OUT_DIR    (from scripts/)

Written like a real Qwen3-VL folder (config, safetensors, preprocessor config with 16-px patches and mean/std 0.5,
tokenizer, chat template, generation config); the tokenizer and chat template are the bundled tiny-shapes
model's, whose special-token ids the config names. float32, about 0.3 M parameters.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tiny import TARGET_DIR

EOS, IMAGE, VIDEO, VISION_START, VISION_END = 416, 419, 420, 417, 418  # the tiny-shapes tokenizer's ids
TEXT = dict(vocab_size=448, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, initializer_range=0.1,
            bos_token_id=414, eos_token_id=EOS, pad_token_id=414,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                             "mrope_interleaved": True})  # fmt: skip
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, patch_size=16,
              num_position_embeddings=64, deepstack_visual_indexes=[0, 2], hidden_act="gelu_pytorch_tanh",
              initializer_range=0.1)
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
                "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "do_convert_rgb": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "patch_size": 16,
                "merge_size": 2, "temporal_patch_size": 2, "resample": 3,
                "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 48}}  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint folder; returns its path."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(text_config=dict(TEXT), vision_config=dict(VISION), image_token_id=IMAGE,
                           video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    return write_folder(Qwen3VLForConditionalGeneration, config, PREPROCESSOR, Path(out_dir), seed)


def write_folder(model_cls, config, preprocessor: dict, out: Path, seed: int) -> Path:
    """A random float32 ``model_cls`` of ``config`` saved with ``preprocessor`` and the tiny-shapes tokenizer."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = model_cls._from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random (not zero/one) biases and norm weights, so a weight we miss shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config = GenerationConfig(bos_token_id=414, eos_token_id=EOS, pad_token_id=414)
    model.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(TARGET_DIR / name, out / name)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1]))
