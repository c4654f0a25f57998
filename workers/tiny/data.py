"""Turn shapes examples into training rows: token ids built piecewise (identical to the processor's).

A "group" is one image with several (question, answer) rows; the vision tower runs once per
group and its features are shared by the rows (see scripts/train_tiny.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vlmq.workers.tiny import shapes

IGNORE = -100


@dataclass(slots=True)
class Group:
    pixel_values: torch.Tensor  # [num_patches, 3 * 2 * 14 * 14]
    grid_thw: torch.Tensor  # [3]
    rows: list[tuple[list[int], list[int]]]  # (input_ids, labels) per question
    qa: list[tuple[str, str]]  # (question, answer) per row
    num_image_tokens: int
    token_labels: torch.Tensor | None = None  # [num_image_tokens, 2]: colour, shape of each LM image token
    cell_labels: torch.Tensor | None = None  # [9, 2]: colour, shape in each grid cell (0 = nothing)


class RowBuilder:
    """Builds chat token ids for (question, answer) around an image of n tokens."""

    def __init__(self, processor):
        tok = processor.tokenizer
        self.processor = processor
        self.image_token_id = tok.convert_tokens_to_ids("<|image_pad|>")
        self.im_end_id = tok.convert_tokens_to_ids("<|im_end|>")
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "@Q@"}]}],
            tokenize=False, add_generation_prompt=True,
        )
        before, after = text.split("<|image_pad|>")
        self.prefix = tok(before, add_special_tokens=False).input_ids
        self.mid, self.suffix = (s for s in after.split("@Q@"))
        self.tok = tok
        self._cache: dict[str, list[int]] = {}

    def _ids(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = self.tok(text, add_special_tokens=False).input_ids
        return self._cache[text]

    def prompt_ids(self, question: str, num_image_tokens: int) -> list[int]:
        return self.prefix + [self.image_token_id] * num_image_tokens + self._ids(self.mid + question + self.suffix)

    def row(self, question: str, answer: str, num_image_tokens: int) -> tuple[list[int], list[int]]:
        prompt = self.prompt_ids(question, num_image_tokens)
        target = self._ids(answer) + [self.im_end_id]
        return prompt + target, [IGNORE] * len(prompt) + target

    def text_only_row(self, question: str, answer: str) -> tuple[list[int], list[int]]:
        """Draft model rows: the same chat text with the image pads removed (vision_start/end kept)."""
        return self.row(question, answer, 0)


# training sees fewer of the costly large images than the evaluation distribution (shapes.SIZE_BANDS)
TRAIN_BANDS = (0.72, 0.94, 0.985)


def make_group(builder: RowBuilder, rng: np.random.Generator, questions_per_image: int = 2,
               max_side: int | None = None) -> Group:
    size = None
    if max_side is not None:
        size = tuple(int(v) for v in rng.integers(shapes.MIN_SIDE, max_side + 1, size=2))
    scene = shapes.sample_scene(rng, size, bands=TRAIN_BANDS)
    boxes: list = []
    image = shapes.render(scene, rng, boxes)
    out = builder.processor.image_processor(images=[image], return_tensors="pt")
    grid = out["image_grid_thw"][0]
    n = int(grid.prod()) // 4
    tokens, cells = region_labels(scene, boxes, int(grid[1]) // 2, int(grid[2]) // 2)
    if questions_per_image == 1:
        qa = [shapes.pick_question(scene, rng, caption_prob=0.5)]
    else:  # a caption, then questions
        qa = [(shapes.CAPTION_PROMPT, shapes.caption(scene))]
        for _ in range(4 * questions_per_image):  # distinct questions (a repeat could be answered from the text)
            if len(qa) == questions_per_image:
                break
            pair = shapes.pick_question(scene, rng, caption_prob=0.0)
            if pair not in qa:
                qa.append(pair)
    return Group(out["pixel_values"], grid, [builder.row(q, a, n) for q, a in qa], qa, n, tokens, cells)


def _class_ids(shape: shapes.Shape) -> tuple[int, int]:
    return 1 + shapes.COLOUR_NAMES.index(shape.colour), 1 + shapes.SHAPES.index(shape.shape)


def region_labels(scene: shapes.Scene, boxes: list, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per LM image token (rows x cols grid over the image): the colour/shape covering most of it (0: none);
    per 3x3 cell: the colour/shape in it. Auxiliary training targets only."""
    tw, th = scene.width / cols, scene.height / rows
    tokens = torch.zeros((rows * cols, 2), dtype=torch.long)
    best = torch.zeros(rows * cols)
    for x0, y0, x1, y1, shape in boxes:
        ids = torch.tensor(_class_ids(shape))
        for r in range(max(0, int(y0 // th)), min(rows, int(y1 // th) + 1)):
            for c in range(max(0, int(x0 // tw)), min(cols, int(x1 // tw) + 1)):
                ow = min(x1, (c + 1) * tw) - max(x0, c * tw)
                oh = min(y1, (r + 1) * th) - max(y0, r * th)
                frac = max(0.0, ow) * max(0.0, oh) / min(tw * th, (x1 - x0) * (y1 - y0))
                if frac > 0.25 and frac > best[r * cols + c]:
                    best[r * cols + c] = frac
                    tokens[r * cols + c] = ids
    cells = torch.zeros((9, 2), dtype=torch.long)
    for shape in scene.shapes:
        cells[shape.cell] = torch.tensor(_class_ids(shape))
    return tokens, cells


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-pad rows -> input_ids, labels, attention_mask [B, S]."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return input_ids, labels, mask
