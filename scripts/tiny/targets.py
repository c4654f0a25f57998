"""Training targets read off a shapes example: what a question names, what each caption token describes, and
the count and cell of each colour-and-shape pair. Classes are 1-based; 0 means "not named" or "nothing"."""

from __future__ import annotations

import torch

from tiny import shapes

ASK_CLASSES = (1 + len(shapes.COLOUR_NAMES), 1 + len(shapes.SHAPES), 1 + len(shapes.POSITIONS))
AUX_CLASSES = (1 + len(shapes.COLOUR_NAMES), 1 + len(shapes.SHAPES))
NUM_CELLS = len(shapes.POSITIONS)  # --register-target cell: one register per cell of the 3x3 grid
NUM_PAIRS = len(shapes.COLOUR_NAMES) * len(shapes.SHAPES)  # --register-target pair: one register per pair
PAIR_CLASSES = (5, 1 + len(shapes.POSITIONS))  # how many (0-4), the cell of a single one (0: none or several)


def question_target(question: str) -> tuple[int, int, int]:
    """(colour, shape, cell) a question names, each 1-based (0: not named): "Is there a red circle?" -> (1+red,
    1+circle, 0); "How many squares?" -> (0, 1+square, 0); "What shape is at the top left?" -> (0, 0, 1+top left)."""
    words = question.rstrip("?.").split()
    colour = next((1 + shapes.COLOUR_NAMES.index(w) for w in words if w in shapes.COLOUR_NAMES), 0)
    kind = next((1 + shapes.SHAPES.index(w.removesuffix("s")) for w in words
                 if w.removesuffix("s") in shapes.SHAPES), 0)
    _, at, place = question.rstrip("?").partition(" at the ")
    return colour, kind, 1 + shapes.POSITIONS.index(place) if at else 0


def phrase_targets(tokens: torch.Tensor, cell_labels: torch.Tensor, separator_ids: torch.Tensor) -> torch.Tensor:
    """A caption's label tokens (its words, then <|im_end|>) -> [len(tokens), 3]: the (colour, shape, cell) of the
    phrase each token belongs to, 1-based like question_target. Phrases follow the occupied cells in reading order
    (shapes.caption); a separator ("," or " and") starts the next phrase, so the position that predicts it has to
    know whether a shape follows and which; <|im_end|> belongs to none (0, 0, 0)."""
    cells = (cell_labels[:, 0] > 0).nonzero().flatten()
    phrases = torch.cat([torch.stack([cell_labels[cells, 0], cell_labels[cells, 1], cells + 1], -1),
                         torch.zeros(1, 3, dtype=torch.long)])
    index = torch.isin(tokens, separator_ids).cumsum(0)
    index[-1] = len(cells)
    return phrases[index]


def separator_ids(tokenizer) -> torch.Tensor:
    """The tokens that join a caption's phrases (shapes.caption: ", " and " and ")."""
    return torch.tensor([t for text in (",", " and") for t in tokenizer(text, add_special_tokens=False).input_ids])


def pair_targets(cell_labels: torch.Tensor) -> torch.Tensor:
    """[..., 9, 2] (colour, shape in each cell, 0 = nothing) -> [..., NUM_PAIRS, 2]: for pair k (colour k // 3,
    shape k % 3) how many cells hold it and, when one does, that cell (1-9; 0 for none or several)."""
    present = cell_labels[..., 0] > 0
    pair = ((cell_labels[..., 0] - 1) * len(shapes.SHAPES) + cell_labels[..., 1] - 1).clamp(min=0)
    onehot = torch.nn.functional.one_hot(pair, NUM_PAIRS) * present[..., None]  # [..., 9 cells, pairs]
    counts = onehot.sum(-2)
    cell = (onehot * torch.arange(1, 10)[:, None]).sum(-2)
    return torch.stack([counts.clamp(max=PAIR_CLASSES[0] - 1), torch.where(counts == 1, cell, 0)], -1)
