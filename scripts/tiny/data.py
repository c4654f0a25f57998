"""Turn shapes examples into training rows: token ids built piecewise (identical to the processor's).

A "group" is one image with several (question, answer) rows; the vision tower runs once per
group and its features are shared by the rows (see scripts/train_tiny.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tiny import shapes
from vlmq.workers.engine.preprocess import ImagePreprocessor

IGNORE = -100


@dataclass(slots=True)
class Group:
    pixel_values: torch.Tensor  # [num_patches, 3 * 2 * patch * patch]
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
        # the tokens between the image and the question (<|vision_end|>, then any register tokens)
        self.mid_ids = self._ids(self.mid)
        # the engine's preprocessing: the processor's pixel_values bit for bit (tests/engine/test_preprocess.py),
        # several times faster, which buys the training run more images
        self.images = ImagePreprocessor.from_preprocessor_config(processor.image_processor.to_dict())

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
        """Draft model rows: the same chat text with the image pads removed (vision_start/end and registers kept)."""
        return self.row(question, answer, 0)


# training sees fewer of the costly large images than the evaluation distribution (shapes.SIZE_BANDS)
TRAIN_BANDS = (0.72, 0.94, 0.985)


def make_group(builder: RowBuilder, rng: np.random.Generator, questions_per_image: int = 2,
               max_side: int | None = None, on_grid: bool = True, balanced: bool = False,
               size_rng: np.random.Generator | None = None) -> Group:
    """One image and its rows; the image's size comes from `size_rng` when given (data-parallel training gives
    every rank the same size stream, so their steps cost the same), the rest from `rng`."""
    size_rng = rng if size_rng is None else size_rng
    if max_side is not None:
        size = tuple(int(v) for v in size_rng.integers(shapes.MIN_SIDE, max_side + 1, size=2))
    else:
        size = shapes.sample_size(size_rng, TRAIN_BANDS)
    scene = shapes.sample_scene(rng, size, bands=TRAIN_BANDS)
    boxes: list = []
    image = shapes.render(scene, rng, boxes, on_grid=on_grid)
    pixel_values, grids = builder.images([image])
    grid = grids[0]
    n = int(grid.prod()) // 4
    tokens, cells = region_labels(scene, boxes, int(grid[1]) // 2, int(grid[2]) // 2)
    if questions_per_image == 1:
        qa = [shapes.pick_question(scene, rng, caption_prob=0.5)]
    elif balanced:  # a caption, then questions spread over the question kinds
        qa = [(shapes.CAPTION_PROMPT, shapes.caption(scene)), *shapes.balanced_questions(scene, rng,
                                                                                         questions_per_image - 1)]
    else:  # a caption, then questions
        qa = [(shapes.CAPTION_PROMPT, shapes.caption(scene))]
        for _ in range(4 * questions_per_image):  # distinct questions (a repeat could be answered from the text)
            if len(qa) == questions_per_image:
                break
            pair = shapes.pick_question(scene, rng, caption_prob=0.0)
            if pair not in qa:
                qa.append(pair)
    return Group(pixel_values, grid, [builder.row(q, a, n) for q, a in qa], qa, n, tokens, cells)


def token_cells(rows: int, cols: int) -> torch.Tensor:
    """The 3x3 cell (0 = top left ... 8 = bottom right) of each token of a rows x cols grid (shapes.cell_edges).

    Image tokens carry no absolute position (RoPE is relative, backgrounds are uniform): the LM has to
    work out where a token sits relative to the image's size, which this auxiliary target teaches."""
    def cell_index(n: int) -> torch.Tensor:
        inner = shapes.cell_edges(n)[1:3]
        return torch.tensor([sum(i >= e for e in inner) for i in range(n)])

    r, c = cell_index(rows), cell_index(cols)
    return (r[:, None] * 3 + c[None, :]).reshape(-1)


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


def shared_length(group: Group, builder: RowBuilder) -> int:
    """Tokens every row of a group starts with: the chat prefix, the image and the tokens after it up to the
    question (its rows differ after that)."""
    return len(builder.prefix) + group.num_image_tokens + len(builder.mid_ids)


def packed_length(group: Group, builder: RowBuilder) -> int:
    shared = shared_length(group, builder)
    return shared + sum(len(ids) - shared for ids, _ in group.rows)


def pack_groups(groups: list[Group], builder: RowBuilder, pad_id: int, rope_index):
    """One sequence per image: the shared prefix and image once, then each row's remainder (question, answer).

    Each remainder sees the shared part and itself only, at the positions it has in its own row, so the loss is
    the loss of the separate rows while the image tokens go through the LM once instead of once per row.
    `rope_index(ids, grid)` gives a single row's M-RoPE positions [3, len]. Returns input_ids, labels [G, S],
    position_ids [3, G, S] and a boolean attention mask [G, 1, S, S] (True: may attend)."""
    width = max(packed_length(g, builder) for g in groups)
    input_ids = torch.full((len(groups), width), pad_id, dtype=torch.long)
    labels = torch.full((len(groups), width), IGNORE, dtype=torch.long)
    positions = torch.zeros((3, len(groups), width), dtype=torch.long)
    segment = torch.full((len(groups), width), -1, dtype=torch.long)  # 0: shared, j + 1: row j, -1: padding
    for i, g in enumerate(groups):
        shared = shared_length(g, builder)
        first_ids = g.rows[0][0]
        row_positions = rope_index(first_ids, g.grid_thw)
        input_ids[i, :shared] = torch.tensor(first_ids[:shared])
        positions[:, i, :shared] = row_positions[:, :shared]
        segment[i, :shared] = 0
        at, text_start = shared, int(row_positions[0, shared])
        for j, (ids, lab) in enumerate(g.rows):
            if ids[:shared] != first_ids[:shared]:
                raise ValueError("rows of a group must share the prefix and image")
            n = len(ids) - shared
            input_ids[i, at: at + n] = torch.tensor(ids[shared:])
            labels[i, at: at + n] = torch.tensor(lab[shared:])
            positions[:, i, at: at + n] = text_start + torch.arange(n)
            segment[i, at: at + n] = j + 1
            at += n
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same = segment[:, :, None] == segment[:, None, :]
    visible = causal & (same | (segment[:, None, :] == 0)) & (segment[:, :, None] >= 0)
    visible |= torch.eye(width, dtype=torch.bool)  # padding attends to itself (no empty softmax rows)
    return input_ids, labels, positions, visible[:, None]
