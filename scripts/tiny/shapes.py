"""Synthetic "shapes" visual task, deterministic from a seed (numpy + PIL only, no torch).

An image holds 1-4 shapes (circle, square, triangle) in 6 colours, each in its own cell of a
3x3 grid, on a plain or noisy background. Images run from 56 px to 1024 px per side (most
small), with varied aspect ratios; some large images carry small shapes that are only legible
at full resolution. Shapes sit on the model's token grid (see `layout`): the task is drawn for
the bundled model's processor.

Targets follow a fixed grammar:
  "Describe the image." -> "a red circle at the top left and a blue square at the bottom right"
  "How many triangles?" -> "two"
  "What colour is the square?" -> "blue"          (asked only when there is exactly one square)
  "What shape is at the top left?" -> "circle" / "nothing"
  "Where is the red circle?" -> "top left"        (asked only when that shape is unique)
  "Is there a green triangle?" -> "yes" / "no"
  "How many shapes?" -> "three"
Shapes are listed in reading order of their cells (top left first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from vlmq.cost import smart_resize
from vlmq.models import TINY_SHAPES_POLICY

SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 80, 225),
    "yellow": (240, 210, 30),
    "purple": (145, 60, 190),
    "orange": (250, 135, 25),
}
COLOUR_NAMES = tuple(COLOURS)
POSITIONS = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)
NUMBERS = ("zero", "one", "two", "three", "four")
BACKGROUNDS = ((250, 250, 250), (215, 215, 215), (235, 225, 205), (60, 60, 60), (30, 30, 40))
CAPTION_PROMPT = "Describe the image."
MIN_SIDE, MAX_SIDE = 56, 1024


@dataclass(frozen=True, slots=True)
class Shape:
    shape: str
    colour: str
    cell: int  # index into POSITIONS

    @property
    def phrase(self) -> str:
        return f"{article(self.colour)} {self.colour} {self.shape} at the {POSITIONS[self.cell]}"


@dataclass(frozen=True, slots=True)
class Scene:
    width: int
    height: int
    shapes: tuple[Shape, ...]  # sorted by cell
    background: int  # index into BACKGROUNDS
    noise: float  # std of background noise, 0 for plain
    small: bool  # shapes drawn small (only legible at high resolution)


@dataclass(frozen=True, slots=True)
class Example:
    image: Image.Image
    question: str
    answer: str
    scene: Scene


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def caption(scene: Scene) -> str:
    phrases = [s.phrase for s in scene.shapes]
    if len(phrases) == 1:
        return phrases[0]
    return ", ".join(phrases[:-1]) + " and " + phrases[-1]


def _rng(seed_or_rng: int | np.random.Generator | tuple[int, ...]) -> np.random.Generator:
    if isinstance(seed_or_rng, np.random.Generator):
        return seed_or_rng
    return np.random.default_rng(seed_or_rng)


# cumulative probabilities of the long side falling in 56-224, 225-448, 449-768 (rest: 769-1024)
SIZE_BANDS = (0.6, 0.85, 0.95)
MAX_SHAPE = 120  # px; shapes never grow past this, so large images are not just scaled-up small ones


def sample_size(rng: np.random.Generator, bands: tuple[float, float, float] = SIZE_BANDS) -> tuple[int, int]:
    """(width, height): mostly small, a tail up to 1024 px, aspect ratios up to 3:1."""
    u = rng.random()
    if u < bands[0]:
        long_side = rng.integers(MIN_SIDE, 225)
    elif u < bands[1]:
        long_side = rng.integers(225, 449)
    elif u < bands[2]:
        long_side = rng.integers(449, 769)
    else:
        long_side = rng.integers(769, MAX_SIDE + 1)
    ratio = 1.0 if rng.random() < 0.35 else rng.uniform(1.0, 3.0)
    short_side = int(max(MIN_SIDE, round(long_side / ratio)))
    return (int(long_side), short_side) if rng.random() < 0.5 else (short_side, int(long_side))


def sample_scene(rng: np.random.Generator, size: tuple[int, int] | None = None, num_shapes: int | None = None,
                 bands: tuple[float, float, float] = SIZE_BANDS) -> Scene:
    width, height = size if size is not None else sample_size(rng, bands)
    n = int(num_shapes if num_shapes is not None else rng.integers(1, 5))
    cells = sorted(rng.choice(9, size=n, replace=False).tolist())
    shapes = tuple(Shape(SHAPES[rng.integers(3)], COLOUR_NAMES[rng.integers(6)], c) for c in cells)
    noise = 0.0 if rng.random() < 0.5 else float(rng.uniform(5, 25))
    small = min(width, height) >= 360 and rng.random() < 0.35
    return Scene(width, height, shapes, int(rng.integers(len(BACKGROUNDS))), noise, small)


def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, box: tuple[float, float, float, float], rgb) -> None:
    x0, y0, x1, y1 = box
    if kind == "circle":
        draw.ellipse(box, fill=rgb)
    elif kind == "square":
        draw.rectangle(box, fill=rgb)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=rgb)


TOKEN = TINY_SHAPES_POLICY.factor  # px of one LM image token in the processed image (patch x merge)


def cell_edges(n: int) -> list[int]:
    """Token indices where the 3 rows (or columns) of cells start and end on an axis of n tokens."""
    return [round(i * n / 3) for i in range(4)]


def layout(scene: Scene, rng: np.random.Generator) -> list[tuple]:
    """Each shape's box (x0, y0, x1, y1) in image pixels, placed on the model's token grid.

    The processor resizes the image to a grid of TOKEN px tokens (56 px: patch 28, merge 2); the 3x3 cells are
    split along token boundaries and each shape is centred where four tokens meet (each token shows one quarter of
    it, 1.1-1.7 tokens across in the processed image) or, in small-shape scenes and cells under two tokens wide, on
    one token (0.55-0.85 of it). A tiny ViT learns shapes seen in these few views within the training budget;
    shapes straddling tokens at arbitrary offsets it did not (`python scripts/probe_vision.py`, with and without
    `--off-grid`; the figures are in the model card's training history).
    Falls back to geometric cells when the token grid is under 3x3."""
    height, width = smart_resize(scene.height, scene.width, TINY_SHAPES_POLICY)
    rows, cols = height // TOKEN, width // TOKEN
    if rows < 3 or cols < 3:
        return _geometric_layout(scene, rng)
    sx, sy = scene.width / width, scene.height / height  # image px per processed px
    row_edges, col_edges = cell_edges(rows), cell_edges(cols)
    boxes = []
    for s in scene.shapes:
        row, col = divmod(s.cell, 3)
        r0, r1, c0, c1 = row_edges[row], row_edges[row + 1], col_edges[col], col_edges[col + 1]
        if not scene.small and min(r1 - r0, c1 - c0) >= 2:
            cy, cx = rng.integers(r0 + 1, r1) * TOKEN, rng.integers(c0 + 1, c1) * TOKEN
            side = 2 * TOKEN * rng.uniform(0.55, 0.85)
        else:
            cy, cx = (rng.integers(r0, r1) + 0.5) * TOKEN, (rng.integers(c0, c1) + 0.5) * TOKEN
            side = TOKEN * rng.uniform(0.55, 0.85)
        cx, cy = cx + rng.uniform(-2, 2), cy + rng.uniform(-2, 2)
        boxes.append(((cx - side / 2) * sx, (cy - side / 2) * sy, (cx + side / 2) * sx, (cy + side / 2) * sy))
    return boxes


def _geometric_layout(scene: Scene, rng: np.random.Generator) -> list[tuple]:
    cw, ch = scene.width / 3, scene.height / 3
    boxes = []
    for s in scene.shapes:
        side = rng.uniform(18, 30) if scene.small else min(MAX_SHAPE, max(11.0, min(cw, ch) * rng.uniform(0.55, 0.85)))
        side = min(side, cw - 2, ch - 2)
        row, col = divmod(s.cell, 3)
        # jitter the centre inside the cell while keeping the shape inside it
        cx = (col + 0.5) * cw + rng.uniform(-1, 1) * max(0.0, (cw - side) / 2 - 1)
        cy = (row + 0.5) * ch + rng.uniform(-1, 1) * max(0.0, (ch - side) / 2 - 1)
        boxes.append((cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2))
    return boxes


def render(scene: Scene, rng: np.random.Generator, boxes: list | None = None, on_grid: bool = True) -> Image.Image:
    """Draw the scene; if `boxes` is given, append (x0, y0, x1, y1, shape) per shape (training labels).

    on_grid=False draws shapes at any offset in geometric cells, sized with the cell (scripts/probe_vision.py
    compares the two)."""
    w, h = scene.width, scene.height
    bg = np.empty((h, w, 3), np.float32)
    bg[:] = BACKGROUNDS[scene.background]
    if scene.noise > 0:
        bg += rng.normal(0.0, scene.noise, size=(h, w, 3)).astype(np.float32)
    img = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    placed = layout(scene, rng) if on_grid else _geometric_layout(scene, rng)
    for s, box in zip(scene.shapes, placed, strict=True):
        jitter = rng.integers(-15, 16, size=3)
        rgb = tuple(int(v) for v in np.clip(np.array(COLOURS[s.colour]) + jitter, 0, 255))
        _draw_shape(draw, s.shape, box, rgb)
        if boxes is not None:
            boxes.append((*box, s))
    return img


def questions(scene: Scene) -> list[tuple[str, str]]:
    """Every (question, answer) pair with a unique answer for this scene, caption first."""
    qa = [(CAPTION_PROMPT, caption(scene)), ("How many shapes?", NUMBERS[len(scene.shapes)])]
    for kind in SHAPES:
        same = [s for s in scene.shapes if s.shape == kind]
        qa.append((f"How many {kind}s?", NUMBERS[len(same)]))
        if len(same) == 1:
            qa.append((f"What colour is the {kind}?", same[0].colour))
    by_cell = {s.cell: s for s in scene.shapes}
    for cell, pos in enumerate(POSITIONS):
        qa.append((f"What shape is at the {pos}?", by_cell[cell].shape if cell in by_cell else "nothing"))
    for s in scene.shapes:
        if sum(t.shape == s.shape and t.colour == s.colour for t in scene.shapes) == 1:
            qa.append((f"Where is the {s.colour} {s.shape}?", POSITIONS[s.cell]))
    return qa


def presence_question(scene: Scene, rng: np.random.Generator) -> tuple[str, str]:
    if rng.random() < 0.5:
        s = scene.shapes[rng.integers(len(scene.shapes))]
        return f"Is there {article(s.colour)} {s.colour} {s.shape}?", "yes"
    colour, kind = COLOUR_NAMES[rng.integers(6)], SHAPES[rng.integers(3)]
    present = any(s.colour == colour and s.shape == kind for s in scene.shapes)
    return f"Is there {article(colour)} {colour} {kind}?", "yes" if present else "no"


def question_kind(question: str) -> str:
    """caption, count, colour, shape_at, where or presence (accuracy tables, balanced training rows)."""
    for prefix, kind in (("Describe", "caption"), ("How many", "count"), ("What colour", "colour"),
                         ("What shape", "shape_at"), ("Where", "where"), ("Is there", "presence")):
        if question.startswith(prefix):
            return kind
    return "other"


def pick_question(scene: Scene, rng: np.random.Generator, caption_prob: float = 0.4) -> tuple[str, str]:
    if rng.random() < caption_prob:
        return CAPTION_PROMPT, caption(scene)
    if rng.random() < 0.12:
        return presence_question(scene, rng)
    qa = questions(scene)[1:]
    return qa[rng.integers(len(qa))]


def balanced_questions(scene: Scene, rng: np.random.Generator, n: int) -> list[tuple[str, str]]:
    """n distinct questions (no caption) spread over the question kinds in turn, not over the question list
    (where "what shape is at ..." has nine entries and "what colour is ..." often none)."""
    by_kind: dict[str, list[tuple[str, str]]] = {}
    for pair in questions(scene)[1:] + [presence_question(scene, rng) for _ in range(3)]:
        if pair not in by_kind.setdefault(question_kind(pair[0]), []):
            by_kind[question_kind(pair[0])].append(pair)
    kinds = [k for k in by_kind if by_kind[k]]
    picked: list[tuple[str, str]] = []
    while len(picked) < n and kinds:
        for k in [kinds[i] for i in rng.permutation(len(kinds))]:
            pool = by_kind[k]
            picked.append(pool.pop(int(rng.integers(len(pool)))))
            if not pool:
                kinds.remove(k)
            if len(picked) == n:
                break
    return picked


def make_example(
    seed_or_rng: int | np.random.Generator | tuple[int, ...],
    size: tuple[int, int] | None = None,
    caption_prob: float = 0.4,
) -> Example:
    """One (image, question, answer); the same seed always gives the same example."""
    rng = _rng(seed_or_rng)
    scene = sample_scene(rng, size)
    image = render(scene, rng)
    question, answer = pick_question(scene, rng, caption_prob)
    return Example(image, question, answer, scene)


def make_split(seed: int, n: int, caption_prob: float = 0.4) -> list[Example]:
    """n examples; example i depends only on (seed, i), so prefixes of a split are stable."""
    return [make_example((seed, i), caption_prob=caption_prob) for i in range(n)]


def all_texts() -> list[str]:
    """Every prompt and answer word the grammar can produce (for building the tokenizer)."""
    texts = [CAPTION_PROMPT, "How many shapes?", *NUMBERS, "yes", "no", "nothing", *POSITIONS]
    for kind in SHAPES:
        texts += [f"How many {kind}s?", f"What colour is the {kind}?", kind]
        for colour in COLOUR_NAMES:
            texts += [f"Where is the {colour} {kind}?", f"Is there {article(colour)} {colour} {kind}?"]
            texts += [f"{article(colour)} {colour} {kind} at the {pos}" for pos in POSITIONS]
    texts += [f"What shape is at the {pos}?" for pos in POSITIONS]
    return texts
