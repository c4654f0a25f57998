"""The training targets and losses (tiny.targets, tiny.losses), checked against the examples' own text."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from tiny import TARGET_DIR, data, losses, shapes, targets
from tiny import model as tiny_model
from tiny import tokenizer as tiny_tokenizer
from transformers import Qwen2VLForConditionalGeneration

from vlmq.workers.models.processor import load_processor


def caption_shapes(caption: str) -> list[tuple[str, str, str]]:
    """(colour, shape, position) of each phrase of a caption, read from its text (the grammar of shapes.caption)."""
    return [re.fullmatch(r"an? (\w+) (\w+) at the (.+)", p).groups() for p in re.split(r", | and ", caption)]


@pytest.fixture(scope="module")
def builder():
    return data.RowBuilder(load_processor(TARGET_DIR))


@pytest.mark.parametrize(("registers", "target"), [(0, "cell"), (9, "cell"), (18, "pair"), (27, "both")])
def test_packed_rows_give_the_loss_of_separate_rows(tmp_path, registers, target):
    """Training packs an image's rows into one sequence (its tokens through the LM once): same loss, and no row
    sees another's question or answer; with register tokens after the image too (shared by the rows)."""
    tiny_tokenizer.save_tokenizer_files(tmp_path, registers=registers)
    ids = tiny_tokenizer.special_token_ids(tiny_tokenizer.build_tokenizer(registers))
    register_ids = torch.tensor([ids[t] for t in tiny_tokenizer.REGISTER_TOKENS[:registers]])
    builder = data.RowBuilder(load_processor(tmp_path))
    assert builder.mid_ids[1:] == register_ids.tolist()  # <|vision_end|>, then the registers in cell order
    rng = np.random.default_rng(0)
    groups = [data.make_group(builder, rng, 4, max_side=150) for _ in range(3)]
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(tiny_model.target_config(ids, layers=2, rope_theta=20.0))
    model.aux = losses.aux_heads(model.config.text_config.hidden_size, where=True, summary=True,
                                 registers=target if registers else "", ask=True, phrase=True)
    pad = ids["<|endoftext|>"]
    separators = targets.separator_ids(builder.tok)
    for aux_weight, per_row in ((0.0, 0.0), (0.5, 0.0), (0.5, 0.5)):
        losses.PARTS.clear()
        rows = losses.target_loss(model, groups, pad, aux_weight, register_ids=register_ids, per_row=per_row,
                                  separator_ids=separators)
        packed = losses.target_loss(model, groups, pad, aux_weight, builder, register_ids, per_row, separators)
        torch.testing.assert_close(packed, rows, rtol=1e-5, atol=1e-5)
    heads = {"cell": ["registers"], "pair": ["pairs"], "both": ["registers", "pairs"]}[target]
    assert all((head in losses.PARTS) == bool(registers) for head in heads)  # the register targets were scored
    assert "ask" in losses.PARTS  # and the question target, at one position per row in both layouts
    assert "phrase" in losses.PARTS  # and the caption's phrase target, at every caption position
    _, _, positions, visible = data.pack_groups(groups, builder, pad, losses.rope_index(model, ids["<|image_pad|>"]))
    shared = data.shared_length(groups[0], builder)
    second = len(groups[0].rows[0][0])  # packed: the first row whole, then the second row's remainder
    assert visible[0, 0, second, shared] == 0 and visible[0, 0, second, shared - 1] == 1
    assert positions[0, 0, second] == positions[0, 0, shared]  # the second row restarts after the image


def test_per_row_answer_loss_weighs_answers_not_tokens():
    """--per-row 1: a one-word answer counts as much as a long caption (the evaluation counts answers); 0.5 mixes."""
    ignore = data.IGNORE
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 5)
    hidden = torch.randn(2, 7, 8)
    # row 0: a 4-token answer, then a 1-token answer (packed rows); row 1: a 2-token answer at the row's end
    labels = torch.tensor([[ignore, 1, 2, 3, 4, ignore, 0], [ignore, ignore, ignore, ignore, ignore, 3, 2]])
    ce = torch.nn.functional.cross_entropy(head(hidden[:, :-1]).transpose(1, 2), labels[:, 1:], reduction="none")
    answers = [ce[0, 0:4].mean(), ce[0, 5:6].mean(), ce[1, 4:6].mean()]
    torch.testing.assert_close(losses.answer_loss(head, hidden, labels, per_row=1.0), torch.stack(answers).mean())
    per_token = ce[labels[:, 1:] != ignore].mean()
    torch.testing.assert_close(losses.answer_loss(head, hidden, labels), per_token)
    torch.testing.assert_close(losses.answer_loss(head, hidden, labels, per_row=0.5),
                               (per_token + torch.stack(answers).mean()) / 2)


