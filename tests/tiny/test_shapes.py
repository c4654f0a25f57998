"""The synthetic shapes task: deterministic, and every shape drawn on the bundled model's token grid."""
from __future__ import annotations

import numpy as np
from tiny import shapes

from vlmq.cost import smart_resize
from vlmq.models import TINY_SHAPES_POLICY

TOKEN = TINY_SHAPES_POLICY.factor


def test_the_same_seed_gives_the_same_example() -> None:
    a, b = shapes.make_example((5, 3)), shapes.make_example((5, 3))
    assert a.image.tobytes() == b.image.tobytes() and (a.question, a.answer) == (b.question, b.answer)
    assert shapes.make_example((5, 4)).image.tobytes() != a.image.tobytes()


def test_each_shape_sits_in_its_cell_on_a_token_corner_or_centre() -> None:
    rng = np.random.default_rng(0)
    seen = {"corner": 0, "centre": 0}
    for _ in range(300):
        scene = shapes.sample_scene(rng)
        height, width = smart_resize(scene.height, scene.width, TINY_SHAPES_POLICY)
        rows, cols = height // TOKEN, width // TOKEN
        assert rows >= 3 and cols >= 3
        for s, (x0, y0, x1, y1) in zip(scene.shapes, shapes.layout(scene, rng), strict=True):
            # the box in processed pixels
            px0, px1 = x0 * width / scene.width, x1 * width / scene.width
            py0, py1 = y0 * height / scene.height, y1 * height / scene.height
            side, cx, cy = px1 - px0, (px0 + px1) / 2, (py0 + py1) / 2
            assert abs((py1 - py0) - side) < 1e-6 and 0.55 * TOKEN - 1e-6 <= side <= 1.7 * TOKEN + 1e-6
            row, col = divmod(s.cell, 3)
            (r0, r1), (c0, c1) = shapes.cell_edges(rows)[row: row + 2], shapes.cell_edges(cols)[col: col + 2]
            assert r0 * TOKEN <= py0 and py1 <= r1 * TOKEN and c0 * TOKEN <= px0 and px1 <= c1 * TOKEN
            offset = 0.0 if side > TOKEN else TOKEN / 2  # big shapes centre on a corner, small ones on a token
            assert abs((cx - offset) / TOKEN - round((cx - offset) / TOKEN)) * TOKEN <= 2
            assert abs((cy - offset) / TOKEN - round((cy - offset) / TOKEN)) * TOKEN <= 2
            seen["corner" if side > TOKEN else "centre"] += 1
    assert min(seen.values()) > 50


def test_shapes_are_drawn_in_their_colour_and_listed_in_reading_order() -> None:
    for i in range(40):
        rng = np.random.default_rng((11, i))
        scene = shapes.sample_scene(rng)
        boxes: list = []
        pixels = np.asarray(shapes.render(scene, rng, boxes)).astype(int)
        assert [b[4] for b in boxes] == list(scene.shapes)
        for x0, y0, x1, y1, s in boxes:
            centre = pixels[int((y0 + y1) / 2), int((x0 + x1) / 2)]
            assert np.abs(centre - np.array(shapes.COLOURS[s.colour])).max() <= 16, (s, centre)
        cells = [s.cell for s in scene.shapes]
        assert cells == sorted(cells)
        assert shapes.caption(scene).count(" at the ") == len(scene.shapes)


def test_balanced_questions_spread_over_the_kinds_and_never_repeat() -> None:
    kinds: dict[str, int] = {}
    for i in range(200):
        rng = np.random.default_rng((12, i))
        scene = shapes.sample_scene(rng)
        picked = shapes.balanced_questions(scene, rng, 5)
        assert len(picked) == 5 and len(set(picked)) == 5
        assert all(pair in shapes.questions(scene)[1:] or pair[0].startswith("Is there") for pair in picked)
        for question, _ in picked:
            kind = shapes.question_kind(question)
            kinds[kind] = kinds.get(kind, 0) + 1
    assert "caption" not in kinds and set(kinds) == {"count", "colour", "shape_at", "where", "presence"}
    assert max(kinds.values()) < 2 * min(kinds.values())  # the plain sampler gives "shape at" most of them


def test_off_grid_shapes_stay_inside_their_geometric_cell() -> None:
    for i in range(40):
        rng = np.random.default_rng((13, i))
        scene = shapes.sample_scene(rng)
        boxes: list = []
        shapes.render(scene, rng, boxes, on_grid=False)
        for x0, y0, x1, y1, s in boxes:
            row, col = divmod(s.cell, 3)
            assert col * scene.width / 3 <= x0 and x1 <= (col + 1) * scene.width / 3
            assert row * scene.height / 3 <= y0 and y1 <= (row + 1) * scene.height / 3
