"""scripts/train_tiny.py end to end in a few steps on small images; the output folders load."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from vlmq.workers.models.processor import load_processor, render_prompt
from vlmq.workers.tiny import shapes

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_tiny.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_tiny", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny"] = module  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(module)
    return module


def test_train_script_writes_loadable_folders(tmp_path):
    target_dir, draft_dir, demo_dir = tmp_path / "t", tmp_path / "d", tmp_path / "demo"
    rc = _script().main([
        "--out", str(target_dir), "--draft-out", str(draft_dir), "--demo-dir", str(demo_dir),
        "--steps", "3", "--draft-steps", "2", "--warmup", "1", "--pool", "4", "--max-side", "84",
        "--eval-n", "0", "--log-every", "1", "--procs", "1",
    ])
    assert rc == 0
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json", "README.md"):
        assert (target_dir / name).is_file(), name
    report = json.loads((target_dir / "train_report.json").read_text())
    assert report["target_images"] > 0 and report["draft_images"] > 0

    model = AutoModelForImageTextToText.from_pretrained(target_dir).eval()
    processor = load_processor(target_dir)
    ex = shapes.make_example(0, size=(70, 90))
    inputs = processor(text=[render_prompt(processor, ex.question)], images=[ex.image], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    draft = AutoModelForCausalLM.from_pretrained(draft_dir)
    assert draft.config.vocab_size == model.config.text_config.vocab_size
    assert len(json.loads((demo_dir / "samples.json").read_text())) == 8
