"""A tiny random-weight Qwen2.5-VL checkpoint folder, built with transformers, for tests and local pool runs.

    python -m tiny.qwen2_5_vl OUT_DIR    (from scripts/)

Written like a real Qwen2.5-VL folder (config, safetensors, preprocessor config with 14-px patches, window
attention with one full-attention block, tokenizer, chat template, generation config); the tokenizer and chat
template are the bundled tiny-shapes model's, whose special-token ids the config names. float32.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tiny.qwen3_vl import EOS, IMAGE, VIDEO, VISION_END, VISION_START, write_folder

TEXT = dict(vocab_size=448, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.1,
            bos_token_id=414, eos_token_id=EOS, pad_token_id=414,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})  # fmt: skip
VISION = dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4, patch_size=14,
              window_size=56, fullatt_block_indexes=[1], initializer_range=0.1)
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
                "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "do_convert_rgb": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": 14, "merge_size": 2,
                "temporal_patch_size": 2, "resample": 3,
                "size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 48}}  # fmt: skip


def build(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint folder; returns its path."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(text_config=dict(TEXT), vision_config=dict(VISION), image_token_id=IMAGE,
                              video_token_id=VIDEO, vision_start_token_id=VISION_START,
                              vision_end_token_id=VISION_END)
    return write_folder(Qwen2_5_VLForConditionalGeneration, config, PREPROCESSOR, Path(out_dir), seed)


if __name__ == "__main__":
    print(build(sys.argv[1]))