def test_pair_registers_name_the_count_and_cell_of_each_colour_and_shape(builder):
    """--register-target pair: register k's targets are the number of (colour k // 3, shape k % 3) shapes in the
    image and, for a single one, its cell (1-9; 0 for none or several), read back here against the caption."""
    rng = np.random.default_rng(3)
    groups = [data.make_group(builder, rng, 3, max_side=224) for _ in range(12)]
    pairs = targets.pair_targets(torch.stack([g.cell_labels for g in groups]))
    assert pairs.shape == (len(groups), 18, 2)
    for g, target in zip(groups, pairs, strict=True):
        question, caption = g.qa[0]
        assert question == shapes.CAPTION_PROMPT
        found = caption_shapes(caption)
        for k, (count, cell) in enumerate(target.tolist()):
            same = [pos for colour, kind, pos in found
                    if (colour, kind) == (shapes.COLOUR_NAMES[k // 3], shapes.SHAPES[k % 3])]
            assert count == len(same)
            assert cell == (shapes.POSITIONS.index(same[0]) + 1 if len(same) == 1 else 0)
    assert (pairs[..., 0] > 1).any()  # some image holds two shapes of one colour and kind


def test_ask_target_sits_on_each_rows_last_prompt_token(builder):
    rows = data.make_group(builder, np.random.default_rng(0), 4, max_side=150).rows
    _, labels, _ = data.pad_rows(rows, 0)
    starts = losses.answer_starts(labels[:, 1:] != data.IGNORE)
    prompt_lengths = [sum(label == data.IGNORE for label in row_labels) for _, row_labels in rows]
    assert starts.nonzero().tolist() == [[r, n - 1] for r, n in enumerate(prompt_lengths)]


def test_question_target_names_what_the_question_asks_about():
    colour, kind, cell = (shapes.COLOUR_NAMES.index("red") + 1, shapes.SHAPES.index("circle") + 1,
                          shapes.POSITIONS.index("top left") + 1)
    assert targets.question_target("Is there a red circle?") == (colour, kind, 0)
    assert targets.question_target("Where is the red circle?") == (colour, kind, 0)
    assert targets.question_target("How many circles?") == (0, kind, 0)
    assert targets.question_target("What colour is the circle?") == (0, kind, 0)
    assert targets.question_target("What shape is at the top left?") == (0, 0, cell)
    assert targets.question_target("How many shapes?") == (0, 0, 0)
    assert targets.question_target(shapes.CAPTION_PROMPT) == (0, 0, 0)


def test_phrase_target_names_the_shape_each_caption_token_describes(builder):
    """--phrase: each caption token's target is the (colour, shape, cell) of its phrase, read back against the
    caption text; a separator belongs to the phrase it opens and <|im_end|> to none."""
    separators = targets.separator_ids(builder.tok)
    assert len(separators) == 2
    rng = np.random.default_rng(5)
    for g in [data.make_group(builder, rng, 2, max_side=224) for _ in range(12)]:
        _, labels = g.rows[0]
        tokens = torch.tensor([t for t in labels if t != data.IGNORE])
        phrases = targets.phrase_targets(tokens, g.cell_labels, separators).tolist()
        words = [builder.tok.decode([t]) for t in tokens.tolist()]
        assert words[-1] == "<|im_end|>" and phrases[-1] == [0, 0, 0]
        phrase, expected = -1, []
        found = caption_shapes(g.qa[0][1])
        for word in words[:-1]:
            phrase += word in (",", " and") or phrase < 0
            colour, kind, place = found[phrase]
            expected.append([shapes.COLOUR_NAMES.index(colour) + 1, shapes.SHAPES.index(kind) + 1,
                             shapes.POSITIONS.index(place) + 1])
        assert phrases[:-1] == expected
