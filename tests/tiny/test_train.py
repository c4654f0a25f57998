"""scripts/train_tiny.py end to end in a few steps on small images; the output folders load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tiny import ROOT, shapes, train
from tiny import model as tiny_model
from tiny import tokenizer as tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Qwen2VLForConditionalGeneration

from vlmq.workers.models.processor import load_processor, render_prompt


def test_train_script_help_runs_from_a_checkout():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_tiny.py"), "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert "--register-target" in out and "python scripts/train_tiny.py --steps 0" in out


def test_train_writes_loadable_folders_and_keeps_the_cards_history(tmp_path):
    target_dir, draft_dir, demo_dir = tmp_path / "t", tmp_path / "d", tmp_path / "demo"
    target_dir.mkdir()
    (target_dir / "README.md").write_text("# old card\n\n## Training history\n\nrun 1: 41%\n")
    rc = train.main([
        "--out", str(target_dir), "--draft-out", str(draft_dir), "--demo-dir", str(demo_dir),
        "--steps", "3", "--draft-steps", "2", "--warmup", "1", "--pool", "4", "--max-side", "84",
        "--eval-n", "0", "--log-every", "1", "--procs", "1",
        "--vision-until", "0.4", "--packed", "1", "--where", "1", "--summary", "1", "--balanced", "1",  # options
        "--registers", "27", "--register-target", "both", "--ask", "1", "--phrase", "1",
    ])
    assert rc == 0
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json", "README.md"):
        assert (target_dir / name).is_file(), name
    report = json.loads((target_dir / "train_report.json").read_text())
    assert report["target_images"] > 0 and report["draft_images"] > 0
    card = (target_dir / "README.md").read_text()
    assert card.startswith("# tiny-shapes") and card.endswith("## Training history\n\nrun 1: 41%\n")
    assert f"s wall on\n{report['machine']}." in card  # the machine the figures were measured on

    model = AutoModelForImageTextToText.from_pretrained(target_dir).eval()
    processor = load_processor(target_dir)
    ex = shapes.make_example(0, size=(70, 90))
    prompt = render_prompt(processor, ex.question)
    assert "<|vision_end|>" + "".join(f"<|reg_{i}|>" for i in range(27)) + ex.question in prompt
    inputs = processor(text=[prompt], images=[ex.image], return_tensors="pt")
    assert sum(processor.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist()).count(f"<|reg_{i}|>")
               for i in range(27)) == 27  # one token each
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    draft = AutoModelForCausalLM.from_pretrained(draft_dir)
    assert draft.config.vocab_size == model.config.text_config.vocab_size
    assert len(json.loads((demo_dir / "samples.json").read_text())) == 8


def test_linear_patch_embed_equals_the_convolution():
    """Training runs the Conv3d patch embedding as a matmul on the same weight (faster backward on CPU)."""
    ids = tiny_tokenizer.special_token_ids(tiny_tokenizer.build_tokenizer())
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(tiny_model.target_config(ids, layers=1))
    embed = model.model.visual.patch_embed
    pixels = torch.randn(50, embed.in_channels * embed.temporal_patch_size * embed.patch_size ** 2)
    conv = embed(pixels)
    train.linear_patch_embed(model)
    torch.testing.assert_close(embed(pixels), conv, rtol=1e-4, atol=1e-4)
    assert list(model.state_dict()) == list(Qwen2VLForConditionalGeneration(model.config).state_dict())


def test_target_config_head_layout():
    ids = tiny_tokenizer.special_token_ids(tiny_tokenizer.build_tokenizer())
    default = tiny_model.target_config(ids, hidden=128).text_config
    assert (default.num_attention_heads, default.num_key_value_heads) == (4, 2)
    narrow = tiny_model.target_config(ids, hidden=128, mrope_section=(2, 3, 3), head_dim=16, kv_groups=1).text_config
    assert (narrow.num_attention_heads, narrow.num_key_value_heads) == (8, 8)
    with pytest.raises(ValueError, match="mrope_section"):  # (4, 6, 6) covers 16 pairs, a 16-wide head has 8
        tiny_model.target_config(ids, hidden=128, head_dim=16)
