"""scripts/train_tiny.py end to end in a few steps on small images; the output folders load."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from vlmq.workers.models.processor import load_processor, render_prompt
from vlmq.workers.tiny import shapes

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_tiny.py"


def _caption_shapes(caption: str) -> list[tuple[str, str, str]]:
    """(colour, shape, position) of each phrase of a caption, read from its text (the grammar of shapes.caption)."""
    return [re.fullmatch(r"an? (\w+) (\w+) at the (.+)", p).groups() for p in re.split(r", | and ", caption)]


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
        "--vision-until", "0.4", "--packed", "1", "--where", "1", "--summary", "1", "--balanced", "1",  # options
        "--registers", "27", "--register-target", "both", "--ask", "1", "--phrase", "1",
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


@pytest.mark.parametrize(("registers", "target"), [(0, "cell"), (9, "cell"), (18, "pair"), (27, "both")])
def test_packed_rows_give_the_loss_of_separate_rows(tmp_path, registers, target):
    """Training packs an image's rows into one sequence (its tokens through the LM once): same loss, and no row
    sees another's question or answer; with register tokens after the image too (shared by the rows)."""
    import numpy as np
    from transformers import Qwen2VLForConditionalGeneration

    from vlmq.workers.tiny import data
    from vlmq.workers.tiny import model as tiny_model
    from vlmq.workers.tiny import tokenizer as tiny_tokenizer

    train = _script()
    tiny_tokenizer.save_tokenizer_files(tmp_path, registers=registers)
    ids = tiny_tokenizer.special_token_ids(tiny_tokenizer.build_tokenizer(registers))
    register_ids = torch.tensor([ids[t] for t in tiny_tokenizer.REGISTER_TOKENS[:registers]])
    builder = data.RowBuilder(load_processor(tmp_path))
    assert builder.mid_ids[1:] == register_ids.tolist()  # <|vision_end|>, then the registers in cell order
    rng = np.random.default_rng(0)
    groups = [data.make_group(builder, rng, 4, max_side=150) for _ in range(3)]
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(tiny_model.target_config(ids, layers=2, rope_theta=20.0))
    model.aux = train.aux_heads(model.config.text_config.hidden_size, where=True, summary=True,
                                registers=target if registers else "", ask=True, phrase=True)
    pad = ids["<|endoftext|>"]
    separators = train.separator_ids(builder.tok)
    for aux_weight, per_row in ((0.0, 0.0), (0.5, 0.0), (0.5, 0.5)):
        train.PARTS.clear()
        rows = train.target_loss(model, groups, pad, aux_weight, register_ids=register_ids, per_row=per_row,
                                 separator_ids=separators)
        packed = train.target_loss(model, groups, pad, aux_weight, builder, register_ids, per_row, separators)
        torch.testing.assert_close(packed, rows, rtol=1e-5, atol=1e-5)
    heads = {"cell": ["registers"], "pair": ["pairs"], "both": ["registers", "pairs"]}[target]
    assert all((head in train.PARTS) == bool(registers) for head in heads)  # the register targets were scored
    assert "ask" in train.PARTS  # and the question target, at one position per row in both layouts
    assert "phrase" in train.PARTS  # and the caption's phrase target, at every caption position
    rope_index = train._rope_index(model, ids["<|image_pad|>"])
    _, _, positions, visible = data.pack_groups(groups, builder, pad, rope_index)
    shared = data.shared_length(groups[0], builder)
    second = len(groups[0].rows[0][0])  # packed: the first row whole, then the second row's remainder
    assert visible[0, 0, second, shared] == 0 and visible[0, 0, second, shared - 1] == 1
    assert positions[0, 0, second] == positions[0, 0, shared]  # the second row restarts after the image


