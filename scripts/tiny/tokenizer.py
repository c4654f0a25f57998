"""Build the tiny model's tokenizer, chat template and image processor config offline.

The tokenizer is a byte-level BPE with Qwen2's pre-tokenizer (same split regex, NFC, byte-level
decoder), trained with the `tokenizers` library on the shapes grammar and the chat scaffolding,
plus Qwen2-VL's special tokens. Any text still encodes (bytes are in the base alphabet); only
the task's words are merged into single tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

from tiny import shapes
from vlmq.models import TINY_SHAPES_POLICY

# Qwen2's pre-tokenization regex (split on contractions, letters, single digits, punctuation, spaces)
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# register tokens: a fixed run after each image (chat template) where the model writes down what it read from
# the image (one per cell, one per colour and shape, or both), so a question can look it up by attention (training
# gives each its target: scripts/train_tiny.py --register-target)
REGISTER_TOKENS = tuple(f"<|reg_{i}|>" for i in range(27))
DEFAULT_SYSTEM = "You are a helpful assistant."
VOCAB_SIZE = 448  # base 256 bytes + merges + specials; the model's embedding table may be larger

# Qwen2-VL style chat template, images as vision_start/image_pad/vision_end (then @REGISTERS@). Unlike
# Qwen2-VL's it adds no default system turn (11 tokens per request the tiny model does not need).
_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>@REGISTERS@"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_template(registers: int = 0) -> str:
    """The chat template; `registers` register tokens follow each image."""
    return _TEMPLATE.replace("@REGISTERS@", "".join(REGISTER_TOKENS[:registers]))


CHAT_TEMPLATE = chat_template()

IMAGE_PROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": TINY_SHAPES_POLICY.patch_size,
    "merge_size": TINY_SHAPES_POLICY.merge_size,
    "temporal_patch_size": TINY_SHAPES_POLICY.temporal_patch_size,
    "size": {"shortest_edge": TINY_SHAPES_POLICY.min_pixels, "longest_edge": TINY_SHAPES_POLICY.max_pixels},
    "resample": 3,
}


def _corpus() -> list[str]:
    chat = [DEFAULT_SYSTEM, "system\n", "user\n", "assistant\n", "\n"]
    phrases = shapes.all_texts()
    joined = [f"{a}, {b} and {c}" for a, b, c in zip(phrases, phrases[7:], phrases[13:], strict=False)]
    return (chat + phrases + joined) * 4


def build_tokenizer(registers: int = 0) -> Tokenizer:
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens(registers)])
    return tok


def special_tokens(registers: int = 0) -> tuple[str, ...]:
    if not 0 <= registers <= len(REGISTER_TOKENS):
        raise ValueError(f"registers must be 0..{len(REGISTER_TOKENS)}, got {registers}")
    return SPECIAL_TOKENS + REGISTER_TOKENS[:registers]


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """Ids of the Qwen2-VL specials and of whichever register tokens `tok` has."""
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + REGISTER_TOKENS if tok.token_to_id(t) is not None}


def save_tokenizer_files(out_dir: str | Path, model_max_length: int = 4096, registers: int = 0) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja and preprocessor_config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(registers)
    tok.save(str(out / "tokenizer.json"))
    ids = special_token_ids(tok)
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for t, i in ids.items()
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": list(special_tokens(registers)[1:]),
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": model_max_length,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(chat_template(registers))
    (out / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR_CONFIG, indent=2) + "\n")
    return ids
