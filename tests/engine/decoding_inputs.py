"""Inputs the decoding tests share: the bundled model, its questions, and small seeded images with a shape."""
from __future__ import annotations

import random
from pathlib import Path

from PIL import Image

TINY = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny-shapes"
QUESTIONS = ["Describe the image.", "What is in the image?", "How many shapes are there?", "What colour is it?",
             "Where is the square?"]


def image(seed: int) -> Image.Image:
    """A seeded image of its own size and background with one square on it."""
    rng = random.Random(seed)
    img = Image.new("RGB", (rng.randrange(64, 200), rng.randrange(64, 200)), (rng.randrange(256), 80, 160))
    img.paste((230, 40, 30), (8, 8, 38, 38))
    return img