def test_linear_patch_embed_equals_the_convolution():
    """Training runs the Conv3d patch embedding as a matmul on the same weight (faster backward on CPU)."""
    from transformers import Qwen2VLForConditionalGeneration

    from vlmq.workers.tiny import model as tiny_model
    from vlmq.workers.tiny import tokenizer as tiny_tokenizer

    ids = tiny_tokenizer.special_token_ids(tiny_tokenizer.build_tokenizer())
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(tiny_model.target_config(ids, layers=1))
    embed = model.model.visual.patch_embed
    pixels = torch.randn(50, embed.in_channels * embed.temporal_patch_size * embed.patch_size ** 2)
    conv = embed(pixels)
    _script()._linear_patch_embed(model)
    torch.testing.assert_close(embed(pixels), conv, rtol=1e-4, atol=1e-4)
    assert list(model.state_dict()) == list(Qwen2VLForConditionalGeneration(model.config).state_dict())


def test_target_config_head_layout():
    from vlmq.workers.tiny import model as tiny_model
    from vlmq.workers.tiny.tokenizer import build_tokenizer, special_token_ids

    ids = special_token_ids(build_tokenizer())
    default = tiny_model.target_config(ids, hidden=128).text_config
    assert (default.num_attention_heads, default.num_key_value_heads) == (4, 2)
    narrow = tiny_model.target_config(ids, hidden=128, mrope_section=(2, 3, 3), head_dim=16, kv_groups=1).text_config
    assert (narrow.num_attention_heads, narrow.num_key_value_heads) == (8, 8)
    with pytest.raises(ValueError, match="mrope_section"):  # (4, 6, 6) covers 16 pairs, a 16-wide head has 8
        tiny_model.target_config(ids, hidden=128, head_dim=16)


def test_per_row_answer_loss_weighs_answers_not_tokens():
    """--per-row 1: a one-word answer counts as much as a long caption (the evaluation counts answers); 0.5 mixes."""
    train = _script()
    ignore = -100
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 5)
    hidden = torch.randn(2, 7, 8)
    # row 0: a 4-token answer, then a 1-token answer (packed rows); row 1: a 2-token answer at the row's end
    labels = torch.tensor([[ignore, 1, 2, 3, 4, ignore, 0], [ignore, ignore, ignore, ignore, ignore, 3, 2]])
    ce = torch.nn.functional.cross_entropy(head(hidden[:, :-1]).transpose(1, 2), labels[:, 1:], reduction="none")
    answers = [ce[0, 0:4].mean(), ce[0, 5:6].mean(), ce[1, 4:6].mean()]
    torch.testing.assert_close(train._answer_loss(head, hidden, labels, per_row=1.0), torch.stack(answers).mean())
    per_token = ce[labels[:, 1:] != ignore].mean()
    torch.testing.assert_close(train._answer_loss(head, hidden, labels), per_token)
    torch.testing.assert_close(train._answer_loss(head, hidden, labels, per_row=0.5),
                               (per_token + torch.stack(answers).mean()) / 2)


