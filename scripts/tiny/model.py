"""Configs for the bundled tiny target (Qwen2-VL) and its text-only draft (Qwen2)."""

from __future__ import annotations

from transformers import Qwen2Config, Qwen2VLConfig

from vlmq.models import TINY_SHAPES_POLICY

VOCAB_SIZE = 448  # tokenizer has 421 tokens; the embedding table is padded to a multiple of 64


def target_config(token_ids: dict[str, int], hidden: int = 128, layers: int = 2, vision_depth: int = 3,
                  vision_embed: int = 64, mlp_mult: int = 2, rope_theta: float = 10000.0,
                  mrope_section: tuple[int, int, int] = (4, 6, 6), head_dim: int = 32,
                  kv_groups: int = 2) -> Qwen2VLConfig:
    """mrope_section covers head_dim / 2 frequency pairs (t, h, w); kv_groups query heads share a key/value head."""
    heads = hidden // head_dim
    if sum(mrope_section) * 2 != head_dim or heads % kv_groups:
        raise ValueError(f"mrope_section {mrope_section} must cover head_dim/2 = {head_dim // 2} pairs and "
                         f"{heads} heads must split into groups of {kv_groups}")
    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=hidden * mlp_mult,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // kv_groups,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "mrope_section": list(mrope_section)},
        rms_norm_eps=1e-6,
        bos_token_id=token_ids["<|endoftext|>"],
        eos_token_id=token_ids["<|im_end|>"],
        pad_token_id=token_ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )
    vision = dict(
        depth=vision_depth,
        embed_dim=vision_embed,
        hidden_size=hidden,  # the merger projects into the LM's hidden size
        mlp_ratio=2,
        num_heads=vision_embed // 32,
        patch_size=TINY_SHAPES_POLICY.patch_size,  # the processor's, so one token covers policy.factor px
        spatial_merge_size=TINY_SHAPES_POLICY.merge_size,
        temporal_patch_size=TINY_SHAPES_POLICY.temporal_patch_size,
    )
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def draft_config(token_ids: dict[str, int], hidden: int = 64, layers: int = 2) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        bos_token_id=token_ids["<|endoftext|>"],
        eos_token_id=token_ids["<|im_end|>"],
        pad_token_id=token_ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )
