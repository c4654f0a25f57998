"""The bundled tiny shapes VLM: loads offline through plain transformers and answers correctly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from tiny import TEST_SEED, evaluate, shapes

import vlmq
from vlmq.cost import ResolutionPolicy
from vlmq.models import TINY_SHAPES_POLICY

ASSETS = Path(__file__).resolve().parents[2] / "workers" / "assets"
TARGET, DRAFT = ASSETS / "tiny-shapes", ASSETS / "tiny-shapes-draft"
DEMO = Path(vlmq.__file__).resolve().parent / "demo_assets"
KEYS = {"input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"}


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForImageTextToText

    torch.set_num_threads(1)
    return AutoModelForImageTextToText.from_pretrained(TARGET).eval()


@pytest.fixture(scope="module")
def processor():
    from vlmq.workers.models.processor import load_processor

    return load_processor(TARGET)


PROBE = r"""
import json, sys
sys.modules["torchvision"] = None  # any import of torchvision now fails
from PIL import Image
from transformers import AutoProcessor
from vlmq.workers.models.processor import load_processor, render_prompt
p = load_processor(sys.argv[1])
text = render_prompt(p, "How many circles?")
out = p(text=[text], images=[Image.new("RGB", (300, 200), "white")], return_tensors="pt")
try:  # transformers' own loading needs torchvision for Qwen2-VL: it must fail loudly, never hand back a tokenizer
    auto = type(AutoProcessor.from_pretrained(sys.argv[1])).__name__
except ImportError:
    auto = "ImportError"
print(json.dumps({"keys": sorted(out.keys()), "grid": out["image_grid_thw"].tolist(),
                  "pads": int((out["input_ids"] == p.image_token_id).sum()),
                  "auto": auto, "cls": type(p).__name__, "has_ip": hasattr(p, "image_processor"), "text": text}))
"""


def test_processor_loads_offline_without_torchvision():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", PROBE, str(TARGET)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(got["keys"]) == KEYS
    # 300x200 -> smart_resize to 280x224 (multiples of 56) -> 8x10 patches of 28 px -> 4x5 = 20 image tokens
    assert got["grid"] == [[1, 8, 10]] and got["pads"] == 20
    assert got["cls"] == "Qwen2VLImageProcessor" and got["has_ip"]
    assert got["auto"] == "ImportError"  # plain AutoProcessor never silently returns only the tokenizer
    assert got["text"].endswith("How many circles?<|im_end|>\n<|im_start|>assistant\n")
    assert got["text"].count("<|vision_start|><|image_pad|><|vision_end|>") == 1


def test_eos_is_im_end(processor):
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(TARGET)
    assert gen.eos_token_id == processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = json.loads((TARGET / "preprocessor_config.json").read_text())
    assert config["size"] == {"shortest_edge": 224 * 224, "longest_edge": 1024 * 1024}
    assert (config["patch_size"], config["merge_size"]) == (28, 2)
    # the SDK prices tiny-shapes images with this policy without reading the folder
    assert ResolutionPolicy.from_preprocessor_config(config) == TINY_SHAPES_POLICY


def test_draft_loads_and_shares_the_tokenizer(processor):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    draft = AutoModelForCausalLM.from_pretrained(DRAFT).eval()
    tok = AutoTokenizer.from_pretrained(DRAFT)
    assert tok.get_vocab() == processor.tokenizer.get_vocab()
    target_cfg = json.loads((TARGET / "config.json").read_text())
    assert draft.config.vocab_size == target_cfg["text_config"]["vocab_size"]
    assert sum(p.numel() for p in draft.parameters()) * 5 < 2_000_000
    ids = tok("<|im_start|>user\n<|vision_start|><|vision_end|>How many shapes?<|im_end|>\n"
              "<|im_start|>assistant\n", return_tensors="pt").input_ids
    out = draft.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_reads_colours_from_the_image(target, processor):
    # a quick reading check on small images (test_held_out_accuracy is the bar): a blind model, or a pipeline
    # that feeds it the wrong pixels, scores about 1 in 6 here
    examples = []
    for i in range(30):
        rng = np.random.default_rng((TEST_SEED, 1, i))
        scene = shapes.sample_scene(rng, tuple(int(v) for v in rng.integers(56, 225, size=2)), num_shapes=1)
        shape = scene.shapes[0]
        examples.append(shapes.Example(shapes.render(scene, rng), f"What colour is the {shape.shape}?",
                                       shape.colour, scene))
    answers = evaluate.greedy_answers(target, processor, examples)
    right = sum(a == ex.answer for ex, a in zip(examples, answers, strict=True))
    assert right >= 27, list(zip([ex.answer for ex in examples], answers, strict=True))


def test_held_out_accuracy(target, processor):
    examples = shapes.make_split(TEST_SEED, 200)
    assert max(max(ex.image.size) for ex in examples) > 768 and min(min(ex.image.size) for ex in examples) < 100
    assert sum(ex.question == shapes.CAPTION_PROMPT for ex in examples) >= 50
    answers = evaluate.greedy_answers(target, processor, examples)
    pairs = zip(examples, answers, strict=True)
    wrong = [(ex.question, ex.answer, a, ex.image.size) for ex, a in pairs if a != ex.answer]
    assert len(wrong) <= 10, wrong


def test_demo_samples(target, processor):
    samples = json.loads((DEMO / "samples.json").read_text())
    assert len(samples) == 8
    images, orientations = [], []
    for s in samples:
        with Image.open(DEMO / s["file"]) as im:
            orientations.append(im.getexif().get(0x0112, 1))
            images.append(ImageOps.exif_transpose(im).convert("RGB"))
    assert 6 in orientations  # one sample is stored rotated, with an EXIF orientation tag
    sides = [max(im.size) for im in images]
    assert min(sides) <= 120 and max(sides) >= 800
    examples = [shapes.Example(im, s["prompt"], s["expected"], None) for im, s in zip(images, samples, strict=True)]
    answers = evaluate.greedy_answers(target, processor, examples)
    assert answers == [s["expected"] for s in samples], answers  # every demo caption and answer right