def test_pair_registers_name_the_count_and_cell_of_each_colour_and_shape():
    """--register-target pair: register k's targets are the number of (colour k // 3, shape k % 3) shapes in the
    image and, for a single one, its cell (1-9; 0 for none or several), read back here against the caption."""
    import numpy as np

    from vlmq.workers.tiny import data

    train = _script()
    builder = data.RowBuilder(load_processor(train.TARGET_DIR))
    rng = np.random.default_rng(3)
    groups = [data.make_group(builder, rng, 3, max_side=224) for _ in range(12)]
    targets = train.pair_targets(torch.stack([g.cell_labels for g in groups]))
    assert targets.shape == (len(groups), 18, 2)
    for g, target in zip(groups, targets, strict=True):
        question, caption = g.qa[0]
        assert question == shapes.CAPTION_PROMPT
        found = _caption_shapes(caption)
        for k, (count, cell) in enumerate(target.tolist()):
            same = [pos for colour, kind, pos in found
                    if (colour, kind) == (shapes.COLOUR_NAMES[k // 3], shapes.SHAPES[k % 3])]
            assert count == len(same)
            assert cell == (shapes.POSITIONS.index(same[0]) + 1 if len(same) == 1 else 0)
    assert (targets[..., 0] > 1).any()  # some image holds two shapes of one colour and kind


def test_ask_target_sits_on_each_rows_last_prompt_token():
    import numpy as np

    from vlmq.workers.tiny import data

    train = _script()
    builder = data.RowBuilder(load_processor(train.TARGET_DIR))
    rows = data.make_group(builder, np.random.default_rng(0), 4, max_side=150).rows
    _, labels, _ = data.pad_rows(rows, 0)
    starts = train._answer_starts(labels[:, 1:] != data.IGNORE)
    prompt_lengths = [sum(label == data.IGNORE for label in row_labels) for _, row_labels in rows]
    assert starts.nonzero().tolist() == [[r, n - 1] for r, n in enumerate(prompt_lengths)]


def test_question_target_names_what_the_question_asks_about():
    from vlmq.workers.tiny import shapes

    train = _script()
    colour, kind, cell = (shapes.COLOUR_NAMES.index("red") + 1, shapes.SHAPES.index("circle") + 1,
                          shapes.POSITIONS.index("top left") + 1)
    assert train.question_target("Is there a red circle?") == (colour, kind, 0)
    assert train.question_target("Where is the red circle?") == (colour, kind, 0)
    assert train.question_target("How many circles?") == (0, kind, 0)
    assert train.question_target("What colour is the circle?") == (0, kind, 0)
    assert train.question_target("What shape is at the top left?") == (0, 0, cell)
    assert train.question_target("How many shapes?") == (0, 0, 0)
    assert train.question_target(shapes.CAPTION_PROMPT) == (0, 0, 0)


def test_phrase_target_names_the_shape_each_caption_token_describes():
    """--phrase: each caption token's target is the (colour, shape, cell) of its phrase, read back against the
    caption text; a separator belongs to the phrase it opens and <|im_end|> to none."""
    import numpy as np

    from vlmq.workers.tiny import data

    train = _script()
    builder = data.RowBuilder(load_processor(train.TARGET_DIR))
    separators = train.separator_ids(builder.tok)
    assert len(separators) == 2
    rng = np.random.default_rng(5)
    for g in [data.make_group(builder, rng, 2, max_side=224) for _ in range(12)]:
        _, labels = g.rows[0]
        tokens = torch.tensor([t for t in labels if t != data.IGNORE])
        targets = train.phrase_targets(tokens, g.cell_labels, separators).tolist()
        words = [builder.tok.decode([t]) for t in tokens.tolist()]
        assert words[-1] == "<|im_end|>" and targets[-1] == [0, 0, 0]
        phrase, expected = -1, []
        found = _caption_shapes(g.qa[0][1])
        for word in words[:-1]:
            phrase += word in (",", " and") or phrase < 0
            colour, kind, place = found[phrase]
            expected.append([shapes.COLOUR_NAMES.index(colour) + 1, shapes.SHAPES.index(kind) + 1,
                             shapes.POSITIONS.index(place) + 1])
        assert targets[:-1] == expected


def test_eval_script_reports_every_split_the_readme_quotes(capsys):
    """scripts/eval_tiny.py: the README's accuracy figures (seed 7, the tests' seed 9, questions-only seed 21,
    captions-only seed 22) come from one run of it; here a small slice of each split on the bundled weights."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("eval_tiny", SCRIPT.parent / "eval_tiny.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        report = module.main(["--scale", "0.02"])
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert set(report) == {"eval", "tests", "questions", "captions"}
    assert [report[k]["seed"] for k in ("eval", "tests", "questions", "captions")] == [7, 9, 21, 22]
    assert set(report["captions"]["by_question"]) == {"caption"}
    assert "caption" not in report["questions"]["by_question"]
    assert report["questions"]["n"] == 12 and report["captions"]["exact_match"] >= 0.5
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report))
